"""A process's identity that no change of the wall clock moves: its pid and its start in seconds since boot.

A rank's snapshots, its HELLO and its owner file name the process that wrote them by (pid, start), so that a
recycled pid is not taken for the rank. psutil's ``create_time()`` cannot be that start: it is seconds since
the epoch, the kernel's start tick plus a boot time that ``/proc/stat`` derives from the wall clock at each
read, in whole seconds, and psutil 7.1+ reads it afresh at each call (psutil #2541). An NTP correction, a VM
resumed and re-synced, or only a slewed clock crossing a second, moves every process's ``create_time`` while it
runs: a CI run of this suite saw live processes taken for recycled pids that way, and on a node that runs for
days an agent would declare its live ranks dead. The start tick of ``/proc/<pid>/stat`` never changes.
"""
from __future__ import annotations

import os

import psutil

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SLACK = 0.5 / _CLK_TCK   # equal starts are the same tick: the slack only absorbs float rounding
_HAS_PROC = os.path.exists("/proc/self/stat")


def _stat(pid: int) -> tuple[bytes, float]:
    """(state letter, start in seconds since boot) of ``pid``; ProcessLookupError when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    # Field 2, the command name, is in parentheses and may itself hold spaces and parentheses: the fields after it
    # start past its last ')'. There, field 3 (the state) is index 0 and field 22 (starttime, in ticks) index 19.
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0], int(fields[19]) / _CLK_TCK


def start_time(pid: int | None = None) -> float:
    """When ``pid`` (by default this process) started: seconds since boot on Linux (psutil's ``create_time``
    where there is no ``/proc``). ProcessLookupError when there is no such process."""
    pid = os.getpid() if pid is None else pid
    if not _HAS_PROC:
        try:
            return float(psutil.Process(pid).create_time())
        except psutil.NoSuchProcess:
            raise ProcessLookupError(pid) from None
    return _stat(pid)[1]


def is_alive(pid: int, start: float | None) -> bool:
    """Whether ``pid`` is a live process that started at ``start`` (any start when None): a zombie, a pid taken by
    another process since, or one this user may not see is not."""
    if not _HAS_PROC:
        try:
            proc = psutil.Process(pid)
            if start is not None and abs(proc.create_time() - start) > 1.0:
                return False
            return bool(proc.status() != psutil.STATUS_ZOMBIE)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
    try:
        state, started = _stat(pid)
    except (ProcessLookupError, PermissionError):
        return False
    if start is not None and abs(started - start) > _SLACK:
        return False
    return state not in (b"Z", b"X")   # zombie, dead
