"""Sharded state: what a DTensor's local shard is within its global tensor, and the rules of a resume
on another world size.

A DTensor (FSDP2's parameters and optimizer state, DTensor tensor parallelism) is saved as this rank's
local shard plus a :class:`~easyckpt_wire.records.ShardSpec` (global shape, offsets, placements, mesh
shape), in plain ints and strings so that the agent and the wire stay torch-free. The decisions of a
resharded load are plain functions here, unit-tested in one process.
"""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from easyckpt_wire.records import ShardSpec

logger = logging.getLogger(__name__)


class ShardingError(TypeError):
    """A DTensor that cannot be saved as a local shard (a pending reduction, an unknown placement)."""


def is_dtensor(value: Any) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported; importing it here would cost every process
    # about a second of start-up (DTensor's op tables), also the many that never shard.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(value, dtensor.DTensor)


def local_tensor(value: Any) -> torch.Tensor:
    """The shard this rank holds, without autograd (``to_local`` would record a graph edge)."""
    return value._local_tensor  # type: ignore[no-any-return]


def shard_spec(value: Any) -> ShardSpec:
    """Where ``value``'s (a DTensor's) local shard sits in the global tensor. Cached by the DTensor's spec:
    it is computed every snapshot for thousands of tensors whose spec does not change. The key holds this
    rank's coordinate: meshes of different ranks compare equal (a plan for another world builds them all in
    one process)."""
    coordinate = value._spec.mesh.get_coordinate()
    return _spec_of(value._spec, None if coordinate is None else tuple(int(c) for c in coordinate))


@functools.lru_cache(maxsize=65536)
def _spec_of(spec: Any, coordinate: tuple[int, ...] | None) -> ShardSpec:
    placements = tuple(str(p) for p in spec.placements)
    for p in spec.placements:
        if p.is_partial():
            raise ShardingError(
                f"placement {p} is a pending reduction: the local values are not this rank's part of the "
                "tensor. Redistribute it first (dtensor.redistribute(placements=[Replicate()]) or .full_tensor())")
    mesh = spec.mesh
    if coordinate is None:
        raise ShardingError(f"this rank is not in the DTensor's mesh {tuple(mesh.shape)}: it holds no shard to save")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # loaded: a DTensor exists
    _, offsets = compute_local_shape_and_global_offset(spec.shape, mesh, spec.placements)
    # The mesh's rank layout names the writer as a global rank: the same numbering as the saved files'
    # (a submesh, say FSDP's dp dim of a 2-D mesh, lists the global ranks of this rank's group).
    writer = int(mesh.mesh[writer_coordinate(coordinate, placements)].item())
    # An empty shard reports the end of its dim as its offset: still inside the global tensor.
    return ShardSpec(tuple(int(d) for d in spec.shape), tuple(int(o) for o in offsets), placements,
                     tuple(int(d) for d in mesh.shape), coordinate, writer)


def writer_coordinate(coordinate: Sequence[int], placements: Sequence[str]) -> tuple[int, ...]:
    """The mesh coordinate of the rank that writes a shard to disk for its replica group.

    The rule: a replica group is the ranks whose coordinates differ only on the mesh dims where the
    placement is Replicate (``"R"``): they hold the same bytes. Its writer is the one whose coordinate is 0
    on every such dim (the others keep theirs on the sharded dims). So a tensor replicated on the tp dim of
    a (dp, tp) mesh is written by the tp-rank-0 of each dp group, a fully replicated one by the mesh's first
    rank, and a tensor with no ``R`` placement by every rank (each is its own group). The other ranks of a
    group keep their copy in memory (every tier of memory recovery reads it there) and point to the
    writer's file on disk (``stored_by`` in ``metadata.json``)."""
    if len(coordinate) != len(placements):
        raise ValueError(f"coordinate {tuple(coordinate)} and placements {tuple(placements)} need one entry per mesh dim")
    return tuple(0 if p == "R" else int(c) for c, p in zip(coordinate, placements))


def source_rank(rank: int, saved_world_size: int) -> int:
    """Whose rank-private values (RNG states, data position, plain tensors and every non-tensor value)
    rank ``rank`` takes when the saved world had ``saved_world_size`` ranks: its own where that rank
    existed, else rank 0's. A new rank then replays rank 0's random streams and data position; a job
    that needs distinct streams per rank reseeds the new ranks itself (the log says which ranks did this)."""
    if saved_world_size < 1:
        raise ValueError(f"saved world size {saved_world_size} must be at least 1")
    return rank if rank < saved_world_size else 0


def private_rule(world_size: int, saved_world_size: int) -> str:
    """One line for the log: what every rank of the new world took."""
    def ranks(first: int, last: int) -> str:
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    own = min(world_size, saved_world_size)
    parts = [f"{ranks(0, own - 1)} took their own rank's private values"]
    if world_size > saved_world_size:
        parts.append(f"new {ranks(saved_world_size, world_size - 1)} took rank 0's (RNG states, data position: "
                     "reseed them if they must differ)")
    if saved_world_size > world_size:
        parts.append(f"the private values of saved {ranks(world_size, saved_world_size - 1)} were dropped")
    return "; ".join(parts)


def describe(spec: ShardSpec | None, shape: Sequence[int]) -> str:
    """``global (8, 4), shard (2, 4) at (2, 0), S(0) on mesh (4,)`` for error messages."""
    if spec is None:
        return f"{tuple(shape)} (not sharded)"
    return (f"global {tuple(spec.global_shape)}, shard {tuple(shape)} at {tuple(spec.offsets)}, "
            f"{'/'.join(spec.placements)} on mesh {tuple(spec.mesh_shape)}")
