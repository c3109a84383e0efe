"""Persister, single node: committed shared-memory slots -> one durable ``iteration_N``, through the save_dir's
``Storage`` (``easyckpt_wire.storage``).

The rank files are written into a pending iteration (``easyckpt_agent.rankfiles``, the byte path), then
``common.json`` and last the commit marker (``easyckpt_agent.commit.seal``); the iteration is published in one step
(POSIX: a rename of its temporary directory, the parent fsynced) and only then is the tracker replaced
(invariant 3). Every write and delete is written to the audit log first (invariant 5). Rotation and the
moves of a resume's abandoned iterations live in ``easyckpt_agent.timeline`` (invariant 10); the multi-node stage
protocol in ``easyckpt_agent.stages``.

The names the agent imports from here (``persist``, ``persist_shards``, ``AuditLog``...) stay importable from
here whichever module holds them now.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from easyckpt_agent.commit import (  # noqa: F401  (the agent's names, importable from here)
    PersistFailed,
    PersistStats,
    StepAbandoned,
    check_space,
    describe,
    enough_space,
    failure,
    seal,
)
from easyckpt_agent.rankfiles import (  # noqa: F401
    ABORT,
    PERSIST_MBPS_ENV,
    Own,
    PersistAborted,
    RankSnapshot,
    bytes_needed,
    own_shards,
    stored_by,
    write_rank_files,
)
from easyckpt_agent.stages import commit_stage, drop_own_shards, drop_stage, persist_shards, stage_progress, stage_steps  # noqa: F401
from easyckpt_wire import health as wire_health
from easyckpt_wire import layout
from easyckpt_wire.faults import fault_point
from easyckpt_wire.savedir import AuditLog, clean_leftovers, forget_health, record_health, write_tracker  # noqa: F401
from easyckpt_wire.storage import Pending, Storage, StorageLike, open_storage

logger = logging.getLogger(__name__)

BACKGROUND_NICE = 10   # set by the agent's CLI (--nice)


def lower_priority() -> None:
    """Thread initializer for the agent's bulk work (persist, hashing, backups): only these threads run at
    a lower CPU priority (Linux nice is per thread and inherited by the threads they start), so that
    the loop that declares safe steps answers ranks at once even when training takes every core."""
    if BACKGROUND_NICE:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
        except OSError as exc:   # not permitted here: the work still runs, at the caller's priority
            logger.debug("cannot lower this thread's priority: %s", exc)


def free_bytes(save_dir: StorageLike) -> int | None:
    """Bytes an unprivileged writer may still use in ``save_dir`` (None: its storage does not say)."""
    return open_storage(save_dir).free_bytes()


# save_dirs (``Storage.where()``) where a failed persist could not remove its pending copy (an object store that
# stopped answering): the next persist there removes what it left, before it writes anything.
_LEFT: set[str] = set()


def _settle_left(store: Storage, audit: AuditLog) -> None:
    where = store.where()
    if where not in _LEFT:
        return
    try:
        removed = clean_leftovers(store, audit)
    except OSError as exc:
        logger.warning("could not yet remove what a failed persist left in %s: %s", where, exc)
        return
    _LEFT.discard(where)
    logger.info("removed what a failed persist left in %s: %s", where, ", ".join(removed) or "nothing")


def _discard(store: Storage, pending: Pending, step: int, audit: AuditLog) -> None:
    """Remove a failed persist's pending iteration; the audit line is best effort (the disk may be full or
    read-only: the failure itself is what must be reported, not a second one)."""
    if not pending.exists():
        return
    try:
        audit.record("delete", pending.where, step=step, reason="persist failed")
    except OSError:
        pass
    pending.discard()
    if pending.exists():
        _LEFT.add(store.where())
        logger.warning("could not remove the failed persist's %s; the next persist removes it", pending.where)


def _fill(pending: Pending, step: int, snapshots: list[RankSnapshot], threads: int) -> int:
    """Every rank's safetensors files, common.json, and last the commit marker; returns tensor bytes."""
    world_size = snapshots[0].meta.world_size
    ranks_meta, common, nbytes = write_rank_files(pending, step, snapshots, threads)
    seal(pending, step, world_size, ranks_meta, common, nbytes,
         wire_health.combine({s.rank: s.meta.health for s in snapshots}))
    return nbytes


def publish(store: Storage, pending: Pending, step: int, audit: AuditLog) -> str | None:
    """Publish ``pending`` as ``iteration_<step>``, replacing (audited) a copy of the step already there (a
    tracker that lagged a crash); returns the key of the replaced copy, for ``delete_tree``."""
    final = layout.iteration_dirname(step)
    if layout.committed(store, final):
        audit.record("delete", store.where(final), step=step, reason="replaced by a new persist of the same step")
    return pending.publish()


def persist(save_dir: StorageLike, step: int, snapshots: list[RankSnapshot], audit: AuditLog, threads: int = 2,
            publishing: Callable[[int], contextlib.AbstractContextManager[bool]] | None = None) -> PersistStats:
    """Write ``iteration_<step>`` atomically from the given ranks' slots. An OSError (a full or read-only
    disk) comes out as PersistFailed, after the pending iteration is removed.

    ``publishing(step)``: held while the iteration and the tracker are published; yields False when a
    resume abandoned the step meanwhile (invariant 10): the copy is then removed and ``StepAbandoned``
    raised instead."""
    store = open_storage(save_dir)
    started = time.monotonic()
    needed, free = check_space(store, step, snapshots)
    final = layout.iteration_dirname(step)
    pending: Pending | None = None
    published = False
    trash = None
    failed: PersistFailed | None = None
    try:
        _settle_left(store, audit)
        pending = store.begin(final)
        audit.record("write-begin", pending.where, step=step)
        nbytes = _fill(pending, step, snapshots, threads)
        with publishing(step) if publishing is not None else contextlib.nullcontext(True) as current:
            if not current:
                audit.record("delete", pending.where, step=step, reason="a resume abandoned this step while it was "
                             "persisted")
                pending.discard()
                raise StepAbandoned(f"step {step} was abandoned by a resume while it was persisted: not published")
            # Recorded before the rename (invariant 5: the log first): a persist killed just after it still vouches
            # for its iteration (timeline.published_untracked), and one killed before it names an iteration that is
            # not complete, which nothing loads
            audit.record("write", store.where(final), step=step, bytes=nbytes)
            trash = publish(store, pending, step, audit)
            published = True
            fault_point("agent.persist.after_publish", step=step)
            fault_point("agent.persist.before_tracker", step=step)
            write_tracker(store, step, audit)
    except BaseException as exc:
        if pending is not None and not published:
            _discard(store, pending, step, audit)
        failed = failure(exc, step, pending.where if pending is not None else store.where(), needed, free)
        if failed is None:
            raise
    if failed is not None:
        raise failed   # outside the handler: no chained OSError (nor its frames) rides along
    if trash is not None:
        store.delete_tree(trash, best_effort=True)
    record_health(store, step, wire_health.combine({s.rank: s.meta.health for s in snapshots}), audit)
    return PersistStats(step, store.where(final), nbytes, time.monotonic() - started)
