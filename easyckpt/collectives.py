"""The few small collectives easyckpt runs among a job's ranks, in one place. Each is a no-op in one
process, and each places its tensor where the process group's backend can move it (NCCL only moves
CUDA tensors, gloo CPU ones). Every rank must call them in the same order: they decide branches that all
ranks take together (where to resume from, whether to give up a save), and a rank that took the other
branch would hang in the next collective."""
from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist

# How long a completed collective's work is kept. The backend's worker thread lets go of a collective's work only
# after the caller has seen it complete; had the caller let go first, the work's destructor would run in that thread
# and release the Python objects the work holds (its tensors, the caller's thread-local modes), taking the GIL for
# them, which creates a Python thread state without holding the GIL. On CPython before 3.11.10 (gh-112275) a fork at
# that moment deadlocks the child before it runs a line, and a DataLoader forks its workers right after the
# collective easyckpt's Lightning callback runs at each epoch's start. A time, not a count: on a loaded machine the
# worker that ran a collective can still hold it after eight later ones have completed on the other worker
# (tests/jobs/test_collectives.py saw it). easyckpt's collectives are few (a few per persist and per resume), so
# the works kept are few.
KEEP_WORKS_SECONDS = 60.0
_kept_works: collections.deque[tuple[float, dist.Work]] = collections.deque()


def _wait(work: dist.Work | None) -> None:
    if work is None:   # this rank is not in the group (never the case for the default group)
        return
    work.wait()
    now = time.monotonic()
    _kept_works.append((now, work))
    while _kept_works and _kept_works[0][0] < now - KEEP_WORKS_SECONDS:
        _kept_works.popleft()


def distributed() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if not distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device())
    _wait(dist.broadcast(tensor, 0, async_op=True))
    return int(tensor.item())


def barrier() -> None:
    """Every rank of the default group is here (a no-op outside one)."""
    if dist.is_available() and dist.is_initialized():
        _wait(dist.barrier(async_op=True))


def all_ok(ok: bool) -> bool:
    """True when every rank says ok; also a barrier."""
    if not distributed():
        return ok
    tensor = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device())
    _wait(dist.all_reduce(tensor, op=dist.ReduceOp.MIN, async_op=True))
    return bool(tensor.item())


def _in_group(world_size: int) -> bool:
    # The caller's world size, not the group's: a one-rank Checkpointer inside a larger group (a tool that
    # reads a checkpoint on rank 0 alone) must not enter a collective the other ranks never join.
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def all_gather_ints(vector: list[int], world_size: int) -> list[list[int]]:
    """Every rank's ``vector`` (the same length on every rank), in rank order."""
    if not _in_group(world_size):
        return [list(vector)]
    local = torch.tensor(vector, dtype=torch.int64, device=device())
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    _wait(dist.all_gather(gathered, local, async_op=True))
    return [t.tolist() for t in gathered]


def all_gather_text(text: str, world_size: int, *, field: int) -> list[str]:
    """Every rank's ``text`` (UTF-8, at most ``field`` bytes), in rank order."""
    raw = text.encode()
    if len(raw) > field:
        raise ValueError(f"{text!r} is longer than {field} bytes")
    if not _in_group(world_size):
        return [text]
    local = torch.zeros(field, dtype=torch.uint8)
    if raw:
        local[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    local = local.to(device())
    rows = [torch.empty_like(local) for _ in range(world_size)]
    _wait(dist.all_gather(rows, local, async_op=True))
    return [bytes(row.cpu().numpy()).rstrip(b"\0").decode() for row in rows]
