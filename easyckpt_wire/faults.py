"""Named fault points: the tests kill a real process (SIGKILL, no cleanup) at an exact protocol step.

``EASYCKPT_FAULT`` holds ``point`` or ``point@step`` or ``point@step#rank`` (``#rank`` alone works
too), optionally followed by ``:stop``; with ``EASYCKPT_FAULT_ONCE=path`` it fires only once across
processes, and with ``EASYCKPT_FAULT_ARM=path`` only while that file exists (so a long-lived agent
can carry a fault that a test arms at the right moment). When the running code reaches a matching
:func:`fault_point`, the process sends itself SIGKILL, which is exactly what ``kill -9`` does from
outside, or with ``:stop`` SIGSTOP (a hung process), but at a place a test can name instead of at a
moment it would have to guess with a sleep.
"""
from __future__ import annotations

import logging
import os
import re
import signal

logger = logging.getLogger(__name__)

ENV = "EASYCKPT_FAULT"
ONCE_ENV = "EASYCKPT_FAULT_ONCE"  # a path: the fault fires only in the process that creates it first
ARM_ENV = "EASYCKPT_FAULT_ARM"    # a path: the fault fires only while it exists
_SPEC_RE = re.compile(r"^(?P<point>[A-Za-z0-9_.]+)(?:@(?P<step>-?\d+))?(?:#(?P<rank>\d+))?(?::(?P<action>kill|stop))?$")


def _parse(spec: str) -> tuple[str, int | None, int | None, str]:
    match = _SPEC_RE.match(spec.strip())
    if match is None:
        raise ValueError(
            f"{ENV}={spec!r} is malformed: use 'point', 'point@step', 'point#rank' or 'point@step#rank', "
            "optionally followed by ':stop'"
        )
    step = match.group("step")
    rank = match.group("rank")
    return match.group("point"), int(step) if step else None, int(rank) if rank else None, match.group("action") or "kill"


def fault_point(name: str, *, step: int | None = None, rank: int | None = None) -> None:
    """Kill this process with SIGKILL if ``EASYCKPT_FAULT`` names this point (and step/rank)."""
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
    signum = signal.SIGSTOP if action == "stop" else signal.SIGKILL
    logger.warning("fault point %s reached (step=%s rank=%s): sending pid %d %s",
                   name, step, rank, os.getpid(), signum.name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signum)
