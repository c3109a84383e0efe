"""Megatron's tensor-parallel shards as DTensors, so that a save resumes on another tensor/data-parallel size.

Megatron marks a tensor-parallel parameter with ``tensor_model_parallel=True``, ``partition_dim`` and
``partition_stride``: each rank of the tensor-parallel group holds an equal, contiguous slice along
``partition_dim``. Snapshots record such a parameter (and the optimizer moments of the same shape) as a
DTensor over a (data-parallel, tensor-parallel) mesh with placements ``[Replicate(), Shard(partition_dim)]``:
easyckpt then saves the local slice with a ``ShardSpec`` (global shape and offsets), and a resume on another
layout goes through the resharded load (``torch.distributed.checkpoint``'s planning), which reads into the
DTensors of the new layout. No tensor is copied to make these DTensors: they wrap the parameters' storage.

The mesh is built without process groups (``_init_backend=False``): only this rank's coordinate and the
mesh's shape matter for the shard offsets, and DCP's own collectives run on the default group.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from easyckpt.snapshot import sharding

logger = logging.getLogger(__name__)


class TensorParallelError(ValueError):
    """Loaded optimizer state that does not fit this rank's tensor-parallel slice."""


def _groups() -> tuple[list[int], list[int], int]:
    """(data-parallel ranks, tensor-parallel ranks, this rank) of this pipeline stage."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return [rank], [rank], rank
    if not ps.model_parallel_is_initialized():
        return [rank], [rank], rank
    dp = dist.get_process_group_ranks(ps.get_data_parallel_group())
    tp = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    return list(dp), list(tp), rank


@functools.lru_cache(maxsize=8)
def _mesh(dp: tuple[int, ...], tp: tuple[int, ...], rank: int) -> DeviceMesh:
    # Megatron lays ranks out on a regular grid: the tensor-parallel row of data-parallel rank i is this
    # rank's row shifted by (dp[i] - rank).
    grid = torch.tensor([[d + t - rank for t in tp] for d in dp], dtype=torch.int64)
    return DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp"), _init_backend=False)


def mesh() -> DeviceMesh:
    """The (data-parallel, tensor-parallel) mesh of this rank's pipeline stage, built without process groups."""
    dp, tp, rank = _groups()
    return _mesh(tuple(dp), tuple(tp), rank)


def _partition(param: Any) -> int | None:
    """The partition dim of a tensor-parallel parameter, None for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim, stride = int(getattr(param, "partition_dim", -1)), int(getattr(param, "partition_stride", 1))
    if dim < 0:
        return None
    if stride != 1:
        # Its shards interleave (a gated MLP's fc1: both halves in every shard), so they are not contiguous
        # slices: saved as this rank's own tensor, which loads on the same layout; a change of layout then
        # fails on its shape (and concat=True refuses gated MLPs up front).
        return None
    return dim


def _wrap(local: torch.Tensor, dim: int, device_mesh: DeviceMesh) -> DTensor:
    tp = device_mesh.size(1)
    global_shape = list(local.shape)
    global_shape[dim] *= tp
    return DTensor.from_local(local.detach(), device_mesh, [Replicate(), Shard(dim)], run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def partitions(module: Any) -> dict[str, int]:
    """{state-dict name: partition dim} of ``module``'s tensor-parallel parameters (shared ones under every name)."""
    found: dict[str, int] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        dim = _partition(param)
        if dim is not None:
            found[name] = dim
    return found


def wrap_model_state(state: Any, module: Any) -> Any:
    """``state`` (the module's state dict) with its tensor-parallel tensors as DTensors; the same object."""
    dims = partitions(module)
    if not dims:
        return state
    device_mesh = mesh()
    for name, dim in dims.items():
        value = state.get(name)
        if isinstance(value, torch.Tensor) and not sharding.is_dtensor(value):
            state[name] = _wrap(value, dim, device_mesh)
    return state


def _optimizer_params(optimizer: Any) -> list[Any]:
    """The parameters of a torch optimizer (inside Megatron's wrappers) in state-dict index order."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        return []
    return [p for group in inner.param_groups for p in group["params"]]


def _state_entries(state: Any, optimizer: Any) -> Iterator[tuple[dict[Any, Any], Any, int, int]]:
    """(per-parameter optimizer state, key, partition dim, parameter index) of every tensor-parallel parameter's tensors."""
    per_param = state.get("state") if isinstance(state, dict) else None
    if not isinstance(per_param, dict):
        return
    params = _optimizer_params(optimizer)
    for index, entry in per_param.items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entry, dict):
            continue
        dim = _partition(params[index])
        if dim is None:
            continue
        for key in list(entry):
            yield entry, key, dim, index


def wrap_optimizer_state(state: Any, optimizer: Any) -> Any:
    """A torch optimizer's state dict with each tensor-parallel parameter's moments (tensors of its shape)
    as DTensors of the parameter's sharding; the same object. Torch's ``state_dict()`` hands out the live
    per-parameter dicts, so those are replaced by copies rather than edited."""
    params = _optimizer_params(optimizer)
    device_mesh: DeviceMesh | None = None
    copied: set[int] = set()
    for entry, key, dim, index in list(_state_entries(state, optimizer)):
        if index not in copied:
            copied.add(index)
            entry = state["state"][index] = dict(entry)
        else:
            entry = state["state"][index]
        value = entry[key]
        if isinstance(value, torch.Tensor) and not sharding.is_dtensor(value) and value.shape == params[index].shape:
            device_mesh = device_mesh or mesh()
            entry[key] = _wrap(value, dim, device_mesh)
    return state


def localize(state: Any, optimizer: Any) -> Any:
    """The loaded state as Megatron's loaders take it: DTensors back to their local shards (the parameters'
    own storage, already filled), and optimizer moments that came back whole (no template tensor for them:
    a fresh optimizer has no state yet) cut to this rank's slice."""
    if isinstance(state, dict):
        for key, value in state.items():
            if sharding.is_dtensor(value):
                state[key] = sharding.local_tensor(value)
            elif isinstance(value, dict) and key != "optimizer":
                localize(value, None)
    if optimizer is None or not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict):
        return state
    params = _optimizer_params(optimizer)
    optimizer_state = state["optimizer"]
    _, tp, rank = _groups()
    for entry, key, dim, index in _state_entries(optimizer_state, optimizer):
        value = entry[key]
        if sharding.is_dtensor(value):
            entry[key] = sharding.local_tensor(value)
            continue
        local = params[index].shape
        if not isinstance(value, torch.Tensor) or value.shape == local or value.dim() != len(local):
            continue
        size = local[dim]
        if value.shape[dim] != size * len(tp):
            raise TensorParallelError(
                f"optimizer state {index}/{key}: loaded {tuple(value.shape)}, this rank's parameter is {tuple(local)} "
                f"split {len(tp)} ways on dim {dim}: the model was built with another configuration")
        entry[key] = value.narrow(dim, tp.index(rank) * size, size).clone()
    return state
