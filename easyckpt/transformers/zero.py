"""DeepSpeed ZeRO (stages 1, 2 and 3) under TrainerWrapper: what is checked, snapshotted and laid out.

The snapshot takes each rank's state from the DeepSpeed engine: the module's weights (whole on every
rank under ZeRO 1-2; under ZeRO-3 this rank's partition of each parameter, its ``ds_tensor``, never
gathered; of a peft model without its frozen base, ``snapshot.trained_only``, which the files written from it
leave out as ``save_checkpoint(exclude_frozen_parameters=True)`` does, and which DeepSpeed's load under the
Trainer, ``load_module_strict=False`` for a peft model, leaves as the rerun built it), that rank's
``engine.optimizer.state_dict()`` (its partition of the optimizer state, its fp32 master partitions, the loss
scaler), the engine's counters and its LR scheduler. On resume the
state is laid out in DeepSpeed's own checkpoint layout (``latest``, ``global_stepN/mp_rank_00_model_states.pt``
or, under ZeRO-3, one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank,
``global_stepN/zero_pp_rank_R_mp_rank_00_optim_states.pt``) and handed to the Trainer, whose
``deepspeed_load_checkpoint`` calls ``engine.load_checkpoint``: DeepSpeed restores its engine itself, as after
its own save, with nothing of its loading logic re-implemented here. The same writer makes the
``checkpoint-N`` exports DeepSpeed-native, so a plain Trainer + DeepSpeed resumes from them.

A few entries of DeepSpeed's state are Python objects (the loss scaler, ``fragment_address`` records); they
are stored as their class name and fields (``portable``) and rebuilt only for classes of the ``deepspeed``
package (``rebuild``), since easyckpt never unpickles what it reads back.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

STATE_KEY = "deepspeed"       # the engine's counters and file names in the snapshot; "optim" holds its optimizer
OBJECT_TAG = "__easyckpt_object__"
SUPPORTED_STAGES = (1, 2, 3)


def ds_config(trainer: Trainer) -> dict[str, Any]:
    plugin = trainer.accelerator.state.deepspeed_plugin
    config = getattr(plugin, "deepspeed_config", None) or {}
    return config if isinstance(config, dict) else {}


def check_config(trainer: Trainer) -> int:
    """The ZeRO stage, after refusing what the wrapper cannot snapshot exactly (before anything is written)."""
    zero_cfg = ds_config(trainer).get("zero_optimization") or {}
    stage = int(zero_cfg.get("stage", 0) or 0)
    if stage not in SUPPORTED_STAGES:
        raise NotImplementedError(
            f"TrainerWrapper supports DeepSpeed ZeRO stages 1, 2 and 3; this Trainer's DeepSpeed config has "
            f"zero_optimization.stage={stage} (stage 0 keeps no ZeRO optimizer state, whose layout the wrapper "
            "snapshots and writes). Set \"stage\": 1, 2 or 3 in the DeepSpeed config, or drop the wrapper")
    for key in ("offload_optimizer", "offload_param"):
        device = str((zero_cfg.get(key) or {}).get("device", "none") or "none").lower()
        if device not in ("none", ""):
            raise NotImplementedError(
                f"TrainerWrapper does not support DeepSpeed zero_optimization.{key}.device={device!r}: with NVMe "
                "offload the optimizer state lives in DeepSpeed's swap files, outside the tensors a snapshot copies, "
                "and CPU offload runs DeepSpeedCPUAdam (a compiled op that DS_BUILD_OPS=0 installs do not have), "
                "which easyckpt does not test. Remove the offload section (or set its device to \"none\"), or drop "
                "the wrapper")
    return stage


def engine_of(trainer: Trainer) -> Any:
    engine = getattr(trainer, "model_wrapped", None)
    if engine is None or not hasattr(engine, "optimizer") or not hasattr(engine, "global_steps"):
        raise RuntimeError("easyckpt snapshots a DeepSpeed Trainer during training: its DeepSpeed engine is not "
                           "created yet (call TrainerWrapper.train())")
    return engine


def portable(value: Any) -> Any:
    """``value`` with DeepSpeed's objects turned into tagged dicts of their fields (tensors by reference)."""
    if isinstance(value, torch.Tensor) or value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, enum.Enum):   # ZeroStageEnum is an int subclass the flattener refuses
        cls = type(value)
        _check_deepspeed(cls)
        return {OBJECT_TAG: f"{cls.__module__}:{cls.__qualname__}", "enum": value.value}
    if isinstance(value, torch.Size):
        return list(value)
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(portable(v) for v in value)
    cls = type(value)
    _check_deepspeed(cls)
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) \
        else vars(value)
    return {OBJECT_TAG: f"{cls.__module__}:{cls.__qualname__}", "fields": portable(fields)}


