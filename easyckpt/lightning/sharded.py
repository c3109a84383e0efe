"""``ModelParallelStrategy`` (FSDP2, tensor parallelism): snapshots of each rank's own DTensor shards, resumed
in place.

Lightning's ``ModelParallelStrategy`` builds its checkpoint dictionary with ``get_model_state_dict`` /
``get_optimizer_state_dict`` and ``cpu_offload=True`` (a synchronous device-to-host copy of the whole state,
or with ``save_distributed_checkpoint=False`` a gather of everything to rank 0), and saves and loads it with
``torch.distributed.checkpoint`` inside the strategy: its ``load_model_state_dict`` and the optimizer restore
do nothing with the dictionary. So:

* a snapshot is ``dump_checkpoint`` with those two getters returning the live DTensors, unmoved
  (:func:`local_shards`): easyckpt copies each rank's local shards asynchronously, with their global shapes
  and offsets;
* a resume fills the live model's and optimizers' shards in place (``Checkpointer.load(template)``, from
  memory, replicas or disk; resharded when the saved mesh differs) and applies them with
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` (:func:`load`); Lightning restores the rest (loops,
  schedulers, callbacks) from the same dictionary;
* an exported ``.ckpt`` holds whole tensors (the shards assembled from the persisted iteration), the
  single-file form ``ModelParallelStrategy(save_distributed_checkpoint=False)`` writes and any strategy loads.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def enabled(trainer: Any) -> bool:
    return trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


@contextlib.contextmanager
def local_shards(strategy: Any) -> Iterator[None]:
    """While it is open, the strategy's state getters return the live sharded state (no copy, no gather)."""
    if not isinstance(strategy, ModelParallelStrategy):
        yield
        return
    model = strategy.model
    assert model is not None
    strategy.lightning_module_state_dict = lambda: get_model_state_dict(model)   # type: ignore[method-assign]
    strategy.optimizer_state = lambda optimizer: get_optimizer_state_dict(  # type: ignore[method-assign]
        model, _unwrap(optimizer))
    try:
        yield
    finally:
        del strategy.lightning_module_state_dict, strategy.optimizer_state


def template(strategy: Any) -> tuple[dict[str, Any], list[Any]]:
    """The live model's and optimizers' sharded state, for ``Checkpointer.load`` to fill in place, and the
    optimizers that had no state yet: ``get_optimizer_state_dict`` creates it with a step of zero gradients
    (at lr 0, yet AdamW counts it), which :func:`discard` undoes when nothing is loaded."""
    empty = [o for o in map(_unwrap, strategy.optimizers) if not o.state]
    return live_state(strategy), empty


def live_state(strategy: Any) -> dict[str, Any]:
    """The live model's and optimizers' sharded state under the keys of Lightning's checkpoint dictionary."""
    model = strategy.model
    return {"state_dict": get_model_state_dict(model),
            "optimizer_states": [get_optimizer_state_dict(model, _unwrap(o)) for o in strategy.optimizers]}


def discard(created: list[Any]) -> None:
    """A fresh start: the optimizers whose state the template created start without one, as they were."""
    for optimizer in created:
        optimizer.state.clear()


def load(strategy: Any, state: dict[str, Any]) -> None:
    """Apply the loaded shards to the live model and optimizers (every rank, in the same order)."""
    model = strategy.model
    set_model_state_dict(model, state["state_dict"])
    for optimizer, optimizer_state in zip(strategy.optimizers, state["optimizer_states"]):
        set_optimizer_state_dict(model, _unwrap(optimizer), optimizer_state)
