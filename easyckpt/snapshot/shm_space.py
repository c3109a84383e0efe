"""Room for a rank's slots in shared memory: which file system holds them, how many slots fit, the refusal that
names the fix when they do not, and the reservation of a slot's pages.

Containers often give /dev/shm 64 MiB. A snapshot that does not fit is refused before any byte is copied, with
the ``--shm-size`` to ask for; a snapshot that fits two slots but not the default count takes fewer, said once and
loudly; the pages of every slot are reserved when it is sized, because a tmpfs that fills up later would SIGBUS the
copy instead of failing it.
"""
from __future__ import annotations

import errno
import logging
import math
import os
from pathlib import Path

from easyckpt.config import MIN_SLOTS
from easyckpt_wire.shm import MEMORY_FILESYSTEMS, filesystem_type, format_bytes

logger = logging.getLogger(__name__)


class ShmSpaceError(RuntimeError):
    """The shared-memory file system cannot hold the snapshot."""


_checked_dirs: set[str] = set()   # shm dirs whose file system this process has judged (said once)


def warn_if_not_memory(directory: Path, *, rank: int, first_local: bool) -> None:
    """Say once per process and directory when the slots would not live in memory (a disk file system), and
    what that costs; the node's first rank at WARNING, the others at INFO. Nothing is refused: it works."""
    key = os.path.realpath(directory)
    if key in _checked_dirs:
        return
    _checked_dirs.add(key)
    kind = filesystem_type(directory)
    if kind is None or kind in MEMORY_FILESYSTEMS:
        return
    logger.log(logging.WARNING if first_local else logging.INFO,
               "rank %d: shm_dir %s (EASYCKPT_SHM_DIR or shm_dir=) is on %s, not on a tmpfs: the snapshots meant for "
               "memory are written to that disk by the kernel's writeback, every snapshot, so each one costs its size "
               "in disk bandwidth (and copies stall when writeback falls behind) instead of being near-free. Point "
               "it at a tmpfs such as /dev/shm (said once)", rank, directory, kind)


def free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def fitting_count(*, default: int, slot_bytes: int, local_ranks: int, room: int) -> int | None:
    """How many slots per rank to use when every local rank's ``default`` slots of ``slot_bytes`` may not fit in
    ``room`` bytes (free plus what this job already has there): the most that fit, down to MIN_SLOTS; None when
    not even MIN_SLOTS fit (the free-space check then refuses the snapshot, and the count is judged afresh later)."""
    if room < MIN_SLOTS * slot_bytes * local_ranks:
        return None
    return next((n for n in range(default, MIN_SLOTS, -1) if room >= n * slot_bytes * local_ranks), MIN_SLOTS)


def say_count(*, rank: int, directory: Path, count: int, default: int, slot_bytes: int, local_ranks: int,
              free: int, room: int, loud: bool) -> None:
    """Log the count ``fitting_count`` chose: INFO when it is the default, else what fewer slots cost and the fix
    (at WARNING when ``loud``: the node's first rank)."""
    wanted = default * slot_bytes * local_ranks
    if count == default:
        logger.info("rank %d: %d slots of %s each (%s for %d local ranks; %s free in %s)", rank, default,
                    format_bytes(slot_bytes), format_bytes(wanted), local_ranks, format_bytes(free), directory)
        return
    suggest = math.ceil(wanted * 1.25 / (1 << 30))
    cost = fewer_slots_cost(count)
    (logger.warning if loud else logger.info)(
        "rank %d: %s has %s free, %d slots per rank need %s (%d local ranks x %d x %s): using %d slots. %s; run "
        "the container with --shm-size=%dg (or set EASYCKPT_SLOTS=%d to choose this)", rank, directory,
        format_bytes(room), default, format_bytes(wanted), local_ranks, default, format_bytes(slot_bytes), count,
        cost[0].upper() + cost[1:], suggest, count)


