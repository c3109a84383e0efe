"""A rank's shared-memory slots (3 by default, 2 when memory is short): allocate after a free-space
check, re-attach after a restart, choose where the next snapshot goes, write, read, invalidate, close.

Writing (the stager's snapshots and the replica fetch alike) goes through :meth:`RankSlots.write`:
choose a slot, size it, number the write, mark it WRITING; the :class:`SlotWrite` then either commits
or, left without a commit (an exception, a failed copy), marks the slot EMPTY, and always unlocks it.
Reading goes through :meth:`RankSlots.read` (shared lock, generation checked before and after).

The choice itself is the pure rule of ``slot_choice`` over the slot headers and the node agent's control
block (the safe step and the steps it holds); here it is carried out with exclusive flocks. When no
slot is free the snapshot is skipped, never waited for.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from easyckpt.config import MIN_SLOTS
from easyckpt.snapshot.shm_space import (
    check_space,
    fitting_count,
    free_bytes,
    reserve,
    say_asked_count,
    say_count,
    warn_if_not_memory,
)
from easyckpt.snapshot.slot_choice import (
    PastNewest,
    SlotView,
    lone_newest,
    past_newest,
    undecided_due,
    waits_for_due,
    write_order,
)
from easyckpt_wire.control import ControlReader, ControlView, control_path
from easyckpt_wire.episode import Episode
from easyckpt_wire.records import SlotMeta, TensorEntry
from easyckpt_wire.shm import SlotFormatError, SlotHeader, SlotMap, format_bytes, list_slots, slot_path
from easyckpt_wire.transfer import tensor_checksum

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 3
# Across nodes the agent may keep three steps at once (the job-safe step for a rank kill, the node-safe step for
# a node loss, and a due step being decided or persisted) and the ranks need one to write: four when shared
# memory has room (agent.agreement.plan_holds uses what there is).
MULTI_NODE_SLOTS = 4
MOVE_WAIT = 0.05   # longest a rank waits for the agent to finish moving the safe step (a few flock calls)
SAFE_WAIT = 0.02   # longest a rank waits for the agent to declare a step every local rank holds safe
PEER_WAIT_MAX = 0.5   # cap on the wait for the other local ranks' commits of this rank's newest step
DUE_WAIT = 0.5    # floor of a rank's wait for the agent's word on the undecided due step in its one free slot
DUE_WAIT_STEPS = 4   # ... which is otherwise this many observed step times


class SlotWrite:
    """One write into one of the rank's slots, begun (WRITING, odd generation) and locked exclusively.

    Used as a context manager (possibly on another thread than the one that began it): the block ends
    with :meth:`commit`, or the slot is marked EMPTY; either way it is unlocked."""

    def __init__(self, slots: RankSlots, index: int, slot: SlotMap, generation: int) -> None:
        self.slots = slots
        self.index = index
        self.slot = slot
        self.generation = generation
        self.committed = False
        self.closed = False

    def data(self, entry: TensorEntry) -> memoryview:
        return self.slot.data(entry.offset, entry.nbytes)

    def commit(self, step: int, data_len: int, meta: bytes) -> None:
        slots = self.slots
        self.slot.commit(generation=self.generation, step=step, data_len=data_len, meta=meta, rank=slots.rank,
                         world_size=slots.world_size, job_id=slots.job_id)
        self.committed = True

    def close(self) -> None:
        """Unlock; a write that did not commit leaves an EMPTY slot, never a half-written one that looks busy."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.committed:
                self.slot.invalidate()
        finally:
            self.slot.unlock()

    def __enter__(self) -> SlotWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlotRead:
    """A committed slot under a shared lock (``RankSlots.read``): its metadata and zero-copy views."""

    def __init__(self, slot: SlotMap, generation: int, meta: SlotMeta) -> None:
        self.slot = slot
        self.path = slot.path
        self.generation = generation
        self.meta = meta

    def data(self, entry: TensorEntry) -> memoryview:
        return self.slot.data(entry.offset, entry.nbytes)

    def verify(self, checksums: list[bytes]) -> None:
        """Every tensor against the checksums the agent took of this very snapshot (multi-node reads)."""
        tensors = self.meta.tensors
        if len(checksums) != len(tensors):
            raise SlotFormatError(f"{self.path}: {len(tensors)} tensors but {len(checksums)} checksums from the agent")
        for entry, checksum in zip(tensors, checksums):
            with self.data(entry) as view:
                if tensor_checksum(view) != checksum:
                    raise SlotFormatError(f"{self.path}: tensor {entry.name} of step {self.meta.step} does not match "
                                          "the checksum the agent took when it was committed (memory corrupted?)")


