"""What easyckpt says when nobody configured logging, and ``EASYCKPT_LOG_LEVEL``.

The library logs through ``logging.getLogger(__name__)`` (loggers ``easyckpt.*`` in the training process,
``agent.*`` and ``easyckpt_wire.*`` in the agent, whose log is a file) and never configures the root logger.
That alone would leave a plain loop silent: with no handler anywhere, Python's ``logging.lastResort``
prints WARNING and above, so a resume (INFO: it is news, not a problem) says nothing.

Two rules close that gap without taking logging over from the application:

* A *notice* (``notice()``) is one of the few events a user must hear of even with no logging set up: where
  training resumed from, a persist failure and its recovery. When a handler would see the record (the
  application configured logging, or asked through ``EASYCKPT_LOG_LEVEL``) it is an ordinary log record at
  its level, filtered like any other. When none would, easyckpt does what ``lastResort`` does for warnings:
  one line ``easyckpt: ...`` on stderr, unless the ``easyckpt`` logger was set above WARNING (silenced).
* ``EASYCKPT_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR, CRITICAL or a number) is the user asking: the
  ``easyckpt`` and ``easyckpt_wire`` loggers get that level and, only when no handler would show their
  records, one stderr handler each (never on the root logger).
"""
from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "EASYCKPT_LOG_LEVEL"
# The training process's loggers: the library's and the code it shares with the agent.
LIBRARY_LOGGERS = ("easyckpt", "easyckpt_wire")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _EnvHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler EASYCKPT_LOG_LEVEL adds when nothing else would show easyckpt's records."""


def parse_level(text: str) -> int:
    """A level name or number from the environment; ValueError naming the variable and the choices."""
    value = text.strip()
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={text!r} is not a logging level: use DEBUG, INFO, WARNING, ERROR or "
                         "CRITICAL (or unset it: then easyckpt prints only its resume line and persist failures "
                         "unless your program configures logging)")
    return level


def apply_env_level() -> None:
    """Honour ``EASYCKPT_LOG_LEVEL``: the level of the ``easyckpt`` and ``easyckpt_wire`` loggers, and a stderr
    handler on each when no handler would show its records. Called by every ``Checkpointer``; repeated calls
    add nothing."""
    text = os.environ.get(LOG_LEVEL_ENV, "")
    if not text.strip():
        return
    level = parse_level(text)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.setLevel(level)
        if has_handlers(library):   # the application's handlers, or ours from an earlier call
            continue
        handler = _EnvHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        library.addHandler(handler)


def has_handlers(logger: logging.Logger) -> bool:
    """Whether a record of ``logger`` reaches some handler (``Logger.hasHandlers``, which follows
    ``propagate`` as ``Logger.callHandlers`` does): False is when Python falls back to ``lastResort``."""
    return logger.hasHandlers()


def notice(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """Log a notice; with no handler configured, print it as one ``easyckpt: ...`` line on stderr instead
    (``logging.lastResort``'s rule, extended to these few INFO records)."""
    if has_handlers(logger):
        logger.log(level, msg, *args)
    elif logger.isEnabledFor(logging.WARNING):
        text = msg % args if args else msg
        try:
            sys.stderr.write(f"easyckpt: {text}\n")
            sys.stderr.flush()
        except (OSError, ValueError):   # a closed stderr (a daemonised process) must not break training
            pass