def fewer_slots_cost(count: int) -> str:
    """What a rank gives up with ``count`` slots, fewer than its default (3 on one node, 4 across nodes: the
    bounds of invariant 9 are for those). Three across nodes leave the agent two holds for the persisted step, the
    job-safe step, the node-safe step and a due step being decided; the simulation (``benchmarks/cluster_sim.py``)
    then finds rank kills that cost 3 to 5 steps (``tests/unit/test_agreement.py``, KNOWN_MISSES)."""
    if count <= MIN_SLOTS:
        return "a kill may then cost the time of a persist plus two snapshot intervals instead of two intervals"
    return ("a rank kill may then cost more than two snapshot intervals while persists outlast a step, and a node "
            "loss resume further back while a backup or a persist runs")


def say_asked_count(*, rank: int, count: int, default: int, multi_node: bool, loud: bool) -> None:
    """Say once, when a rank is asked for fewer slots (``slots=`` or EASYCKPT_SLOTS) than its default, what that
    costs and the fix: at WARNING on the node's first rank, else at INFO. Nothing is refused: it works."""
    if count >= default:
        return
    where = "across nodes" if multi_node else "on one node"
    cost = fewer_slots_cost(count)
    logger.log(logging.WARNING if loud else logging.INFO,
               "rank %d: %d slots per rank asked for (slots= or EASYCKPT_SLOTS), fewer than the %d a job %s takes by "
               "default: %s. Leave slots unset (shared memory permitting) or set EASYCKPT_SLOTS=%d", rank, count,
               default, where, cost, default)


def check_space(directory: Path, *, rank: int, needed: int, slot_bytes: int, count: int, full_count: int,
                local_ranks: int) -> str:
    """Raise ShmSpaceError, naming the ``--shm-size`` to ask for, when ``directory`` has less than ``needed`` bytes
    free for rank ``rank``'s ``count`` slots of ``slot_bytes``; ``full_count`` is the count the job asked for (or
    the default), which the suggested size covers. Returns that advice, for :func:`reserve`."""
    free = free_bytes(directory)
    advice = shm_size_advice(slot_bytes=slot_bytes, full_count=full_count, local_ranks=local_ranks)
    if needed <= free:
        return advice
    two_fit = count > MIN_SLOTS and MIN_SLOTS * slot_bytes * local_ranks <= free
    raise ShmSpaceError(
        f"{directory} has {format_bytes(free)} free, the snapshot of rank {rank} needs {format_bytes(needed)} more "
        f"({count} slots of {format_bytes(slot_bytes)}): {advice}"
        + (f" or EASYCKPT_SLOTS={MIN_SLOTS}" if two_fit else "")
    )


def shm_size_advice(*, slot_bytes: int, full_count: int, local_ranks: int) -> str:
    """The fix for a shared memory too small for the node's slots: the ``--shm-size`` that holds them, with the sum."""
    total = slot_bytes * full_count * local_ranks
    suggest = math.ceil(total * 1.25 / (1 << 30))
    return (f"run the container with --shm-size={suggest}g ({full_count} slots per rank x {local_ranks} local rank(s) "
            f"x {format_bytes(slot_bytes)} = {format_bytes(total)}, plus room), or set EASYCKPT_SHM_DIR to a larger "
            "tmpfs")


def reserve(fd: int, path: Path, size: int, *, rank: int, advice: str | None = None) -> None:
    """Size the slot file ``fd`` (at ``path``) to ``size`` bytes and reserve (and touch) every page now; on a full
    file system the file keeps its old size and ShmSpaceError names the fix (``advice``, from
    :func:`shm_size_advice`). The free-space check before it judges each rank alone, so the node's ranks sizing
    their slots at once can each pass it and then fill the file system together: this says how full it is."""
    previous = os.fstat(fd).st_size
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return   # no fallocate on this file system: the slot keeps its new size, its pages come on first touch
        os.ftruncate(fd, previous)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            stats = os.statvfs(path.parent)
            raise ShmSpaceError(
                f"{path}: cannot reserve {format_bytes(size)} for rank {rank}: {exc.strerror} ({path.parent}: "
                f"{format_bytes(stats.f_bavail * stats.f_frsize)} free of {format_bytes(stats.f_blocks * stats.f_frsize)}"
                f"); " + (advice or "run the container with a larger --shm-size, or set EASYCKPT_SHM_DIR to a larger "
                                    "tmpfs")
            ) from None
        raise
