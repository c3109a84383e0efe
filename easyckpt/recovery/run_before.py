"""What a run says about the run before it on the same save_dir, when that is not what the user may think.

Two mistakes look alike from outside: starting a new run into a save_dir (or a node's memory) that holds a newer
step of an earlier one, and deleting save_dir to start over while the node's agent still keeps the crashed run's
snapshots. In both, a resume takes the earlier run's state; neither is refused (a resume from memory may be the
only copy of the state), and both are said once by the rank that can see it, with the fix.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from easyckpt.storage import marked_steps
from easyckpt_wire import layout
from easyckpt_wire.storage import is_url

logger = logging.getLogger(__name__)


def check_unloaded_start(save_dir: Path, in_memory: Collection[int], step: int) -> None:
    """Rank 0 of a run that never called load() (a fresh start by choice, or a forgotten load) at its first
    ``step``: save_dir or this node's memory (``in_memory``, the steps of its slots) holding a newer step of an
    earlier run means a resume before this run passes that step takes the earlier run's state."""
    newest = max([*marked_steps(save_dir), *in_memory], default=None)
    if newest is not None and newest > step:
        logger.warning("easyckpt rank 0: this run starts at step %d without load(), and %s (or this node's memory) "
                       "holds step %d of an earlier run: a resume before this run passes step %d takes that run's "
                       "state. To continue it, load() first (HF: resume_from_checkpoint=True; Lightning: "
                       "ckpt_path=\"last\"); for a new run, use a new save_dir", step, save_dir, newest, newest)


def check_save_dir_kept(save_dir: Path, persisted: int | None, *, rank: int, step: int | None) -> None:
    """A node's first rank, after a resume from memory: a save_dir that lost what this job persisted (the newest
    step the agent put on disk, ``persisted``; the save_dir's audit log is gone with it) was deleted (``rm -rf``
    to start over) or replaced while the agent kept the crashed run's snapshots. Memory still wins (a storage
    mount that is not up yet must not cost the state), but a user who meant a fresh start is told."""
    if persisted is None or is_url(save_dir) or (save_dir / layout.AUDIT_LOG).exists():
        return
    logger.warning("easyckpt rank %d: resumed at step %s from this node's memory, but %s no longer holds what this "
                   "job persisted (up to step %d; its %s is gone too): it was deleted or replaced while the agent "
                   "kept the snapshots of the run before. This run continues that run. To start over instead, stop "
                   "it and use a new save_dir, or free the memory with `easyckpt clean %s` once the job's agent has "
                   "exited (`easyckpt status %s` says when)", rank, step, save_dir, persisted, layout.AUDIT_LOG,
                   save_dir, save_dir)