def _check_deepspeed(cls: type) -> None:
    if cls.__module__.split(".")[0] != "deepspeed":
        raise TypeError(f"easyckpt cannot snapshot a {cls.__module__}.{cls.__qualname__} in DeepSpeed's state: only "
                        "tensors, plain values and DeepSpeed's own records are taken")


def rebuild(value: Any) -> Any:
    """Inverse of ``portable``; dicts come back as OrderedDict where DeepSpeed's loaders iterate them in order."""
    if isinstance(value, dict):
        if OBJECT_TAG in value:
            module_name, _, qualname = str(value[OBJECT_TAG]).partition(":")
            if module_name.split(".")[0] != "deepspeed":
                raise ValueError(f"refusing to rebuild {value[OBJECT_TAG]!r}: not a DeepSpeed class")
            cls: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if "enum" in value:
                return cls(value["enum"])
            obj = cls.__new__(cls)
            obj.__dict__.update(rebuild(value["fields"]))
            return obj
        return OrderedDict((k, rebuild(v)) for k, v in value.items())
    if isinstance(value, list):
        return [rebuild(v) for v in value]
    if isinstance(value, tuple):
        return tuple(rebuild(v) for v in value)
    return value


def module_state(trainer: Trainer) -> dict[str, Any]:
    """The module's state as this rank holds it: whole under ZeRO 1-2; under ZeRO-3 each partitioned
    parameter's ``ds_tensor`` (this rank's flat slice, padded at the end) instead of the empty placeholder
    ``state_dict()`` gives for it, and buffers whole."""
    module = engine_of(trainer).module
    state = module.state_dict()
    params = dict(module.named_parameters(remove_duplicate=False))
    for name in state:
        param = params.get(name)
        if param is not None and hasattr(param, "ds_tensor"):
            state[name] = param.ds_tensor.detach()
    return state


def partitioned_shapes(trainer: Trainer) -> dict[str, list[int]]:
    """The full shape of every ZeRO-3 partitioned parameter of ``module_state`` (empty under ZeRO 1-2)."""
    module = engine_of(trainer).module
    return {name: list(param.ds_shape) for name, param in module.named_parameters(remove_duplicate=False)
            if hasattr(param, "ds_tensor")}


