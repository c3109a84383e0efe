"""A rank's two shared-memory slots: allocate (after a free-space check), re-attach, choose, read.

Slot choice keeps invariant 2: a snapshot never goes into the slot that holds the rank's newest
committed snapshot, nor into one the agent holds (shared flock) or has yet to claim for a due persist.
When no slot is free the snapshot is skipped, never waited for.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from easyckpt_wire.shm import (SlotFormatError, SlotHeader, SlotMap, format_bytes, slot_path)

logger = logging.getLogger(__name__)

NUM_SLOTS = 2


class ShmSpaceError(RuntimeError):
    """The shared-memory file system cannot hold the snapshot."""


class RankSlots:
    def __init__(self, directory: Path, job_id: str, rank: int, world_size: int, local_world_size: int) -> None:
        self.directory = directory
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.maps: list[SlotMap | None] = [None] * NUM_SLOTS
        self._pinned_since: dict[tuple[int, int], float] = {}
        for index in range(NUM_SLOTS):
            path = self.path(index)
            if path.exists():
                try:
                    self.maps[index] = SlotMap(path, writable=True)
                    logger.info("rank %d re-attached to %s", rank, path)
                except (OSError, SlotFormatError) as exc:
                    logger.warning("rank %d cannot re-attach to %s (%s): it will be re-created", rank, path, exc)

    def path(self, index: int) -> Path:
        return slot_path(self.directory, self.job_id, self.rank, index)

    def header(self, index: int) -> SlotHeader | None:
        slot = self.maps[index]
        if slot is None:
            return None
        try:
            header = slot.header()
        except SlotFormatError:
            return None
        if header.job_id != self.job_id or header.rank != self.rank:
            return None
        return header

    def committed(self) -> dict[int, tuple[int, SlotHeader]]:
        """{step: (slot index, header)} of committed slots; the newer generation wins a tie."""
        found: dict[int, tuple[int, SlotHeader]] = {}
        for index in range(NUM_SLOTS):
            header = self.header(index)
            if header is not None and header.committed and header.world_size == self.world_size:
                if header.step not in found or found[header.step][1].generation < header.generation:
                    found[header.step] = (index, header)
        return found

    def next_generation(self) -> int:
        newest = max((h.generation for h in map(self.header, range(NUM_SLOTS)) if h is not None), default=0)
        return newest + 1 if newest % 2 == 0 else newest + 2

    # allocation -------------------------------------------------------------------------------------
    def ensure(self, index: int, size: int) -> SlotMap:
        """Make slot ``index`` at least ``size`` bytes; both slots are sized together the first time."""
        slot = self.maps[index]
        if slot is not None and slot.size >= size:
            return slot
        first = all(m is None for m in self.maps)
        targets = [i for i in range(NUM_SLOTS) if self.maps[i] is None] if first else [index]
        current = sum(self.maps[i].size if self.maps[i] is not None else 0 for i in targets)
        self.check_space(size * len(targets) - current, size)
        for target in targets:
            self._grow(target, size)
        result = self.maps[index]
        assert result is not None
        if slot is None and not result.try_lock(exclusive=True):
            raise RuntimeError(f"{result.path} was locked by another process right after rank {self.rank} created it")
        return result

    def check_space(self, needed: int, slot_bytes: int) -> None:
        stats = os.statvfs(self.directory)
        free = stats.f_bavail * stats.f_frsize
        if needed > free:
            total = slot_bytes * NUM_SLOTS * max(1, self.local_world_size)
            suggest = math.ceil(total * 1.25 / (1 << 30))
            raise ShmSpaceError(
                f"{self.directory} has {format_bytes(free)} free, the snapshot of rank {self.rank} needs "
                f"{format_bytes(needed)} more ({NUM_SLOTS} slots of {format_bytes(slot_bytes)}; "
                f"{format_bytes(total)} for all {self.local_world_size} local ranks): run the container with "
                f"--shm-size={suggest}g, or set EASYCKPT_SHM_DIR to a larger tmpfs"
            )

    def _grow(self, index: int, size: int) -> None:
        """Create or enlarge slot ``index``; an existing slot keeps its fd, and so its flock."""
        path = self.path(index)
        slot = self.maps[index]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if slot is None else slot.fd
        if slot is not None:
            slot.unmap()
        previous = os.fstat(fd).st_size
        try:
            os.ftruncate(fd, size)
            try:
                # Reserve (and touch) every page now: a tmpfs that fills up later would SIGBUS the copy.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.ftruncate(fd, previous)
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ShmSpaceError(
                        f"{path}: cannot reserve {format_bytes(size)} for rank {self.rank}: {exc.strerror}; "
                        "run the container with a larger --shm-size, or set EASYCKPT_SHM_DIR to a larger tmpfs"
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        finally:
            if slot is None:
                os.close(fd)
            else:
                slot.refresh()
        if slot is None:
            slot = SlotMap(path, writable=True)
            slot.init_empty(rank=self.rank, world_size=self.world_size, job_id=self.job_id)
            self.maps[index] = slot
        logger.info("rank %d slot %d: %s (%s)", self.rank, index, path, format_bytes(size))

    # choice -----------------------------------------------------------------------------------------
    def choose(self, *, persist_due: Any, agent_alive: Any, pin_timeout: float) -> int | None:
        """The slot index to write next, locked exclusively; None means skip this snapshot."""
        headers = [self.header(i) for i in range(NUM_SLOTS)]
        committed = [i for i in range(NUM_SLOTS) if headers[i] is not None and headers[i].committed]
        newest = max(committed, key=lambda i: headers[i].generation) if committed else None
        order = [i for i in range(NUM_SLOTS) if i != newest]
        for index in order:
            slot = self.maps[index]
            if slot is None:
                return index  # not allocated yet: ensure() creates and locks it
            header = headers[index]
            if header is not None and header.committed and persist_due(header.step) \
                    and slot.read_ack() != header.generation and self._pinned(index, header, agent_alive, pin_timeout):
                continue
            if slot.try_lock(exclusive=True):
                self._pinned_since.pop((index, header.generation if header else -1), None)
                return index
        return None

    def _pinned(self, index: int, header: SlotHeader, agent_alive: Any, pin_timeout: float) -> bool:
        """A due snapshot the agent has not claimed yet keeps its slot, within limits."""
        if not agent_alive():
            return False
        since = self._pinned_since.setdefault((index, header.generation), time.monotonic())
        if time.monotonic() - since > pin_timeout:
            logger.warning("rank %d: the agent has not claimed due step %d for %.0fs; overwriting it",
                           self.rank, header.step, pin_timeout)
            return False
        return True

    def invalidate_newer_than(self, step: int) -> None:
        """Forget snapshots past the resumed step: they belong to a timeline the job abandoned."""
        for index in range(NUM_SLOTS):
            header, slot = self.header(index), self.maps[index]
            if header is not None and slot is not None and header.committed and header.step > step:
                if slot.try_lock(exclusive=True):
                    slot.invalidate()
                    slot.unlock()
                    logger.info("rank %d: dropped slot %d with step %d (resumed at %d)", self.rank, index,
                                header.step, step)

    def drop_stale_copies(self, newest: int, step: int) -> None:
        """Invalidate other slots that hold ``step`` too (older copies); one the agent is reading stays,
        and readers prefer the newer generation anyway."""
        for index in range(NUM_SLOTS):
            header, slot = self.header(index), self.maps[index]
            if index == newest or slot is None or header is None or not header.committed or header.step != step:
                continue
            if slot.try_lock(exclusive=True):
                slot.invalidate()
                slot.unlock()
                logger.info("rank %d: dropped the older snapshot of step %d in slot %d", self.rank, step, index)

    def close(self) -> None:
        for index, slot in enumerate(self.maps):
            if slot is not None:
                slot.close()
                self.maps[index] = None
