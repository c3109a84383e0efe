"""The state TrainerWrapper snapshots, taken from the live Trainer in the layout its own checkpoints use.

Model (under ZeRO-3: this rank's parameter partitions; under FSDP2 this rank's shards, see ``fsdp``; of a
peft model what trains, as the Trainer's own checkpoints of one hold only the adapter: see ``trained_only``),
optimizer (under DeepSpeed ZeRO: this rank's partition, see ``zero``; under FSDP2 keyed by parameter
name), LR scheduler, grad scaler (when there is one), ``trainer_state.json`` as the Trainer would write
it now (callbacks' states included) and every RNG as in its ``rng_state`` files. The data position needs
nothing more: the Trainer derives it from the global step and the seeds.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState

from easyckpt.snapshot import sharding
from easyckpt.transformers import fsdp
from easyckpt.transformers.adapters import frozen_parameters, is_peft_model

logger = logging.getLogger(__name__)

STATE_FORMAT = "easyckpt-hf-1"


def unwrapped_model(trainer: Trainer) -> Any:
    """The model without DDP (and torch.compile) wrappers: what the Trainer saves."""
    accelerator = trainer.accelerator
    try:
        return accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    except TypeError:  # accelerate versions without keep_torch_compile
        return accelerator.unwrap_model(trainer.model)


# The state's entry for a peft model's frozen base: {parameter name: [sum, sum of squares], or None for a partitioned
# or sharded one} of what the snapshot leaves out, so that a resume can tell whether the script built the same base.
FROZEN_KEY = "peft_frozen_base"


def trained_only(model_state: dict[str, Any], frozen: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``model_state`` without the ``frozen`` parameters of a peft model (LoRA ...; ``frozen_parameters``): its base
    weights never change, and the script builds them again at every start (``from_pretrained``, then
    ``get_peft_model``), as a resume from the Trainer's own checkpoint of a peft model (the adapter only) needs. A LoRA
    of a 7B model would otherwise copy 14 GB into every snapshot for a few MB that train, and hold that in every slot.
    Buffers stay."""
    return model_state.__class__((name, value) for name, value in model_state.items() if name not in frozen)


