"""What checkpointing every step blocks a Lightning Trainer's loop: EasyCkpt vs Lightning's own checkpointing.

    python benchmarks/lightning_blocking.py --dim 1024 --layers 1 4 --steps 30 --out results/lightning-blocking-cpu.json

One process, one model (an MLP stack with AdamW: parameters plus two moments, ~3x the parameter bytes), the
same data, one run; each configuration trains a fresh Trainer for ``--steps`` optimizer steps, ``--rounds``
times interleaved with the others:

* ``none``: no checkpointing (the step's compute alone);
* ``lightning``: ``ModelCheckpoint(every_n_train_steps=1)``, Lightning's default ``TorchCheckpointIO``
  (``torch.save`` on the training thread);
* ``async_io``: the same with ``plugins=[AsyncCheckpointIO()]`` (every tensor cloned on the training thread,
  written by a thread);
* ``easyckpt``: ``EasyCkpt(save_mem_interval=1)``, a snapshot into shared memory every step (the agent
  persists only what Lightning asks for: nothing here);
* ``easyckpt_persist``: ``EasyCkpt`` and the same ``ModelCheckpoint(every_n_train_steps=1)``: every step
  snapshotted twice (the snapshot, and Lightning's save with a persist request), persisted by the agent as
  fast as it goes (it passes a step over when a newer one is asked for meanwhile) and exported as ``.ckpt``.

Per step, the **blocking time** is what the training thread spends on checkpointing: the batch-end hooks
(EasyCkpt's snapshot launch, ``ModelCheckpoint``'s save; timed from before the first callback to after the
last) plus, for EasyCkpt, its waits for a copy to finish (after the next step's forward and backward, before
the optimizer update). Medians over the steps after ``--warmup`` of every round; the headline ratios are the
peers' blocking times over ``easyckpt``'s. The step time (one batch start to the next) is reported too: on a
CPU the copy thread also takes a core from the compute, which blocking time does not show; it is noisy where
the machine is shared.
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
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
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
    """Wall time from one batch start to the next, and the start of the batch-end hooks (the first callback)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.hooks_started = 0.0
        self.hooks: list[float] = []
        self.waits: list[float] = []   # EasyCkpt's waits for a copy, per step
        self._waited = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        easy = next((cb for cb in trainer.callbacks if isinstance(cb, EasyCkpt)), None)
        if easy is not None and easy.ckpt is not None:   # time each wait of the training thread for a copy
            stager = easy.ckpt.stager
            wait = stager.wait

            def timed_wait() -> None:
                started = time.perf_counter()
                wait()
                self._waited += time.perf_counter() - started

            stager.wait = timed_wait   # type: ignore[method-assign]

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        self.hooks_started = time.perf_counter()

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]

    def blocking(self) -> list[float]:
        """Per step: the batch-end hooks plus the waits for a copy that the step's optimizer update made."""
        return [hook + wait for hook, wait in zip(self.hooks, self.waits)]


class HooksDone(Checkpoint):
    """After every other callback's batch end (Lightning runs checkpoint callbacks last, this one after
    ModelCheckpoint): closes the step's hook time; the copy waits are counted per step here too."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, *args: Any) -> None:
        clock = self.clock
        clock.hooks.append(time.perf_counter() - clock.hooks_started)
        clock.waits.append(clock._waited)
        clock._waited = 0.0


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
    callbacks.append(HooksDone(clock))
    if config == "async_io":
        plugins.append(AsyncCheckpointIO())
    if config.startswith("easyckpt"):
        callbacks.insert(1, EasyCkpt(save_mem_interval=1, save_dir=root / "easyckpt", max_ckpt_num=1))
    trainer = pl.Trainer(default_root_dir=root, max_steps=steps, accelerator=device, devices=1, callbacks=callbacks,
                         plugins=plugins, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)   # HooksDone is a Checkpoint: Lightning adds no ModelCheckpoint of its own
    started = time.perf_counter()
    trainer.fit(model, data)
    total = time.perf_counter() - started
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    return {"config": config, "state_bytes": state_bytes, "step_times_s": clock.steps(),
            "blocking_s": clock.blocking(), "fit_s": total}


def measure(dim: int, layers: int, steps: int, warmup: int, batch: int, directory: Path, device: str,
            configs: tuple[str, ...], rounds: int) -> dict[str, Any]:
    """Every configuration ``rounds`` times, interleaved (a noisy machine's drift spreads over all of them);
    the per-step times of a configuration's rounds pooled."""
    steps_s: dict[str, list[float]] = {config: [] for config in configs}
    blocking_s: dict[str, list[float]] = {config: [] for config in configs}
    fits: dict[str, list[float]] = {config: [] for config in configs}
    state_bytes = 0
    for _ in range(rounds):
        for config in configs:
            row = run(config, dim, layers, steps, batch, directory, device)
            steps_s[config] += row["step_times_s"][warmup:]
            blocking_s[config] += row["blocking_s"][warmup:]
            fits[config].append(row["fit_s"])
            state_bytes = row["state_bytes"]
    step = {config: statistics.median(values) for config, values in steps_s.items()}
    blocking = {config: statistics.median(values) for config, values in blocking_s.items()}
    result: dict[str, Any] = {"dim": dim, "layers": layers, "state_bytes": state_bytes, "median_step_s": step,
                              "median_blocking_s": blocking, "fit_s": fits, "steps_timed": len(steps_s[configs[0]])}
    if "easyckpt" in blocking:
        result["ratio_over_easyckpt"] = {peer: blocking[peer] / blocking["easyckpt"]
                                         for peer in ("lightning", "async_io") if peer in blocking}
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
    ratios = [p for p in ("lightning", "async_io") if p in peers and "easyckpt" in peers]
    print(f"{'state MB':>8} {'config':>17} {'blocking ms':>11} {'step ms':>9}")
    for row in rows:
        for config in configs:
            print(f"{row['state_bytes'] / 1e6:8.0f} {config:>17} {row['median_blocking_s'][config] * 1e3:11.2f} "
                  f"{row['median_step_s'][config] * 1e3:9.1f}")
        print("".join(f"   {p} / easyckpt: {row['ratio_over_easyckpt'][p]:.1f}" for p in ratios))
    return write_result(args.out, {"benchmark": "lightning_blocking", "machine": machine, "steps": args.steps,
                                   "warmup": args.warmup, "batch_size": args.batch_size, "rounds": args.rounds,
                                   "rows": rows})


if __name__ == "__main__":
    main()
