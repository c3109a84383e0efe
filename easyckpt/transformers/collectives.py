"""The two collectives the wrapper needs, no-ops in one process: every rank must take the same branch
(resume from the same place, give up a save together), or one of them hangs in the next collective."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if not distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def all_ok(ok: bool) -> bool:
    """True when every rank says ok; also a barrier."""
    if not distributed():
        return ok
    tensor = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())