def with_frozen(model: Any, model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` as ``state_dict()`` gives it: the frozen parameters that ``trained_only`` left out, from the
    live model (what its frozen base holds is what it held when the snapshot was taken, unless the script built
    another base: ``base_differs``)."""
    if not is_peft_model(model):
        return model_state
    missing = {name: param.detach() for name, param in frozen_parameters(model).items() if name not in model_state}
    if not missing:
        return model_state
    order = list(model.state_dict())   # the layout state_dict() gives, so that save_pretrained writes the same file
    whole = {**model_state, **missing}
    return {**{name: whole[name] for name in order if name in whole}, **whole}


class FrozenBase:
    """A fingerprint of a peft model's frozen base (``FROZEN_KEY``), computed once per parameter: a frozen parameter
    is not written in place, so its storage and version counter say when it must be summed again. A parameter that
    DeepSpeed ZeRO-3 partitions or FSDP2 shards has none (None): each rank holds a slice of it, and a resume checks
    the base before the model is partitioned or sharded again."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[Any, ...], list[float]]] = {}

    def __call__(self, frozen: Mapping[str, torch.Tensor]) -> dict[str, list[float] | None]:
        """The fingerprint of the ``frozen`` parameters (``frozen_parameters``)."""
        prints: dict[str, list[float] | None] = {}
        for name, param in frozen.items():
            if _partitioned(param):
                prints[name] = None
                continue
            key = (param.data_ptr(), param._version, tuple(param.shape), param.dtype, param.device)
            known = self._known.get(name)
            if known is None or known[0] != key:
                known = (key, fingerprint(param))
                self._known[name] = known
            prints[name] = known[1]
        return prints


FINGERPRINT_CHUNK = 1 << 24   # elements summed at a time: 128 MiB of float64 beside the model, not a copy of it


def fingerprint(tensor: torch.Tensor) -> list[float]:
    """[sum, sum of squares] of ``tensor``'s values in float64, on its own device."""
    total = squares = 0.0
    with torch.no_grad():
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), FINGERPRINT_CHUNK):
            chunk = flat[start:start + FINGERPRINT_CHUNK].to(torch.float64)
            total += chunk.sum().item()
            squares += chunk.square().sum().item()
    return [total, squares]


def _partitioned(param: torch.Tensor) -> bool:
    # DeepSpeed ZeRO-3: the parameter is a placeholder, ds_tensor a slice; FSDP2: a DTensor of this rank's shards,
    # whose sums would be collectives
    return hasattr(param, "ds_tensor") or sharding.is_dtensor(param)


def _same(now: float, then: float) -> bool:
    return math.isclose(now, then, rel_tol=1e-9, abs_tol=1e-9) or (math.isnan(now) and math.isnan(then))


def base_differs(model: Any, saved: dict[str, list[float] | None]) -> list[str]:
    """The frozen parameters whose live values are not those of the run that took the snapshot (``saved``: its
    ``FROZEN_KEY``), or that it had and this model lacks. Sums over the same values in another order differ in the
    last digits only; another initialisation or base model differs in every parameter. A parameter partitioned by
    ZeRO-3 or sharded by FSDP2, then or now, is not compared (``FrozenBase``)."""
    live = frozen_parameters(model)
    differ = []
    for name, sums in saved.items():
        param = live.get(name)
        if sums is None or (param is not None and _partitioned(param)):
            continue
        total, squares = sums
        now = fingerprint(param) if param is not None else None
        if now is None or not (_same(now[0], total) and _same(now[1], squares)):
            differ.append(name)
    return differ


class LogHistoryJson:
    """``trainer_state.json``'s ``log_history`` list, encoded once per entry.

    The state is snapshotted every step, and ``json.dumps(dataclasses.asdict(state))`` of the whole state cost time in
    proportion to the history: 0.75 s a step at 50,000 entries (``logging_steps=1`` at step 50,000), a hundred times
    the step of the model it was measured with. The Trainer only appends new dicts to ``log_history``, so each entry
    is encoded once, in the very layout ``json.dumps(..., indent=2, sort_keys=True)`` gives it inside the state; a
    history that is another list, shorter, or whose last encoded entry is another object is encoded again whole."""

    def __init__(self) -> None:
        self.history: list[Any] | None = None
        self.count = 0          # entries of ``history`` in ``block``
        self.last: Any = None   # the last of them
        self.block = ""         # their encodings, joined as in the list (one copy a snapshot, not one per entry)

    def __call__(self, history: list[Any]) -> str:
        count = self.count
        if history is not self.history or len(history) < count or (count and history[count - 1] is not self.last):
            self.history, self.block, count = history, "", 0
        # an entry at depth 2 of the state (its list is the value of a top-level key): four spaces before each line
        new = ["    " + json.dumps(entry, indent=2, sort_keys=True).replace("\n", "\n    ")
               for entry in history[count:]]
        if new:
            self.block = ",\n".join([self.block, *new] if self.block else new)
            self.count, self.last = len(history), history[-1]
        return "[\n" + self.block + "\n  ]" if self.block else "[]"


_HISTORY_MARK = "\x00easyckpt log_history\x00"   # stands in for the list in the rest of the state's encoding


def trainer_state_json(trainer: Trainer, extra: dict[str, Any] | None = None,
                       history: LogHistoryJson | None = None) -> str:
    """The Trainer's state as ``trainer_state.json`` holds it, callbacks' states taken now; ``extra``:
    more entries of ``stateful_callbacks`` (the wrapper's data skipping counter); ``history``: the encoder that
    keeps ``log_history``'s entries from the calls before (each call encodes the whole history without it)."""
    shallow = copy.copy(trainer.state)
    shallow.log_history = []
    record = dataclasses.asdict(shallow)
    record["log_history"] = _HISTORY_MARK
    stateful: dict[str, Any] = {}
    for callback in trainer.callback_handler.callbacks + [trainer.control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if name in stateful:
                if not isinstance(stateful[name], list):
                    stateful[name] = [stateful[name]]
                stateful[name].append(callback.state())
            else:
                stateful[name] = callback.state()
    stateful.update(extra or {})
    record["stateful_callbacks"] = stateful
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    return text.replace(json.dumps(_HISTORY_MARK), (history or LogHistoryJson())(trainer.state.log_history), 1)


def rng_state(trainer: Trainer) -> dict[str, Any]:
    """Every RNG, in the layout of the Trainer's rng_state files."""
    rng: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = str(getattr(trainer.args.parallel_mode, "value", "")) == "distributed"
        rng["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return rng


def capture(trainer: Trainer, extra_callback_states: dict[str, Any] | None = None,
            history: LogHistoryJson | None = None, frozen: FrozenBase | None = None) -> dict[str, Any]:
    """This rank's whole state now (tensors by reference: the Checkpointer copies them); ``history``: the
    ``log_history`` encoder kept from one snapshot to the next (see ``LogHistoryJson``), ``frozen`` the fingerprint
    of a peft model's base (see ``FrozenBase``)."""
    if trainer.optimizer is None or trainer.lr_scheduler is None:
        raise RuntimeError("easyckpt snapshots the Trainer's state during training: its optimizer and scheduler "
                           "are not created yet (call TrainerWrapper.train(), not a snapshot before it)")
    fsdp_info, base = None, None
    unwrapped = unwrapped_model(trainer)
    # A peft model's frozen base is left out (trained_only): under DeepSpeed as DeepSpeed's own checkpoint of one (the
    # Trainer's save_checkpoint(exclude_frozen_parameters=True)), under FSDP2 as the Trainer's save_fsdp_model
    # (adapter_only=True).
    left_out = frozen_parameters(unwrapped) if is_peft_model(unwrapped) else None
    if getattr(trainer, "is_deepspeed_enabled", False):
        from easyckpt.transformers import zero  # only here: deepspeed is an optional extra
        optim, engine_info = zero.capture(trainer, exclude_frozen=left_out is not None)
        model = zero.module_state(trainer)   # under ZeRO-3 this rank's partitions, not empty placeholders
    elif fsdp.enabled(trainer):
        model, optim, fsdp_info = fsdp.capture(trainer, leave_out=left_out or {})
        engine_info = None
    else:
        optim, engine_info = trainer.optimizer.state_dict(), None
        model = unwrapped.state_dict()
    if left_out is not None:
        base = (frozen or FrozenBase())(left_out)
        if fsdp_info is None:   # fsdp.capture left them out itself, before it took the DTensors' layouts
            model = trained_only(model, left_out)
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "step": trainer.state.global_step,
        "model": model,
        "optim": optim,
        "sched": trainer.lr_scheduler.state_dict(),
        "rng": rng_state(trainer),
        "trainer_state": trainer_state_json(trainer, extra_callback_states, history),
    }
    if engine_info is not None:
        state["deepspeed"] = engine_info
    if fsdp_info is not None:
        state[fsdp.STATE_KEY] = fsdp_info
    if base is not None:
        state[FROZEN_KEY] = base
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    return state
