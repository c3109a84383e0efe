"""Persist scheduling: which step goes to disk when, one persist at a time, and what a failure costs.

Persists run one at a time in a worker thread, so the agent's loop keeps answering while gigabytes go to
disk. Each round :meth:`PersistScheduler.schedule` claims (``easyckpt_agent.claims``) what is to be persisted: on one
node the newest due step every local rank holds, when the persister is free (``policy.due_to_claim``; one
that arrives while it is busy is passed over, logged once per episode); the steps ranks asked for (FLUSH);
after a rank died, the newest snapshot every local rank holds; at the end of a job whose last due step was
passed over, its tail. Across nodes the leader decides which due steps are persisted (``easyckpt_agent.node_agreement``
claims them); this module only writes this node's shards. A step is persisted once every local rank's
slot of it is claimed and its metadata read.

A persist that fails (a full or read-only disk) is one line in the log and a failure episode, published in
the control block for the ranks to report (a WARNING when it starts and when it ends, ``stats()``,
``flush()``, ``close()`` raising PersistError); the step is not retried (a newer due step, or a rank's
request, is) and stays in memory.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

from easyckpt_agent import agreement, policy
from easyckpt_agent.claims import Claims, FlushRequests, Send
from easyckpt_agent.persister import (
    AuditLog,
    PersistFailed,
    PersistStats,
    RankSnapshot,
    StepAbandoned,
    describe,
    drop_own_shards,
    lower_priority,
    persist,
    persist_shards,
)
from easyckpt_agent.roles import Announcements
from easyckpt_agent.timeline import DiskTimeline
from easyckpt_agent.watcher import SlotHolds, SlotInfo, Watcher
from easyckpt_wire import layout
from easyckpt_wire import timeline as wire_timeline
from easyckpt_wire.control import PersistFailure
from easyckpt_wire.episode import Episode

logger = logging.getLogger(__name__)

# How long a step of a multi-node job waits for PEERS (the ranks send it with their HELLO to an agent that
# replaced a dead one, and once at start-up after a collective) before its persist fails for want of it.
PEERS_GRACE = 30.0


class PersistSettings(Protocol):
    """What the scheduler reads of the agent's config (``AgentConfig``; the first three follow the ranks' HELLO)."""

    save_storage_interval: int
    max_ckpt_num: int
    log_file_path: str | None
    persist_threads: int
    node_id: str


class PersistScheduler:
    def __init__(self, *, settings: PersistSettings, save_dir: Path, audit: AuditLog, timeline: DiskTimeline,
                 watcher: Watcher, holds: SlotHolds, announced: Announcements, multi: Callable[[], bool],
                 checksums_of: Callable[[Path, int], tuple[bytes, ...] | None] = lambda path, generation: None) -> None:
        self.settings = settings
        self.save_dir = save_dir
        self.audit = audit
        self.timeline = timeline
        self.watcher = watcher
        self.announced = announced
        self.multi = multi   # whether the job spans nodes (PEERS arrived): then this node writes shards only
        self.checksums_of = checksums_of   # the agent's checksums of a slot write, which the persist checks
        self.claims = Claims(holds)
        self.flushes = FlushRequests()
        # The newest step of the current timeline on disk (what a load follows: the tracker, invariant 10);
        # a newer complete iteration is of an abandoned timeline, or lost the race with the tracker.
        self.persisted: int | None = _tracked_head(save_dir)
        self.last_persist: PersistStats | None = None
        self.stored_at = 0.0   # when a persist last reached the store (monotonic): the stage listing's backoff ends
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="persist", initializer=lower_priority)
        self.inflight: tuple[int, concurrent.futures.Future[PersistStats]] | None = None
        self.inflight_epoch = 0   # the timeline's epoch when the persist in flight started
        self.failed_ranks: set[int] = set()   # ranks that died without closing: their node flushes
        self.given_up = -1  # the newest step whose persist failed: not retried, a newer one will be
        # The failure episode in progress (the newest persist failed), published in the control block for the
        # ranks to report; failures counts them over the agent's life.
        self.failure: PersistFailure | None = None
        self.failures = 0
        self._failures_before = 0   # failures before the episode in progress
        # Across nodes: a node's failed persist of a step the leader has not committed, as the leader's verdict
        # says (this node's own included): that iteration cannot be committed, and no rank waits for it.
        self.job_failure: agreement.StepFailure | None = None
        self.job_committed: int | None = None   # the newest iteration the leader committed, as its verdict says
        self.passed = Episode(logger, logging.INFO)   # due steps passed over while a persist ran
        # A step of a job that spans nodes, claimed before any rank told this agent the other nodes (PEERS): an
        # agent a rank just started hears a rank's FLUSH, or finds due steps in the slots, before the PEERS that
        # another rank's socket carries. It waits for them, up to PEERS_GRACE seconds.
        self.no_peers = Episode(logger, logging.INFO)
        self.log_file_failing = Episode(logger)   # log_file_path cannot be appended to (said once, and when it can)
        self.last_passed = -1
        self.passed_since_claim = False

    # where things stand ---------------------------------------------------------------------------------
    def floor(self) -> int:
        """Steps at or below this are on disk, or were given up on: never persisted again unless a rank asks."""
        return max(self.durable(), self.given_up)

    def durable(self) -> int:
        """Steps at or below this are on disk. A rank's explicit request (FLUSH: flush(), close()) retries a
        step whose persist failed: the disk may have been fixed since."""
        return -1 if self.persisted is None else self.persisted

    def inflight_step(self) -> int | None:
        return self.inflight[0] if self.inflight is not None else None

    def held_steps(self) -> frozenset[int]:
        """Steps whose slots are held for a persist (claimed or being written)."""
        return frozenset(self.claims) | ({self.inflight[0]} if self.inflight else set())

    def busy(self) -> bool:
        return self.inflight is not None or bool(self.claims)

    def failure_dict(self) -> dict[str, Any] | None:
        return None if self.failure is None else self.failure.as_dict()

    # one round of the agent's loop -------------------------------------------------------------------
    def schedule(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: frozenset[int], *,
                 multi: bool) -> None:
        """Claim what is to be persisted this round, drop what cannot be, and start a persist when one is ready."""
        self.flushes.claim_committed(ranks, held, self.claims, self.durable())
        if not multi:   # across nodes the leader decides which due steps are persisted (agent.node_agreement)
            self.persist_due(ranks, held, common)
        if self.failed_ranks:
            self.flush_on_failure()
        if not multi and self.watcher.all_said_bye():
            self.flush_missed_due(common)
        for step, why in self.claims.drop_unreachable(self.watcher, self.persisted).items():
            if step in self.flushes.wanted:   # or the next round would claim it again
                self.flushes.give_up(step, why)
        self.flushes.drop_unreachable(self.watcher, self.claims, self.durable())
        self.start_ready()

    def persist_due(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: frozenset[int]) -> None:
        """Single node: claim the newest due step every local rank holds when the persister is free; one that
        arrives while it is busy is passed over (logged once per episode)."""
        busy = self.busy()
        floor, interval = self.floor(), self.settings.save_storage_interval
        due = policy.due_to_claim(common, floor=floor, interval=interval, busy=busy)
        if due is not None and self.claims.claim_all(due, ranks, held):
            if not self.passed_since_claim:   # the persister keeps up again: the episode is over
                self.passed.end("persists keep up with save_storage_interval again at step %d; due steps were "
                                "passed over meanwhile", due)
            self.passed_since_claim = False
        skipped = policy.passed_over(common, floor=floor, interval=interval, busy=busy)
        if skipped is not None and skipped not in self.claims and skipped not in self.flushes.wanted \
                and skipped != self.inflight_step() and skipped != self.last_passed:
            self.last_passed = skipped   # counted once per step, not per loop turn
            self.passed_since_claim = True
            self.announced.recent = sorted({*self.announced.recent, skipped})[-agreement.PASSED_KEPT:]
            self.passed.hit("due step %d passed over: the persist of step %s is still running (a persist takes "
                            "longer than save_storage_interval=%d steps); the next due step after it is persisted",
                            skipped, self.inflight_step(), interval)

    def claim_newest(self, step: int) -> bool:
        """Claim ``step`` on every local rank (it is the newest snapshot every local rank holds)."""
        ranks = self.watcher.local_ranks()
        return self.claims.claim_all(step, ranks, {rank: self.watcher.committed(rank) for rank in ranks})

    def flush_on_failure(self) -> None:
        """Ranks died: persist the newest snapshot every local rank holds, if disk lacks it."""
        self.watcher.scan()   # the round's scan may predate the dead rank's last commit
        common = self.watcher.common_steps()
        if not common or common[0] <= self.floor():
            self.failed_ranks.clear()
            return
        if self.claim_newest(common[0]):
            logger.warning("flush on failure: persisting step %d, the newest snapshot of every local rank", common[0])
            self.failed_ranks.clear()

    def flush_missed_due(self, common: Collection[int]) -> None:
        """The job finished, but its last due snapshot never reached disk (passed over while an older step
        was persisted): persist the newest snapshot instead of losing the tail."""
        interval = self.settings.save_storage_interval
        step = policy.tail_to_persist(common, floor=self.floor(), interval=interval)
        if step is None or step in self.claims or self.inflight is not None:
            return
        if self.claim_newest(step):
            logger.warning("due step %d never reached disk (passed over while an older step was persisted): "
                           "persisting step %d, the newest snapshot of every rank, before the job's memory is "
                           "released", step // interval * interval, step)

    # the persist in flight ----------------------------------------------------------------------------
    def start_ready(self) -> None:
        """Start a claimed step whose every local rank is claimed and whose metadata is read: the newest, or
        (``policy.next_to_persist``) one a rank asked for while the job is failing."""
        if self.inflight is not None:
            return
        ranks = self.watcher.local_ranks()
        ready: dict[int, list[RankSnapshot]] = {}
        for step in self.claims:
            claims = self.claims.ranks(step)
            if len(ranks) >= self.watcher.local_world_size and set(claims) >= ranks:
                metas = {rank: claim.info.meta for rank, claim in claims.items()}
                if any(meta is None or meta.step != step for meta in metas.values()):
                    continue  # metadata not read yet for this generation: next tick
                ready[step] = [RankSnapshot(rank, claim.info.map, meta, self.checksums_of(claim.info.path, claim.generation))
                               for (rank, claim), meta in zip(claims.items(), metas.values()) if meta is not None]
        self._wait_for_peers(ready)
        # Across nodes every node must write the same step first (the leader waits for each stage): newest.
        failing = len(ready) > 1 and not self.multi() and self.watcher.any_died()
        chosen = policy.next_to_persist(ready, self.flushes.wanted, failing=failing)
        if chosen is not None:
            self.inflight_epoch = self.timeline.epoch
            self.inflight = (chosen, self.pool.submit(self._persist, chosen, ready[chosen], self.inflight_epoch))

    def _wait_for_peers(self, ready: dict[int, list[RankSnapshot]]) -> None:
        """Leave out of ``ready`` the steps of other nodes' ranks too while no PEERS arrived, for PEERS_GRACE
        seconds; past that, a persist says that no rank told the agent (``_persist``)."""
        partial = [step for step, snaps in ready.items() if len(snaps) != snaps[0].meta.world_size]
        if self.multi() or not partial:
            self.no_peers.end("the job's other nodes are known (PEERS): persists of steps %s go ahead", partial)
            return
        self.no_peers.hit("steps %s are of a job that spans nodes, and no rank told this agent the other nodes yet "
                          "(PEERS): they wait for it (at most %.0fs)", partial, PEERS_GRACE)
        if time.monotonic() - self.no_peers.started < PEERS_GRACE:
            for step in partial:
                del ready[step]

    def _persist(self, step: int, snaps: list[RankSnapshot], epoch: int) -> PersistStats:
        settings = self.settings
        world_size = snaps[0].meta.world_size
        if len(snaps) != world_size:
            if not self.multi():
                raise RuntimeError(
                    f"this node holds ranks {sorted(s.rank for s in snaps)} of a {world_size}-rank job but no rank "
                    "told this agent the job's other nodes (PEERS): a multi-node checkpoint needs every node's "
                    "shards before its commit marker, so nothing is written"
                )
            return persist_shards(self.save_dir, step, snaps, settings.node_id, self.audit, settings.persist_threads)
        stats = persist(self.save_dir, step, snaps, self.audit, settings.persist_threads,
                        publishing=lambda s: self.timeline.publishing(s, epoch))
        try:
            self.timeline.rotate(settings.max_ckpt_num, step)
        except OSError as exc:   # the step is durable all the same; the next persist rotates again
            logger.warning("rotation after step %d failed: %s: %s", step, exc.filename or self.save_dir,
                           exc.strerror or exc)
        return stats

    def finish_inflight(self) -> None:
        """Take the outcome of a persist that finished: the new step on disk, or a failure episode."""
        if self.inflight is None or not self.inflight[1].done():
            return
        step, future = self.inflight
        self.inflight = None
        abandoned = self.timeline.abandoned_since(self.inflight_epoch, step)
        try:
            stats = future.result()
        except StepAbandoned:
            logger.info("persist of step %d finished after the job resumed at an older step: not published", step)
            self.claims.drop(step)
            return
        except Exception as exc:
            self._failed(step, exc, abandoned)
            return
        if abandoned:
            # A node's shards (multi-node) written for a step a resume abandoned meanwhile: they must not
            # complete the new timeline's iteration of that number.
            drop_own_shards(self.save_dir, step, self.settings.node_id, sorted(self.claims.ranks(step)), self.audit)
            self.claims.drop(step)
            return
        self._succeeded(step, stats)

    def _failed(self, step: int, exc: Exception, abandoned: bool) -> None:
        if abandoned:   # not a failure of the new timeline: its step of this number is still persisted
            logger.warning("persist of step %d (abandoned by a resume meanwhile) failed: %s", step, exc)
            traceback.clear_frames(exc.__traceback__)
            self.claims.drop(step)
            return
        if isinstance(exc, PersistFailed):
            self.persist_failed(step, exc)
            return
        if isinstance(exc, OSError):   # the storage's (the multi-node stage path raises it as it is): one line
            traceback.clear_frames(exc.__traceback__)   # its frames hold views of the slots
            self.persist_failed(step, PersistFailed(step, exc.filename or self.save_dir, exc.errno or 0,
                                                    exc.strerror or str(exc)))
            return
        # not the disk: a bug, worth its traceback (once per failure)
        logger.exception("persist of step %d to %s failed", step, self.save_dir)
        traceback.clear_frames(exc.__traceback__)   # its frames hold views of the slots
        self.persist_failed(step, PersistFailed(step, self.save_dir, 0, f"{type(exc).__name__}: {exc}"))

    def _succeeded(self, step: int, stats: PersistStats) -> None:
        self.persisted = step if self.persisted is None else max(step, self.persisted)
        self.stored_at = time.monotonic()
        self.last_persist = stats
        if self.failure is not None:
            logger.warning("persists succeed again: step %d is on disk after %d failed persist(s) since %s",
                           step, self.failure.failures - self._failures_before, time.strftime(
                               "%H:%M:%S", time.localtime(self.failure.since)))
            self.failure = None
        line = describe(stats, len(self.claims.ranks(step)))
        logger.info(line)
        self.claims.release(lambda s: s <= step)
        path = self.settings.log_file_path
        if path:
            try:
                with open(path, "a", encoding="utf-8") as handle:
                    handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
            except OSError as exc:
                self.log_file_failing.hit("cannot append to log_file_path %s: %s (the persists go on; said once)",
                                          path, exc)
            else:
                self.log_file_failing.end("log_file_path %s takes the persists' lines again", path)

    def persist_failed(self, step: int, exc: PersistFailed) -> None:
        """One line per failed persist; the step is not retried (a newer due step, or a rank's request, is)."""
        self.failures += 1
        now = time.time()
        if self.failure is None:
            self._failures_before = self.failures - 1
        since = now if self.failure is None else self.failure.since
        self.failure = PersistFailure(step, exc.errno, exc.text(), exc.needed, exc.free, since, now, self.failures)
        logger.warning("%s; the snapshot stays in memory and training goes on (failed persists in a row: %d)",
                       exc.describe(), self.failures - self._failures_before)
        self.given_up = max(self.given_up, step)
        self.claims.release(lambda s: s <= step)
        for wanted in [s for s in self.flushes.wanted if s <= step]:
            self.flushes.give_up(wanted, exc.describe())

    def abandon_inflight(self, step: int, exc: BaseException | None = None) -> None:
        """The agent stops: the persist of ``step`` is given up (it failed with ``exc``, or was abandoned)."""
        if exc is not None:
            logger.error("persist of step %d to %s failed: %s", step, self.save_dir, exc)
        self.inflight = None
        if exc is not None:
            self.given_up = max(self.given_up, step)
        self.claims.release(lambda s: s <= step)

    # ranks waiting ---------------------------------------------------------------------------------------
    def answer(self, send: Send, *, force: bool = False) -> None:
        """Answer BYE waiters once nothing is being persisted or claimed (``force``: now), and FLUSH waiters
        whose step is on disk or given up. Not for the leader's staged steps: a rank's close() waits for its
        own node's shards only; the leader commits the step (or gives up after STAGE_WAIT) before it exits."""
        if self.flushes.bye_waiters and (force or not self.busy()):
            self.flushes.answer_byes(send, persisted=self.persisted, failure=self.failure_dict())
        self.flushes.answer(send, persisted=self.persisted, save_dir=self.save_dir, given_up=self.given_up,
                            failure=self.failure_dict(), job_failure=self.job_failure, job_committed=self.job_committed)

    # timelines --------------------------------------------------------------------------------------------
    def rewind(self, step: int, complete: Collection[int]) -> tuple[int | None, int]:
        """The job resumed at ``step``: steps after it are persisted again whatever the abandoned timeline
        reached. Returns (newest step on disk, newest step given up) as they were before."""
        before = (self.persisted, self.given_up)
        self.persisted, self.given_up = policy.floor_after_resume(complete, step, self.persisted, self.given_up)
        if self.last_passed > step:
            self.last_passed = -1
        return before


def _tracked_head(save_dir: Path) -> int | None:
    try:
        return wire_timeline.head([s for s, _ in layout.complete_iterations(save_dir)], layout.read_tracker(save_dir))
    except OSError as exc:
        # The store down or unreachable as the agent starts (a replacement agent mid-job): the snapshots in memory
        # still need an agent; persists try the store again, and the first one that works says what is there.
        logger.warning("cannot read what %s holds (%s): the newest step on disk is taken as unknown; persists try "
                       "again at the next due step", save_dir, exc)
        return None
