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
local rank holds is not declared safe at once. Bit 1 (MOVING): set by ``begin_move`` and cleared by every write
of the fields, so an odd generation with it set means the fields are still the last word, whole: an agent that
restarts adopts such a word, but not one its predecessor died writing.

Version 2 adds, at offset 1024, how persisting goes (the ranks log a failure and show it in ``stats()``;
the agent is the only one that sees the disk)::

    persisted q | failures Q | failing_step q | errno i | needed q | free q | since d | last_at d |
    text_len H | text (utf-8, at most MAX_TEXT bytes: the path and the error)

``persisted`` is the newest step on disk (-1: none); ``failures`` counts failed persists over the agent's
life; ``failing_step`` >= 0 while a failure episode lasts (the newest persist failed), -1 once a persist
succeeds again. ``needed``/``free`` are bytes (-1: unknown). A version 1 block (an agent of the previous
build) still reads, as one with no persist report.

Version 3 adds, at offset 768, what a multi-node job protects and passes over::

    node_safe q | decided q | n_passed I | passed q * MAX_PASSED

``safe_step`` is then the job-safe step (every rank of the job committed it, every node holds it: what a
rank kill resumes from) and ``node_safe`` the newest job-safe step every node's rank-private bytes are backed
up for on another node (what a node loss resumes from; -1: none yet). ``passed`` lists the newest due steps
that were passed over (never persisted), so that a rank waiting for one of them stops waiting. ``decided``:
due steps at or below it are decided (persisted, being persisted or passed over); a rank spares its newest
due step above it when it chooses a slot (``easyckpt.snapshot.slot_choice``).

``generation`` is a seqlock: odd while the agent moves the safe step (it takes the flocks of the new
safe step, publishes it, then drops the old one's flocks) or takes any other new flock (a persist claim, a step
held for the job) until its round publishes why, even when the fields are consistent. A rank that finds no free
slot while the generation is odd waits for the move (milliseconds) instead of skipping its snapshot.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from pathlib import Path

from easyckpt_wire.shm import format_bytes

MAGIC = b"EZCKCTRL"
VERSION = 3
SIZE = 4096
MAX_HELD = 64
MAX_PASSED = 16
_HEAD = struct.Struct("<8sIIQqqdI")
_FLAGS_OFFSET = 12
_GENERATION_OFFSET = 16
GATED = 1
MOVING = 2
_JOB_OFFSET = 768
_JOB = struct.Struct("<qqI")
_PERSIST_OFFSET = 1024
_PERSIST = struct.Struct("<qQqiqqddH")
MAX_TEXT = SIZE - _PERSIST_OFFSET - _PERSIST.size


def control_path(directory: Path, job_id: str) -> Path:
    return directory / f"easyckpt-{job_id}-control"


