"""Checkpoint health monitoring and data skipping (the MindSpore Transformers features, in PyTorch terms).

* :class:`DataSkipper`: a step whose global gradient norm exceeds ``global_norm_spike_threshold`` is
  skipped (the loop consumes the batch but does not apply the update) and counted; a normal step resets
  the count; at ``global_norm_spike_count_threshold`` consecutive spikes :class:`TrainingAborted` is raised.
* The health verdict: ``Checkpointer(..., health_thresholds={"embedding_local_norm": 270.0})`` and
  ``save_if_needed(step, state, metrics={"embedding_local_norm": ..., "loss": ...})``; the rules are in
  :mod:`easyckpt_wire.health` (shared with the agent).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from easyckpt_wire.health import HEALTH_FILE, RankHealth, check_thresholds, rank_verdict

logger = logging.getLogger(__name__)

__all__ = ["HEALTH_FILE", "DataSkipper", "RankHealth", "TrainingAborted", "check_thresholds", "configure",
           "embedding_local_norm", "rank_verdict"]


class TrainingAborted(RuntimeError):
    """Too many consecutive gradient-norm spikes: training stops (after the newest healthy state is durable)."""

    def __init__(self, step: int, global_norm: float, threshold: float, count: int) -> None:
        self.step, self.global_norm, self.threshold, self.count = step, global_norm, threshold, count
        super().__init__(
            f"step {step}: global norm {global_norm:.6g} > threshold {threshold:g}, {count} consecutive time(s), "
            f"reaching global_norm_spike_count_threshold={count}: training aborted. The newest healthy state is "
            "kept: resume with load() (it skips unhealthy snapshots), and look at the data or the learning rate "
            "around this step, or raise global_norm_spike_threshold")


@dataclasses.dataclass(kw_only=True)
class DataSkipper:
    """Decides, step by step, whether an update is skipped because its global gradient norm spiked.

    ``skip(step, global_norm)`` needs the norm as a number: passing a CUDA tensor reads it (one
    device-to-host synchronisation, which a loop that clips gradients or logs the norm pays already); it
    adds nothing else. ``on_abort`` runs before :class:`TrainingAborted` is raised (for example
    ``ckpt.flush``, so the newest healthy snapshot is durable first).
    """

    global_norm_spike_threshold: float
    global_norm_spike_count_threshold: int
    on_abort: Callable[[], Any] | None = None
    consecutive: int = dataclasses.field(default=0, init=False)
    skipped_total: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        check_thresholds({"global_norm_spike_threshold": self.global_norm_spike_threshold}, "DataSkipper")
        count = self.global_norm_spike_count_threshold
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"global_norm_spike_count_threshold must be a positive int, got {count!r}")

    def skip(self, step: int, global_norm: float | torch.Tensor) -> bool:
        """True when this step's update must be skipped; raises TrainingAborted at the count threshold.
        A norm that is not finite counts as a spike."""
        norm = float(global_norm.item() if isinstance(global_norm, torch.Tensor) else global_norm)
        if math.isfinite(norm) and norm <= self.global_norm_spike_threshold:
            if self.consecutive:
                logger.info("step %d: global norm %.6g back under threshold %g after %d skipped step(s)", step,
                            norm, self.global_norm_spike_threshold, self.consecutive)
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped_total += 1
        if self.consecutive >= self.global_norm_spike_count_threshold:
            error = TrainingAborted(step, norm, self.global_norm_spike_threshold, self.consecutive)
            logger.error("%s", error)
            if self.on_abort is not None:
                self.on_abort()
            raise error
        logger.warning("step %d: global norm %.6g > threshold %g, %d consecutive time(s); data skipped", step, norm,
                       self.global_norm_spike_threshold, self.consecutive)
        return True

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("consecutive", "skipped_total"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DataSkipper state {key!r} must be an int >= 0, got {value!r}")
        self.consecutive, self.skipped_total = state["consecutive"], state["skipped_total"]


def embedding_local_norm(model: torch.nn.Module) -> float | None:
    """The L2 norm of this rank's input-embedding gradient (its local shard under tensor or FSDP
    sharding), or None when the module has no embedding with a gradient (a later pipeline stage: neutral).
    Reading it synchronises with the device once."""
    getter = getattr(model, "get_input_embeddings", None)   # transformers' models name their own
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, torch.nn.Module):
        embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is None:
        return None
    grads = [p.grad for p in embedding.parameters() if p.grad is not None]
    if not grads:
        return None
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]   # DTensor: this rank's shard
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in local])))


# MindSpore Transformers' defaults for the keywords of the integrations.
DEFAULT_GLOBAL_NORM_SPIKE_THRESHOLD = 1.0
DEFAULT_GLOBAL_NORM_SPIKE_COUNT_THRESHOLD = 10
DEFAULT_EMBEDDING_LOCAL_NORM_THRESHOLD = 1.0


def configure(*, use_skip_data_by_global_norm: bool = False, global_norm_spike_threshold: float | None = None,
              global_norm_spike_count_threshold: int | None = None, use_checkpoint_health_monitor: bool = False,
              embedding_local_norm_threshold: float | None = None,
              health_thresholds: dict[str, float] | None = None,
              what: str = "easyckpt") -> tuple[DataSkipper | None, dict[str, float] | None]:
    """The integrations' keywords (TrainerWrapper, initialize_easyckpt), checked: the DataSkipper (None when
    skipping is off; its ``on_abort`` is set once there is a Checkpointer) and the Checkpointer's
    ``health_thresholds`` (``health_thresholds`` given directly, plus ``embedding_local_norm``)."""
    for flag, on in (("use_skip_data_by_global_norm", use_skip_data_by_global_norm),
                     ("use_checkpoint_health_monitor", use_checkpoint_health_monitor)):
        if not isinstance(on, bool):
            raise TypeError(f"{what}: {flag} must be True or False, got {on!r}")
    if not use_skip_data_by_global_norm:
        for name, value in (("global_norm_spike_threshold", global_norm_spike_threshold),
                            ("global_norm_spike_count_threshold", global_norm_spike_count_threshold)):
            if value is not None:
                raise ValueError(f"{what}: {name}={value!r} has no effect without use_skip_data_by_global_norm=True")
    if not use_checkpoint_health_monitor and embedding_local_norm_threshold is not None:
        raise ValueError(f"{what}: embedding_local_norm_threshold={embedding_local_norm_threshold!r} has no effect "
                         "without use_checkpoint_health_monitor=True")
    skipper = None
    if use_skip_data_by_global_norm:
        skipper = DataSkipper(
            global_norm_spike_threshold=DEFAULT_GLOBAL_NORM_SPIKE_THRESHOLD if global_norm_spike_threshold is None
            else global_norm_spike_threshold,
            global_norm_spike_count_threshold=DEFAULT_GLOBAL_NORM_SPIKE_COUNT_THRESHOLD
            if global_norm_spike_count_threshold is None else global_norm_spike_count_threshold)
    thresholds = check_thresholds(health_thresholds, what) if health_thresholds is not None else None
    if use_checkpoint_health_monitor:
        threshold = DEFAULT_EMBEDDING_LOCAL_NORM_THRESHOLD if embedding_local_norm_threshold is None \
            else embedding_local_norm_threshold
        mine = check_thresholds({"embedding_local_norm": threshold}, what)
        if thresholds is not None and thresholds.get("embedding_local_norm", threshold) != threshold:
            raise ValueError(f"{what}: embedding_local_norm_threshold={threshold!r} and "
                             f"health_thresholds['embedding_local_norm']={thresholds['embedding_local_norm']!r} "
                             "disagree: give one")
        thresholds = {**(thresholds or {}), **mine}
    return skipper, thresholds
