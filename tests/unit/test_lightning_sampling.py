"""The draws of samplers Lightning wraps (``easyckpt.lightning.sampling``), in one process: the wrapper and
torchdata's sampler are the real ones, iterated as Lightning and torchdata iterate them."""
from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="easyckpt.lightning needs lightning: pip install -e '.[lightning]'")
stateful_sampler = pytest.importorskip("torchdata.stateful_dataloader.sampler",
                                       reason="these tests use torchdata's RandomSampler: pip install torchdata")

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper  # noqa: E402

from easyckpt.lightning import sampling  # noqa: E402


def wrapped(generator: torch.Generator | None = None) -> tuple[Any, DistributedSamplerWrapper]:
    """A loader as Lightning leaves it under DDP: torchdata's RandomSampler behind DistributedSamplerWrapper."""
    inner = stateful_sampler.RandomSampler(range(16), generator=generator)
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=0, shuffle=True, seed=3)
    return types.SimpleNamespace(sampler=wrapper, batch_sampler=None), wrapper


@pytest.mark.parametrize("draws", [1, 2])
def test_a_mid_epoch_resume_draws_the_order_in_use_however_often_either_side_draws(draws: int) -> None:
    """A fresh iterator draws once without workers and twice with them (its order is the last draw's); a resumed
    one draws again to fast-forward. Every draw of the resumed iterator gives the order the snapshot's epoch used,
    and the generator then goes on from where the snapshot left it."""
    loader, wrapper = wrapped()
    list(wrapper)   # the first epoch, before fit's first hook
    watched = sampling.watch([loader], resumed=False)
    wrapper.set_epoch(1)
    for _ in range(draws):
        order = list(wrapper)
    saved = sampling.record(watched)
    after = list(wrapper)   # what the epoch after it draws (the first of its draws)
    assert after != order

    loader, wrapper = wrapped()   # the resumed process: the same loader, drawn again by Lightning's setup
    list(wrapper)
    watched = sampling.watch([loader], resumed=True)
    wrapper.set_epoch(1)
    with sampling.drawn_from(watched, saved, mid_epoch=True):
        assert list(wrapper) == order and list(wrapper) == order and list(wrapper) == order
    assert list(wrapper) == after, "the generator goes on from the snapshot's state"
    sampling.unwatch(watched)
    assert "reset" not in vars(wrapper.dataset)


def test_an_epoch_end_resume_draws_the_next_epoch_as_the_uninterrupted_run() -> None:
    loader, wrapper = wrapped()
    list(wrapper)
    watched = sampling.watch([loader], resumed=False)
    saved = sampling.record(watched)   # the snapshot at the first epoch's last batch
    wrapper.set_epoch(1)
    nexts = [list(wrapper), list(wrapper)]

    loader, wrapper = wrapped()
    list(wrapper)
    list(wrapper)
    watched = sampling.watch([loader], resumed=True)
    wrapper.set_epoch(1)
    with sampling.drawn_from(watched, saved, mid_epoch=False):
        assert [list(wrapper), list(wrapper)] == nexts


@pytest.mark.parametrize("draws", [1, 2])
def test_the_first_order_is_found_from_the_seed_and_refused_for_an_advanced_generator(
        draws: int, caplog: pytest.LogCaptureFixture) -> None:
    loader, wrapper = wrapped()
    for _ in range(draws):   # what Lightning's setup draws before fit's first hook, with or without workers
        order = list(wrapper)
    now = wrapper.dataset._sampler.generator.get_state()
    watched = sampling.watch([loader], resumed=False)
    assert torch.equal(wrapper.dataset._sampler.generator.get_state(), now), "the generator is left as it was"
    with sampling.drawn_from(watched, sampling.record(watched), mid_epoch=True):
        assert list(wrapper) == order

    generator = torch.Generator().manual_seed(7)
    for _ in range(sampling.SEARCH):
        torch.randperm(5, generator=generator)   # the user drew from it before handing it over
    loader, wrapper = wrapped(generator)
    list(wrapper)
    with caplog.at_level(logging.WARNING, logger="easyckpt.lightning.sampling"):
        watched = sampling.watch([loader], resumed=False)
    assert watched["0.sampler"].order is None and sampling.record(watched)["order"] == {}
    assert "loader 0.sampler had drawn from its generator before the first epoch" in caplog.text


def test_loaders_without_a_wrapped_generator_are_not_watched() -> None:
    plain = torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True)
    assert sampling.generators([plain]) == {} and sampling.watch([plain], resumed=False) == {}
    with sampling.drawn_from({}, None, mid_epoch=True):
        assert len(list(plain)) == 4
