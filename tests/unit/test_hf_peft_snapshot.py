"""What TrainerWrapper snapshots of a peft model (``easyckpt.transformers.snapshot``): what trains, not the frozen base,
the base given back whole for the Trainer's files, and a fingerprint that tells another base from the same one."""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("peft", reason="the peft snapshot is tested with peft: pip install -e '.[test]'")
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from easyckpt.transformers import snapshot  # noqa: E402


def lora_model(seed: int) -> Any:
    torch.manual_seed(seed)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))


def test_a_peft_model_is_snapshotted_without_its_frozen_base_and_given_back_whole() -> None:
    model = lora_model(0)
    whole = model.state_dict()
    frozen = snapshot.frozen_parameters(model)
    kept = snapshot.trained_only(whole, frozen)
    assert set(kept) == set(whole) - set(frozen) and all("lora_" in name for name in kept), sorted(kept)
    # the tied output embedding is left out under its own name as well
    assert "base_model.model.lm_head.weight" in frozen and "base_model.model.transformer.wte.weight" in frozen
    back = snapshot.with_frozen(model, {name: value.clone() for name, value in kept.items()})
    assert list(back) == list(whole), "the Trainer's files are written in state_dict()'s order"
    assert all(torch.equal(back[name], whole[name]) for name in whole)


def test_a_model_that_is_not_peft_is_snapshotted_whole() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    model.transformer.wte.weight.requires_grad_(False)   # frozen by hand: the Trainer saves it, so do snapshots
    whole = model.state_dict()
    # capture leaves frozen parameters out only of a peft model (snapshot.is_peft_model gates trained_only)
    assert not snapshot.is_peft_model(model) and snapshot.is_peft_model(lora_model(0))
    assert snapshot.with_frozen(model, whole) is whole


def test_the_fingerprint_tells_another_base_from_the_same_one() -> None:
    model = lora_model(0)
    prints = snapshot.FrozenBase()(snapshot.frozen_parameters(model))
    assert set(prints) == set(snapshot.frozen_parameters(model))
    assert snapshot.base_differs(lora_model(0), prints) == [], "the same seed builds the same base"
    other = snapshot.base_differs(lora_model(1), prints)
    assert "base_model.model.transformer.wte.weight" in other
    assert not any(name.endswith(("ln_1.weight", "ln_1.bias")) for name in other), "initialised alike in both"
    # summed in chunks, another order: the last digits differ, not the verdict
    chunked = lora_model(0)
    old, snapshot.FINGERPRINT_CHUNK = snapshot.FINGERPRINT_CHUNK, 7
    try:
        assert snapshot.base_differs(chunked, prints) == []
    finally:
        snapshot.FINGERPRINT_CHUNK = old
    with torch.no_grad():
        chunked.base_model.model.transformer.h[1].attn.c_proj.weight[0, 0] += 1e-3
    assert snapshot.base_differs(chunked, prints) == ["base_model.model.transformer.h.1.attn.c_proj.weight"]


def test_the_fingerprint_is_summed_once_until_a_frozen_parameter_is_written() -> None:
    model = lora_model(0)
    base = snapshot.FrozenBase()
    first = base(snapshot.frozen_parameters(model))
    weight = model.base_model.model.transformer.wpe.weight
    with torch.no_grad():
        weight.mul_(2)   # in place: its version counter moves, so it is summed again
    second = base(snapshot.frozen_parameters(model))
    name = "base_model.model.transformer.wpe.weight"
    assert second[name] != first[name]
    assert {k: v for k, v in second.items() if k != name} == {k: v for k, v in first.items() if k != name}


def test_convert_knows_the_snapshot_entry_of_a_peft_base() -> None:
    """``easyckpt.dcp`` does not import transformers, so it names the entry itself: the two must agree, or
    ``convert --to hf`` of a LoRA iteration would call what trains "the full model weights" again."""
    from easyckpt import dcp

    assert dcp.PEFT_FROZEN_KEY == snapshot.FROZEN_KEY


def test_a_base_partitioned_by_zero3_is_neither_fingerprinted_nor_compared() -> None:
    """Under DeepSpeed ZeRO-3 a parameter is an empty placeholder and each rank holds a slice (``ds_tensor``); a resume
    checks the base before DeepSpeed partitions it again, so such a parameter has no fingerprint, and one partitioned
    now is not compared: neither may be taken for another base."""
    name = "base_model.model.transformer.h.0.attn.c_proj.weight"
    model = lora_model(0)
    frozen = snapshot.frozen_parameters(model)
    frozen[name].ds_tensor = frozen[name].detach().reshape(-1)[:4].clone()   # type: ignore[attr-defined]
    prints = snapshot.FrozenBase()(frozen)
    assert prints[name] is None and all(sums is not None for key, sums in prints.items() if key != name)
    differ = snapshot.base_differs(lora_model(1), prints)
    now = "base_model.model.transformer.h.1.attn.c_proj.weight"
    assert now in differ and name not in differ, differ
    again = lora_model(1)
    partitioned_now = snapshot.frozen_parameters(again)[now]
    partitioned_now.ds_tensor = partitioned_now.detach().reshape(-1)[:4].clone()   # type: ignore[attr-defined]
    assert set(snapshot.base_differs(again, prints)) == set(differ) - {now}
