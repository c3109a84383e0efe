"""Training-step time of a Lightning Trainer checkpointing every step: EasyCkpt vs Lightning's own checkpointing.

    python benchmarks/lightning_blocking.py --dim 1024 --layers 1 4 --steps 30 --out results/lightning_blocking.json

One process, one model (an MLP stack with AdamW: parameters plus two moments, ~3x the parameter bytes), the
same data, one run; each configuration trains a fresh Trainer for ``--steps`` optimizer steps, ``--rounds``
times interleaved with the others, and the median step time (from one ``on_train_batch_start`` to the next,
so a save at a batch end and a wait for a copy inside the next step both count) is taken over the steps
after ``--warmup`` of every round:

* ``none``: no checkpointing (the step's compute alone);
* ``lightning``: ``ModelCheckpoint(every_n_train_steps=1)``, Lightning's default ``TorchCheckpointIO``
  (``torch.save`` on the training thread);
* ``async_io``: the same with ``plugins=[AsyncCheckpointIO()]`` (every tensor cloned on the training thread,
  written by a thread);
* ``easyckpt``: ``EasyCkpt(save_mem_interval=1)``, a snapshot into shared memory every step (the agent
  persists only what Lightning asks for: nothing here);
* ``easyckpt_persist``: ``EasyCkpt`` and the same ``ModelCheckpoint(every_n_train_steps=1)``: every step
  snapshotted, persisted by the agent and written as a ``.ckpt`` file by the export thread.

The blocking time of a configuration is its median step minus ``none``'s; the headline ratios are the
peers' blocking times over easyckpt's, measured in the same run.
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

import lightning
import lightning.pytorch as pl
import torch
from common import write_result
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from easyckpt.lightning import EasyCkpt

CONFIGS = ("none", "lightning", "async_io", "easyckpt", "easyckpt_persist")


class Mlp(pl.LightningModule):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)]
        self.net = torch.nn.Sequential(*blocks)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class StepClock(pl.Callback):
    """Wall time from one batch start to the next: everything the loop waits for in between."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def run(config: str, dim: int, layers: int, steps: int, batch: int, directory: Path, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Mlp(dim, layers)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(steps * batch, dim)),
                                       batch_size=batch)
    clock = StepClock()
    root = directory / config
    callbacks: list[pl.Callback] = [clock]
    plugins: list[Any] = []
    if config != "none" and config != "easyckpt":
        callbacks.append(ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=1, save_top_k=1))
    if config == "async_io":
        plugins.append(AsyncCheckpointIO())
    if config.startswith("easyckpt"):
        callbacks.insert(0, EasyCkpt(save_mem_interval=1, save_dir=root / "easyckpt", max_ckpt_num=1))
    trainer = pl.Trainer(default_root_dir=root, max_steps=steps, accelerator=device, devices=1, callbacks=callbacks,
                         plugins=plugins, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=config not in ("none", "easyckpt"), limit_val_batches=0)
    started = time.perf_counter()
    trainer.fit(model, data)
    total = time.perf_counter() - started
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    return {"config": config, "state_bytes": state_bytes, "step_times_s": clock.steps(), "fit_s": total}


def measure(dim: int, layers: int, steps: int, warmup: int, batch: int, directory: Path, device: str,
            configs: tuple[str, ...], rounds: int) -> dict[str, Any]:
    """Every configuration ``rounds`` times, interleaved (a noisy machine's drift spreads over all of them);
    the step times of a configuration's rounds pooled."""
    times: dict[str, list[float]] = {config: [] for config in configs}
    fits: dict[str, list[float]] = {config: [] for config in configs}
    state_bytes = 0
    for _ in range(rounds):
        for config in configs:
            row = run(config, dim, layers, steps, batch, directory, device)
            times[config] += row["step_times_s"][warmup:]
            fits[config].append(row["fit_s"])
            state_bytes = row["state_bytes"]
    medians = {config: statistics.median(values) for config, values in times.items()}
    base = medians.get("none", float("nan"))
    blocking = {config: medians[config] - base for config in medians if config != "none"}
    result: dict[str, Any] = {"dim": dim, "layers": layers, "state_bytes": state_bytes, "median_step_s": medians,
                              "blocking_s": blocking, "fit_s": fits, "steps_timed": len(times[configs[0]])}
    easy = blocking.get("easyckpt")
    if easy is not None:
        # a blocking time at or under the noise floor is shown as such, not as an infinite ratio
        floor = max(easy, 1e-4)
        result["ratio_over_easyckpt"] = {peer: blocking[peer] / floor for peer in ("lightning", "async_io")
                                         if peer in blocking}
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every configuration, interleaved")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    configs = tuple(dict.fromkeys(["none", *args.configs]))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [measure(args.dim, layers, args.steps, args.warmup, args.batch_size, Path(tmp), args.device, configs,
                        args.rounds) for layers in args.layers]
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "lightning": lightning.__version__, "device": args.device, "python": platform.python_version()}
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    peers = [c for c in configs if c != "none"]
    print(f"{'state MB':>8} {'step ms':>8} " + " ".join(f"{c + ' +ms':>20}" for c in peers) +
          " " + " ".join(f"{p + '/easyckpt':>20}" for p in ("lightning", "async_io") if p in peers))
    for row in rows:
        print(f"{row['state_bytes'] / 1e6:8.0f} {row['median_step_s']['none'] * 1e3:8.1f} " +
              " ".join(f"{row['blocking_s'][c] * 1e3:20.1f}" for c in peers) + " " +
              " ".join(f"{row.get('ratio_over_easyckpt', {}).get(p, float('nan')):20.1f}"
                       for p in ("lightning", "async_io") if p in peers))
    return write_result(args.out, {"benchmark": "lightning_blocking", "machine": machine, "steps": args.steps,
                                   "warmup": args.warmup, "batch_size": args.batch_size, "rounds": args.rounds,
                                   "rows": rows})


if __name__ == "__main__":
    main()
