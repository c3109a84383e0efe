"""The few small collectives easyckpt runs among a job's ranks, in one place. Each is a no-op in one
process, and each places its tensor where the process group's backend can move it (NCCL only moves
CUDA tensors, gloo CPU ones). Every rank must call them in the same order: they decide branches that all
ranks take together (where to resume from, whether to give up a save), and a rank that took the other
branch would hang in the next collective."""
from __future__ import annotations

import torch
import torch.distributed as dist


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
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def all_ok(ok: bool) -> bool:
    """True when every rank says ok; also a barrier."""
    if not distributed():
        return ok
    tensor = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
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
    dist.all_gather(gathered, local)
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
    dist.all_gather(rows, local)
    return [bytes(row.cpu().numpy()).rstrip(b"\0").decode() for row in rows]
