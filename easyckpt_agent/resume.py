"""A rank resumed at a step: a new timeline begins (invariant 10), and every part of the agent forgets the old one.

Ranks send RESUME after ``load()``, every rank the same step. :meth:`Resume.resume` has the agent that commits
iterations (the only one of a single-node job, the leader of a multi-node one) move newer iterations aside
(``easyckpt_agent.timeline``); every agent then forgets newer steps, so that the new timeline's are persisted again
whatever numbers the abandoned one reached: the newest step on disk and the step given up on
(``PersistScheduler.rewind``), the leader's committed step, this node's shards in an abandoned stage, the due
steps taken, lost and passed over (``NodeAgreement.rewind``), claims and requests of newer steps, and holds
of newer steps or of snapshots the rank could not invalidate (``Protection.rewind``). Only the first of the
ranks' calls reads the store and moves anything (see below). Those snapshots of the abandoned timeline are
invalidated once nothing holds them (:meth:`Resume.invalidate_abandoned`, every round while there are any), so
that no later load, in this process or after a crash, takes them for the job's memory.

The store is read once per restart: the first rank's RESUME lists it (and moves what is newer aside); the restart's
other ranks, at the same step moments later, are answered with what it found (:class:`Found`). Each reading is a few
requests (listings, the tracker) that an object store answers in tens of milliseconds, or in seconds under
throttling or an outage, and the agent's loop answers no rank meanwhile: read once per rank, a node of eight ranks
held its last rank's resume for the sum.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from easyckpt_agent import policy
from easyckpt_agent.cluster import NodeReplication
from easyckpt_agent.node_agreement import NodeAgreement
from easyckpt_agent.persister import AuditLog, drop_own_shards, stage_steps
from easyckpt_agent.protection import Protection
from easyckpt_agent.scheduler import PersistScheduler
from easyckpt_agent.timeline import DiskTimeline
from easyckpt_agent.watcher import Watcher
from easyckpt_wire import layout
from easyckpt_wire.records import ResumeReply
from easyckpt_wire.storage import unavailable

logger = logging.getLogger(__name__)

# The ranks of one restart send RESUME within moments of each other: for this long after the first, the others at the
# same step are answered with what it found in the store (reachable or not), not read again.
RESTART_REMEMBERED_S = 10.0


@dataclasses.dataclass(kw_only=True)
class Found:
    """What the first RESUME of a restart found in the store, for the restart's other ranks."""

    step: int
    when: float                 # time.monotonic() of the first RESUME
    answered: set[int]          # ranks answered with it: the same rank again is a new restart
    persisted: int | None       # the newest step on disk after it: a persist since then ends it
    moved: list[int]            # what it moved aside (the others find nothing left to move)
    tracker: int | None
    complete: list[int]
    error: str | None
    down: bool                  # the store was unreachable

    def answers(self, rank: int, step: int, persisted: int | None, now: float) -> bool:
        return (step == self.step and rank not in self.answered and persisted == self.persisted
                and now - self.when < RESTART_REMEMBERED_S)


