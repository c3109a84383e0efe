"""What TrainerWrapper's snapshot of every step costs a peft LoRA fine-tune: step time over a plain Trainer's, and
the bytes each snapshot holds.

    python benchmarks/hf_lora.py --layers 8 --width 768 --steps 30 --out results/hf-lora-cpu.json

A GPT-2 of ``--layers`` blocks of width ``--width`` (a 64-token vocabulary, so the blocks are the weights), frozen,
with a LoRA adapter of rank 8 on its attention projections (``c_attn``), trains ``--steps`` optimizer steps in this
process:

* ``plain``: the Trainer alone, no checkpoint (``save_steps`` past the end);
* ``easyckpt``: the same in ``TrainerWrapper(save_mem_interval=1)``: a snapshot every step, persisted at the end.

``--zero 2`` (or 3) runs both under DeepSpeed ZeRO in this one process (``DS_ACCELERATOR=cpu``, a process group of
one: pip install deepspeed), where the snapshot takes the module's state from the engine.

Printed per configuration: the median step time after ``--warmup`` steps, and for ``easyckpt`` the bytes of the
iteration its final persist wrote (what each snapshot holds). The headline is ``easyckpt``'s step over ``plain``'s.
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

import peft
import torch
import transformers
from common import free_port, write_result
from hf_log_history import Tokens
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from easyckpt.transformers import TrainerWrapper
from easyckpt_wire import layout

CONFIGS = ("plain", "easyckpt")


class Clock(TrainerCallback):
    """Times each optimizer step (one step end to the next)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def run(config: str, layers: int, width: int, steps: int, warmup: int, directory: Path,
        zero: int = 0) -> dict[str, Any]:
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=64,
                                      n_positions=32))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(output_dir=str(directory), max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=steps, save_steps=steps + 1, report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0, deepspeed=ds_config(zero) if zero else None)
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock])
    (TrainerWrapper(trainer, save_mem_interval=1) if config == "easyckpt" else trainer).train()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])][warmup:]
    row: dict[str, Any] = {"median_step_s": statistics.median(times), "parameters": total, "trained": trained}
    if config == "easyckpt":
        iteration = directory / "easyckpt" / layout.iteration_dirname(steps)
        row["snapshot_bytes"] = sum(p.stat().st_size for p in iteration.iterdir())
    return row


def ds_config(stage: int) -> dict[str, Any]:
    # DeepSpeed in this process alone: the launcher's variables for a group of one, its CPU accelerator
    for key, value in {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(key, value)
    return {"zero_optimization": {"stage": stage}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}



def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 2, 3), help="DeepSpeed ZeRO stage (0: none)")
    parser.add_argument("--dir", type=Path, default=None, help="where the runs' output_dirs go (a temporary dir)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON result")
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for config in CONFIGS:
            rows[config] = run(config, args.layers, args.width, args.steps, args.warmup, Path(tmp) / config, args.zero)
            extra = (f", {rows[config]['snapshot_bytes'] / 2**20:.1f} MiB a snapshot"
                     if "snapshot_bytes" in rows[config] else "")
            print(f"{config}: {rows[config]['median_step_s'] * 1000:.1f} ms a step{extra} "
                  f"({rows[config]['trained']:,} of {rows[config]['parameters']:,} parameters train)", flush=True)
    ratio = rows["easyckpt"]["median_step_s"] / rows["plain"]["median_step_s"]
    print(f"easyckpt over plain: {ratio:.2f}x")
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "transformers": transformers.__version__, "peft": peft.__version__, "python": platform.python_version()}
    return write_result(args.out, {"benchmark": "hf_lora", "machine": machine, "layers": args.layers,
                                   "width": args.width, "zero": args.zero, "steps": args.steps, "warmup": args.warmup,
                                   "rows": rows,
                                   "ratio_easyckpt_over_plain": ratio})


if __name__ == "__main__":
    main()
