"""Named fault points: the tests kill a real process (SIGKILL, no cleanup) at an exact protocol step.

``EASYCKPT_FAULT`` holds ``point`` or ``point@step`` or ``point@step#rank`` (``#rank`` alone works
too), optionally followed by ``:stop`` or ``:hold``; with ``EASYCKPT_FAULT_ONCE=path`` it fires only once
across processes, and with ``EASYCKPT_FAULT_ARM=path`` only while that file exists (so a long-lived agent
can carry a fault that a test arms at the right moment). When the running code reaches a matching
:func:`fault_point`, the process sends itself SIGKILL, which is exactly what ``kill -9`` does from
outside, or with ``:stop`` SIGSTOP (a hung process), but at a place a test can name instead of at a
moment it would have to guess with a sleep. ``:hold`` (which needs ``EASYCKPT_FAULT_ARM``) stops only the
thread that reached the point, until the test removes the arm file: a persist that stays in flight for as
long as a test needs, while the rest of the process goes on (a throttled persist does that only for as
long as the machine's speed lets it).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import time

logger = logging.getLogger(__name__)

ENV = "EASYCKPT_FAULT"
ONCE_ENV = "EASYCKPT_FAULT_ONCE"  # a path: the fault fires only in the process that creates it first
ARM_ENV = "EASYCKPT_FAULT_ARM"    # a path: the fault fires only while it exists
HOLD_LIMIT = 300.0                # seconds a ':hold' waits for its arm file to go before it lets the thread go on
# Every point the code fires, and where: the parser refuses any other name, so a misspelled point in a
# test fails loudly instead of never firing (and the test silently checking nothing).
POINTS: dict[str, str] = {
    "stager.mid_copy": "rank: half-way through copying a snapshot into its slot",
    "stager.before_commit": "rank: every byte copied, the slot not yet committed",
    "agent.start": "agent: its arguments taken, before its lock (it dies before serving, every time it is started)",
    "agent.persist.after_file": "agent: one file of the iteration written",
    "agent.persist.before_marker": "agent: every file written, metadata.json (the completion marker) not yet",
    "agent.persist.after_publish": "agent: the iteration renamed into place, nothing else done since",
    "agent.persist.before_tracker": "agent: the iteration renamed into place, the tracker not yet updated",
    "agent.replica.fetch": "agent: serving a FETCH of a replica to a peer (every one; arm it with EASYCKPT_FAULT_ARM)",
    "layout.replace.swapped": "any: replace_dir swapped the new directory in, the old one not yet renamed to trash",
    "layout.replace.aside": "any: replace_dir without an atomic swap, the old directory aside, the new one not yet in",
    "hf.export.mid_write": "rank: a checkpoint-N folder half-written (weights in, the rest not)",
    "hf.export.before_rename": "rank: a checkpoint-N folder complete in its temp name, not yet renamed",
}
_SPEC_RE = re.compile(r"^(?P<point>[A-Za-z0-9_.]+)(?:@(?P<step>-?\d+))?(?:#(?P<rank>\d+))?(?::(?P<action>kill|stop|hold))?$")


def _parse(spec: str) -> tuple[str, int | None, int | None, str]:
    match = _SPEC_RE.match(spec.strip())
    if match is None:
        raise ValueError(
            f"{ENV}={spec!r} is malformed: use 'point', 'point@step', 'point#rank' or 'point@step#rank', "
            "optionally followed by ':stop' or ':hold'"
        )
    if match.group("point") not in POINTS:
        raise ValueError(f"{ENV}={spec!r} names no fault point; the points are: {', '.join(sorted(POINTS))}")
    step = match.group("step")
    rank = match.group("rank")
    action = match.group("action") or "kill"
    if action == "hold" and not os.environ.get(ARM_ENV):
        raise ValueError(f"{ENV}={spec!r}: ':hold' holds the thread while the file {ARM_ENV} names exists; set "
                         f"{ARM_ENV} to a path the test creates before the point and removes to let the thread go on")
    return match.group("point"), int(step) if step else None, int(rank) if rank else None, action


def fault_point(name: str, *, step: int | None = None, rank: int | None = None) -> None:
    """Kill this process with SIGKILL (or stop it, or hold this thread) if ``EASYCKPT_FAULT`` names this point
    (and step/rank)."""
    if name not in POINTS:
        raise ValueError(f"fault point {name!r} is not registered in easyckpt_wire.faults.POINTS")
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, want_step, want_rank, action = _parse(spec)
    if point != name:
        return
    if want_step is not None and want_step != step:
        return
    if want_rank is not None and want_rank != rank:
        return
    armed = os.environ.get(ARM_ENV)
    if armed and not os.path.exists(armed):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return  # fired before (e.g. in the agent this one replaces)
    if action == "hold":
        assert armed is not None   # _parse refuses ':hold' without an arm file
        _hold(name, step, rank, armed)
        return
    signum = signal.SIGSTOP if action == "stop" else signal.SIGKILL
    logger.warning("fault point %s reached (step=%s rank=%s): sending pid %d %s",
                   name, step, rank, os.getpid(), signum.name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signum)


def _hold(name: str, step: int | None, rank: int | None, armed: str) -> None:
    logger.warning("fault point %s reached (step=%s rank=%s): pid %d holds this thread while %s exists (at most "
                   "%.0fs)", name, step, rank, os.getpid(), armed, HOLD_LIMIT)
    started = time.monotonic()
    while os.path.exists(armed):
        if time.monotonic() - started > HOLD_LIMIT:
            logger.warning("fault point %s: %s still exists after %.0fs (HOLD_LIMIT): the thread goes on", name,
                           armed, HOLD_LIMIT)
            return
        time.sleep(0.02)   # polled: the test ends the hold by removing a file, from another process
    logger.warning("fault point %s: %s removed, the thread goes on after %.2fs", name, armed,
                   time.monotonic() - started)


if os.environ.get(ENV):
    # At import, in every process that can fire a point: a bad spec stops the test's job at its start.
    _parse(os.environ[ENV])

