"""PyTorch Lightning with easyckpt: a small model under torchrun; kill a rank, run it again.

    torchrun --nproc-per-node=2 examples/lightning_trainer.py --root /tmp/pl --out /tmp/pl-run --steps 24
    # kill -9 one rank mid-training (--kill-rank 1 --kill-at 13 does it), then resume: from memory while the
    # node's agent holds the snapshot, else from disk
    torchrun --nproc-per-node=2 examples/lightning_trainer.py --root /tmp/pl --out /tmp/pl-run --steps 24

Without torchrun, ``--devices 2`` has Lightning's own launcher start the ranks (``python
examples/lightning_trainer.py --devices 2 ...``), as a Lightning user on one machine usually runs.

The usual Lightning code gains two things: the callback, and the ``ckpt_path`` Lightning users pass to resume::

    trainer = Trainer(..., callbacks=[EasyCkpt(save_mem_interval=1), ModelCheckpoint(every_n_train_steps=8)])
    trainer.fit(model, datamodule=data, ckpt_path="last")   # memory, replica, disk; fresh when nothing exists

Every optimizer step is snapshotted into shared memory; every ``--save-steps``-th is persisted by the agent and
written as ``<root>/checkpoints/epoch=E-step=N.ckpt`` (and ``last.ckpt``), which a plain Lightning Trainer
resumes from (``--plain --resume <root>/checkpoints/last.ckpt``).

The model has dropout and the data is shuffled (``DistributedSampler``), so a resume that lost an RNG state
or the data position would show. ``--loader stateful`` trains from torchdata's ``StatefulDataLoader`` instead
(``pip install torchdata``; ``--loader-workers N`` for its worker processes). Each rank appends one JSON line
per optimizer step to ``--out/losses-rank<r>.jsonl``: the step, the loss, the ids of the batch's samples, and a
digest of the model and optimizer state after the step; it writes ``--out/resume-rank<r>-<n>.json`` (where
fit() started from, and the digest of the state it starts with) at the start of training. Those files are what
the tests compare with an uninterrupted run.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import xxhash
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from easyckpt.lightning import EasyCkpt
from easyckpt.snapshot.state import flatten

FEATURES, SAMPLES, BATCH = 16, 64, 4


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Whole or not at all: tests poll for these files while the job runs."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)


class Samples(torch.utils.data.Dataset):
    """Fixed random inputs and targets; each sample carries its id, so a run's batches can be compared."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Model(pl.LightningModule):
    def __init__(self, lr: float = 0.01, spike_at: tuple[int, ...] = (), fsdp2: bool = False,
                 stateful_loader: bool = False, loader_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        if self.hparams.fsdp2:   # ModelParallelStrategy: each Linear a unit of FSDP2, sharded over the ranks
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step + 1 in self.hparams.spike_at:   # a bad batch: its gradient norm spikes
            loss = loss * 1e4
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        if self.hparams.stateful_loader:   # a loader that saves its own position (torchdata)
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(Samples(), batch_size=BATCH, shuffle=True,
                                      num_workers=self.hparams.loader_workers)
        return torch.utils.data.DataLoader(Samples(), batch_size=BATCH, shuffle=True)


def digest(trainer: pl.Trainer) -> str:
    """xxh3-128 over every tensor of the model and optimizer, in order: equal digests mean equal bits."""
    hasher = xxhash.xxh3_128()
    state = {"model": trainer.lightning_module.state_dict(), "optim": [o.state_dict() for o in trainer.optimizers]}
    _, refs, values = flatten(state)
    for ref, value in zip(refs, values):
        hasher.update(ref.name.encode())
        hasher.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


class Report(pl.Callback):
    """The per-step lines and the resume report the tests read; ``kill_at``: SIGKILL this rank there."""

    def __init__(self, out: Path, kill_rank: int, kill_at: int) -> None:
        self.out, self.kill_rank, self.kill_at = out, kill_rank, kill_at
        self.ids: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        (self.out / f"pid-rank{rank}").write_text(str(os.getpid()))
        easy = next((cb for cb in trainer.callbacks if isinstance(cb, EasyCkpt)), None)
        report = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                  "ckpt_path": None if trainer.ckpt_path is None else str(trainer.ckpt_path),
                  "resumed": easy.resumed if easy is not None else None, "digest": digest(trainer)}
        index = len(list(self.out.glob(f"resume-rank{rank}-*.json")))
        write_report(self.out / f"resume-rank{rank}-{index}.json", report)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.ids = [int(i) for i in batch[2]]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, rank = trainer.global_step, trainer.global_rank
        row = {"step": step, "epoch": trainer.current_epoch, "loss": float(outputs["loss"]), "ids": self.ids,
               "lr": trainer.optimizers[0].param_groups[0]["lr"], "digest": digest(trainer)}
        with open(self.out / f"losses-rank{rank}.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        if rank == self.kill_rank and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="Trainer(default_root_dir=...)")
    parser.add_argument("--out", type=Path, required=True, help="where the per-step and resume reports go")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=8, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--save-mem-interval", type=int, default=1)
    parser.add_argument("--save-dir", default=None, help="EasyCkpt(save_dir=...): a path or s3://bucket/prefix "
                        "(default <root>/easyckpt)")
    parser.add_argument("--resume", default="last", help="fit(ckpt_path=...): 'last', a .ckpt path, or 'none'")
    parser.add_argument("--plain", action="store_true", help="plain Lightning, without EasyCkpt")
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp",
                        help="fsdp2: ModelParallelStrategy, fully_shard in configure_model")
    parser.add_argument("--loader", choices=("plain", "stateful"), default="plain",
                        help="stateful: torchdata's StatefulDataLoader (pip install torchdata), whose position "
                        "Lightning saves and restores")
    parser.add_argument("--loader-workers", type=int, default=0, help="the stateful loader's num_workers")
    parser.add_argument("--devices", type=int, default=0, help="without torchrun: Lightning's own launcher starts "
                        "this many ranks (python examples/lightning_trainer.py --devices 2 ...)")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...): batches "
                        "per optimizer step (a line per batch in the losses file, each with its optimizer step)")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--spike-at", default="", help="steps (comma-separated) whose loss is scaled by 1e4")
    parser.add_argument("--skip-spikes", action="store_true", help="use_skip_data_by_global_norm=True")
    parser.add_argument("--health", action="store_true", help="use_checkpoint_health_monitor=True")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("EASYCKPT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(args)
    # Lightning leaves its process group up, and gloo's group torn down during interpreter exit can abort ("terminate
    # called without an active exception": seen once, rank 1 of a plain FSDP2 run after its last step, CI rehearsal of
    # 2026-12-01): the same teardown as examples/hf_trainer.py, once every rank is done and the Trainer is collected.
    if dist.is_initialized():
        dist.barrier()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(1234, workers=True, verbose=False)

    checkpoints = ModelCheckpoint(dirpath=args.root / "checkpoints", every_n_train_steps=args.save_steps,
                                  save_top_k=2, monitor="step", mode="max", save_last=True)
    callbacks: list[pl.Callback] = [checkpoints, Report(args.out, args.kill_rank, args.kill_at)]
    if not args.plain:
        skip = {"use_skip_data_by_global_norm": True, "global_norm_spike_threshold": 100.0,
                "global_norm_spike_count_threshold": 2} if args.skip_spikes else {}
        health = {"use_checkpoint_health_monitor": True, "embedding_local_norm_threshold": 1e6} if args.health else {}
        callbacks.insert(0, EasyCkpt(save_mem_interval=args.save_mem_interval,
                                     log_file_path=str(args.out / "persist.log"), save_dir=args.save_dir, **skip,
                                     **health))
    # under torchrun, its world; else the ranks Lightning's launcher starts (it runs this script again for each)
    world = args.devices or int(os.environ.get("WORLD_SIZE", "1"))
    strategy: Any = "ddp" if world > 1 else "auto"
    if args.strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(default_root_dir=args.root, max_steps=args.steps, accelerator="cpu", devices=world,
                         strategy=strategy, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         log_every_n_steps=1, accumulate_grad_batches=args.accumulate)
    spikes = tuple(int(step) for step in args.spike_at.split(",") if step)
    model = Model(spike_at=spikes, fsdp2=args.strategy == "fsdp2", stateful_loader=args.loader == "stateful",
                  loader_workers=args.loader_workers)
    trainer.fit(model, ckpt_path=None if args.resume == "none" else args.resume)


if __name__ == "__main__":
    main()
