"""A small DDP training job with easyckpt: run it under torchrun, kill a rank, run it again.

    torchrun --nproc-per-node=2 examples/plain_ddp.py --save-dir /tmp/ckpt --out /tmp/run --steps 40

Everything that decides the next loss is in the saved state (model, AdamW, LR schedule, the torch /
python / numpy RNGs that drive dropout and noise, and the data position), so a resumed run continues
the loss curve exactly. Each rank appends one JSON line per step to ``--out/losses-rank<r>.jsonl``
(step, loss, a digest of the state) and writes ``--out/resume-rank<r>-<n>.json`` after load, which is
what the tests and the demo read.

Across nodes (each node runs its own torchrun; with EASYCKPT_NODE_ID and EASYCKPT_SHM_DIR set per
"node", two can share one machine)::

    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \
        examples/plain_ddp.py --save-dir /tmp/ckpt --out /tmp/run --grad-sync flat

``--grad-sync flat`` averages gradients on one flat buffer in a fixed order instead of DDP's buckets,
whose order changes after DDP's first step: with more than two ranks that changes the float sums, and
a resumed run's losses would differ from an uninterrupted one's in the last bits.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel

import easyckpt
from easyckpt.snapshot.state import flatten


def write_report(path: Path, report: dict[str, object]) -> None:
    """Whole or not at all: tests poll for these files while the job runs (a half-written one was read)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def batch(position: int, rank: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The data at ``position`` of this rank's stream: resuming at a position replays the same data."""
    generator = torch.Generator().manual_seed(1000 * position + rank)
    tokens = torch.randint(0, vocab, (8, 16), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def state_digest(state: dict) -> str:
    """xxh3-128 over every tensor of model and optimizer, in order: equal digests mean equal bits."""
    digest = xxhash.xxh3_128()
    _, refs, values = flatten({"model": state["model"], "optim": state["optim"]})
    for ref, value in zip(refs, values):
        digest.update(ref.name.encode())
        digest.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """All-reduce every gradient as one flat buffer: the same summation order at every step."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True, help="directory for loss logs and resume reports")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-mem-interval", type=int, default=1)
    parser.add_argument("--save-storage-interval", type=int, default=10)
    parser.add_argument("--max-ckpt-num", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra compute per step (busy loop)")
    parser.add_argument("--step-idle", type=float, default=0.0,
                        help="extra idle time per step, as when the CPU waits for a GPU step to finish")
    parser.add_argument("--grad-sync", choices=("ddp", "flat"), default="ddp",
                        help="DDP's buckets, or one flat all-reduce in a fixed order (bitwise-stable across restarts)")
    parser.add_argument("--ballast-mb", type=float, default=0.0,
                        help="an extra tensor of this size in the state, rewritten every step, so that persisting "
                             "takes many steps as for a large model")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="SIGKILL --kill-rank right after this step's snapshot starts, once per --out directory")
    parser.add_argument("--kill-rank", default="1", help="a rank, ranks separated by commas, or -1: every rank")
    parser.add_argument("--kill-signal", choices=("KILL", "STOP"), default="KILL",
                        help="STOP freezes the rank instead, for a test to kill its whole node at that very step")
    parser.add_argument("--load-dir", default=None,
                        help="the first attempt loads this iteration_N directory (a rollback: a new timeline); "
                             "torchrun's restarts resume as usual")
    parser.add_argument("--peer-timeout", type=float, default=10.0,
                        help="multi-node: seconds one request to another node's agent may take")
    args = parser.parse_args()
    if "RANK" not in os.environ:   # else torch.distributed only says that RANK is not set
        parser.error(f"run it under torchrun: torchrun --nproc-per-node=2 {sys.argv[0]} ARGS")
    logging.basicConfig(level=os.environ.get("EASYCKPT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s rank%(process)d %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    net = TinyLM()  # the same initial weights on every rank
    # Each rank its own dropout and noise stream: a rank's RNG state exists only on that rank, which is
    # what a replica on another node must carry besides the (replicated) model and optimizer.
    torch.manual_seed(1 + rank)
    random.seed(1 + rank)
    np.random.seed(1 + rank)
    model = DistributedDataParallel(net) if args.grad_sync == "ddp" else net
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))

    ballast = torch.zeros(int(args.ballast_mb * (1 << 20)) // 4, dtype=torch.float32)
    ckpt = easyckpt.Checkpointer(args.save_dir, args.save_mem_interval, args.save_storage_interval,
                                 args.max_ckpt_num, log_file_path=str(out / "persist.log"),
                                 peer_timeout=args.peer_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    load_began = time.time()   # the soak's judge: what storage held when this load began (its audit log's clock)
    result = ckpt.load({"model": net.state_dict(), "optim": optimizer.state_dict()},
                       load_dir=args.load_dir if attempt == "0" else None)
    start = 0
    if result.step is not None:
        net.load_state_dict(result.state["model"])
        optimizer.load_state_dict(result.state["optim"])
        scheduler.load_state_dict(result.state["sched"])
        torch.set_rng_state(result.state["rng"]["torch"])
        random.setstate(result.state["rng"]["python"])
        np.random.set_state(result.state["rng"]["numpy"])
        start = result.state["data_position"]
        if ballast.numel():
            expected = float(result.state["step"])
            saved = result.state["ballast"]
            if saved.shape != ballast.shape or not bool((saved == expected).all()):
                raise SystemExit(f"rank {rank}: the ballast resumed at step {result.step} is not all {expected}")
            ballast.copy_(saved)
    report = {"rank": rank, "step": result.step, "source": result.source, "seconds": result.seconds,
              "bytes": result.nbytes, "attempt": attempt, "pid": os.getpid(),
              "node": os.environ.get("EASYCKPT_NODE_ID"), "load_began": load_began,
              "digest": state_digest(result.state) if result.step is not None else None}
    write_report(out / f"resume-rank{rank}-{len(list(out.glob(f'resume-rank{rank}-*.json')))}.json", report)
    if rank == 0 and result.step is not None:
        print(f"resumed at step {result.step} from {result.source} in {result.seconds * 1000:.1f} ms "
              f"({result.nbytes / 1e6:.1f} MB)", flush=True)

    with open(out / f"losses-rank{rank}.jsonl", "a", encoding="utf-8") as log:
        for step in range(start, args.steps):
            inputs, targets = batch(step, rank)
            noise = 1e-3 * torch.randn(()) + 1e-3 * random.random() + 1e-3 * np.random.rand()
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) + noise
            optimizer.zero_grad()
            loss.backward()
            if args.grad_sync == "flat":
                average_gradients(net, dist.get_world_size())
            optimizer.step()
            scheduler.step()
            deadline = time.perf_counter() + args.step_seconds
            while time.perf_counter() < deadline:
                pass
            time.sleep(args.step_idle)  # stands in for GPU work, not a synchronisation
            state = {"model": net.state_dict(), "optim": optimizer.state_dict(),
                     "sched": scheduler.state_dict(), "data_position": step + 1, "step": step,
                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}}
            if ballast.numel():
                ckpt.wait()   # the previous snapshot's copy reads the ballast: change it only after
                ballast.fill_(float(step))
                state["ballast"] = ballast
            ckpt.save_if_needed(step, state)
            victims = {int(r) for r in args.kill_rank.split(",")}
            marker = out / f"killed-rank{rank}"
            if step == args.kill_at and victims & {rank, -1} and not marker.exists():
                partial = marker.with_name(f".{marker.name}.partial")   # whole or not at all: tests poll for it
                partial.write_text(str(step))
                os.replace(partial, marker)
                os.kill(os.getpid(), getattr(signal, f"SIG{args.kill_signal}"))
            log.write(json.dumps({"step": step, "loss": loss.item(), "attempt": attempt,
                                  "digest": state_digest(state)}) + "\n")
            log.flush()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
