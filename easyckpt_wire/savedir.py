"""The agent's writes to a save_dir that are not an iteration's files, written once over ``Storage`` so that
they hold alike on every implementation (invariants 3, 5, 10, 13): the audit log, the tracker, the health
index, and the clean-up of what dead writers left.

Every write and delete is written to the audit log first (invariant 5). The tracker is replaced atomically
and only after the iteration it names is published (invariant 3). Nothing here reads tensors: the library's
readers are in ``easyckpt_wire.layout`` (names, iterations, tracker) and ``easyckpt.storage``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from easyckpt_wire import health, layout
from easyckpt_wire.health import RankHealth
from easyckpt_wire.storage import Storage, StorageLike, open_storage

logger = logging.getLogger(__name__)


class AuditLog:
    """Append-only JSON lines in ``save_dir/easyckpt-audit.log``, one per write or delete, each durable before
    the operation it announces.

    On a storage whose appends rewrite the object (an object store), a line that names a ``node`` (a node's own
    part of a multi-node persist) goes to that node's log, ``easyckpt-audit.node-<id>.log``: every node writes
    those lines at the same moment of each persist, and in one object they would race (measured on a local moto
    server, 2026-12-05: one line from each of 32 / 64 / 128 writers at once took 1.6 / 6.6 / 23.6 s, against
    0.17 s for 4). The main log keeps every line of the single writer of a step (the leader's commit, the
    tracker, rotation, timelines), which is all that the readers of the log (``timeline.published_untracked``)
    need. On POSIX every line stays in the main log."""

    def __init__(self, save_dir: StorageLike) -> None:
        self.store = open_storage(save_dir)
        self.path = self.store.where(layout.AUDIT_LOG)

    def record(self, op: str, path: str | os.PathLike[str], **fields: Any) -> None:
        """``path``: where the operation happens, as ``Storage.where`` names it (or a path)."""
        line = json.dumps({"time": time.time(), "pid": os.getpid(), "op": op, "path": os.fspath(path), **fields})
        node = fields.get("node")
        key = layout.node_audit_log(str(node)) if node is not None and not self.store.shared_appends else layout.AUDIT_LOG
        self.store.append(key, (line + "\n").encode())


def write_tracker(save_dir: StorageLike, step: int, audit: AuditLog) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``step`` (atomically), after its iteration is published."""
    store = open_storage(save_dir)
    store.put(layout.TRACKER, f"{step}\n".encode())
    audit.record("tracker", store.where(layout.TRACKER), step=step)


def remove_tracker(save_dir: StorageLike, audit: AuditLog, **fields: Any) -> bool:
    """Remove the tracker (a resume below every iteration on disk); False when there was none."""
    store = open_storage(save_dir)
    if not store.exists(layout.TRACKER):
        return False
    audit.record("tracker-remove", store.where(layout.TRACKER), **fields)
    store.delete(layout.TRACKER)
    return True


def record_health(save_dir: StorageLike, step: int, verdict: RankHealth, audit: AuditLog) -> None:
    """After the tracker names ``step``: rewrite ``health_ckpts.json`` (atomically) with its entry, keeping
    only entries of iterations still on disk. Only when a rank reported metrics or the file exists already:
    a job that does not use health sees no new file. A failure here is logged; the step is durable anyway."""
    store = open_storage(save_dir)
    path = store.where(health.HEALTH_FILE)
    if not verdict.reporting and not store.exists(health.HEALTH_FILE):
        return
    try:
        try:
            entries = health.read_health(store) or []
        except health.HealthFileError as exc:
            logger.warning("%s; it is rewritten from this persist on (older entries are lost)", exc)
            entries = []
        kept = [s for s, _ in layout.complete(store)]
        new = health.entry_for(step, layout.iteration_dirname(step), verdict)
        health.write_health(store, health.updated(entries, new, kept))
        audit.record("health", path, step=step, healthy=verdict.healthy, reasons=list(verdict.reasons))
    except OSError as exc:
        logger.warning("cannot update %s after step %d: %s", path, step, exc)
    if not verdict.healthy:
        logger.warning("step %d is unhealthy: %s (recorded in %s)", step, "; ".join(verdict.reasons), path)


def forget_health(save_dir: StorageLike, audit: AuditLog) -> None:
    """Drop the entries of iterations no longer on disk (rotation, a resume's moves) from an existing
    ``health_ckpts.json``."""
    store = open_storage(save_dir)
    path = store.where(health.HEALTH_FILE)
    try:
        entries = health.read_health(store)
        if entries is None:
            return
        kept = [s for s, _ in layout.complete(store)]
        left = health.updated(entries, None, kept)
        if len(left) != len(entries):
            health.write_health(store, left)
            audit.record("health", path, dropped=sorted({e.step for e in entries} - {e.step for e in left}))
    except (OSError, health.HealthFileError) as exc:
        logger.warning("cannot update %s: %s", path, exc)


def _ours_only(store: Storage, key: str) -> bool:
    """Whether every file of the marker-less iteration ``key`` has one of our names (then it is ours to delete)."""
    return all(layout.RANK_FILE_RE.match(e.name) or e.name == layout.COMMON for e in store.entries(key))


def clean_leftovers(save_dir: StorageLike, audit: AuditLog) -> list[str]:
    """Remove what dead writers left (the storage's ``leftovers``: on POSIX their temporary and trash
    directories, an aside copy put back when its iteration is missing) and iteration directories without a
    commit marker whose files are all ours; returns where each was. Anything else is left alone."""
    store = open_storage(save_dir)
    removed: list[str] = []
    for leftover in store.leftovers():
        match = layout.ITERATION_RE.match(leftover.final)
        if match is None:
            continue   # not an iteration's: not ours to judge
        audit.record("rename" if leftover.restore else "delete", store.where(leftover.key), step=int(match.group(1)),
                     reason=leftover.reason)
        store.settle(leftover)
        removed.append(store.where(leftover.key))
    for step, key, has_marker in layout.iterations(store):
        if has_marker:
            continue
        if any(e.name.startswith(layout.LEASE_PREFIX) for e in store.entries(key)):
            logger.info("%s is being written (a live writer holds its lease): left alone", store.where(key))
            continue
        if _ours_only(store, key):
            audit.record("delete", store.where(key), step=step, reason="incomplete: no commit marker")
            store.delete_tree(key)
            removed.append(store.where(key))
        else:
            logger.warning("%s has no %s but holds files that are not ours: left alone", store.where(key),
                           layout.METADATA)
    for where in removed:
        logger.info("cleaned up %s", where)
    return removed


def clean_leftover_paths(save_dir: Path, audit: AuditLog) -> list[Path]:
    """``clean_leftovers`` of a POSIX save_dir, as paths."""
    return [Path(where) for where in clean_leftovers(save_dir, audit)]
