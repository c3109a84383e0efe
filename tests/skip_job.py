"""A 2-rank training loop with data skipping (run under torchrun by tests/jobs/test_skip.py).

The loop is the plain one a user writes (README, "Data skipping")::

    skipper = easyckpt.DataSkipper(global_norm_spike_threshold=..., global_norm_spike_count_threshold=...,
                                   on_abort=ckpt.flush)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if skipper.skip(step, norm): optimizer.zero_grad()      # the batch is consumed, the update not applied
    else: optimizer.step(); scheduler.step()

``--spike-steps`` scales the loss at those steps (a gradient spike); ``--drop-steps`` is the reference:
it never applies those steps' updates, by construction, without a skipper. For checkpoint health,
``--spike-from`` scales the loss from that step on (a run that diverges), ``--health-threshold`` is the
``embedding_local_norm`` threshold (the embedding's pre-clip gradient norm is reported with every
snapshot), and ``--kill-at`` SIGKILLs rank 1 once its snapshot of that step is committed. Gradients are averaged on one
flat buffer in a fixed order, so every rank sees the same norm and the runs are bitwise comparable. Each
rank appends ``{"step", "norm", "skipped", "digest"}`` per step to ``--out/steps-rank<r>.jsonl`` and writes
``--out/resume-rank<r>.json`` (the step resumed and the skipper's state) after load; an abort writes
``--out/aborted-rank<r>.json`` (the error and the flush result) and lets TrainingAborted end the process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from plain_ddp import TinyLM, average_gradients, batch, state_digest  # noqa: E402

import easyckpt  # noqa: E402
from easyckpt.health import embedding_local_norm  # noqa: E402


def steps(text: str) -> set[int]:
    return {int(s) for s in text.split(",") if s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--spike-steps", type=steps, default=set())
    parser.add_argument("--spike-scale", type=float, default=1e4)
    parser.add_argument("--drop-steps", type=steps, default=set())
    parser.add_argument("--threshold", type=float, default=50.0)
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--save-storage-interval", type=int, default=1000)
    parser.add_argument("--max-ckpt-num", type=int, default=3)
    parser.add_argument("--spike-from", type=int, default=None)
    parser.add_argument("--health-threshold", type=float, default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--durable-due", action="store_true",
                        help="wait (flush) until each due step is on disk, so that none is passed over")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyLM()
    torch.manual_seed(1 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    health = {"embedding_local_norm": args.health_threshold} if args.health_threshold else None
    ckpt = easyckpt.Checkpointer(args.save_dir, 1, args.save_storage_interval, args.max_ckpt_num,
                                 log_file_path=str(out / "persist.log"), health_thresholds=health)
    skipper = easyckpt.DataSkipper(global_norm_spike_threshold=args.threshold,
                                   global_norm_spike_count_threshold=args.count, on_abort=ckpt.flush)

    result = ckpt.load({"model": model.state_dict(), "optim": optimizer.state_dict()})
    start = 0
    if result.step is not None:
        model.load_state_dict(result.state["model"])
        optimizer.load_state_dict(result.state["optim"])
        scheduler.load_state_dict(result.state["sched"])
        torch.set_rng_state(result.state["rng"])
        skipper.load_state_dict(result.state["skipper"])
        start = result.step + 1
    (out / f"resume-rank{rank}.json").write_text(json.dumps(
        {"step": result.step, "source": result.source, "skipper": skipper.state_dict()}))

    with open(out / f"steps-rank{rank}.jsonl", "a", encoding="utf-8") as log:
        for step in range(start, args.steps):
            inputs, targets = batch(step, rank)
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            if step in args.spike_steps or (args.spike_from is not None and step >= args.spike_from):
                loss = loss * args.spike_scale
            optimizer.zero_grad()
            loss.backward()
            average_gradients(model, world)
            embedding = embedding_local_norm(model)   # before clipping scales it down
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            try:
                skipped = skipper.skip(step, norm)
            except easyckpt.TrainingAborted as error:
                flushed = ckpt.flush()   # on_abort ran it already: this one reports what is durable
                (out / f"aborted-rank{rank}.json").write_text(json.dumps(
                    {"step": error.step, "count": error.count, "message": str(error),
                     "flush": {k: v for k, v in dataclasses.asdict(flushed).items() if k != "failure"}}))
                raise   # the process ends non-zero; the exit hook detaches the Checkpointer
            if skipped or step in args.drop_steps:
                optimizer.zero_grad()
            else:
                optimizer.step()
                scheduler.step()
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict(),
                     "rng": torch.get_rng_state(), "skipper": skipper.state_dict()}
            metrics = {"loss": loss.item()}
            if embedding is not None:
                metrics["embedding_local_norm"] = embedding
            ckpt.save_if_needed(step, state, metrics=metrics)
            if args.durable_due and step > 0 and step % args.save_storage_interval == 0:
                ckpt.flush()
            log.write(json.dumps({"step": step, "norm": float(norm), "skipped": skipped, "embedding": embedding,
                                  "digest": state_digest(state)}) + "\n")
            log.flush()
            if step == args.kill_at and rank == 1 and result.step is None:   # only in the first attempt
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