@dataclasses.dataclass(frozen=True, slots=True)
class PersistFailure:
    """The agent's newest persist failed (an episode lasts until a persist succeeds again)."""

    step: int                 # the step whose persist failed
    errno: int                # 0 when the error was not an OSError
    text: str                 # the path and the error, one line
    needed: int | None        # bytes the persist needed, when known
    free: int | None          # bytes free on save_dir's file system before it started, when known
    since: float              # wall time of the first failure of this episode
    at: float                 # wall time of this failure
    failures: int = 0         # failed persists over the agent's life, this one included

    def describe(self) -> str:
        space = ""
        if self.needed is not None and self.free is not None:
            space = f" (needs {format_bytes(self.needed)}; {format_bytes(self.free)} were free when it started)"
        return f"persist of step {self.step} failed: {self.text}{space}"

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


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
    persisted: int | None = None  # the newest step on disk (this node's files, multi-node)
    failure: PersistFailure | None = None   # set while the newest persist failed
    failures: int = 0             # failed persists over the agent's life
    node_safe: int | None = None  # multi-node: the newest job-safe step backed up off every node
    passed: frozenset[int] = frozenset()   # the newest due steps passed over (never persisted)
    decided: int = -1             # due steps at or below are decided (persisted, persisting or passed over)
    moving: bool = False          # changing by begin_move, not in the middle of a write: the fields are whole

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
        if magic != MAGIC or version not in (1, 2, VERSION):   # older versions read as having no newer fields
            return None
        held = struct.unpack_from(f"<{min(count, MAX_HELD)}q", mm, _HEAD.size)
        node_safe, decided, n_passed = _JOB.unpack_from(mm, _JOB_OFFSET) if version >= 3 else (-1, -1, 0)
        passed = struct.unpack_from(f"<{min(n_passed, MAX_PASSED)}q", mm, _JOB_OFFSET + _JOB.size)
        persisted, failures, step, code, needed, free, since, at, length = (
            _PERSIST.unpack_from(mm, _PERSIST_OFFSET) if version >= 2 else (-1, 0, -1, 0, -1, -1, 0.0, 0.0, 0))
        text = bytes(mm[_PERSIST_OFFSET + _PERSIST.size:_PERSIST_OFFSET + _PERSIST.size + min(length, MAX_TEXT)]) \
            if step >= 0 else b""
        if struct.unpack_from("<Q", mm, _GENERATION_OFFSET)[0] != before or generation != before:
            continue  # torn: the agent wrote while we read
        failure = None if step < 0 else PersistFailure(
            step, code, text.decode("utf-8", "replace"), None if needed < 0 else needed, None if free < 0 else free,
            since, at, failures)
        return ControlView(None if safe < 0 else safe, frozenset(held), generation, pid, updated,
                           gated=bool(flags & GATED), changing=generation % 2 == 1,
                           persisted=None if persisted < 0 else persisted, failure=failure, failures=failures,
                           node_safe=None if node_safe < 0 else node_safe, passed=frozenset(passed),
                           decided=decided, moving=bool(flags & MOVING))
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
        # (A block of another version reads as None: a fresh start, the ranks' slots are adopted anyway.)
        self.adopted = previous if previous is not None and (not previous.changing or previous.moving) else None
        self.generation = previous.generation + (previous.generation % 2) if previous is not None else 0
        self.persisted: int | None = None
        self.failure: PersistFailure | None = None
        self.failures = 0
        self.node_safe: int | None = None
        self.passed: list[int] = []
        self.decided = -1
        if previous is None:
            self._write(None, frozenset(), False, self.generation)
        else:   # the predecessor's persist report is not this agent's: ranks must not warn about it again
            self._write(previous.safe, previous.held, previous.gated, self.generation)

    def begin_move(self) -> None:
        if self.generation % 2 == 0:
            self.generation += 1
            flags = struct.unpack_from("<I", self._mm, _FLAGS_OFFSET)[0]
            struct.pack_into("<I", self._mm, _FLAGS_OFFSET, flags | MOVING)   # before the generation: see MOVING
            struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, self.generation)

    def publish(self, safe: int | None, held: frozenset[int], *, gated: bool = False) -> None:
        """Write the new state and end a move (the generation becomes even)."""
        self.generation += 1 if self.generation % 2 else 2
        self._write(safe, held, gated, self.generation)

    def set_persist(self, persisted: int | None, failure: PersistFailure | None, failures: int) -> None:
        """How persisting goes; written with the next ``publish``."""
        self.persisted, self.failure, self.failures = persisted, failure, failures

    def set_job(self, node_safe: int | None, passed: list[int], decided: int) -> None:
        """Multi-node protection, the due steps passed over and decided; written with the next ``publish``."""
        self.node_safe, self.passed, self.decided = node_safe, sorted(passed)[-MAX_PASSED:], decided

    def _write(self, safe: int | None, held: frozenset[int], gated: bool, generation: int) -> None:
        steps = sorted(held, reverse=True)[:MAX_HELD]
        struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, generation | 1)   # readers retry meanwhile
        _HEAD.pack_into(self._mm, 0, MAGIC, VERSION, GATED if gated else 0, generation | 1, -1 if safe is None else safe,
                        os.getpid(), time.time(), len(steps))
        struct.pack_into(f"<{len(steps)}q", self._mm, _HEAD.size, *steps)
        _JOB.pack_into(self._mm, _JOB_OFFSET, -1 if self.node_safe is None else self.node_safe, self.decided,
                       len(self.passed))
        struct.pack_into(f"<{len(self.passed)}q", self._mm, _JOB_OFFSET + _JOB.size, *self.passed)
        failure = self.failure
        text = failure.text.encode("utf-8", "replace")[:MAX_TEXT] if failure is not None else b""
        _PERSIST.pack_into(self._mm, _PERSIST_OFFSET, -1 if self.persisted is None else self.persisted, self.failures,
                           -1 if failure is None else failure.step, 0 if failure is None else failure.errno,
                           -1 if failure is None or failure.needed is None else failure.needed,
                           -1 if failure is None or failure.free is None else failure.free,
                           0.0 if failure is None else failure.since, 0.0 if failure is None else failure.at, len(text))
        self._mm[_PERSIST_OFFSET + _PERSIST.size:_PERSIST_OFFSET + _PERSIST.size + len(text)] = text
        struct.pack_into("<Q", self._mm, _GENERATION_OFFSET, generation)

    def close(self, *, unlink: bool = False) -> None:
        self._mm.close()
        if unlink:
            self.path.unlink(missing_ok=True)
