"""Data skipping and checkpoint health for the Megatron integration.

Megatron's ``train_step`` returns the global gradient norm only after ``optimizer.step()`` applied the
update, so the decision is taken inside the step: the optimizer's own ``step()`` (every Megatron optimizer:
``prepare_grads``, then ``clip_grad_norm`` or ``get_grad_norm``, then ``step_with_ready_grads``) is left
as it is, and :func:`guard_optimizer` wraps, on that one optimizer instance,

* ``clip_grad_norm`` / ``get_grad_norm``: keep the norm they return (pre-clip, reduced over the
  model-parallel groups by Megatron) and, on snapshot iterations with the health monitor, read the input
  embedding's local gradient norm first (pipeline stage 0 holds the embedding; other stages report none);
* ``step_with_ready_grads``: ask the :class:`~easyckpt.health.DataSkipper`; on a spike it returns False
  without stepping, which is Megatron's own "update not successful": ``train_step`` then counts a skipped
  iteration and does not step the LR scheduler, exactly as for a loss-scale overflow. (An overflow itself
  never gets here: ``prepare_grads`` found it and the step returned before, so it is not counted as a spike.)

The skipper's counter rides in the snapshot (``state["easyckpt_megatron"]["data_skipper"]``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from easyckpt.health import DataSkipper

logger = logging.getLogger(__name__)

_WRAPPED = "_easyckpt_data_skipping"


def is_megatron_optimizer(optimizer: Any) -> bool:
    return all(callable(getattr(optimizer, name, None))
               for name in ("prepare_grads", "step_with_ready_grads", "get_grad_norm", "clip_grad_norm"))


def embedding_local_norm(chunks: list[Any]) -> float | None:
    """The L2 norm of this rank's word-embedding gradient (its tensor-parallel shard), from the model chunk
    that holds the embedding (pipeline stage 0); None on other stages or before a backward. Megatron's DDP
    keeps gradients in ``main_grad``."""
    from easyckpt.megatron.snapshot import unwrap

    for chunk in chunks:
        embedding = getattr(getattr(unwrap(chunk), "embedding", None), "word_embeddings", None)
        weight = getattr(embedding, "weight", None)
        if weight is None:
            continue
        grad = getattr(weight, "main_grad", None)
        grad = grad if grad is not None else weight.grad
        if grad is not None:
            return float(torch.linalg.vector_norm(grad.float()))
    return None


class OptimizerGuard:
    """The wrapped methods of one Megatron optimizer (see the module docstring)."""

    def __init__(self, optimizer: Any, chunks: list[Any], skipper: DataSkipper | None, *, health: bool,
                 due: Callable[[int], bool], iteration: int) -> None:
        self.optimizer = optimizer
        self.chunks = chunks
        self.skipper = skipper
        self.health = health
        self.due = due                        # Checkpointer.due: is this step snapshotted
        self.iteration = iteration            # the last iteration done; the step being taken is the next
        self.embedding: tuple[int, float | None] | None = None
        self._norm: Any = None
        self._originals = {name: getattr(optimizer, name) for name in ("get_grad_norm", "clip_grad_norm",
                                                                       "step_with_ready_grads")}
        optimizer.get_grad_norm = self._get_grad_norm
        optimizer.clip_grad_norm = self._clip_grad_norm
        optimizer.step_with_ready_grads = self._step_with_ready_grads
        setattr(optimizer, _WRAPPED, self)

    def _before_norm(self) -> None:
        step = self.iteration + 1
        if self.health and self.due(step) and self.embedding is None:
            self.embedding = (step, embedding_local_norm(self.chunks))

    def _get_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        self._before_norm()
        self._norm = self._originals["get_grad_norm"](*args, **kwargs)
        return self._norm

    def _clip_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        self._before_norm()
        self._norm = self._originals["clip_grad_norm"](*args, **kwargs)
        return self._norm

    def _step_with_ready_grads(self, *args: Any, **kwargs: Any) -> Any:
        norm, self._norm = self._norm, None
        if self.health:
            self._before_norm()   # no norm was computed (no clipping): the gradients are as the backward left them
        if self.skipper is not None:
            if norm is None:   # no clipping: Megatron computed no norm; this is the one reduction it costs
                norm = self._originals["get_grad_norm"]()
            if self.skipper.skip(self.iteration + 1, norm):
                # The spiked gradients are discarded, so the state stays that of a healthy step: its
                # snapshot must not be judged by their embedding norm (that would mark the kept state unhealthy).
                self.embedding = None
                return False
        return self._originals["step_with_ready_grads"](*args, **kwargs)

    def metrics_for(self, iteration: int) -> dict[str, float]:
        """The health metrics of ``iteration`` gathered during its step (none when they are not known)."""
        embedding, self.embedding = self.embedding, None
        if embedding is not None and embedding[0] == iteration and embedding[1] is not None:
            return {"embedding_local_norm": embedding[1]}
        return {}

    def remove(self) -> None:
        for name in self._originals:
            vars(self.optimizer).pop(name, None)
        vars(self.optimizer).pop(_WRAPPED, None)


def guard_of(optimizer: Any) -> OptimizerGuard | None:
    return vars(optimizer).get(_WRAPPED) if hasattr(optimizer, "__dict__") else None