class RankSlots:
    def __init__(self, directory: Path, job_id: str, rank: int, world_size: int, local_world_size: int,
                 count: int | None = None, *, persist_every: int = 0, snapshot_every: int = 1) -> None:
        """``count`` slots, or None: 3 when shared memory has room for three, else 2 (decided at the first
        snapshot, when the size is known). ``persist_every``: save_storage_interval (a due step the agent
        has not decided yet is the last free slot to overwrite). ``snapshot_every``: save_mem_interval (a kill may
        cost two of them)."""
        self.persist_every = persist_every
        self.snapshot_every = snapshot_every
        self.directory = directory
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.wanted = count
        self.default = MULTI_NODE_SLOTS if world_size > local_world_size else DEFAULT_SLOTS
        existing = sorted(s for (r, s) in list_slots(directory, job_id) if r == rank)
        # A restarted rank keeps every slot its predecessor left: they may hold the step to resume from.
        self.count = max([count or self.default, *(s + 1 for s in existing)])
        if count is not None:
            say_asked_count(rank=rank, count=count, default=self.default, multi_node=world_size > local_world_size,
                            loud=self._first_local())
        self.sized = False   # the count is final once the first snapshot allocated its slots
        self.maps: list[SlotMap | None] = [None] * self.count
        self.control = ControlReader(control_path(directory, job_id))
        self._peer_maps: dict[Path, tuple[int, SlotMap]] = {}   # other local ranks' slots, headers only
        self._stalled = Episode(logger, logging.INFO)   # costs one step of freshness, heals itself
        self._stalled_at = -1   # control generation at which the agent last let a wait run out
        # How long a rank waits for the other local ranks to commit its newest step (the stager sets it from its
        # own copy time: the others copy as much), and whether the last such wait ran out (then it waits again
        # only once they are seen to catch up by themselves: ranks that are not in lockstep pay it once).
        self.peer_wait = SAFE_WAIT
        self._peers_late = Episode(logger, logging.INFO)
        # slot index -> generation of snapshots of an abandoned timeline that could not be invalidated yet
        # (the agent held them): never read as this rank's memory, invalidated as soon as they are free.
        self.abandoned: dict[int, int] = {}
        # The wait for the agent's word on a due step in the one free slot (``_let_due_be_decided``): its bound (the
        # checkpointer scales it with the step time), the seconds waited in all, and the control generation at which
        # such a wait last ran out (no new wait until the agent shows a sign of life).
        self.due_wait = DUE_WAIT
        self.due_waited = 0.0
        self._due_stalled_at = -1
        self._due_late = Episode(logger, logging.WARNING)
        self.raced = False   # the last choice found no slot because the agent flocked one it had not published yet
        # The step the last choice skipped a snapshot to keep: the newest, which the agent was late to declare safe.
        self.kept_newest: int | None = None
        warn_if_not_memory(directory, rank=rank, first_local=self._first_local())
        for index in existing:
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
        for index in range(self.count):
            header = self.header(index)
            if header is not None and header.committed and header.world_size == self.world_size:
                if self.abandoned.get(index) == header.generation:
                    continue
                if header.step not in found or found[header.step][1].generation < header.generation:
                    found[header.step] = (index, header)
        return found

    def next_generation(self) -> int:
        newest = max((h.generation for h in map(self.header, range(self.count)) if h is not None), default=0)
        return newest + 1 if newest % 2 == 0 else newest + 2

    # writing and reading ----------------------------------------------------------------------------
    def write(self, size: int, *, step: int | None = None,
              before_remap: Callable[[int], None] = lambda index: None) -> SlotWrite | None:
        """Begin a write of ``size`` bytes of the snapshot of ``step`` into the slot ``choose`` picks; None when
        the caller skips (see ``choose``; a write with no ``step`` never skips to keep the newest step).
        ``before_remap(index)`` runs before a slot is grown, when the caller's views of the old mapping must go
        (an mmap with live views cannot be re-mapped)."""
        index = self.choose(step)
        if index is None:
            return None
        current = self.maps[index]
        if current is not None and current.size < size:
            before_remap(index)
        try:
            slot = self.ensure(index, size)
        except BaseException:
            stale = self.maps[index]
            if stale is not None:
                stale.unlock()
            raise
        generation = self.next_generation()
        slot.begin_write(generation=generation, rank=self.rank, world_size=self.world_size, job_id=self.job_id)
        return SlotWrite(self, index, slot, generation)

    @contextlib.contextmanager
    def read(self, step: int, timeout: float) -> Iterator[SlotRead]:
        """This rank's newest committed slot of ``step`` under a shared lock (waiting at most ``timeout`` for
        a writer); raises SlotFormatError when it changed meanwhile, or was overwritten during the block."""
        index, header = self.committed()[step]
        slot = self.maps[index]
        assert slot is not None
        slot.lock_shared(timeout)
        try:
            current = slot.header()
            if not current.committed or current.generation != header.generation or current.step != step:
                raise SlotFormatError(f"{slot.path}: changed while it was being opened (step {current.step})")
            yield SlotRead(slot, current.generation, SlotMeta.from_wire(slot.read_meta(current), str(slot.path)))
            if slot.generation() != current.generation:
                raise SlotFormatError(f"{slot.path}: overwritten while being read")
        finally:
            slot.unlock()

    # allocation -------------------------------------------------------------------------------------
    def ensure(self, index: int, size: int) -> SlotMap:
        """Make slot ``index`` at least ``size`` bytes; all slots are sized together the first time."""
        slot = self.maps[index]
        if slot is not None and slot.size >= size:
            return slot
        first = not self.sized
        if first:
            self._decide_count(size)
        sizes = [m.size if m is not None else 0 for m in self.maps]
        targets = [i for i in range(self.count) if sizes[i] < size] if first else [index]
        current = sum(sizes[i] for i in targets)
        # The size to ask for holds the job's full count: the one chosen, else the default (fewer: memory was short).
        advice = check_space(self.directory, rank=self.rank, needed=size * len(targets) - current, slot_bytes=size,
                             count=self.count, full_count=self.wanted or self.default,
                             local_ranks=max(1, self.local_world_size))
        for target in targets:
            self._grow(target, size, advice)
        self.sized = True
        result = self.maps[index]
        assert result is not None
        if slot is None and not result.try_lock(exclusive=True):
            raise RuntimeError(f"{result.path} was locked by another process right after rank {self.rank} created it")
        return result

    def _decide_count(self, slot_bytes: int) -> None:
        """The default count (4 across nodes, else 3) when every local rank's slots fit in shared memory, else
        fewer, down to two, said once and loudly: fewer slots keep fewer steps at once."""
        if self.wanted is not None or any(m is not None for m in self.maps[self.default:]):
            return
        # Bytes this job already has there count as room: they are re-used, not added.
        ours = sum(p.stat().st_size for p in list_slots(self.directory, self.job_id).values() if p.exists())
        free = free_bytes(self.directory)
        local = max(1, self.local_world_size)
        count = fitting_count(default=self.default, slot_bytes=slot_bytes, local_ranks=local, room=free + ours)
        if count is None:
            # Not even two fit: the free-space check refuses the snapshot with the one message that holds
            # (ShmSpaceError); a warning about using fewer slots first would be contradicted at once. The count
            # is left alone, so that a smaller state later is judged afresh.
            return
        say_count(rank=self.rank, directory=self.directory, count=count, default=self.default, slot_bytes=slot_bytes,
                  local_ranks=local, free=free, room=free + ours, loud=self._first_local())
        self.count = count
        del self.maps[count:]

    def _first_local(self) -> bool:
        local = max(1, self.local_world_size)
        return self.rank % local == 0 or local == 1

    def _grow(self, index: int, size: int, advice: str) -> None:
        """Create or enlarge slot ``index``; an existing slot keeps its fd, and so its flock."""
        path = self.path(index)
        slot = self.maps[index]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if slot is None else slot.fd
        if slot is not None:
            slot.unmap()
        try:
            reserve(fd, path, size, rank=self.rank, advice=advice)
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
    def views(self) -> list[SlotView]:
        views = []
        for index in range(self.count):
            header = self.header(index)
            committed = header is not None and header.committed
            views.append(SlotView(index, self.maps[index] is not None, committed,
                                  header.step if committed and header else -1, header.generation if header else 0))
        return views

    def agent_word(self) -> ControlView | None:
        return self.control.read()

    def choose(self, step: int | None = None) -> int | None:
        """The slot index to write the snapshot of ``step`` to, locked exclusively (or not allocated yet: ensure()
        creates and locks it); None means skip this snapshot: every slot holds a step the agent keeps, or the one
        left holds this rank's newest step, which the agent is late to declare safe (``kept_newest``)."""
        word = self.control.read()
        self.raced, self.kept_newest = False, None
        past = PastNewest.WRITE
        if word is not None:
            word, past = self._let_newest_become_safe(word, step)
            if past is PastNewest.SKIP:
                return None
        for attempt in range(2):
            spare_first = past is PastNewest.SPARE
            views, spare, order = self._order(word, spare_first=spare_first)
            if word is not None and spare is not None and waits_for_due(views, order, spare, gated=word.gated):
                word = self._let_due_be_decided(word, spare)
                views, spare, order = self._order(word, spare_first=spare_first)
            flocked: set[int] = set()
            for index in order:
                slot = self.maps[index]
                if slot is None or slot.try_lock(exclusive=True):
                    if slot is not None and flocked and word is not None:
                        then = self._past_flocked(step, index, views, [i for i in order if i not in flocked], spare,
                                                  word)
                        if then is not PastNewest.WRITE:
                            slot.unlock()
                            if then is PastNewest.SKIP:
                                return None
                            continue   # SPARE: the spared due step's slot comes later in the order
                    self.raced = False
                    return index
                flocked.add(index)
            # Slots the word leaves free, flocked all the same: the agent took a hold (a persist claim, a step kept
            # for the job) that it publishes at the end of its round, and it marks the word as changing before it
            # flocks. If the word moved since it was read, the choice is made again on the agent's new word (the
            # same round may have let go of another slot); else a skip, but not for want of slots.
            self.raced = bool(order)
            if attempt or word is None:
                return None
            first = word
            word = self.control.read(wait=MOVE_WAIT)   # the old safe step's slot is free in a moment
            if word is None or not (first.changing or word.changing or word.generation != first.generation):
                return None
            # The move may have failed: the same rule as the first try before this rank's newest step is
            # overwritten (it waited for nothing and said nothing here before; a CI kill cost three steps).
            word, past = self._let_newest_become_safe(word, step)
            if past is PastNewest.SKIP:
                return None
        return None

    def _order(self, word: ControlView | None, *, spare_first: bool = False
               ) -> tuple[list[SlotView], int | None, list[int]]:
        """The slot headers, the undecided due step to spare and the write order, on the agent's ``word``."""
        views = self.views()
        if word is None:
            return views, None, write_order(views, lambda step: False)
        # On one node the agent holds steps only for persists (its safe step apart); across nodes also for the job.
        spare = undecided_due(views, every=self.persist_every, decided=word.decided,
                              persisting=not word.gated and bool(word.held))
        return views, spare, write_order(views, word.keeps, spare=spare, spare_first=spare_first)

    def scale_due_wait(self, step_seconds: float | None) -> None:
        """Bound the wait for the agent's word on a due step by a few of the observed ``step_seconds``."""
        if step_seconds is not None:
            self.due_wait = max(DUE_WAIT, DUE_WAIT_STEPS * step_seconds)

    def _let_due_be_decided(self, word: ControlView, due: int) -> ControlView:
        """Invariant 12 with one free slot, and that slot holds ``due``: a due step the agent has neither held nor
        decided (persist it, or pass it over). Overwriting it loses it to disk for good, yet the agent decides it
        within a round of its loop once every local rank holds it (across nodes, within the leader's next verdict).
        A starved agent is later than a step (CI, 2026-12-01: "due step 5 passed over on every node: the ranks of
        node(s) ['node0'] moved past it before their agent held it"). So wait for its word, at most ``due_wait``
        (a few step times: training slows down for an agent that cannot keep up, it never stops), and not again
        while an agent that let such a wait run out shows no sign of life. Returns the word to choose on."""
        if self._due_stalled_at == word.generation:
            return word
        started = time.monotonic()
        # ``decided`` covers a due step passed over too (the agent publishes both together).
        current = self._await_word(lambda view: view.keeps(due) or view.decided >= due, self.due_wait)
        self.due_waited += time.monotonic() - started
        if current is not None:
            self._due_late.end("rank %d: the node agent decides due steps in time again (step %d)", self.rank, due)
            return current
        current = self.control.read() or word
        self._due_stalled_at = current.generation
        self._due_late.hit("rank %d: the node agent has neither held nor passed over due step %d within %.2fs (starved "
                           "of CPU?): the snapshot goes over it, the one free slot, so it never reaches disk (the agent "
                           "announces it passed over)", self.rank, due, self.due_wait)
        return current

    def _await_word(self, done: Callable[[ControlView], bool], bound: float) -> ControlView | None:
        """The agent's first word for which ``done`` holds, polled for at most ``bound`` seconds; None if none came."""
        deadline = time.monotonic() + bound
        while True:
            current = self.control.read()
            if current is not None and done(current):
                return current
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.0002)   # polling the control block (shared memory, no syscall) against the deadline

    def _let_newest_become_safe(self, word: ControlView, step: int | None) -> tuple[ControlView, PastNewest]:
        """Freshness with one free slot (the others hold the safe step and a persist, or the spared due step): that
        slot holds this rank's newest snapshot, and overwriting it before the agent declares it safe would leave
        the safe step where it is for as long as the persist runs. When every local rank has committed that step,
        the agent (woken by their commits) declares it within a moment: wait for that, at most SAFE_WAIT,
        and not again while an agent that let a wait run out shows no sign of life. Not in a multi-node job
        (``gated``): there the step also waits for another node's backup, which may take longer than a step.

        Returns the word to choose on, and what to do past the newest step (``slot_choice.past_newest``): write
        over it, or, the agent still late and a kill during that copy costing more than two intervals, skip the
        snapshot to keep it (CI, 2026-12-01: an agent late twice in a row let two snapshots overwrite the newest
        step, and a kill at step 5 resumed at 2) or write over the spared due step instead."""
        views, spare, order = self._order(word)
        newest = lone_newest(views, order, spare)
        if newest is None or word.gated or (word.safe is not None and newest.step <= word.safe):
            return word, PastNewest.WRITE
        if self._stalled_at == word.generation:
            return word, self._past(step, newest, views, spare, word)
        if not self._peers_commit(newest.step):
            return word, PastNewest.WRITE
        current = self._await_word(lambda view: (view.safe or -1) >= newest.step, SAFE_WAIT)
        if current is not None:
            self._stalled.end("rank %d: the agent declares steps safe again", self.rank)
            return current, PastNewest.WRITE
        self._stalled_at = word.generation
        word = self.control.read() or word
        past = self._past(step, newest, views, spare, word)
        self._stalled.hit("rank %d: the agent did not declare step %d safe within %.0f ms although every local rank "
                          "holds it; %s (the safe step stays %s until the agent catches up)", self.rank, newest.step,
                          SAFE_WAIT * 1000, "overwriting it" if past is PastNewest.WRITE else "keeping it", word.safe)
        return word, past

    def _past_flocked(self, step: int | None, index: int, views: list[SlotView], left: list[int], spare: int | None,
                      word: ControlView) -> PastNewest:
        """What to do with slot ``index``, locked, when the agent flocks other slots its word leaves free (``left``:
        those it does not): it is in the middle of a round, moving the safe step, or starved there. When ``index``
        holds this rank's newest step and is the one slot left, the same rule as when the word leaves it alone
        (CI, 2026-12-02: an agent stopped while it moved the safe step from 0 to 1 flocked the slot of 1; the
        snapshots of 3 and 4 went over 2 and 3, and a kill during the copy of 4 resumed at 1)."""
        newest = lone_newest(views, left, spare)
        if newest is None or newest.index != index or word.gated:
            return PastNewest.WRITE
        return self._past(step, newest, views, spare, word)

    def _past(self, step: int | None, newest: SlotView, views: list[SlotView], spare: int | None,
              word: ControlView) -> PastNewest:
        """``slot_choice.past_newest`` for the snapshot of ``step``; sets ``kept_newest`` when it is skipped."""
        if step is None or (word.safe or -1) >= newest.step:
            return PastNewest.WRITE
        fallback = max((v.step for v in views if v.committed and v.index != newest.index), default=word.safe)
        past = past_newest(step, newest=newest.step, fallback=fallback, bound=2 * self.snapshot_every, spare=spare)
        self.kept_newest = newest.step if past is PastNewest.SKIP else None
        return past

    def _peers_commit(self, step: int) -> bool:
        """Whether every local rank holds ``step`` committed, waiting at most ``peer_wait`` for the others' copies.

        Ranks in lockstep (DDP) reach this step's save a moment apart, each after its own copy of the previous step
        committed but not necessarily another's. Overwriting the one free slot then would leave no step newer than
        the safe step in every rank's memory; when the others are as quick the next time too, the safe step stands
        still for as long as the persist that holds the third slot runs, and a kill costs more than two steps
        (invariant 9). The wait is for the ranks' own commits only, never for the agent or a persist."""
        if self._every_local_rank_has(step):
            self._peers_late.end("rank %d: the other local ranks commit their snapshots in time again", self.rank)
            return True
        if self._peers_late.active:
            self._peers_late.hit("")   # counted for the episode's end line; logged only when it began
            return False
        bound = min(PEER_WAIT_MAX, max(SAFE_WAIT, self.peer_wait))
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            time.sleep(0.0005)   # polling the other ranks' slot headers against a deadline
            if self._every_local_rank_has(step):
                return True
        self._peers_late.hit("rank %d: not every local rank committed step %d within %.0f ms of this rank's next "
                             "snapshot; overwriting it (the safe step stays where it is until they keep pace)",
                             self.rank, step, bound * 1000)
        return False

    def _every_local_rank_has(self, step: int) -> bool:
        """Whether every local rank's slots hold ``step`` committed (read from their headers, read-only)."""
        if len(self._peer_maps) < self.local_world_size * MIN_SLOTS:
            for (rank, _), path in list_slots(self.directory, self.job_id).items():
                if path not in self._peer_maps and rank != self.rank:
                    try:
                        self._peer_maps[path] = (rank, SlotMap(path, writable=False))
                    except (OSError, SlotFormatError):
                        continue
        holders = {self.rank}
        for rank, slot in self._peer_maps.values():
            try:
                slot.refresh()
                header = slot.header()
            except (OSError, ValueError, SlotFormatError):
                continue
            if header.committed and header.step == step and header.job_id == self.job_id:
                holders.add(rank)
        return len(holders) >= self.local_world_size

    def invalidate_newer_than(self, step: int) -> None:
        """Forget snapshots past the resumed step: they belong to a timeline the job abandoned. One the agent
        holds is remembered in ``abandoned`` (never read again) and invalidated once it is free."""
        for index in range(self.count):
            header, slot = self.header(index), self.maps[index]
            if header is not None and slot is not None and header.committed and header.step > step:
                if slot.try_lock(exclusive=True):
                    slot.invalidate()
                    slot.unlock()
                    logger.info("rank %d: dropped slot %d with step %d (resumed at %d)", self.rank, index,
                                header.step, step)
                else:
                    self.abandoned[index] = header.generation
                    logger.info("rank %d: slot %d with step %d (resumed at %d) is held by the agent: ignored, and "
                                "dropped once it is free", self.rank, index, header.step, step)

    def retry_abandoned(self) -> None:
        """Invalidate the abandoned snapshots that the agent no longer holds."""
        for index, generation in list(self.abandoned.items()):
            header, slot = self.header(index), self.maps[index]
            if header is None or slot is None or not header.committed or header.generation != generation:
                del self.abandoned[index]   # rewritten, or invalidated by the agent
            elif slot.try_lock(exclusive=True):
                try:
                    if slot.header().generation == generation:
                        slot.invalidate()
                finally:
                    slot.unlock()
                del self.abandoned[index]
                logger.info("rank %d: dropped slot %d with step %d of the abandoned timeline", self.rank, index,
                            header.step)

    def drop_stale_copies(self) -> None:
        """Invalidate every committed slot whose step a newer generation holds too (a step snapshotted
        again). One the agent still holds stays until a later commit finds it free (the agent moves its
        hold to the newer copy); readers prefer the newer generation meanwhile."""
        if self.abandoned:
            self.retry_abandoned()
        newest: dict[int, tuple[int, int]] = {}
        for index in range(self.count):
            header = self.header(index)
            if header is not None and header.committed:
                best = newest.get(header.step)
                if best is None or header.generation > best[0]:
                    newest[header.step] = (header.generation, index)
        for index in range(self.count):
            header, slot = self.header(index), self.maps[index]
            if slot is None or header is None or not header.committed or newest[header.step][1] == index:
                continue
            if slot.try_lock(exclusive=True):
                slot.invalidate()
                slot.unlock()
                logger.info("rank %d: dropped the older snapshot of step %d in slot %d", self.rank, header.step,
                            index)

    def close(self) -> None:
        for index, slot in enumerate(self.maps):
            if slot is not None:
                slot.close()
                self.maps[index] = None
        self.control.close()
        for _, slot in self._peer_maps.values():
            slot.close()
        self._peer_maps.clear()
