"""What Megatron itself saves, as a nested state easyckpt can snapshot, and how it goes back.

The state has Megatron's own keys (``megatron.training.checkpointing.generate_state_dict``)::

    {"args": {...plain values...}, "checkpoint_version": 3.0, "iteration": N,
     "model": {...} | "model0": {...}, "model1": {...}     # one per virtual pipeline chunk
     "optimizer": optimizer.state_dict(),
     "optimizer_param_state": [...]                          # distributed optimizer only: this rank's shards
     "opt_param_scheduler": opt_param_scheduler.state_dict(),
     "rng_state": [{"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                    "rng_tracker_states"}],
     "num_floating_point_operations_so_far": F,
     "easyckpt_megatron": {"version": 1, "parallel": {tp/pp/dp/ep ranks and sizes}, ...}}

``args`` keeps only plain values (numbers, strings, bools, None, torch dtypes, and lists/tuples/dicts of
them): nothing is pickled, and whatever else a Namespace holds (functions, enums, objects) is left out.
``cuda_rng_state`` is present only where CUDA is; the tracker states only where Megatron's tensor-parallel
RNG tracker is usable and initialised.
"""
from __future__ import annotations

import enum
import io
import logging
import random
from collections import OrderedDict
from typing import Any

import numpy
import torch
import torch.distributed as dist

from easyckpt.megatron import tp

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_KEY = "easyckpt_megatron"
_BYTESIO = "__easyckpt_bytesio__"
_RESTORED_ARGS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")


