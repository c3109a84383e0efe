"""One rank of a 2-rank torchrun job (gloo, CPU): runs easyckpt's collectives, then plain ones on tensors it lets go
of at once, and counts where the tensors handed to the backend were freed (the main thread or another); writes the
counts as JSON to ``<out>/report-rank<r>.json`` (``out``: its one argument).

A tensor freed off the main thread means a thread without a Python thread state took the GIL, which on CPython
before 3.11.10 deadlocks a child forked at that moment (see easyckpt/collectives.py)."""
from __future__ import annotations

import collections
import json
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from easyckpt import collectives

ROUNDS = 400
SHORT_KEEP = 0.5   # seconds: works let go within the run, so that their frees are seen
MAIN = threading.get_native_id()
freed: collections.Counter[str] = collections.Counter()
counting = ["easyckpt"]


def count(kind: str) -> None:
    freed[kind + ("" if threading.get_native_id() == MAIN else " off the main thread")] += 1


def watched(collective: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            for tensor in arg if isinstance(arg, list) else [arg]:
                if isinstance(tensor, torch.Tensor):
                    weakref.finalize(tensor, count, counting[0])
        return collective(*args, **kwargs)
    return call


def one_round(i: int, world: int) -> None:
    assert collectives.all_ok(True)
    assert collectives.broadcast_int(i) == i
    assert collectives.all_gather_ints([i, 1], world) == [[i, 1]] * world
    assert collectives.all_gather_text("x" * (i % 5), world, field=8) == ["x" * (i % 5)] * world
    collectives.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    for name in ("all_reduce", "broadcast", "all_gather"):
        setattr(dist, name, watched(getattr(dist, name)))
    world = dist.get_world_size()
    for i in range(ROUNDS):
        one_round(i, world)
    # Works kept for SHORT_KEEP: both ranks run rounds (the same number, rank 0's count) for at least four times
    # that, so that most are let go, and every let-go work's tensors are freed here.
    collectives.KEEP_WORKS_SECONDS = SHORT_KEEP
    ends = time.monotonic() + 4 * SHORT_KEEP
    i = 0
    while collectives.broadcast_int(int(time.monotonic() < ends)) or i < ROUNDS:
        one_round(i, world)
        i += 1
    counting[0] = "plain"
    for i in range(ROUNDS):
        tensor = torch.tensor([i], dtype=torch.int64)
        dist.all_reduce(tensor)
        assert int(tensor.item()) == i * world
        del tensor
    dist.barrier()
    report = {"rank": dist.get_rank(), "rounds": ROUNDS, "freed": dict(freed)}
    (Path(sys.argv[1]) / f"report-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
