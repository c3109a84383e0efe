"""FSDP2 (``fully_shard``) training with easyckpt, on CPU with gloo: resume on the same or another world size.

    torchrun --nproc-per-node=4 examples/fsdp2_train.py --save-dir /tmp/ckpt --out /tmp/run4 --steps 8
    torchrun --nproc-per-node=2 examples/fsdp2_train.py --save-dir /tmp/ckpt --out /tmp/run2 --steps 10

The second command resumes the 4-rank save on 2 ranks: ``ckpt.load(state)`` sees that the newest
iteration was written by another world size and reshards it from disk through
``torch.distributed.checkpoint``'s load planning (``easyckpt.dcp.StorageReader``).

Each rank appends ``{"step", "loss"}`` per step to ``--out/losses-rank<r>.jsonl``; rank 0 writes
``--out/full-<step>.json`` (xxh3-128 of every ``full_tensor()`` of model and optimizer state) for each
persisted step and ``--out/resume-<n>.json`` after a load, which is what tests/jobs/test_fsdp.py compares.
``--dcp-check DIR`` first loads that iteration with plain ``dcp.load`` into a fresh model and writes its
digests to ``--out/dcp.json``.

``--tp 2`` adds DTensor tensor parallelism: a 2-D mesh (dp, tp) of world/2 x 2 ranks, the MLP's ``up``
``ColwiseParallel`` and ``down`` ``RowwiseParallel`` on the tp dim, FSDP2 on the dp dim. Its saves resume on
a 1-D FSDP-only mesh (``--tp 1``, the default) of any size: the state dict's keys are the same, and each
tensor's global shape too; only the placements differ, which the resharded load handles::

    torchrun --nproc-per-node=4 examples/fsdp2_train.py --save-dir /tmp/ckpt2d --out /tmp/run2d --tp 2
    torchrun --nproc-per-node=2 examples/fsdp2_train.py --save-dir /tmp/ckpt2d --out /tmp/run1d --steps 10

``--device cuda`` trains on the GPUs (rank r on GPU r mod the GPU count; NCCL for CUDA tensors, gloo for the
rest) and also saves and restores the CUDA RNG (dropout on the GPU draws from it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import easyckpt
import easyckpt.dcp


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        # 3 rows: on 4 ranks the last shard is empty, on 2 the shards are uneven (2 and 1)
        self.gate = torch.nn.Linear(dim, 3)
        self.block = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=48, dropout=0.1, batch_first=True)
        # tensor-parallel under --tp (up: column-wise, down: row-wise); 40 columns split evenly on tp 2
        self.mlp = MLP(dim, 40)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x * (1 + self.gate(x).mean(-1, keepdim=True))
        x = self.block(x)
        return self.head(x + self.mlp(x))


class MLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))  # type: ignore[no-any-return]


def dp_mesh(tp: int) -> DeviceMesh | None:
    """FSDP's mesh: None (the whole world) without tensor parallelism, else the dp dim of a (dp, tp) mesh."""
    if tp == 1:
        return None
    world = dist.get_world_size()
    if world % tp:
        raise SystemExit(f"--tp {tp} does not divide the world size {world}")
    return init_device_mesh(DEVICE.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))["dp"]


DEVICE = torch.device("cpu")   # --device: set once in main(), before anything is built


def build(tp: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)   # the same full weights on every rank before fully_shard splits them
    model = TinyLM().to(DEVICE)
    mesh = dp_mesh(tp)
    if mesh is not None:
        root = mesh._get_root_mesh()
        parallelize_module(model.mlp, root["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if mesh is None and DEVICE.type == "cuda":
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    init_optimizer_state(optimizer)
    return model, optimizer


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW creates its state at the first step; a load needs it to exist (as DCP does): one step with zero
    gradients and lr 0 changes no parameter."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def batch(position: int, rank: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * position + rank)
    tokens = torch.randint(0, vocab, (4, 12), generator=generator)
    return tokens[:, :-1].to(DEVICE), tokens[:, 1:].to(DEVICE)


def full_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """xxh3-128 of every model and optimizer tensor as a whole (``full_tensor()``: collective)."""
    found = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        found.update({f"optim.{index}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    digests = {}
    for name, value in found.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        digests[name] = xxhash.xxh3_128_hexdigest(
            full.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return digests


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "data_position": step + 1, "step": step}
    if DEVICE.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(DEVICE)
    return state


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-storage-interval", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra compute per step (busy loop)")
    parser.add_argument("--step-idle", type=float, default=0.0,
                        help="seconds each step waits, as a rank does while its GPU computes (simulated nodes)")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL --kill-rank right after this step's snapshot")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--digest-every", type=int, default=None,
                        help="write full-<step>.json every this many steps (default: --save-storage-interval)")
    parser.add_argument("--dcp-check", default=None, help="an iteration_N directory to load with dcp.load first")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2-D mesh dp x tp when > 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if "RANK" not in os.environ:   # else torch.distributed only says that RANK is not set
        parser.error(f"run it under torchrun: torchrun --nproc-per-node=2 {sys.argv[0]} ARGS")
    logging.basicConfig(level=os.environ.get("EASYCKPT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s rank%(process)d %(name)s: %(message)s")
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))

    if args.dcp_check:
        # Plain torch.distributed.checkpoint, easyckpt's layout through its StorageReader.
        model, optimizer = build(args.tp)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, storage_reader=easyckpt.dcp.StorageReader(args.dcp_check))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        digests = full_digests(model, optimizer)
        if rank == 0:
            (out / "dcp.json").write_text(json.dumps(digests))

    model, optimizer = build(args.tp)
    data_rank = rank // args.tp    # the ranks of one tensor-parallel group read the same batch
    torch.manual_seed(1 + rank)   # each rank its own dropout stream: rank-private state
    ckpt = easyckpt.Checkpointer(args.save_dir, 1, args.save_storage_interval, 3)
    result = ckpt.load(training_state(model, optimizer, -1))
    start = 0
    if result.step is not None:
        model.load_state_dict(result.state["model"])
        optimizer.load_state_dict(result.state["optim"])
        torch.set_rng_state(result.state["rng"])
        if DEVICE.type == "cuda":
            torch.cuda.set_rng_state(result.state["cuda_rng"].cpu(), DEVICE)
        start = result.state["data_position"]
    digests = full_digests(model, optimizer) if result.step is not None else {}
    if rank == 0:
        report = {"step": result.step, "source": result.source, "world_size": dist.get_world_size(), "tp": args.tp,
                  "digests": digests}
        (out / f"resume-{len(list(out.glob('resume-*.json')))}.json").write_text(json.dumps(report))

    with open(out / f"losses-rank{rank}.jsonl", "a", encoding="utf-8") as log:
        for step in range(start, args.steps):
            inputs, targets = batch(step, data_rank)
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            deadline = time.perf_counter() + args.step_seconds
            while time.perf_counter() < deadline:
                pass
            if args.step_idle:
                time.sleep(args.step_idle)   # stands in for GPU compute: leaves the CPU to the node agents
            # The digests of this step go out before its snapshot: a job killed right after the snapshot (a
            # lost node) may resume at this step, and the test compares the resumed state with these digests.
            if step % (args.digest_every or args.save_storage_interval) == 0:
                full = full_digests(model, optimizer)
                if rank == 0:
                    (out / f"full-{step}.json").write_text(json.dumps(full))
            ckpt.save_if_needed(step, training_state(model, optimizer, step))
            if step == args.kill_at and rank == args.kill_rank:
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            log.flush()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
