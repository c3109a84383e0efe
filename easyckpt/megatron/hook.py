"""``import easyckpt.megatron.hook``: on SIGTERM or an uncaught exception, the newest snapshot reaches storage.

What the hook does when the process is about to end that way:

1. it waits for the snapshot copy in flight (``Checkpointer.wait()``), so that the newest snapshot is
   committed to its shared-memory slot instead of being left half-copied;
2. it does *not* close the Checkpointer: a rank that says goodbye is a rank that finished, and an agent
   whose ranks all finished deletes their slots; a rank that dies without goodbye makes the node agent
   persist the newest snapshot that every local rank holds ("flush on failure"), due by
   ``save_storage_interval`` or not, and keep the slots for a restart;
3. it lets the process end as it would have: SIGTERM is re-raised with its previous disposition (a
   Python handler installed before the hook is called; the default action otherwise, so the exit
   status still says SIGTERM), an exception goes on to the previous ``sys.excepthook``.

Limitation: the persist starts when the agent sees this process gone (within its poll interval), not
before the process exits; the Checkpointer has no "persist the newest snapshot now and tell me when it
is durable" request yet, which would let the hook wait for the file (bounded) before exiting.

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
from types import FrameType, TracebackType
from typing import Any

logger = logging.getLogger(__name__)

_previous_handler: Any = None
_previous_excepthook: Any = None
_installed = False
_flushing = threading.Lock()


def flush_newest(reason: str) -> int | None:
    """Make the newest snapshot complete in shared memory; returns its step (None if none was taken)."""
    from easyckpt.megatron import get_checkpointer

    ckpt = get_checkpointer()
    if ckpt is None or getattr(ckpt, "_closed", False):
        return None
    if not _flushing.acquire(blocking=False):
        return None  # a second signal while the first is being handled
    try:
        ckpt.wait()
        step = ckpt.stats().get("last_step")
        if step is None:
            logger.warning("easyckpt rank %d: %s before any snapshot was taken: nothing to persist", ckpt.rank, reason)
            return None
        logger.warning("easyckpt rank %d: %s: the newest snapshot (step %s) is complete in shared memory; the node "
                       "agent persists it to %s once this process has exited", ckpt.rank, reason, step,
                       ckpt.config.save_dir)
        return step
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
