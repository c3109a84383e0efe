"""One rank of a 2-rank torchrun job (gloo, CPU): runs easyckpt's collectives, then plain ones on tensors it lets go
of at once, and counts the tensors a backend thread (not the main thread) freed in each; prints them as JSON.

A tensor freed off the main thread means a thread without a Python thread state took the GIL, which on CPython
before 3.11.10 deadlocks a child forked at that moment (see easyckpt/collectives.py)."""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from easyckpt import collectives

ROUNDS = 400
MAIN = threading.get_native_id()
freed_elsewhere = {"easyckpt": 0, "plain": 0}
counting = ["easyckpt"]


def count_if_elsewhere(kind: str) -> None:
    if threading.get_native_id() != MAIN:
        freed_elsewhere[kind] += 1


def watched(collective: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            for tensor in arg if isinstance(arg, list) else [arg]:
                if isinstance(tensor, torch.Tensor):
                    weakref.finalize(tensor, count_if_elsewhere, counting[0])
        return collective(*args, **kwargs)
    return call


def main() -> None:
    dist.init_process_group("gloo")
    for name in ("all_reduce", "broadcast", "all_gather"):
        setattr(dist, name, watched(getattr(dist, name)))
    world = dist.get_world_size()
    for i in range(ROUNDS):
        assert collectives.all_ok(True)
        assert collectives.broadcast_int(i) == i
        assert collectives.all_gather_ints([i, 1], world) == [[i, 1]] * world
        assert collectives.all_gather_text("x" * (i % 5), world, field=8) == ["x" * (i % 5)] * world
    counting[0] = "plain"
    for i in range(ROUNDS):
        tensor = torch.tensor([i], dtype=torch.int64)
        dist.all_reduce(tensor)
        assert int(tensor.item()) == i * world
        del tensor
    dist.barrier()
    print(json.dumps({"rank": dist.get_rank(), "rounds": ROUNDS, **freed_elsewhere}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