# parallel layout ------------------------------------------------------------------------------------
def parallel_info() -> dict[str, int]:
    """This rank's place in Megatron's parallel layout (a plain data-parallel layout without Megatron)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    info = {"rank": rank, "world_size": world, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
            "dp_rank": rank, "dp_size": world, "ep_rank": 0, "ep_size": 1, "cp_size": 1, "vp_size": 0}
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return info
    if not ps.model_parallel_is_initialized():
        return info
    info.update(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                cp_size=ps.get_context_parallel_world_size(),
                vp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 0)
    return info


# model chunks ---------------------------------------------------------------------------------------
def unwrap(module: Any) -> Any:
    """The model inside Megatron's DDP / Float16Module / FSDP wrappers and torch's DDP."""
    try:
        from megatron.core.utils import unwrap_model
        module = unwrap_model(module)
    except Exception:  # megatron-core missing, or a version whose wrappers import differently
        pass
    while isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    return module


def model_keys(chunks: list[Any]) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_state(chunk: Any) -> Any:
    module = unwrap(chunk)
    save = getattr(module, "state_dict_for_save_checkpoint", None)
    state = save() if callable(save) else module.state_dict()
    if any(isinstance(v, io.BytesIO) for v in state.values()):
        # TransformerEngine's _extra_state (fp8 metadata) may be a BytesIO: kept as its bytes.
        fixed = OrderedDict((k, {_BYTESIO: v.getvalue()} if isinstance(v, io.BytesIO) else v) for k, v in state.items())
        if hasattr(state, "_metadata"):
            fixed._metadata = state._metadata  # type: ignore[attr-defined]
        state = fixed
    # Tensor-parallel slices as DTensors: saved with their global shape and offsets (see easyckpt.megatron.tp)
    return tp.wrap_model_state(state, module)


def _restore_bytesio(state: Any) -> Any:
    if not isinstance(state, dict):
        return state
    for key, value in state.items():
        if isinstance(value, dict) and list(value) == [_BYTESIO]:
            state[key] = io.BytesIO(value[_BYTESIO])
    return state


def model_template(chunks: list[Any]) -> dict[str, Any]:
    """The model tensors under their checkpoint names: load() fills them in place and checks shapes."""
    return {key: _model_state(chunk) for key, chunk in zip(model_keys(chunks), chunks)}


# optimizer ------------------------------------------------------------------------------------------
def distributed_optimizers(optimizer: Any) -> list[Any]:
    """Megatron DistributedOptimizers inside ``optimizer`` (itself, or the members of a ChainedOptimizer)."""
    if optimizer is None:
        return []
    members = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o for o in members if hasattr(o, "get_parameter_state_dp_reshardable")
            and not getattr(o, "is_stub_optimizer", False)]


def _param_state(optimizer: Any) -> dict[Any, Any]:
    """This rank's distributed-optimizer shards (main params and moments), without gathering: the format
    ``load_parameter_state_from_dp_reshardable`` reads back (which also wants each entry's padding flag)."""
    state = optimizer.get_parameter_state_dp_reshardable()
    for key, per_dtype in state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return state


def _unshare_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam ``step`` tensor again. Falling back to torch Adam (no Transformer
    Engine or Apex), DistributedOptimizer.load_state_dict hands all parameters one shared step tensor, and
    torch's foreach Adam then advances it once per parameter per iteration: the bias correction of a
    resumed run drifts away from the uninterrupted one (seen on an H100 as losses 1% off within four
    iterations)."""
    inner = getattr(optimizer, "optimizer", None)
    seen: set[int] = set()
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


# plain args -----------------------------------------------------------------------------------------
def _plain(value: Any) -> tuple[Any, bool]:
    t = type(value)
    if value is None or t in (str, int, float, bool) or isinstance(value, torch.dtype):
        return value, True
    if isinstance(value, numpy.generic):
        return value.item(), True
    if isinstance(value, enum.Enum):
        return None, False
    if t in (list, tuple):
        items = [_plain(v) for v in value]
        return (t(v for v, _ in items), True) if all(ok for _, ok in items) else (None, False)
    if t is dict and all(type(k) is str for k in value):
        entries = {k: _plain(v) for k, v in value.items()}
        return ({k: v for k, (v, _) in entries.items()}, True) if all(ok for _, ok in entries.values()) else (None, False)
    return None, False


def plain_args(args: Any) -> dict[str, Any]:
    """The plain values of a Megatron args Namespace (or dict); never pickled, others left out."""
    if args is None:
        return {}
    source = args if isinstance(args, dict) else vars(args)
    kept, dropped = {}, []
    for key, value in source.items():
        plain, ok = _plain(value)
        if ok and type(key) is str:
            kept[key] = plain
        else:
            dropped.append(key)
    if dropped:
        logger.debug("easyckpt megatron: args not saved (not plain values): %s", sorted(map(str, dropped)))
    return kept


def get_arg(args: Any, name: str, default: Any = None) -> Any:
    if args is None:
        return default
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def set_arg(args: Any, name: str, value: Any) -> None:
    if isinstance(args, dict):
        args[name] = value
    elif args is not None:
        setattr(args, name, value)


# rng ------------------------------------------------------------------------------------------------
def _tracker() -> Any:
    try:
        from megatron.core import tensor_parallel
        return tensor_parallel.get_cuda_rng_tracker()
    except Exception:  # megatron-core missing or its tracker unusable here
        return None


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                             "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    tracker = _tracker()
    states = {}
    if tracker is not None:
        try:
            states = dict(tracker.get_states())
        except Exception as exc:  # a tracker that cannot report its states: saved without them
            logger.debug("easyckpt megatron: RNG tracker states unavailable: %s", exc)
    state["rng_tracker_states"] = states
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    numpy.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker_states = state.get("rng_tracker_states")
    if tracker_states:
        tracker = _tracker()
        if tracker is None:
            logger.warning("easyckpt megatron: the checkpoint has tensor-parallel RNG tracker states but "
                           "megatron-core's tracker is not importable here: they are not restored")
        else:
            tracker.set_states(dict(tracker_states))


# the whole state ------------------------------------------------------------------------------------
def build(iteration: int, model: list[Any], optimizer: Any, opt_param_scheduler: Any, *, args: Any,
          flops: float | int) -> dict[str, Any]:
    """Megatron's checkpoint state for this rank at ``iteration`` (no tensor is copied here)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    state: dict[str, Any] = {"args": plain_args(args), "checkpoint_version": 3.0, "iteration": iteration}
    state.update(model_template(list(chunks)))
    if not get_arg(args, "no_save_optim", False):
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            state["optimizer"] = tp.wrap_optimizer_state(optimizer.state_dict(), optimizer)
            shards = distributed_optimizers(optimizer)
            if shards:
                state["optimizer_param_state"] = [_param_state(o) for o in shards]
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not get_arg(args, "no_save_rng", False):
        state["rng_state"] = [rng_state()]
    state["num_floating_point_operations_so_far"] = flops
    state[META_KEY] = {"version": FORMAT_VERSION, "parallel": parallel_info(),
                       "distributed_optimizer": bool(distributed_optimizers(optimizer)),
                       "chunks": len(chunks)}
    return state


def apply(state: dict[str, Any], model: list[Any], optimizer: Any, opt_param_scheduler: Any, *, args: Any,
          strict: bool, release: bool = False) -> tuple[int, float | int]:
    """Load ``state`` into model, optimizer, scheduler, RNGs and args as Megatron's load_checkpoint does;
    returns (iteration, num_floating_point_operations_so_far)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    state = tp.localize(state, optimizer)
    finetune = bool(get_arg(args, "finetune", False))
    _load_models(state, list(chunks), strict=strict)
    if not release and not finetune and not get_arg(args, "no_load_optim", False):
        _load_optimizer(state, optimizer)
        if opt_param_scheduler is not None:
            scheduler_state = state.get("opt_param_scheduler", state.get("lr_scheduler"))
            if scheduler_state is not None:
                opt_param_scheduler.load_state_dict(scheduler_state)
    if not release and not finetune and not get_arg(args, "no_load_rng", False) and "rng_state" in state:
        _load_rng(state["rng_state"], args)
    saved_args = state.get("args")
    if args is not None and saved_args is not None and not finetune:
        for name in _RESTORED_ARGS:
            set_arg(args, name, get_arg(saved_args, name, 0))
        _update_microbatches(get_arg(args, "consumed_train_samples", 0))
    iteration = 0 if (finetune or release) else int(state.get("iteration", state.get("total_iters", 0)))
    return iteration, state.get("num_floating_point_operations_so_far", 0)


def _load_models(state: dict[str, Any], chunks: list[Any], *, strict: bool) -> None:
    """Each model chunk from its ``model``/``model{i}`` entry (an empty virtual pipeline stage has none)."""
    keys = model_keys(chunks)
    if len(chunks) == 1 and "model" not in state and "model0" in state:
        keys = ["model0"]
    for key, chunk in zip(keys, chunks):
        if key not in state:
            if len(chunks) > 1:
                continue  # an empty virtual pipeline stage, as in Megatron
            present = sorted(k for k in state if k.startswith("model"))
            raise KeyError(f"the checkpoint has no {key!r} entry (it has {present})")
        unwrap(chunk).load_state_dict(_restore_bytesio(state[key]), strict=strict)


def _load_optimizer(state: dict[str, Any], optimizer: Any) -> None:
    """The optimizer's state, and a distributed optimizer's parameter shards."""
    if optimizer is None or "optimizer" not in state or getattr(optimizer, "is_stub_optimizer", False):
        return
    optimizer.load_state_dict(state["optimizer"])
    shards = distributed_optimizers(optimizer)
    saved = state.get("optimizer_param_state")
    if not shards or saved is None:
        return
    if len(saved) != len(shards):
        raise ValueError(f"the checkpoint has {len(saved)} distributed-optimizer shards, this optimizer {len(shards)}")
    # No autograd: with fp32 training the shard's main params are views of the model's
    # leaf parameters, which an in-place copy under grad mode refuses.
    with torch.no_grad():
        for shard, param_state in zip(shards, saved):
            _unshare_steps(shard)
            shard.load_parameter_state_from_dp_reshardable(param_state)


def _load_rng(states: list[Any], args: Any) -> None:
    """This rank's RNG states: its data-parallel rank's when the run initialised them per dp rank."""
    index = 0
    if get_arg(args, "data_parallel_random_init", False) and len(states) > 1:
        index = parallel_info()["dp_rank"]
    set_rng_state(states[index])


def _update_microbatches(consumed: int) -> None:
    try:
        from megatron.core import num_microbatches_calculator as calculator
    except ImportError:
        return
    # Megatron's global: update_num_microbatches asserts when it is unset, and no public call says whether it is.
    if getattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None:
        calculator.update_num_microbatches(consumed_samples=consumed, verbose=False)
