"""Data skipping and checkpoint health for TrainerWrapper.

The Trainer computes the global gradient norm of every optimizer step in ``Trainer._get_grad_norm`` (the
pre-clip norm that ``_clip_grad_norm`` returned when ``max_grad_norm > 0``, else the norm itself), right
before ``optimizer.step()`` and ``lr_scheduler.step()``. :class:`StepGuard` wraps those methods of the one
Trainer instance (as the wrapper does with its save point):

* ``_get_grad_norm``: the norm goes to a :class:`~easyckpt.health.DataSkipper`; when it says skip, the
  next ``optimizer.step`` and ``lr_scheduler.step`` calls of this step are replaced by no-ops. The Trainer
  then zeroes the gradients, counts the step (``global_step``, logs with its ``grad_norm``) and goes on:
  model, optimizer, scheduler and grad scaler are as if the batch had not been there. (An optimizer
  pre-hook cannot cancel the step, and ``accelerator.optimizer_step_was_skipped`` is the scaler's own.)
  With fp16's GradScaler a norm that is not finite is the scaler's business (it skips that step and
  lowers its scale, as always): it is not counted as a spike.
* ``_clip_grad_norm`` (pre-clip) or ``_get_grad_norm``: on snapshot steps with the health monitor, the
  input embedding's local gradient norm is read while the gradients exist (the Trainer zeroes them before
  its save point), and ``training_step`` sums the step's micro-batch losses: both go to the snapshot as
  ``metrics``.

The skipper's counter rides in ``trainer_state.json`` (``stateful_callbacks["EasyckptDataSkipper"]``), so
it resumes with the Trainer's state from easyckpt and from ``checkpoint-N`` folders alike.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from easyckpt.health import DataSkipper, embedding_local_norm
from easyckpt.transformers.snapshot import unwrapped_model

logger = logging.getLogger(__name__)

STATE_KEY = "EasyckptDataSkipper"
_MISSING = object()


class StepGuard:
    """The per-step hooks of data skipping and the health metrics (see the module docstring)."""

    def __init__(self, trainer: Trainer, skipper: DataSkipper | None, *, health: bool,
                 snapshot_step: Callable[[int], bool]) -> None:
        self.trainer = trainer
        self.skipper = skipper
        self.health = health
        self.snapshot_step = snapshot_step
        self.metrics: tuple[int, dict[str, float]] | None = None   # (step, metrics) of the coming snapshot
        self._losses: list[torch.Tensor] = []
        self._embedding: float | None = None
        self._restored = False
        self._skipping: list[tuple[Any, str, Any]] = []   # (object, attribute, what it had) replaced this step
        self._original_get = trainer._get_grad_norm
        self._original_clip = trainer._clip_grad_norm
        self._original_training_step = trainer.training_step
        trainer._get_grad_norm = self._get_grad_norm                # type: ignore[method-assign]
        if health:
            trainer._clip_grad_norm = self._clip_grad_norm          # type: ignore[method-assign]
            trainer.training_step = self._training_step             # type: ignore[method-assign]

    def start(self) -> None:
        """A new ``train()``: the skipper's state is restored from the Trainer's at the first step."""
        self._restored = False
        self._losses.clear()
        self.metrics = None
        self._end_skip()

    def state(self) -> dict[str, Any]:
        """This guard's entry in ``trainer_state.json``'s stateful callbacks."""
        return {"args": {}, "attributes": self.skipper.state_dict() if self.skipper else {}}

    # the hooks -----------------------------------------------------------------------------------------
    def _training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = self._original_training_step(*args, **kwargs)
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        return loss

    def _clip_grad_norm(self, model: Any) -> Any:
        self._embedding = self._read_embedding()
        return self._original_clip(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:   # no clipping: the gradients are still as the backward left them
            self._embedding = self._read_embedding()
        norm = self._original_get(model, grad_norm=grad_norm)
        step = self.trainer.state.global_step + 1   # the step being taken (the Trainer counts it after)
        self._record_metrics(step)
        if self.skipper is not None:
            self._restore_skipper()
            value = float(norm.item() if isinstance(norm, torch.Tensor) else norm)
            if math.isfinite(value) or not self._scaler_enabled():
                self._end_skip()
                if self.skipper.skip(step, value):
                    self._skip_this_step()
                    # The spiked gradients are discarded and the state stays a healthy one: its snapshot is
                    # not judged by their embedding norm.
                    if self.metrics is not None and self.metrics[0] == step:
                        self.metrics[1].pop("embedding_local_norm", None)
        return norm

    def end_of_step(self) -> None:
        """At the save point: undo this step's no-ops should the Trainer not have called them (say, a
        ReduceLROnPlateau scheduler, stepped only with metrics)."""
        self._end_skip()

    # internals ---------------------------------------------------------------------------------------
    def _read_embedding(self) -> float | None:
        if not self.health or not self.snapshot_step(self.trainer.state.global_step + 1):
            return None
        return embedding_local_norm(unwrapped_model(self.trainer))

    def _record_metrics(self, step: int) -> None:
        losses, self._losses = self._losses, []
        embedding, self._embedding = self._embedding, None
        if not self.health or not self.snapshot_step(step):
            return
        metrics: dict[str, float] = {}
        if embedding is not None:
            metrics["embedding_local_norm"] = embedding
        if losses:
            metrics["loss"] = float(torch.stack([loss.float() for loss in losses]).sum())
        self.metrics = (step, metrics)

    def metrics_for(self, step: int) -> dict[str, float] | None:
        if self.metrics is not None and self.metrics[0] == step:
            return self.metrics[1]
        return None

    def _restore_skipper(self) -> None:
        if self._restored or self.skipper is None:
            return
        self._restored = True
        stateful: Any = self.trainer.state.stateful_callbacks   # a dict once loaded from trainer_state.json
        saved = stateful.get(STATE_KEY) if isinstance(stateful, dict) else None
        attributes = saved.get("attributes") if isinstance(saved, dict) else None
        if attributes:
            self.skipper.load_state_dict(attributes)
            logger.info("data skipping resumed: %s", attributes)
        else:
            self.skipper.load_state_dict({"consecutive": 0, "skipped_total": 0})

    def _scaler_enabled(self) -> bool:
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        return scaler is not None and bool(getattr(scaler, "is_enabled", lambda: True)())

    def _skip_this_step(self) -> None:
        trainer = self.trainer
        self._replace(trainer.optimizer, "step")
        scheduler = trainer.lr_scheduler
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self._replace(scheduler, "step")
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            # clip_grad_norm_ unscaled the gradients: GradScaler.update() would have cleared that record;
            # with the step skipped, the scale and growth tracker stay as they were, the record is cleared.
            states = getattr(scaler, "_per_optimizer_states", None)
            if states is not None:
                states.clear()

    def _replace(self, obj: Any, name: str) -> None:
        had = vars(obj).get(name, _MISSING)

        def skipped(*args: Any, **kwargs: Any) -> None:
            self._put_back(obj, name, had)

        setattr(obj, name, skipped)
        self._skipping.append((obj, name, had))

    def _put_back(self, obj: Any, name: str, had: Any) -> None:
        for i, entry in enumerate(self._skipping):
            if entry[0] is obj and entry[1] == name:
                del self._skipping[i]
                break
        else:
            return
        if had is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, had)

    def _end_skip(self) -> None:
        for obj, name, had in list(self._skipping):
            self._put_back(obj, name, had)
