"""The names ``easyckpt convert --to hf`` writes: those of the unwrapped model (easyckpt.dcp.unwrapped_names); the
names of a DeepSpeed snapshot that no DCP load may take for one tensor (easyckpt.dcp.deepspeed_partitions)."""
from __future__ import annotations

import pytest

from easyckpt.dcp import deepspeed_partitions, unwrapped_names


@pytest.mark.parametrize("names,expected,removed", [
    # nanoGPT's train.py snapshots raw_model.state_dict() of a torch.compile'd model
    (["_orig_mod.lm_head.weight", "_orig_mod.transformer.wte.weight"], ["lm_head.weight", "transformer.wte.weight"],
     ["_orig_mod."]),
    # DDP's wrapper around a compiled model, and a compiled submodule
    (["module._orig_mod.w", "module.head._orig_mod.b"], ["w", "head.b"], ["module.", "_orig_mod."]),
    (["module.w", "module.b"], ["w", "b"], ["module."]),
    # a model of one's own: nothing to remove
    (["encoder.w", "decoder.module.w"], ["encoder.w", "decoder.module.w"], []),
    (["module.w", "head.b"], ["module.w", "head.b"], []),           # not every name: a submodule named "module"
    (["my_orig_mod.w", "x._orig_mod_.b"], ["my_orig_mod.w", "x._orig_mod_.b"], []),   # no such component
    # two names would become one: kept as they are
    (["_orig_mod.w", "w"], ["_orig_mod.w", "w"], []),
    # DDP around a model with a submodule named "module": only DDP's part goes
    (["module.w", "module.module.w"], ["w", "module.w"], ["module."]),
])
def test_the_names_are_those_of_the_unwrapped_model(names: list[str], expected: list[str], removed: list[str]) -> None:
    new, said = unwrapped_names(names)
    assert [new[name] for name in names] == expected
    assert said == removed


KEYS = ["model.h.0.attn.weight", "model.h.0.attn.bias", "model.ln.running_mean", "optim.base.state.0.exp_avg",
        "optim.single_partition_of_fp32_groups.0", "rng.torch"]
VERSION = {"deepspeed.ds_version": "0.19.8"}
OPTIM = ["optim.base.state.0.exp_avg", "optim.single_partition_of_fp32_groups.0"]


@pytest.mark.parametrize("values,expected", [
    ({}, []),                                                       # not DeepSpeed: every name is whole
    ({"deepspeed.stage": 2}, []),                                   # a state of one's own: no DeepSpeed snapshot
    ({"deepspeed.stage": 0, **VERSION}, []),                        # no ZeRO: the optimizer state is whole
    ({"deepspeed.stage": 2, **VERSION}, OPTIM),
    # ZeRO-3: the partitioned parameters too (a buffer stays whole); a name that is only a prefix of one is not one
    ({"deepspeed.stage": 3, **VERSION, "deepspeed.partitioned.h.0.attn.weight": [4, 4],
      "deepspeed.partitioned.h.0.attn": [4]}, ["model.h.0.attn.weight", *OPTIM]),
])
def test_the_names_each_deepspeed_rank_holds_a_partition_of(values: dict[str, object], expected: list[str]) -> None:
    assert deepspeed_partitions(KEYS, values) == expected
