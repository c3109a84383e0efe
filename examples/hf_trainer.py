"""HuggingFace Trainer with easyckpt: a tiny GPT-2 under torchrun; kill a rank, run it again.

    torchrun --nproc-per-node=2 examples/hf_trainer.py --output-dir /tmp/hf --out /tmp/hf-run --steps 24
    # kill -9 one rank mid-training, then resume (from memory while the node's agent holds the snapshot):
    torchrun --nproc-per-node=2 examples/hf_trainer.py --output-dir /tmp/hf --out /tmp/hf-run --steps 24 --resume

The model is GPT-2 built from a tiny config (nothing is downloaded); the data is synthetic. The usual
Trainer code gains two lines::

    trainer = TrainerWrapper(Trainer(model=model, args=args, train_dataset=data), save_mem_interval=1)
    trainer.train(resume_from_checkpoint=True)     # memory, replica, disk; a fresh start when nothing exists

Every optimizer step is snapshotted into shared memory; every ``--save-steps``-th is persisted and
exported as a Trainer-native ``<output-dir>/checkpoint-N/``, which a plain Trainer can resume from
(``--plain --resume <output-dir>/checkpoint-N``).

Each rank appends one JSON line per optimizer step to ``--out/losses-rank<r>.jsonl``: the step, the loss
the Trainer logged (averaged over the ranks, logging_steps=1), two draws from Python's and numpy's
RNGs taken at the step's start, and a digest of the model and optimizer state after the step; it writes
``--out/resume-rank<r>-<n>.json`` (where the run resumed from) when training starts. Those files are what
the tests compare against an uninterrupted run.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from easyckpt.snapshot.state import flatten
from easyckpt.transformers import TrainerWrapper

VOCAB, SEQ = 64, 16


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Whole or not at all: tests poll for these files while the job runs (a half-written one was read)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)


class SyntheticTokens(torch.utils.data.Dataset):
    """Fixed random token sequences; labels are the inputs (GPT-2 shifts them itself)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (size, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def state_digest(model: torch.nn.Module, optimizer: Any) -> str:
    """xxh3-128 over every tensor of model and optimizer, in order: equal digests mean equal bits."""
    digest = xxhash.xxh3_128()
    optim = optimizer.state_dict()
    if not isinstance(optim.get("state"), dict):   # DeepSpeed ZeRO: this rank's partition, with DeepSpeed objects
        from easyckpt.transformers.zero import portable
        optim = portable(optim)
    _, refs, values = flatten({"model": model.state_dict(), "optim": optim})
    for ref, value in zip(refs, values):
        digest.update(ref.name.encode())
        digest.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class StepLog(TrainerCallback):
    """One JSON line per optimizer step: loss (from the Trainer's own log), RNG draws, state digest."""

    def __init__(self, path: Path, attempt: str) -> None:
        self.path = path
        self.attempt = attempt
        self.draws: dict[str, float] = {}
        self.digest = ""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Drawn after the Trainer restored the RNGs on resume: equal draws mean the RNGs continued exactly.
        self.draws = {"py_rand": random.random(), "np_rand": float(np.random.rand())}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.digest = state_digest(kwargs["model"], kwargs["optimizer"])

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        row = {"step": state.global_step, "loss": logs["loss"], "learning_rate": logs.get("learning_rate"),
               "grad_norm": logs.get("grad_norm"), "epoch": logs.get("epoch"), "attempt": self.attempt,
               "digest": self.digest, **self.draws}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


class BusyStep(TrainerCallback):
    """Extra compute per step, so that a test can kill a rank mid-training without racing the end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        deadline = time.perf_counter() + self.seconds
        while time.perf_counter() < deadline:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir (checkpoint-N/, easyckpt/)")
    parser.add_argument("--out", required=True, help="directory for loss logs and resume reports")
    parser.add_argument("--steps", type=int, default=24, help="max_steps (the data is 8 steps per epoch on 2 ranks)")
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--save-strategy", default="steps", choices=("steps", "no", "epoch"))
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--save-mem-interval", type=int, default=1)
    parser.add_argument("--resume", nargs="?", const="true", default=None,
                        help="no value: newest state (memory, replica, disk); or a checkpoint-N path")
    parser.add_argument("--plain", action="store_true", help="a plain Trainer without easyckpt")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra compute per step (busy loop)")
    parser.add_argument("--spike-steps", default="", help="comma-separated steps whose loss is scaled by 1e4 (a "
                        "gradient spike), to see data skipping at work")
    parser.add_argument("--global-norm-spike-threshold", type=float, default=None,
                        help="data skipping on (use_skip_data_by_global_norm=True) with this threshold")
    parser.add_argument("--global-norm-spike-count-threshold", type=int, default=None)
    parser.add_argument("--embedding-local-norm-threshold", type=float, default=None,
                        help="checkpoint health monitor on (use_checkpoint_health_monitor=True) with this threshold")
    parser.add_argument("--save-dir", default=None, help="TrainerWrapper(save_dir=...): a path or s3://bucket/prefix "
                        "(default <output-dir>/easyckpt)")
    parser.add_argument("--max-ckpt-num", type=int, default=None, help="iterations easyckpt keeps on disk (default 2)")
    parser.add_argument("--lora", action="store_true", help="train a peft LoRA adapter on the attention projections "
                        "(c_attn) of a frozen base: pip install peft")
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config file (ZeRO; run with DS_ACCELERATOR=cpu)")
    parser.add_argument("--fsdp", action="store_true", help="TrainingArguments(fsdp='full_shard', fsdp_config="
                        "{'version': 2}): FSDP2 through Accelerate, which enables it on accelerator devices only "
                        "(tests/accelerate_fsdp_cpu.py runs this script with it enabled on CPU)")
    parser.add_argument("--fsdp-state-dict-type", default=None, choices=("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
                        help="fsdp_config['state_dict_type'] (the Trainer's default: FULL_STATE_DICT)")
    parser.add_argument("--save-full-at", action="append", choices=("begin", "end"), default=[],
                        help="rank 0 saves the whole model and optimizer state training starts from (begin) or ends "
                        "with (end) as --out/<begin|end>-full-<attempt>-<step>.pt; repeatable")
    parser.add_argument("--pin-timeout", type=float, default=None,
                        help="TrainerWrapper(pin_timeout=...): how long a due snapshot waits for a free slot")
    parser.add_argument("--use-cpu", action=argparse.BooleanOptionalAction, default=True,
                        help="TrainingArguments(use_cpu=...): --no-use-cpu under torchrun on a machine without CUDA "
                        "is the misconfiguration TrainerWrapper refuses")
    parser.add_argument("--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself once its snapshot of "
                        "this step is in memory (a fresh start only): a kill right after a known step")
    args = parser.parse_args()
    run(args)
    # The Trainer leaves its process group up. Torn down during interpreter exit, gloo's DDP group can
    # deadlock or abort ("terminate called without an active exception"): its worker threads may still
    # need the GIL to drop a finished collective's tensors while the exiting thread joins them, holding it
    # (see pytorch/pytorch#190489). So: run() returned after a barrier, the Trainer and the DDP module are
    # collected now, and the group is destroyed while the interpreter is whole.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=os.environ.get("EASYCKPT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s rank%(process)d %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=3e-3,
        warmup_steps=4, logging_steps=1, save_strategy=args.save_strategy, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, seed=0, data_seed=1234, report_to="none", use_cpu=args.use_cpu,
        disable_tqdm=True, dataloader_num_workers=0, deepspeed=args.deepspeed,
        **({"fsdp": "full_shard", "fsdp_config": {"version": 2, **({"state_dict_type": args.fsdp_state_dict_type}
                                                                  if args.fsdp_state_dict_type else {})}}
           if args.fsdp else {}))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32))
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))
    step_log = StepLog(out / f"losses-rank{rank}.jsonl", attempt)
    spikes = {int(step) for step in args.spike_steps.split(",") if step}

    class SpikyTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *rest: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *rest, **kwargs)
            return loss * 1e4 if self.state.global_step + 1 in spikes else loss

    trainer = (SpikyTrainer if spikes else Trainer)(model=model, args=training_args,
                                                    train_dataset=SyntheticTokens(64), callbacks=[step_log])
    # Each rank its own dropout and noise streams (the sampler is seeded by data_seed), so a resumed rank
    # must get its own RNG states back, not rank 0's.
    torch.manual_seed(1 + rank)
    random.seed(1 + rank)
    np.random.seed(1 + rank)

    if args.step_seconds:
        trainer.add_callback(BusyStep(args.step_seconds))

    resume: str | bool | None = True if args.resume == "true" else args.resume
    health: dict[str, Any] = {}
    if args.global_norm_spike_threshold is not None:
        health.update(use_skip_data_by_global_norm=True, global_norm_spike_threshold=args.global_norm_spike_threshold,
                      global_norm_spike_count_threshold=args.global_norm_spike_count_threshold)
    if args.embedding_local_norm_threshold is not None:
        health.update(use_checkpoint_health_monitor=True,
                      embedding_local_norm_threshold=args.embedding_local_norm_threshold)
    if args.max_ckpt_num is not None:
        health["max_ckpt_num"] = args.max_ckpt_num
    if args.save_dir is not None:
        health["save_dir"] = args.save_dir
    if args.pin_timeout is not None:
        health["pin_timeout"] = args.pin_timeout
    wrapper = None if args.plain else TrainerWrapper(trainer, save_mem_interval=args.save_mem_interval,
                                                     log_file_path=str(out / "persist.log"), **health)

    class ResumeReport(TrainerCallback):
        """Where this run started, written before its first step (a killed run still has it)."""

        def on_train_begin(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if wrapper is not None:
                assert wrapper.resumed is not None
                info = wrapper.resumed.as_dict()
            else:
                info = {"step": state.global_step if resume else None, "source": "path" if resume else None,
                        "path": resume}
            report = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "plain": args.plain,
                      "global_step": state.global_step, "load_began": load_began, **info}
            index = len(list(out.glob(f"resume-rank{rank}-*.json")))
            write_report(out / f"resume-rank{rank}-{index}.json", report)
            if rank == 0 and info["step"] is not None:
                print(f"resumed at step {info['step']} from {info['source']} ({info['path']})", flush=True)

    trainer.add_callback(ResumeReport())
    if args.save_full_at:
        class SaveFull(TrainerCallback):
            """The whole model and optimizer state the run starts from (after any resume) or ends with, gathered
            from every rank's shards: what a test compares with a saved state."""

            def save(self, when: str, state: Any, kwargs: dict[str, Any]) -> None:
                from torch.distributed.checkpoint.state_dict import (
                    StateDictOptions,
                    get_model_state_dict,
                    get_optimizer_state_dict,
                )
                if when not in args.save_full_at:
                    return
                whole = StateDictOptions(full_state_dict=True)
                full = {"model": get_model_state_dict(kwargs["model"], options=whole),
                        "optim": get_optimizer_state_dict(kwargs["model"], kwargs["optimizer"], options=whole)}
                if rank == 0:
                    torch.save(full, out / f"{when}-full-{attempt}-{state.global_step}.pt")

            def on_train_begin(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.save("begin", state, kwargs)

            def on_train_end(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.save("end", state, kwargs)

        trainer.add_callback(SaveFull())
    if args.kill_at is not None and rank == 1 and wrapper is not None:
        class KillAfterSnapshot(TrainerCallback):
            """At the start of the step after ``--kill-at``: the snapshot of that step was taken at its save
            point; once its copy is in shared memory, die as kill -9 would."""

            def on_step_begin(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
                assert wrapper is not None and wrapper.resumed is not None
                if state.global_step == args.kill_at and wrapper.resumed.step is None and wrapper.ckpt is not None:
                    wrapper.ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)

        trainer.add_callback(KillAfterSnapshot())
    # The soak's judge: what storage held when this load began (its audit log's clock). train() loads first, so
    # this moment is at or before the load's own start, which only makes the judge's check weaker, never wrong.
    load_began = time.time()
    (wrapper or trainer).train(resume_from_checkpoint=resume)
    if rank == 0:
        print(f"done at step {trainer.state.global_step}", flush=True)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
