"""Which process owns a rank's slots: one small file per rank next to them, version 2.

``<runtime dir of the job>/rank-<rank:06d>.owner`` holds one JSON line: the pid and start time (seconds since
boot, ``procs.start_time``) of the process whose Checkpointer last took the rank, and its save_dir. A second job
started on the same save_dir would otherwise resume out of the first one's slots and write into them
while the first still trains (issue 11); the start time tells a live owner from a recycled pid. A dead
owner (a crash, a kill -9, a torchrun restart: the old workers are gone by then) is no owner at all,
so a restarted rank adopts the slots as before.

The files live in the job's runtime directory (per job and node, owner-only), not next to the slots in
/dev/shm: that directory is what the agent removes at a clean exit and ``easyckpt clean`` removes with
the slots; the CLI's ``clean`` and ``status`` read them to tell whether ranks of the job still live.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import time
from pathlib import Path

from easyckpt_wire import procs

OWNER_VERSION = 2   # 2: the start in seconds since boot (procs.start_time), not psutil's create_time
_LOCK_TIMEOUT = 5.0   # the claim's flock is held for one read and one write: microseconds
_OWNER_RE = re.compile(r"^rank-(?P<rank>\d{6})\.owner$")


class SaveDirInUseError(RuntimeError):
    """A live process of another run owns this rank's slots (the same save_dir, or job id, twice)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    pid: int
    start: float
    save_dir: str
    rank: int


def owner_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank-{rank:06d}.owner"


def is_owner_file(name: str) -> bool:
    return _OWNER_RE.match(name) is not None


def list_owner_files(job_dir: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    try:
        names = os.listdir(job_dir)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for name in names:
        match = _OWNER_RE.match(name)
        if match:
            found[int(match.group("rank"))] = job_dir / name
    return found


def parse(text: str, rank: int) -> Owner | None:
    """The owner recorded in ``text``, or None for a file that is empty, damaged or of another version."""
    try:
        record = json.loads(text)
        if record.get("v") != OWNER_VERSION:
            return None
        return Owner(pid=int(record["pid"]), start=float(record["start"]), save_dir=str(record["save_dir"]),
                     rank=rank)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def read_owner(path: Path, rank: int) -> Owner | None:
    try:
        return parse(path.read_text(encoding="utf-8"), rank)
    except FileNotFoundError:
        return None


def live_owners(job_dir: Path) -> list[Owner]:
    """The job's ranks on this node whose owning process is alive, by rank."""
    owners = []
    for rank, path in sorted(list_owner_files(job_dir).items()):
        owner = read_owner(path, rank)
        if owner is not None and procs.is_alive(owner.pid, owner.start):
            owners.append(owner)
    return owners


def conflict(recorded: Owner | None, *, pid: int, alive: bool) -> bool:
    """The decision, as a pure function: another process that still lives owns the rank."""
    return recorded is not None and recorded.pid != pid and alive


def claim(job_dir: Path, job_id: str, rank: int, save_dir: Path) -> Path:
    """Record this process as the owner of ``rank``'s slots, or raise SaveDirInUseError naming the live one.

    The check and the write happen under an exclusive flock of the owner file, so two processes that
    start at the same moment cannot both win."""
    path = owner_path(job_dir, rank)
    me = os.getpid()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: the owner file {path} stayed locked for {_LOCK_TIMEOUT:.0f}s "
                                       f"(owner claim timeout); another process of job {job_id} is claiming it "
                                       "right now") from None
                time.sleep(0.01)   # polling a lock held for microseconds, against the deadline
        recorded = parse(os.pread(fd, 4096, 0).decode("utf-8", "replace"), rank)
        if conflict(recorded, pid=me, alive=recorded is not None and procs.is_alive(recorded.pid, recorded.start)):
            assert recorded is not None
            raise SaveDirInUseError(
                f"rank {rank}: save_dir {save_dir} is in use by another live run: pid {recorded.pid} (save_dir "
                f"{recorded.save_dir}) owns rank {rank}'s snapshots (job {job_id}, recorded in {path}). Two runs on one "
                f"save_dir would overwrite each other's snapshots. Stop pid {recorded.pid} first, or give this run "
                f"its own save_dir (or its own EASYCKPT_JOB_ID and save_dir)")
        blob = json.dumps({"v": OWNER_VERSION, "pid": me, "start": procs.start_time(), "save_dir": str(save_dir),
                           "rank": rank}).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, blob, 0)
        return path
    finally:
        os.close(fd)   # drops the flock


def release(job_dir: Path, rank: int) -> None:
    """Forget this process as the owner (only if it still is: a later run may own the rank by now)."""
    path = owner_path(job_dir, rank)
    owner = read_owner(path, rank)
    if owner is not None and owner.pid == os.getpid():
        path.unlink(missing_ok=True)
