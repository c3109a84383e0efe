"""Sharded state in one process: the rank-private rule of a resume on another world size, a DTensor's record
(its local shard and where it sits), and the DCP keys easyckpt.dcp gives a saved state."""
from __future__ import annotations

import pytest
import torch

from easyckpt import sharding
from easyckpt.dcp import _keys_of
from easyckpt.state import flatten, flatten_template
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
    assert "ranks 0-1 took their own" in grow and "new ranks 2-2 took rank 0's" in grow and "reseed" in grow


def test_dtensor_is_recorded_as_its_local_shard(one_rank: None) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    sharded = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    replicated = distribute_tensor(torch.ones(2), mesh, [Replicate()])
    skeleton, refs, values = flatten({"model": {"w": sharded, "b": replicated}, "step": 3})
    assert [r.name for r in refs] == ["model/w", "model/b"]
    assert refs[0].shard == ShardSpec((4, 3), (0, 0), ("S(0)",), (1,)) and refs[0].shape == (4, 3)
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
