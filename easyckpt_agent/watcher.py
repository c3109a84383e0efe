"""Watcher: which slot of which local rank is committed at which step, and which ranks are alive.

The agent polls slot headers (a few dozen bytes each) instead of relying on messages, so an agent
that was restarted adopts the existing slots at once, and a message lost to a dying rank costs
nothing. Rank processes are identified by (pid, start time) so a recycled pid is not taken for a
live rank.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from easyckpt_wire import procs
from easyckpt_wire.records import SlotMeta
from easyckpt_wire.shm import SlotFormatError, SlotHeader, SlotMap, list_slots

logger = logging.getLogger(__name__)

# A rank creates all its slots at its first snapshot (and again after a restart), one file after another: a
# listing between two of them sees only some. For this long after a listing found a new slot, every scan lists
# again, so that the rest are watched before their first commit; at full speed a job takes tens of steps in the
# 0.25 s between ordinary listings, while the agent, blind to those slots, could neither declare a step safe nor
# flush the right one on a failure (seen in CI: rank 0's second and third slots found only after it died).
SETTLE_S = 1.0


@dataclasses.dataclass(slots=True)
class RankProcess:
    rank: int
    pid: int
    start_time: float | None
    said_bye: bool = False
    # Its run failed (BYE with failed=True): it leaves like a rank that dies, and the job goes on (a restart).
    failed: bool = False
    dead: bool = False
    reported: bool = False   # its death was handed to the agent (any_alive() may see it first)
    # Known only from its slots' metadata (this agent adopted them) and already gone then: it ended under an
    # earlier agent (a successor after a tree kill, an agent started again after its own death), which said how
    # if it lived; this one has nothing to add but that the slots stay.
    ended_before: bool = False

    def alive(self) -> bool:
        if self.said_bye or self.dead:
            return False
        if not procs.is_alive(self.pid, self.start_time):   # gone, a zombie, or its pid taken by another process
            self.dead = True
        return not self.dead


@dataclasses.dataclass(slots=True)
class SlotInfo:
    rank: int
    slot: int
    path: Path
    map: SlotMap
    header: SlotHeader | None = None
    meta: SlotMeta | None = None
    meta_generation: int = -1

    def committed_step(self) -> int | None:
        return self.header.step if self.header is not None and self.header.committed else None


class Watcher:
    def __init__(self, shm_dir: Path, job_id: str) -> None:
        self.shm_dir = shm_dir
        self.job_id = job_id
        self.slots: dict[tuple[int, int], SlotInfo] = {}
        self.ranks: dict[int, RankProcess] = {}
        self.local_world_size = 0
        self.world_size = 0   # of the current run: slots and ranks of a run with another size are ignored
        # Multi-node: the ranks the job's peer table places on this node (None: every rank with slots here). A restart
        # may place a rank on another node; its slots here are then leftovers, still hashed and served to pulls.
        self.assigned: frozenset[int] | None = None
        self._last_listing = 0.0
        self._settle_until = 0.0   # list at every scan until then: a rank may still be creating its slots
        # (rank, slot, generation) of snapshots of an abandoned timeline that their rank could not invalidate
        # (the agent held the slot): never persisted, declared safe or served, until the slot is rewritten.
        self.abandoned: set[tuple[int, int, int]] = set()

    # slots ------------------------------------------------------------------------------------------
    def scan(self, *, relist_every: float = 0.25) -> None:
        now = time.monotonic()
        seen = {rank for rank, _ in self.slots}
        missing = any(rank not in seen for rank in self.ranks)  # a registered rank whose slots we have not seen
        if missing or now < self._settle_until or now - self._last_listing >= relist_every:
            self._last_listing = now
            found = list_slots(self.shm_dir, self.job_id)
            for key, path in found.items():
                if key not in self.slots:
                    try:
                        self.slots[key] = SlotInfo(key[0], key[1], path, SlotMap(path, writable=True))
                        self._settle_until = now + SETTLE_S
                        logger.info("watching slot %s", path)
                    except (OSError, SlotFormatError) as exc:
                        logger.warning("cannot map slot %s: %s", path, exc)
            for key in set(self.slots) - set(found):
                self.slots.pop(key).map.close()
        for info in self.slots.values():
            try:
                info.map.refresh()
                info.header = info.map.header()
                if info.header.committed and info.meta_generation != info.header.generation:
                    meta = SlotMeta.from_wire(info.map.read_meta(info.header), str(info.path))
                    if info.map.generation() != info.header.generation:
                        raise SlotFormatError(f"{info.path} was rewritten while its metadata was read")
                    info.meta, info.meta_generation = meta, info.header.generation
                    self._learn_from_meta(info.meta)
            except (SlotFormatError, ValueError) as exc:
                info.header = None  # torn or foreign: treat as holding nothing
                logger.debug("slot %s unreadable: %s", info.path, exc)
        if self.abandoned:   # a rewritten slot holds a new snapshot: forget its abandoned generation
            self.abandoned = {key for key in self.abandoned if (held := self.slots.get((key[0], key[1]))) is not None
                              and held.header is not None and held.header.generation == key[2]}

    def _learn_from_meta(self, meta: SlotMeta) -> None:
        if not self.world_size:  # an adopting agent before any HELLO: the slots tell the job's shape
            self.set_shape(meta.world_size, meta.local_world_size)
        if meta.pid is not None and meta.rank not in self.ranks and self._here(meta.rank):
            self.register(meta.rank, meta.pid, meta.pid_start)
            proc = self.ranks[meta.rank]
            # Not alive(), which would mark it dead before the loop sees it die (Lifecycle.on_signal counts a rank
            # whose death the loop has not seen as still running).
            proc.ended_before = not procs.is_alive(proc.pid, proc.start_time)

    def set_shape(self, world_size: int, local_world_size: int) -> None:
        """The newest run's word wins: after a restart with fewer ranks, the others' leftovers are ignored."""
        if world_size != self.world_size and self.world_size:
            logger.info("world size changed from %d to %d", self.world_size, world_size)
        self.world_size, self.local_world_size = world_size, local_world_size
        for rank in [r for r in self.ranks if r >= world_size]:
            del self.ranks[rank]

    def _current(self, info: SlotInfo) -> bool:
        return info.header is None or not self.world_size or info.header.world_size == self.world_size

    def assign(self, ranks: tuple[int, ...] | None) -> None:
        """The ranks the job's peer table places on this node (None: a single-node job). A rank of an earlier
        incarnation that a restart placed on another node is no longer this node's: its persists, claims and
        backups would otherwise wait for a process that never comes back here (fault soak, seed 7, fault 7: the
        nodes' ranks swapped after a node loss, and no step after the resume was ever committed)."""
        assigned = None if ranks is None else frozenset(ranks)
        if assigned == self.assigned:
            return
        self.assigned = assigned
        moved = sorted(rank for rank in {r for r, _ in self.slots} | set(self.ranks) if not self._here(rank))
        if moved:
            logger.info("rank(s) %s now run on other nodes (this node runs ranks %s): their slots here are leftovers, "
                        "served to replica pulls but never waited for", moved, sorted(assigned or ()))
        for rank in moved:
            self.ranks.pop(rank, None)

    def leftovers_newer_than(self, step: int) -> list[tuple[int, int, int]]:
        """(rank, slot, generation) of committed snapshots newer than ``step`` in the slots of ranks that now run on
        other nodes: after a resume at ``step`` they belong to the abandoned timeline, and no rank here invalidates
        them (served to a later pull, such a snapshot would be taken for the new timeline's step of that number)."""
        return [(rank, slot, info.header.generation) for (rank, slot), info in self.slots.items()
                if not self._here(rank) and info.header is not None and info.header.committed
                and info.header.step > step]

    def _here(self, rank: int) -> bool:
        return self.assigned is None or rank in self.assigned

    def local_ranks(self) -> set[int]:
        ranks = {rank for (rank, _), info in self.slots.items() if self._current(info)} | set(self.ranks)
        return ranks if self.assigned is None else ranks & self.assigned

    def slots_per_rank(self) -> int:
        """The fewest slots any local rank has (what the agent may hold without starving it); 0 before any."""
        counts: dict[int, int] = {}
        for (rank, _), info in self.slots.items():
            if self._current(info):
                counts[rank] = counts.get(rank, 0) + 1
        return min(counts.values(), default=0)

    def committed(self, rank: int) -> dict[int, SlotInfo]:
        """{step: slot} of the rank's committed slots; of two copies of one step, the newer generation."""
        found: dict[int, SlotInfo] = {}
        for (r, _), info in self.slots.items():
            step = info.committed_step()
            if r != rank or step is None or not self._current(info):
                continue
            if self.abandoned and info.header is not None and (r, info.slot, info.header.generation) in self.abandoned:
                continue
            previous = found.get(step)
            if previous is None or _generation(previous) < _generation(info):
                found[step] = info
        return found

    def common_steps(self) -> list[int]:
        """Steps that every expected local rank holds committed, newest first."""
        ranks = self.local_ranks()
        if not ranks or len(ranks) < self.local_world_size:
            return []
        common: set[int] | None = None
        for rank in ranks:
            steps = set(self.committed(rank))
            common = steps if common is None else common & steps
        return sorted(common or (), reverse=True)

    def newest_step(self, rank: int) -> int | None:
        steps = self.committed(rank)
        return max(steps) if steps else None

    # ranks ------------------------------------------------------------------------------------------
    def register(self, rank: int, pid: int, start_time: float | None) -> None:
        previous = self.ranks.get(rank)
        if previous is not None and previous.pid == pid:
            return
        self.ranks[rank] = RankProcess(rank, pid, start_time)
        logger.info("rank %d is pid %d%s", rank, pid,
                    f" (was pid {previous.pid})" if previous is not None else "")

    def newly_dead(self) -> list[RankProcess]:
        """Ranks that died without saying goodbye since the last call."""
        died = []
        for proc in self.ranks.values():
            if not proc.said_bye and not proc.reported and not proc.alive():
                proc.reported = True
                died.append(proc)
        return died

    def any_died(self) -> bool:
        """A local rank died without closing (handed to the agent by newly_dead) and has not come back."""
        return any(proc.reported for proc in self.ranks.values())

    def any_alive(self) -> bool:
        return any(proc.alive() for proc in self.ranks.values())

    def all_said_bye(self) -> bool:
        ranks = self.local_ranks()
        return bool(self.ranks) and len(ranks) >= self.local_world_size and all(
            rank in self.ranks and self.ranks[rank].said_bye for rank in ranks)

    def close(self) -> None:
        # drop_exported: the agent is on its way out, and a view still alive somewhere (a failed persist's
        # traceback) must not stop it from closing the rest (it once died here, leaving every slot behind).
        for info in self.slots.values():
            info.map.close(drop_exported=True)
        self.slots.clear()


class SlotHolds:
    """The agent's shared flocks on slots, by reason: a rank cannot overwrite a held slot (it skips a
    snapshot instead). The safe step and a persist claim may hold the same slot; the flock of a slot's
    fd is taken by the first reason and dropped with the last."""

    def __init__(self, before_lock: Callable[[], None] = lambda: None) -> None:
        self.reasons: dict[int, set[tuple[Any, ...]]] = {}   # id(slot map) -> why
        # Called before a new flock: a rank that reads the control block between the flock and the agent's next
        # word about it must see that word as changing, and wait for it, rather than skip its snapshot.
        self.before_lock = before_lock

    def hold(self, info: SlotInfo, reason: tuple[Any, ...]) -> bool:
        reasons = self.reasons.setdefault(id(info.map), set())
        if not reasons:
            self.before_lock()
            if not info.map.try_lock(exclusive=False):
                return False
        reasons.add(reason)
        return True

    def hold_if_current(self, info: SlotInfo, step: int, reason: tuple[Any, ...]) -> bool:
        """Hold ``info``'s slot for ``reason`` if it still holds ``step`` at the generation the watcher saw."""
        header = info.header
        if header is None or not self.hold(info, reason):
            return False
        current = info.map.header()
        if not current.committed or current.generation != header.generation or current.step != step:
            self.release(info, reason)
            return False
        return True

    def hold_all(self, ranks: set[int], committed: dict[int, dict[int, SlotInfo]], step: int,
                 reason: tuple[Any, ...]) -> list[SlotInfo] | None:
        """Hold every local rank's slot of ``step`` for ``reason``, or none of them."""
        taken: list[SlotInfo] = []
        for rank in sorted(ranks):
            info = committed[rank].get(step)
            if info is None or not self.hold_if_current(info, step, reason):
                for other in taken:
                    self.release(other, reason)
                return None
            taken.append(info)
        return taken

    def release(self, info: SlotInfo, reason: tuple[Any, ...]) -> None:
        reasons = self.reasons.get(id(info.map), set())
        reasons.discard(reason)
        if not reasons:
            self.reasons.pop(id(info.map), None)
            try:
                info.map.unlock()
            except (OSError, ValueError):  # the watcher closed the map (file gone): the flock went with it
                pass


def _generation(info: SlotInfo) -> int:
    # Only infos whose header was read are listed as committed; -1 keeps the order total all the same.
    return -1 if info.header is None else info.header.generation
