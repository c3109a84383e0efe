"""``import easyckpt.megatron.hook``: on SIGTERM or an uncaught exception, the newest snapshot reaches storage.

What the hook does when the process is about to end that way:

1. ``Checkpointer.flush()``: it finishes the snapshot copy in flight, asks the node agent to persist
   that step now (due by ``save_storage_interval`` or not) and waits until its files are fsynced, at
   most ``flush_timeout`` (25 s by default: torchrun kills a worker 30 s after its SIGTERM). The agent
   persists the step once every rank of the node holds it; every rank gets the same signal and asks
   for its own newest step, and a rank one step behind gets the older one persisted. Past the timeout
   the agent goes on on its own.
2. It does *not* close the Checkpointer: a rank that says goodbye is a rank that finished, and an agent
   whose ranks all finished deletes their slots. A rank that dies without goodbye leaves its slots for
   the restart, which resumes from memory.
3. It lets the process end as it would have: SIGTERM is re-raised with its previous disposition (a
   Python handler installed before the hook is called; the default action otherwise, so the exit
   status still says SIGTERM), an exception goes on to the previous ``sys.excepthook``.

Install it after anything else that sets a SIGTERM handler you want chained (Megatron's
``--exit-signal-handler`` replaces it when installed later). The hook is harmless before
``initialize_easyckpt``: it then does nothing but pass the signal or exception on.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

logger = logging.getLogger(__name__)

# What signal.getsignal returned: a handler, SIG_DFL/SIG_IGN, or None (one not installed from Python).
_previous_handler: Callable[[int, FrameType | None], Any] | int | signal.Handlers | None = None
_previous_excepthook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] | None = None
_installed = False
_flushing = threading.Lock()


def flush_newest(reason: str) -> int | None:
    """Make the newest snapshot durable (bounded); returns the newest step on disk, None if unknown."""
    from easyckpt.megatron import get_checkpointer

    ckpt = get_checkpointer()
    if ckpt is None or ckpt.closed:
        return None
    if not _flushing.acquire(blocking=False):
        return None  # a second signal while the first is being handled
    try:
        result = ckpt.flush()
        if result.step is None:
            logger.warning("easyckpt rank %d: %s before any snapshot was taken: nothing to persist", ckpt.rank, reason)
            return None
        if result.durable:
            where = ("committed" if result.committed else
                     "this node's files; the leader commits the iteration once every node's are")
            logger.warning("easyckpt rank %d: %s: the newest snapshot (step %d) is durable in %s (step %s, %s) after "
                           "%.2fs", ckpt.rank, reason, result.step, ckpt.config.save_dir, result.persisted, where,
                           result.seconds)
        else:
            logger.warning("easyckpt rank %d: %s: the newest snapshot (step %d) is not durable: %s; newest step on "
                           "disk: %s", ckpt.rank, reason, result.step, result.error, result.persisted)
        return result.persisted
    except Exception:
        logger.exception("easyckpt: could not complete the newest snapshot on %s", reason)
        return None
    finally:
        _flushing.release()
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:
                pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    flush_newest("SIGTERM")
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_exception(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        flush_newest(f"uncaught {kind.__name__}")
    (_previous_excepthook or sys.__excepthook__)(kind, value, tb)


def install() -> None:
    """Install the handlers (done on import); a no-op when already installed."""
    global _previous_handler, _previous_excepthook, _installed
    if _installed:
        return
    if threading.current_thread() is threading.main_thread():
        _previous_handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    else:
        logger.warning("easyckpt.megatron.hook imported outside the main thread: no SIGTERM handler installed, "
                       "only the exception hook")
    _previous_excepthook = sys.excepthook
    sys.excepthook = _on_exception
    _installed = True


def uninstall() -> None:
    """Restore the previous SIGTERM handler and excepthook."""
    global _installed
    if not _installed:
        return
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _previous_handler if _previous_handler is not None else signal.SIG_DFL)
    if sys.excepthook is _on_exception:
        sys.excepthook = _previous_excepthook or sys.__excepthook__
    _installed = False


install()
