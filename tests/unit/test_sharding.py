"""Sharded state in one process: the rank-private rule of a resume on another world size, a DTensor's record
(its local shard and where it sits), and the DCP keys easyckpt.dcp gives a saved state."""
from __future__ import annotations

import pytest
import torch

from easyckpt.dcp import _keys_of
from easyckpt.snapshot import sharding
from easyckpt.snapshot.state import flatten, flatten_template
from easyckpt_wire.records import ShardSpec


@pytest.mark.parametrize("rank, saved, expected", [
    (0, 4, 0), (1, 4, 1), (1, 2, 1),     # shrink or same: a rank keeps its own
    (2, 2, 0), (3, 2, 0), (5, 3, 0),     # grow: new ranks take rank 0's
])
def test_source_rank(rank: int, saved: int, expected: int) -> None:
    assert sharding.source_rank(rank, saved) == expected


def test_source_rank_refuses_an_empty_world() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        sharding.source_rank(0, 0)


def test_private_rule_says_what_every_rank_took() -> None:
    assert sharding.private_rule(2, 4) == ("ranks 0-1 took their own rank's private values; "
                                           "the private values of saved ranks 2-3 were dropped")
    grow = sharding.private_rule(3, 2)
    assert "ranks 0-1 took their own" in grow and "new rank 2 took rank 0's" in grow and "reseed" in grow


def test_dtensor_is_recorded_as_its_local_shard(one_rank: None) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    sharded = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    replicated = distribute_tensor(torch.ones(2), mesh, [Replicate()])
    skeleton, refs, values = flatten({"model": {"w": sharded, "b": replicated}, "step": 3})
    assert [r.name for r in refs] == ["model/w", "model/b"]
    assert refs[0].shard == ShardSpec((4, 3), (0, 0), ("S(0)",), (1,), (0,), 0) and refs[0].shape == (4, 3)
    assert type(values[0]) is torch.Tensor and values[0] is sharded._local_tensor
    assert refs[1].shard is not None and refs[1].shard.replicated
    _, _, wrappers = flatten_template({"model": {"w": sharded, "b": replicated}})
    assert wrappers == {0: sharded, 1: replicated}   # what the loaded state hands back

    pending = sharded.redistribute(mesh, [Replicate()]).to_local()
    partial = torch.distributed.tensor.DTensor.from_local(pending, mesh, [Partial()])
    with pytest.raises(TypeError, match=r"state\['g'\].*pending reduction.*redistribute"):
        flatten({"g": partial})


def test_dcp_keys_are_dcp_flattened_paths() -> None:
    skeleton, refs, _ = flatten({"model": {"0.weight": torch.zeros(2)},
                                 "optim": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]},
                                 "rng": (1, torch.zeros(3, dtype=torch.uint8)), "step": 7})
    keys, values = _keys_of(skeleton, len(refs))
    assert keys == {0: "model.0.weight", 1: "optim.state.0.exp_avg"}   # a tensor in a tuple has no DCP key
    assert values == {"optim.param_groups.0.lr": 0.1, "step": 7}


@pytest.mark.parametrize("coordinate, placements, writer", [
    ((1, 1), ("S(0)", "R"), (1, 0)),      # tp-replicated on a (dp, tp) mesh: tp rank 0 of each dp group
    ((0, 1), ("S(0)", "R"), (0, 0)),
    ((1, 0), ("S(0)", "R"), (1, 0)),      # the writer itself
    ((1, 1), ("R", "R"), (0, 0)),         # fully replicated: the mesh's first rank
    ((1, 1), ("R", "S(1)"), (0, 1)),      # Megatron's tensor-parallel shards: replicated on dp
    ((1, 1), ("S(0)", "_S(0, 2)"), (1, 1)),   # nothing replicated: every rank writes its own
    ((3,), ("R",), (0,)),
])
def test_writer_coordinate_is_zero_on_replicated_dims(coordinate: tuple[int, ...], placements: tuple[str, ...],
                                                      writer: tuple[int, ...]) -> None:
    assert sharding.writer_coordinate(coordinate, placements) == writer


def test_writer_coordinate_needs_one_placement_per_dim() -> None:
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        sharding.writer_coordinate((0, 1), ("R",))


@pytest.mark.parametrize("rank", range(4))
def test_shard_spec_names_the_writer_as_a_global_rank(rank: int) -> None:
    """On a (dp, tp) mesh whose rank layout is not row-major, the writer of a tp-replicated tensor is the rank
    at tp coordinate 0 in this rank's dp row, read from the mesh (no process group: a mesh of that rank)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = torch.tensor([[3, 1], [2, 0]])   # rank 3 is (0, 0), rank 0 is (1, 1)
    mesh = DeviceMesh("cpu", layout, mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=rank)
    row = [r for r in layout.tolist() if rank in r][0]
    bias = DTensor.from_local(torch.zeros(2), mesh, [Shard(0), Replicate()], run_check=False,
                              shape=torch.Size([4]), stride=(1,))
    spec = sharding.shard_spec(bias)
    assert spec.coordinate == (layout.tolist().index(row), row.index(rank))
    assert spec.writer == row[0] and spec.written_by(rank) == (rank == row[0])
    full = DTensor.from_local(torch.zeros(3), mesh, [Replicate(), Replicate()], run_check=False)
    assert sharding.shard_spec(full).writer == 3
    split = DTensor.from_local(torch.zeros(1), mesh, [Shard(0), Shard(0)], run_check=False,
                               shape=torch.Size([4]), stride=(1,))
    assert sharding.shard_spec(split).writer == rank   # no replicated dim: its own


def test_a_loaded_tensor_without_a_place_in_a_dtensor_template_is_named(one_rank: None) -> None:
    """An FSDP2 loop's optimizer.state_dict() before the first step is empty: the saved moments have no place in
    the template and come back as plain local shards (easyckpt.recovery.template.left_plain names them, and
    Checkpointer.load warns). Keys the template leaves out on purpose (Lightning's template of a part of its
    checkpoint dictionary), and templates without DTensors, are not named."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from easyckpt.recovery.template import left_plain

    w = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    moments = {"state": {0: {"exp_avg": torch.zeros(4, 2), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1}]}
    loaded = {"model": {"w": w}, "optim": moments, "callbacks": {"best": torch.tensor(0.5)}}
    empty = {"model": {"w": w}, "optim": {"state": {}, "param_groups": [{"lr": 1}]}}
    assert left_plain(empty, loaded) == ["optim/state/0/exp_avg", "optim/state/0/step"]
    assert left_plain({"model": {"w": w}, "optim": moments}, loaded) == []
    assert left_plain({"model": {"w": torch.ones(4, 2)}, "optim": {"state": {}}}, loaded) == []