def consolidate(models: dict[int, dict[str, Any]], info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Whole weights from every rank's ``module_state`` under ZeRO-3 (rank -> state): each parameter's
    partitions in rank order, cut to its size. Names DeepSpeed records as shared (tied embeddings) get the
    same tensor, so that ``save_pretrained`` writes them once, as for the live model."""
    shapes = info.get("partitioned") or {}
    ranks = sorted(models)
    if ranks != list(range(int(info["dp_world_size"]))):
        raise ValueError(f"consolidating ZeRO-3 weights needs every rank's partitions: have ranks {ranks} of "
                         f"{info['dp_world_size']}")
    full: dict[str, torch.Tensor] = {}
    for name, value in models[0].items():
        if name not in shapes:
            full[name] = value
            continue
        shape = shapes[name]
        flat = torch.cat([models[rank][name].reshape(-1) for rank in ranks])
        full[name] = flat[:math.prod(shape)].reshape(shape).clone()
    for name, source in (rebuild(info["shared_params"]) or {}).items():
        if name in full and source in full:
            full[name] = full[source]
    return full


def gathered_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Whole weights of a ZeRO-3 module, gathered from every rank (a collective: every rank calls it).
    Only for the synchronous fallback save; snapshots never gather."""
    import deepspeed

    module = engine_of(trainer).module
    copies: dict[int, torch.Tensor] = {}
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        # one copy per tensor: tied names keep sharing it
        return {name: copies.setdefault(id(value), value.detach().clone())
                for name, value in module.state_dict(keep_vars=True).items()}


def capture(trainer: Trainer, *, exclude_frozen: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's ZeRO optimizer state, the engine's counters and layout) from the live engine; ``exclude_frozen``:
    the snapshot leaves the frozen parameters out (a peft model's base), and the files written from it say so as
    DeepSpeed's ``save_checkpoint(exclude_frozen_parameters=True)`` does (no frozen shapes, which zero_to_fp32 would
    look for)."""
    import deepspeed

    engine = engine_of(trainer)
    zero_name = os.path.basename(engine._get_zero_ckpt_name("", "tag"))
    info: dict[str, Any] = {
        "lr_scheduler": portable(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None,
        "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
        "skipped_steps": int(engine.skipped_steps), "dp_world_size": int(engine.seq_dp_world_size),
        "mp_world_size": int(engine.mp_world_size), "zero_file": zero_name,
        "model_file": os.path.basename(engine._get_ckpt_name("", "tag")),
        # What zero_to_fp32 needs to rebuild full weights from the fp32 partitions.
        "buffer_names": list(engine._get_buffer_names()),
        "param_shapes": portable(engine._get_zero_param_shapes()),
        "shared_params": portable(engine._get_shared_params()),
        "frozen_param_shapes": portable(engine._get_zero_frozen_param_attributes(engine._get_param_shape_func))
        if engine.zero_optimization_partition_gradients() and not exclude_frozen else None,
        "ds_config": portable(engine.config), "ds_version": deepspeed.__version__,
        "stage": int(engine.zero_optimization_stage()),
        # ZeRO-3: which entries of the snapshot's "model" are partitions, and their full shapes
        "partitioned": partitioned_shapes(trainer),
    }
    return portable(engine.optimizer.state_dict()), info


def tag(step: int) -> str:
    return f"global_step{step}"


def is_partitioned(info: dict[str, Any]) -> bool:
    """Whether the snapshot with engine info ``info`` holds ZeRO-3 partitions (one model file per rank)."""
    return bool(info.get("partitioned"))


def write_model_states(directory: Path, step: int, model_state: dict[str, Any], info: dict[str, Any], *,
                       latest: bool = True) -> None:
    """``global_stepN/mp_rank_00_model_states.pt`` (ZeRO-3: this rank's ``zero_pp_rank_R_mp_rank_00_model_states.pt``)
    and ``latest`` as ``engine.save_checkpoint`` writes them."""
    folder = directory / tag(step)
    folder.mkdir(parents=True, exist_ok=True)
    frozen = info.get("frozen_param_shapes")
    partitioned = info.get("partitioned") or {}
    # Under ZeRO-3 DeepSpeed saves the empty placeholder of each partitioned parameter (its data lives in the
    # optimizer file's fp32 partitions, from which load_checkpoint restores it), and buffers whole.
    module = OrderedDict((name, torch.empty(0, dtype=value.dtype) if name in partitioned else value)
                         for name, value in model_state.items())
    state = {
        "module": module, "buffer_names": info["buffer_names"], "optimizer": None,
        "param_shapes": [_sizes(group) for group in rebuild(info["param_shapes"])],
        "frozen_param_shapes": _sizes(rebuild(frozen)) if frozen is not None else None,
        "shared_params": rebuild(info["shared_params"]),
        "frozen_param_fragments": OrderedDict() if frozen is not None else None,
        "lr_scheduler": rebuild(info["lr_scheduler"]), "data_sampler": None, "random_ltd": None,
        "skipped_steps": info["skipped_steps"], "global_steps": info["global_steps"],
        "global_samples": info["global_samples"], "dp_world_size": info["dp_world_size"],
        "mp_world_size": info["mp_world_size"], "ds_config": rebuild(info["ds_config"]),
        "ds_version": info["ds_version"],
    }
    torch.save(state, folder / info["model_file"])
    if latest:
        (directory / "latest").write_text(tag(step), encoding="utf-8")


def _sizes(shapes: dict[str, Any]) -> OrderedDict[str, torch.Size]:
    """Shapes back as torch.Size (stored as lists): zero_to_fp32 calls ``.numel()`` on them under ZeRO-3."""
    return OrderedDict((name, torch.Size(shape)) for name, shape in shapes.items())


def write_optim_states(directory: Path, step: int, optim_state: Any, info: dict[str, Any]) -> None:
    """This rank's ``global_stepN/zero_pp_rank_R_mp_rank_00_optim_states.pt``."""
    folder = directory / tag(step)
    folder.mkdir(parents=True, exist_ok=True)
    state = {"optimizer_state_dict": rebuild(optim_state), "ds_config": rebuild(info["ds_config"]),
             "ds_version": info["ds_version"]}
    torch.save(state, folder / info["zero_file"])

