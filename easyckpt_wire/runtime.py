"""The job's runtime directory (``protocol.runtime_dir``: agent socket, lock, pid, log, rank owner files):
taking the agent lock, and removing the directory of a job that is over.

Shared by the agent (which removes its directory at a clean exit) and the ``easyckpt`` CLI (``status``
prunes stale directories, ``clean`` removes a job's). Removal happens under the agent lock, and the lock
file goes last; whoever takes the lock checks that the file it locked is still the one at the path.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from easyckpt_wire import protocol
from easyckpt_wire.owner import is_owner_file

# What an agent or a rank puts in a runtime directory; anything else makes ``remove_runtime_dir`` keep it.
RUNTIME_FILES = frozenset({"agent.sock", "agent.lock", "agent.pid", "agent.port", "agent.log", "commits.fifo"})
STALE_AFTER = 60.0               # a directory untouched this long, with no agent and no slots, is over
LOG_RETENTION = 7 * 24 * 3600.0  # a kept agent.log (a run that warned) goes after a week


def take_lock(job_id: str) -> tuple[Path, int] | None:
    """The job's runtime dir and its agent lock (an open fd, flocked), or None when another agent holds it.

    An agent that ended cleanly removes its runtime dir while holding the lock, and ``easyckpt status`` and
    ``clean`` remove stale ones the same way: a lock taken on a file that was unlinked meanwhile is no
    lock, so the path is checked against the locked file and the whole thing is tried again."""
    for _ in range(100):
        job_dir = protocol.runtime_dir(job_id)
        try:
            lock_fd = os.open(protocol.agent_lock_path(job_dir), os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            continue   # the directory went away between its creation and the open
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            return None
        try:
            same = os.stat(protocol.agent_lock_path(job_dir)).st_ino == os.fstat(lock_fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return job_dir, lock_fd
        os.close(lock_fd)
    raise RuntimeError(f"job {job_id}: its runtime directory kept vanishing under the agent lock")


def remove_runtime_dir(job_dir: Path, *, keep: set[str]) -> bool:
    """Remove the job's runtime files (the caller holds the agent lock; the lock file goes last), and the
    directory when nothing in ``keep`` is left in it. True if the directory is gone."""
    names = sorted(os.listdir(job_dir))
    for name in names:
        if name not in keep and name != "agent.lock" and (name in RUNTIME_FILES or is_owner_file(name)):
            (job_dir / name).unlink(missing_ok=True)   # never anything that is not ours
    (job_dir / "agent.lock").unlink(missing_ok=True)   # a later agent's take_lock sees the inode change
    if any(name in keep or not (name in RUNTIME_FILES or is_owner_file(name)) for name in names):
        return False
    try:
        job_dir.rmdir()
    except OSError:
        return False
    return True


def lock_existing(job_dir: Path) -> int | None:
    """The agent lock of an existing job directory, flocked (an fd), or None when an agent holds it or the
    directory is gone. For the CLI: it never creates a directory."""
    try:
        fd = os.open(protocol.agent_lock_path(job_dir), os.O_RDWR)
    except FileNotFoundError:
        try:   # a directory without a lock file (an agent that never started): take a fresh one
            fd = os.open(protocol.agent_lock_path(job_dir), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except (FileExistsError, FileNotFoundError):
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def newest_mtime(job_dir: Path) -> float:
    newest = 0.0
    try:
        newest = job_dir.stat().st_mtime
        with os.scandir(job_dir) as entries:
            for entry in entries:
                try:
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
                except FileNotFoundError:
                    continue
    except FileNotFoundError:
        pass
    return newest


def prunable(names: list[str], *, age: float, agent_running: bool, slots: int, live_ranks: int) -> bool:
    """The decision, as a pure function: a runtime directory of a job that is over (no agent, no slot, no
    live rank) and was left alone long enough; one that kept its log (a run that warned) stays a week."""
    if agent_running or slots or live_ranks:
        return False
    if any(not (name in RUNTIME_FILES or is_owner_file(name)) for name in names):
        return False   # holds something that is not ours
    kept_log = set(names) <= {"agent.log"} and "agent.log" in names
    return age >= (LOG_RETENTION if kept_log else STALE_AFTER)
