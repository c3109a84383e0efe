"""The node agent's control block: the safe step and the steps it holds, published for ranks to read.

One 4 KiB file per job next to the slots, ``<shm_dir>/easyckpt-<job>-control``. Only the node agent
writes it; ranks map it read-only and read it (a few dozen bytes, no syscall) each time they choose a
slot. It is the agent's word on invariant 9: a rank never overwrites a slot holding the published safe
step. The agent also holds shared flocks on the slots of the safe step and of the steps it persists, so
a rank's exclusive ``try_lock`` on such a slot fails; the block lets the rank skip those slots without
trying, and keeps the last safe step known after the agent died (its flocks went with it).

Layout (little endian)::

    magic 8s | version I | flags I | generation Q | safe_step q | agent_pid q | updated_at d |
    n_held I | held_steps q * MAX_HELD

``flags`` bit 0 (GATED): the safe step also waits for another node's backup (multi-node), so a step every
local rank holds is not declared safe at once.

``generation`` is a seqlock: odd while the agent moves the safe step (it takes the flocks of the new
safe step, publishes it, then drops the old one's flocks), even when the fields are consistent. A rank
that finds no free slot while the generation is odd waits for the move (microseconds) instead of
skipping its snapshot.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from pathlib import Path

MAGIC = b"EZCKCTRL"
VERSION = 1
SIZE = 4096
MAX_HELD = 64
_HEAD = struct.Struct("<8sIIQqqdI")
_GENERATION_OFFSET = 16
GATED = 1


def control_path(directory: Path, job_id: str) -> Path:
    return directory / f"easyckpt-{job_id}-control"


@dataclasses.dataclass(frozen=True, slots=True)
class ControlView:
    """One consistent reading of the block."""

    safe: int | None              # the newest safe step (invariant 9); None before the first
    held: frozenset[int]          # steps whose slots the agent holds (persist claims, the safe step)
    generation: int
    agent_pid: int
    updated_at: float
    gated: bool = False           # multi-node: a step is safe only once another node backed it up
    changing: bool = False        # the agent was moving the safe step: read again shortly

    def keeps(self, step: int) -> bool:
        return step == self.safe or step in self.held


class ControlReader:
    """The rank's read-only view; the file appears when the agent starts, so it is opened lazily."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self.last: ControlView | None = None   # kept when the agent is gone and the file with it

    def read(self, *, wait: float = 0.0) -> ControlView | None:
        """The current view (or the last one seen if the file is gone); while the agent is moving the safe
        step, poll up to ``wait`` seconds for the move to finish."""
        if self._mm is None and not self._open():
            return self.last
        assert self._mm is not None
        deadline = time.monotonic() + wait
        while True:
            view = _read(self._mm)
            if view is None:
                return self.last
            if not view.changing:
                self.last = view
                return view
            if time.monotonic() >= deadline:
                return dataclasses.replace(self.last, changing=True) if self.last else view
            time.sleep(0.0002)  # the agent holds the odd generation for a few flock calls only

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size < SIZE:
                return False
            self._mm = mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return True

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def _read(mm: mmap.mmap) -> ControlView | None:
    for _ in range(1000):
        before = struct.unpack_from("<Q", mm, _GENERATION_OFFSET)[0]
        magic, version, flags, generation, safe, pid, updated, count = _HEAD.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION:
            return None
        held = struct.unpack_from(f"<{min(count, MAX_HELD)}q", mm, _HEAD.size)
        if struct.unpack_from("<Q", mm, _GENERATION_OFFSET)[0] != before or generation != before:
            continue  # torn: the agent wrote while we read
        return ControlView(None if safe < 0 else safe, frozenset(held), generation, pid, updated,
                           gated=bool(flags & GATED), changing=generation % 2 == 1)
    return None


class ControlWriter:
    """The agent's side. ``begin_move`` / ``publish`` bracket a change of the safe step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fresh = os.fstat(fd).st_size < SIZE
            if fresh:
                os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE, access=mmap.ACCESS_WRITE)
        finally:
            os.close(fd)
        previous = None if fresh else _read(self._mm)
        # An agent restarted after a crash adopts its predecessor's word: ranks are still keeping that step.
        self.adopted = previous if previous is not None and not previous.changing else None
        self.generation = previous.generation + (previous.generation % 2) if previous is not None else 0
        if previous is None:
            self._write(None, frozenset(), False, self.generation)

    def begin_move(self) -> None:
        if self.generation % 2 == 0:
            self.generation += 1
            struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, self.generation)

    def publish(self, safe: int | None, held: frozenset[int], *, gated: bool = False) -> None:
        """Write the new state and end a move (the generation becomes even)."""
        self.generation += 1 if self.generation % 2 else 2
        self._write(safe, held, gated, self.generation)

    def _write(self, safe: int | None, held: frozenset[int], gated: bool, generation: int) -> None:
        steps = sorted(held, reverse=True)[:MAX_HELD]
        struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, generation | 1)   # readers retry meanwhile
        _HEAD.pack_into(self._mm, 0, MAGIC, VERSION, GATED if gated else 0, generation | 1, -1 if safe is None else safe,
                        os.getpid(), time.time(), len(steps))
        struct.pack_into(f"<{len(steps)}q", self._mm, _HEAD.size, *steps)
        struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, generation)

    def close(self, *, unlink: bool = False) -> None:
        self._mm.close()
        if unlink:
            self.path.unlink(missing_ok=True)
