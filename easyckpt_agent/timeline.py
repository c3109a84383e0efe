"""The agent's side of timelines (invariant 10): a resume moves the abandoned iterations aside.

Ranks tell their node agent the step they resumed from (RESUME, after ``load()``). The agent that
commits iterations (the only one of a single-node job, the leader of a multi-node one) moves every
iteration newer than that step into ``save_dir/.abandoned-<time>/`` (one rename each, audited, never
deleted here) and points the tracker at the newest iteration at or below it; every agent forgets the
steps of the abandoned timeline, so the new timeline's steps are persisted again. The operation is
idempotent: every rank of the job sends the same step and only the first finds anything to move.

A persist may be in flight while a resume abandons its step; it publishes under the same lock and
checks first (``publishing``), so an abandoned step never becomes ``iteration_N`` nor the tracked one.
Rotation also runs under the lock and removes abandoned iterations before any of the current timeline.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from easyckpt_agent import policy
from easyckpt_agent.stages import drop_stage
from easyckpt_wire import health, layout, timeline
from easyckpt_wire.savedir import AuditLog, forget_health, remove_tracker, write_tracker
from easyckpt_wire.storage import StorageLike, open_storage

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Abandonment:
    resumed: int
    moved: list[int]          # steps moved aside by this call (empty when another rank's call did it)
    directory: Path | None    # where they went
    tracker: int | None       # what the tracker names afterwards


class DiskTimeline:
    def __init__(self, save_dir: StorageLike, audit: AuditLog) -> None:
        self.store = open_storage(save_dir)
        self.save_dir = save_dir
        self.audit = audit
        self.lock = threading.Lock()
        self.epoch = 0
        self._resumes: list[tuple[int, int]] = []   # (epoch, resumed step), the newest few

    def abandoned_since(self, epoch: int, step: int) -> bool:
        """Did a resume after ``epoch`` abandon ``step`` (a resume from an older step)?"""
        return any(e > epoch and resumed < step for e, resumed in self._resumes)

    @contextlib.contextmanager
    def publishing(self, step: int, epoch: int) -> Iterator[bool]:
        """Hold the lock while a persist that started at ``epoch`` publishes ``step``; yields whether the
        step still belongs to the current timeline."""
        with self.lock:
            yield not self.abandoned_since(epoch, step)

    def abandon_after(self, resumed: int, *, commits: bool) -> Abandonment:
        """A resume from ``resumed``: forget newer steps; with ``commits`` (this agent publishes iterations)
        move the newer iterations aside and point the tracker at the newest one left."""
        with self.lock:
            self.epoch += 1
            self._resumes = [*self._resumes[-15:], (self.epoch, resumed)]
            if not commits:
                complete = [s for s, _ in layout.complete(self.store)]
                return Abandonment(resumed, [], None, policy.tracker_after_resume(complete, resumed))
            return self._move_aside(resumed)

    def _move_aside(self, resumed: int) -> Abandonment:
        store = self.store
        on_disk = {step: key for step, key, complete in layout.iterations(store) if complete}
        victims = policy.abandoned_by_resume(on_disk, resumed)
        head = policy.tracker_after_resume(on_disk, resumed)
        # The tracker first: should the agent die between the two, a load already follows the new timeline
        # and the next resume moves the rest aside. Written again when it already names ``head`` but newer
        # iterations go aside: its record then tells a load that they were abandoned, not published by a persist
        # that died before the tracker (``easyckpt_wire.timeline.published_untracked``).
        if layout.tracker(store) != head or victims:
            if head is None:
                remove_tracker(store, self.audit, resumed=resumed,
                               reason=f"resumed at step {resumed}: no iteration at or below it on disk")
            else:
                write_tracker(store, head, self.audit)
        for step in layout.stage_steps(store):
            if step > resumed:
                drop_stage(store, step, self.audit, f"abandoned timeline: the job resumed at step {resumed}")
        if not victims:
            return Abandonment(resumed, [], None, head)
        target = self._new_abandoned_dir()
        moves = [(on_disk[step], f"{target}/{on_disk[step]}") for step in victims]
        for step, (source, dest) in zip(victims, moves):
            self.audit.record("abandon", store.where(source), step=step, to=store.where(dest), resumed=resumed,
                              reason=f"the job resumed at step {resumed}: step {step} belongs to the abandoned "
                                     "timeline")
        store.move(moves)
        forget_health(store, self.audit)
        logger.warning("the job resumed at step %d: moved iterations %s of the abandoned timeline to %s "
                       "(rotation removes them first; delete them by hand if you do not need them)",
                       resumed, victims, store.where(target))
        return Abandonment(resumed, victims, Path(store.where(target)), head)

    def _new_abandoned_dir(self) -> str:
        name = timeline.abandoned_dirname()
        for attempt in range(100):
            key = name if attempt == 0 else f"{name}-{attempt}"
            try:
                self.store.make_dir(key)
            except FileExistsError:
                continue
            self.audit.record("mkdir", self.store.where(key), reason="iterations of an abandoned timeline")
            return key
        raise FileExistsError(f"{self.store.where()}: cannot make a new {name} directory (100 taken)")

    def rotate(self, max_ckpt_num: int, keep: int) -> list[tuple[str, int]]:
        """Delete the iterations beyond ``max_ckpt_num``, abandoned ones first; never ``keep``, the tracked
        step, nor the newest of the current timeline. Returns (directory name, step) of each deleted."""
        store = self.store
        with self.lock:
            current = dict(layout.complete(store))
            abandoned = {(name, step): key for name, step, key in timeline.abandoned(store)}
            tracked = layout.tracker(store)
            keep_steps = policy.rotation_keep({keep} | ({tracked} if tracked is not None else set()),
                                              current, self._unhealthy(current))
            owed = layout.holds(store) & set(current)
            if owed:   # TrainerWrapper still owes their checkpoint-N (it may have died exporting them)
                logger.debug("rotation spares iterations %s: their export is still owed", sorted(owed))
                keep_steps |= owed
            gone_abandoned, gone_current = policy.rotation_victims(sorted(current), sorted(abandoned),
                                                                   max_ckpt_num=max_ckpt_num, keep=keep_steps)
            trash: list[str] = []
            reason = f"rotation to max_ckpt_num={max_ckpt_num}"
            for name_step in gone_abandoned:
                trash.append(self._to_trash(abandoned[name_step], name_step[1], reason + " (abandoned timeline first)"))
            for step in gone_current:
                trash.append(self._to_trash(current[step], step, reason))
            for name in {name for name, _ in gone_abandoned}:
                if not store.entries(name):
                    self.audit.record("delete", store.where(name), reason="no abandoned iteration left in it")
                    store.delete_tree(name)
        if gone_current:
            forget_health(store, self.audit)
        for key in trash:   # each vanished at once (retire); the slow part runs outside the lock
            store.delete_tree(key, best_effort=True)
        for (name, step) in gone_abandoned:
            logger.info("deleted %s/%s (rotation: abandoned timeline first)", name, layout.iteration_dirname(step))
        for step in gone_current:
            logger.info("deleted %s (rotation to max_ckpt_num=%d)", store.where(current[step]), max_ckpt_num)
        return [*gone_abandoned, *(("", step) for step in gone_current)]

    def _unhealthy(self, current: dict[int, str]) -> set[int]:
        """Steps of ``current`` known to be unhealthy: from ``health_ckpts.json``, or (it is unreadable)
        from each iteration's ``metadata.json``."""
        try:
            entries = health.read_health(self.store)
            return set(health.unhealthy_steps(entries or []))
        except health.HealthFileError as exc:
            logger.warning("%s; rotation reads each iteration's %s instead", exc, layout.METADATA)
        bad = set()
        for step, key in current.items():
            try:
                verdict = layout.metadata(self.store, key).get("health")
            except layout.CheckpointFormatError as exc:
                logger.warning("%s: %s", self.store.where(key), exc)
                continue
            if isinstance(verdict, dict) and verdict.get("healthy") is False:
                bad.add(step)
        return bad

    def _to_trash(self, key: str, step: int, reason: str) -> str:
        self.audit.record("delete", self.store.where(key), step=step, reason=reason)
        return self.store.retire(key)