class Resume:
    def __init__(self, *, save_dir: Path, node_id: str, audit: AuditLog, timeline: DiskTimeline, watcher: Watcher,
                 scheduler: PersistScheduler, protection: Protection, agreement: NodeAgreement,
                 cluster: NodeReplication, publish: Callable[[], None]) -> None:
        self.save_dir = save_dir
        self.node_id = node_id
        self.audit = audit
        self.timeline = timeline
        self.watcher = watcher
        self.scheduler = scheduler
        self.protection = protection
        self.agreement = agreement
        self.cluster = cluster
        self.publish = publish
        self._found: Found | None = None

    def resume(self, rank: int, step: int, stale: Iterable[Iterable[int]]) -> ResumeReply:
        """``rank`` resumed at ``step``. Newer iterations are moved aside (by the agent that commits them),
        newer steps are forgotten here so that the new timeline's are persisted again, and the rank's
        snapshots of newer steps that it could not invalidate (``stale``: [slot, generation] that this agent
        held) are ignored and let go. The reply's error says what could not be moved."""
        for slot, generation in stale:
            self.watcher.abandoned.add((rank, slot, generation))
        self.watcher.abandoned.update(self.watcher.leftovers_newer_than(step))
        commits = self.cluster.peers is None or self.cluster.peers.is_leader
        found = self._found_for(rank, step)
        if found is None:
            found = self._read_store(rank, step, commits)
            self._found = found
        found.answered.add(rank)
        moved = found.moved if len(found.answered) == 1 else []
        # The store down as torchrun restarts the workers: the new timeline still starts here (the rewind below
        # needs no listing: a step persisted at or below ``step`` stands, a newer one is forgotten).
        complete, error = found.complete, found.error
        scheduler = self.scheduler
        before = scheduler.rewind(step, complete)
        if before != (scheduler.persisted, scheduler.given_up):
            logger.info("rank %d resumed at step %d: a new timeline; newest step on disk %s -> %s (steps after it "
                        "are persisted again)", rank, step, before[0], scheduler.persisted)
        if self.cluster.complete is not None and self.cluster.complete > step:
            self.cluster.complete = policy.tracker_after_resume(complete, step)
        inflight = scheduler.inflight_step()
        if not commits and not found.down and len(found.answered) == 1:
            try:
                self._drop_stale_shards(step, inflight)
            except OSError as exc:   # the leader drops whole stages newer than the resume once it can list them
                logger.warning("rank %d resumed at step %d: cannot look for this node's shards of newer steps in %s: "
                               "%s", rank, step, self.save_dir, exc)
        self.agreement.rewind(step)
        # Not the persist in flight: it reads its slots until it finishes (and then publishes nothing).
        scheduler.claims.release(lambda s: s > step and s != inflight)
        for wanted in [s for s in scheduler.flushes.wanted if s > step]:
            scheduler.flushes.give_up(wanted, f"the job resumed at step {step}: step {wanted} was abandoned")
        if self.protection.rewind(step):
            self.cluster.safe_step = None
        found.persisted = scheduler.persisted
        self.publish()
        return ResumeReply(moved, found.tracker, scheduler.persisted, error)

    def _found_for(self, rank: int, step: int) -> Found | None:
        """What the first RESUME of this restart found, if ``rank`` is another of its ranks (None: read the store).
        Read again per rank, an unreachable store took the client's retries (seconds) out of the loop that answers
        the ranks, one after the other: a node's last rank resumed seconds after its first (soak, seed 11301)."""
        found, now = self._found, time.monotonic()
        if found is None or not found.answers(rank, step, self.scheduler.persisted, now):
            return None
        logger.debug("rank %d resumed at step %d: answered with what the restart's first RESUME found in %s %.1fs "
                     "ago", rank, step, self.save_dir, now - found.when)
        return found

    def _read_store(self, rank: int, step: int, commits: bool) -> Found:
        """The first RESUME of a restart: move the newer iterations aside (``commits``) and list what is left."""
        moved, tracker, error, down = self._move_aside(rank, step, commits)
        complete: list[int] = []
        if not down:
            try:
                complete = [s for s, _ in layout.complete_iterations(self.save_dir)]
            except OSError as exc:
                down = unavailable(exc)
                if error is None:
                    error = f"cannot list {self.save_dir}: {exc}"
                    logger.warning("rank %d resumed at step %d: %s; persists of the new timeline go on once it "
                                   "answers", rank, step, error)
        return Found(step=step, when=time.monotonic(), answered=set(), persisted=None, moved=moved, tracker=tracker,
                     complete=complete, error=error, down=down)

    def _move_aside(self, rank: int, step: int, commits: bool) -> tuple[list[int], int | None, str | None, bool]:
        """Move the iterations newer than ``step`` aside (``commits``: this agent publishes iterations);
        returns (steps moved, the step the tracker names, what went wrong, whether the store is unreachable)."""
        try:
            result = self.timeline.abandon_after(step, commits=commits)
        except OSError as exc:
            down = unavailable(exc)
            fix = "they stay until a resume finds the store up" if down else "fix the directory and resume again"
            error = (f"could not move the iterations newer than step {step} aside in {self.save_dir}: {exc}; an "
                     f"automatic load follows the tracker, {fix}")
            logger.error("rank %d resumed at step %d: %s", rank, step, error)
            tracker = None
            if not down:
                with contextlib.suppress(OSError):   # the reply says what could not be moved all the same
                    tracker = layout.read_tracker(self.save_dir)
            return [], tracker, error, down
        return result.moved, result.tracker, None, False

    def _drop_stale_shards(self, step: int, inflight: int | None) -> None:
        """A shard of this node that an abandoned persist left in a stage must not complete the new timeline's
        iteration of that number (the leader drops whole stages; this covers a late one)."""
        for staged in stage_steps(self.save_dir):
            if staged > step and staged != inflight:   # the one in flight is dropped once it finishes
                drop_own_shards(self.save_dir, staged, self.node_id, sorted(self.watcher.local_ranks()), self.audit)

    def invalidate_abandoned(self) -> None:
        """Snapshots of an abandoned timeline that their rank could not invalidate (this agent held them):
        invalidate each once nothing holds it, so that no later load, in this process or after a crash,
        takes it for the job's memory."""
        for rank, slot, generation in sorted(self.watcher.abandoned):
            info = self.watcher.slots.get((rank, slot))
            if info is None or self.protection.holds.reasons.get(id(info.map)) or not info.map.try_lock(exclusive=True):
                continue
            try:
                header = info.map.header()
                if header.committed and header.generation == generation:
                    info.map.invalidate()
                    logger.info("invalidated rank %d's slot %d with step %d of the abandoned timeline", rank, slot,
                                header.step)
            finally:
                info.map.unlock()
            self.watcher.abandoned.discard((rank, slot, generation))
