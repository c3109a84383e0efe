"""What a long ``log_history`` costs TrainerWrapper's snapshot of every step: step time with it over a plain Trainer's.

    python benchmarks/hf_log_history.py --entries 0 5000 50000 --steps 30 --out results/hf-log-history-cpu.json

A snapshot holds ``trainer_state.json`` as the Trainer would write it now, and that file holds every line the
Trainer logged (``logging_steps=1`` adds one per step: 50,000 at step 50,000). Each configuration trains a fresh
Trainer in this process (a tiny GPT-2, so that what is not compute shows) for ``--steps`` optimizer steps, its
``log_history`` filled with ``N`` entries of the Trainer's shape at the start of training:

* ``plain``: the Trainer alone, no checkpoint (``save_steps`` past the end);
* ``easyckpt``: the same in ``TrainerWrapper(save_mem_interval=1)``: a snapshot every step.

The median step time after ``--warmup`` steps, per ``N``; the headline is ``easyckpt``'s over ``plain``'s. Before
``LogHistoryJson`` (2026-12-06), each snapshot encoded the whole history: 86.5 ms a step at 5,000 entries and 761.6
ms at 50,000, against 5-8 ms for the plain Trainer, on the 2-vCPU VM.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from common import write_result
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from easyckpt.transformers import TrainerWrapper

CONFIGS = ("plain", "easyckpt")


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (4096, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class History(TrainerCallback):
    """Fills log_history at the start of training, and times each optimizer step (one step end to the next)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.ends: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.log_history.extend({"loss": 3.1, "grad_norm": 0.5, "learning_rate": 1e-4, "epoch": i / 1000, "step": i}
                                 for i in range(self.entries))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def median_step(config: str, entries: int, steps: int, warmup: int, directory: Path) -> float:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(output_dir=str(directory), max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=1, save_steps=steps + 1, report_to="none", use_cpu=True, disable_tqdm=True,
                             seed=0)
    clock = History(entries)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock])
    (TrainerWrapper(trainer, save_mem_interval=1) if config == "easyckpt" else trainer).train()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])][warmup:]
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, nargs="+", default=[0, 5000, 50000], help="log_history lengths")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--dir", type=Path, default=None, help="where the runs' output_dirs go (a temporary dir)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON result")
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for entries in args.entries:
            median = {config: median_step(config, entries, args.steps, args.warmup, Path(tmp) / f"{config}-{entries}")
                      for config in CONFIGS}
            rows.append({"entries": entries, "median_step_s": median,
                         "ratio_easyckpt_over_plain": median["easyckpt"] / median["plain"]})
            print(f"{entries:>7} entries: plain {median['plain'] * 1000:7.1f} ms, easyckpt "
                  f"{median['easyckpt'] * 1000:7.1f} ms a step ({rows[-1]['ratio_easyckpt_over_plain']:.1f}x)",
                  flush=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "transformers": transformers.__version__, "python": platform.python_version()}
    return write_result(args.out, {"benchmark": "hf_log_history", "machine": machine, "steps": args.steps,
                                   "warmup": args.warmup, "rows": rows})


if __name__ == "__main__":
    main()
