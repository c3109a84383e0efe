"""peft models (LoRA and the other adapters) under TrainerWrapper: which parameters are the frozen base that the
snapshots leave out (``snapshot.trained_only``), and the adapter-only model state that the Trainer's own FSDP saves of
a peft model hold.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.utils import is_peft_available


def is_peft_model(model: Any) -> bool:
    """Whether the Trainer saves ``model`` as a peft adapter (its own test, without importing peft when absent)."""
    if not is_peft_available():
        return False
    from peft import PeftMixedModel, PeftModel
    return isinstance(model, (PeftModel, PeftMixedModel))


def frozen_parameters(model: Any) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` that do not train, by their ``state_dict()`` names (a tied one under each)."""
    return {name: param for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def fsdp_trainer_state(model: Any, model_state: dict[str, Any], *, full: bool) -> dict[str, Any]:
    """``model_state`` (by the model's parameter names) as the Trainer's FSDP save holds it. Of a peft model that is
    the adapter only: the Trainer passes ``adapter_only=True`` to Accelerate's ``save_fsdp_model`` and
    ``load_fsdp_model``, which then take, under SHARDED_STATE_DICT, peft's own names
    (``get_peft_model_state_dict``: the adapter's name taken out, ``lora_A.weight`` for ``lora_A.default.weight``),
    and under FULL_STATE_DICT (``full``) the model's names without the frozen parameters. Until 2026-12-07 the
    wrapper wrote every parameter under the model's names there, which that load does not find: a resume failed
    with "Missing key in checkpoint state_dict"."""
    if not is_peft_model(model):
        return model_state
    if full:
        frozen = frozen_parameters(model)
        return {name: value for name, value in model_state.items() if name not in frozen}
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(model, state_dict=model_state, adapter_name=model.active_adapter)
