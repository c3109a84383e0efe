"""Each checkpoint system of ``peers.py`` driven the way its documentation shows, behind one small interface.

``load()`` resumes (newest step or None, and the source), ``before_optimizer_step()``, ``save(step)`` and
``hook_seconds()`` return the seconds the training loop waited on the system at that point, ``close()`` ends
the run as the system's docs say. Imported inside each peer's own environment: only torch and that peer.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def shm_regions() -> list[tuple[int, int]]:
    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                regions.append((lo, hi))
    return regions


def in_shm(tensors: list[Any]) -> list[torch.Tensor]:
    """The tensors whose memory lies in a mapping of a /dev/shm file (views of a snapshot)."""
    regions = shm_regions()

    def inside(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(lo <= ptr < hi for lo, hi in regions)

    return [t for t in tensors if isinstance(t, torch.Tensor) and t.numel() and inside(t)]


class System:
    """No checkpoint at all: the baseline every overhead is measured against."""

    def __init__(self, args: argparse.Namespace, net: torch.nn.Module, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.args, self.net, self.model, self.optimizer = args, net, model, optimizer
        self.ckpt_dir = Path(args.ckpt_dir)

    def load(self) -> tuple[int | None, str | None]:
        return None, None

    def before_optimizer_step(self) -> float:
        return 0.0

    def hook_seconds(self) -> float:
        return 0.0

    def save(self, step: int) -> float:
        return 0.0

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}


class Easyckpt(System):
    """A snapshot every step (the copy overlaps the next step), a persist every ``persist_every``-th by the agent."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        import easyckpt

        self.ck = easyckpt.Checkpointer(str(self.ckpt_dir), save_mem_interval=1,
                                        save_storage_interval=self.args.persist_every, max_ckpt_num=3)

    def load(self) -> tuple[int | None, str | None]:
        result = self.ck.load({"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict()})
        if result.step is None:
            return None, None
        self.net.load_state_dict(result.state["model"])
        self.optimizer.load_state_dict(result.state["optimizer"])
        return result.step, result.source

    def before_optimizer_step(self) -> float:
        # The library awaits the copy in an optimizer pre-hook anyway; calling it here times that wait.
        t0 = time.perf_counter()
        self.ck.wait()
        return time.perf_counter() - t0

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.ck.save_if_needed(step, self.state(step))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ck.close()

    def stats(self) -> dict[str, Any]:
        return {k: v for k, v in self.ck.stats().items() if isinstance(v, (int, float, str)) or v is None}


class EasyckptOncePerNode(Easyckpt):
    """A probe, not a way to run easyckpt: local rank 0 snapshots the replicated model and optimizer, the other
    local ranks only their step (what DLRover does for DDP). It measures what copying replicated state once per
    node would save; its resume cannot restore the other ranks, so it runs the clean job only."""

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.ck.save_if_needed(step, self.state(step) if local_rank == 0 else {"step": step})
        return time.perf_counter() - t0


class DLRover(System):
    """Flash Checkpoint's DdpCheckpointer (dlrover-run hosts the saver): MEMORY every step, DISK every n-th."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.storage_type = StorageType
        self.ck = DdpCheckpointer(str(self.ckpt_dir), replica_count=1 if self.args.replicas else 0)
        self.to_disk = False

    def load(self) -> tuple[int | None, str | None]:
        state = self.ck.load_checkpoint()
        if not state:
            return None, None
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # Its API does not say which tier answered: the memory tier hands out views of the shared-memory
        # segment, torch.load's tensors are private.
        from_memory = bool(in_shm(list(state["model"].values())))
        return int(state["step"]), "memory" if from_memory else "disk"

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        disk = step % self.args.persist_every == 0
        self.to_disk = self.to_disk or disk
        kind = self.storage_type.DISK if disk else self.storage_type.MEMORY
        # DLRover's step counts completed steps from 1: its saver never persists a step 0 (save_step_checkpoint
        # skips a shard whose step is 0, then its commit waits save_timeout, 600 s, for that shard), and load()
        # ignores a step 0 in memory.
        done = step + 1
        self.ck.save_checkpoint(done, self.state(step), str(self.ckpt_dir / str(done) / "rank_0.pt"), storage_type=kind)
        return time.perf_counter() - t0

    def close(self) -> None:
        # the docs' end of a run: wait until this process's newest disk checkpoint is on storage (it polls the
        # tracker for the step of the last DISK save of this process, so only when there was one)
        # Only on rank 0: a DDP rank that does not copy never sets the step it waits for, so it would wait out the
        # timeout (1800 s by default).
        if self.to_disk and dist.get_rank() == 0:
            # It opens the tracker file unguarded (FileNotFoundError while the first persist is still running).
            tracker = self.ckpt_dir / "dlrover_latest.txt"
            deadline = time.monotonic() + 120
            while not tracker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)   # polling against a deadline
            self.ck.wait_latest_checkpoint(timeout=120)


class LMResiliency(System):
    """GEMINI through the package-root ``enable_resiliency`` (detection off), its capture in an optimizer hook."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        from lm_resiliency import InMemoryCkptConfig, enable_resiliency

        self.marks: list[float] = []
        self.optimizer.register_step_post_hook(lambda *_: self.marks.append(time.perf_counter()))
        config = InMemoryCkptConfig(disk_folder=str(self.ckpt_dir), disk_flush_interval=self.args.persist_every,
                                    run_id="peers-benchmark", replication_jump=1)
        # On CPU its peer discovery needs a gloo group (it forms NCCL groups on its own).
        self.handle = enable_resiliency(self.model, self.optimizer, interval=1, enable_detection=False,
                                        checkpoint=config, group=dist.new_group(backend="gloo"))
        self.optimizer.register_step_post_hook(lambda *_: self.marks.append(time.perf_counter()))

    def load(self) -> tuple[int | None, str | None]:
        steps = self.handle.step_count   # completed optimizer steps, the recovered ones included
        return (steps - 1, "gemini") if steps else (None, None)

    def hook_seconds(self) -> float:
        seconds = self.marks[-1] - self.marks[-2] if len(self.marks) >= 2 else 0.0
        self.marks.clear()
        return seconds

    def close(self) -> None:
        self.handle.close()


class NVRx(System):
    """NVIDIA Resiliency Extension's local checkpointing: LocalCheckpointManager + async calls queue."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        strategy = CliqueReplicationStrategy.from_replication_params(1, 2) if self.args.replicas else None
        self.manager = LocalCheckpointManager(str(self.ckpt_dir), repl_strategy=strategy)
        self.queue = AsyncCallsQueue()
        self.wrap = BasicTensorAwareStateDict

    def load(self) -> tuple[int | None, str | None]:
        if self.manager.find_latest() == -1:
            return None, None
        tasd, _ = self.manager.load()
        state = tasd.state_dict
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return int(state["step"]), "local"

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.queue.maybe_finalize_async_calls(blocking=False)
        request = self.manager.save(self.wrap(self.state(step)), step, is_async=True)
        self.queue.schedule_async_request(request)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        self.queue.close()


class DCP(System):
    """``dcp.async_save`` every step (its only tier is storage) on its own gloo group, the writer in a process,
    the DefaultStager in shared memory; at most one save in flight, as the tutorial does; the newest three kept."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.group = dist.new_group(backend="gloo")   # on DDP's own group the save hung after step 0
        # On CPU the stager needs pinned memory and non-blocking copies off (both require CUDA).
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        self.pending: Any = None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def complete(self) -> list[Path]:
        found = [p for p in self.ckpt_dir.glob("step_*") if (p / ".metadata").is_file()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def load(self) -> tuple[int | None, str | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        done = self.complete()
        newest = torch.tensor([int(done[-1].name.split("_")[1]) if done else -1])
        dist.all_reduce(newest, op=dist.ReduceOp.MIN, group=self.group)   # every rank sees the same files
        if int(newest) < 0:
            return None, None
        state = self._state()
        dcp.load(state, checkpoint_id=str(self.ckpt_dir / f"step_{int(newest)}"), process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return int(newest), "disk"

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.result()   # one save in flight: the previous upload must end first
            self.rotate()
        self.pending = dcp.async_save(self._state(), checkpoint_id=str(self.ckpt_dir / f"step_{step}"),
                                      process_group=self.group, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                      async_stager=self.stager)
        return time.perf_counter() - t0

    def rotate(self) -> None:
        if dist.get_rank() == 0:
            for old in self.complete()[:-3]:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.stager.close()


SYSTEMS: dict[str, type[System]] = {"none": System, "easyckpt": Easyckpt, "easyckpt_once": EasyckptOncePerNode,
                                    "dlrover": DLRover,
                                    "lm_resiliency": LMResiliency, "nvrx": NVRx, "dcp": DCP}


def make_system(name: str, *, args: argparse.Namespace, net: torch.nn.Module, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> System:
    os.makedirs(args.ckpt_dir, exist_ok=True)
    return SYSTEMS[name](args, net, model, optimizer)
