"""``trainer.fit(model, ckpt_path="last")`` through easyckpt: two methods of Lightning's checkpoint connector,
wrapped once per process, that act only for a Trainer whose callbacks include an ``EasyCkpt``.

Why here: Lightning resolves ``"last"`` in ``_CheckpointConnector._parse_ckpt_path`` before the strategy sets
up the process group and before any callback hook runs, by looking for ``last*.ckpt`` files; it then loads
the resolved path in ``resume_start`` (after the ``setup`` hooks, with the process group up) and restores
everything from the loaded dictionary at its usual points. So:

* ``_parse_ckpt_path``: ``"last"`` becomes :data:`LAST`, a marker, remembering the file Lightning itself
  would have chosen;
* ``resume_start``: for :data:`LAST` the callback asks its Checkpointer for the newest step every rank can
  get (memory, replicas, disk; a collective) and hands Lightning that state as the loaded checkpoint, so
  that Lightning restores the model, optimizers, schedulers, loops, callbacks, precision plugin and
  datamodule exactly as from its own file. Nothing there: Lightning's own last file if there is one, else
  a fresh start (as Lightning does when ``"last"`` finds nothing).

``ckpt_path`` naming an easyckpt ``iteration_N`` directory loads that iteration the same way. Every other value,
and any Trainer without the callback, goes to Lightning's methods unchanged.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn

from easyckpt_wire import layout

if TYPE_CHECKING:
    from easyckpt.lightning.callback import EasyCkpt

logger = logging.getLogger(__name__)

LAST = "easyckpt://last"       # what "last" resolves to while an EasyCkpt is among the Trainer's callbacks
_installed = threading.Lock()
_ORIGINAL: dict[str, Any] = {}


def find(trainer: Any) -> EasyCkpt | None:
    from easyckpt.lightning.callback import EasyCkpt

    return next((cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, EasyCkpt)), None)


def install() -> None:
    """Wrap the two connector methods (idempotent)."""
    with _installed:
        if _ORIGINAL:
            return
        missing = [name for name in ("_parse_ckpt_path", "resume_start", "dump_checkpoint")
                   if not callable(getattr(_CheckpointConnector, name, None))]
        if missing:
            import lightning

            raise RuntimeError(f"EasyCkpt hooks Lightning's checkpoint connector, and lightning {lightning.__version__} "
                               f"has no {', '.join(missing)}: install the version easyckpt is tested with "
                               "(pip install 'easyckpt[lightning]')")
        _ORIGINAL["parse"] = _CheckpointConnector._parse_ckpt_path
        _ORIGINAL["resume_start"] = _CheckpointConnector.resume_start
        _CheckpointConnector._parse_ckpt_path = _parse_ckpt_path    # type: ignore[method-assign]
        _CheckpointConnector.resume_start = _resume_start           # type: ignore[method-assign]


def _parse_ckpt_path(self: _CheckpointConnector, state_fn: TrainerFn, ckpt_path: Any, model_provided: bool,
                     model_connected: bool) -> Any:
    parse = _ORIGINAL["parse"]
    callback = find(self.trainer)
    if callback is None or ckpt_path != "last" or state_fn != TrainerFn.FITTING:
        return parse(self, state_fn, ckpt_path, model_provided, model_connected)
    with warnings.catch_warnings():
        # "there is no last checkpoint available": not the last word, easyckpt may hold one
        warnings.filterwarnings("ignore", message=r".*no last checkpoint available")
        callback.lightning_last = parse(self, state_fn, ckpt_path, model_provided, model_connected)
    return LAST


def _iteration_dir(path: Any) -> Path | None:
    """``ckpt_path`` naming one of easyckpt's ``iteration_N`` directories (loaded whatever its health)."""
    if not isinstance(path, (str, os.PathLike)) or path == LAST:
        return None
    candidate = Path(path).expanduser()
    return candidate.resolve() if candidate.is_dir() and layout.ITERATION_RE.match(candidate.name) else None


def _resume_start(self: _CheckpointConnector, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
    original = _ORIGINAL["resume_start"]
    callback = find(self.trainer)
    if callback is None or self.trainer.state.fn != TrainerFn.FITTING:
        return original(self, checkpoint_path, weights_only)
    explicit = _iteration_dir(checkpoint_path)
    if checkpoint_path != LAST and explicit is None:
        callback.starting(checkpoint_path)
        return original(self, checkpoint_path, weights_only)
    where, state = callback.resume(load_dir=explicit)
    if state is None:
        # nothing in easyckpt: Lightning's own last file (None: a fresh start)
        callback.starting(where)
        return original(self, where, weights_only)
    self._ckpt_path = where
    self._loaded_checkpoint = state
    return None
