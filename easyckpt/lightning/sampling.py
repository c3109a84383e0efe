"""The order a resumed epoch draws, for samplers whose randomness neither Lightning nor the loader restores.

Under DDP, Lightning shards every sampler other than torch's ``RandomSampler``/``SequentialSampler`` through
its ``DistributedSamplerWrapper``, which draws the wrapped sampler's whole order again at each ``iter()``
(``_DatasetSamplerWrapper.reset``). torchdata's ``StatefulDataLoader(shuffle=True)`` is such a case: its
``RandomSampler`` owns a ``torch.Generator`` that each draw advances. Behind the wrapper, neither Lightning's
loop state nor the loader's ``state_dict`` holds that generator, and how many times an epoch draws depends on
the path: a fresh iterator draws once without workers and twice with them (``_reset``), a resumed one more
often (torchdata's ``load_state_dict`` iterates the sampler again to fast-forward it). A plain Lightning resume
under DDP therefore trains on another order than the uninterrupted run did.

easyckpt watches each wrapped sampler's draws (:class:`Draws`): every snapshot records the generator state the
current order was drawn from and the state now. A mid-epoch resume draws every order of the resumed iterator
from the first (:func:`drawn_from`), then puts the generator where it was; an epoch's end puts it in the
snapshot's state, and the next epoch's iterator, created as in the uninterrupted run, draws the same orders.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

logger = logging.getLogger(__name__)

SEARCH = 4   # draws from a generator's seed tried to find the one that gave the first epoch's order


class Draws:
    """Installed on one of Lightning's ``_DatasetSamplerWrapper`` objects (as the instance attribute ``reset``,
    which ``DistributedSamplerWrapper.__iter__`` calls): remembers the generator state each draw starts from,
    and while ``pinned`` is set, starts every draw from it."""

    def __init__(self, holder: Any, generator: torch.Generator) -> None:
        self.holder, self.generator = holder, generator
        self.draw = holder.reset
        self.order: torch.Tensor | None = None   # the state the current order was drawn from
        self.pinned: torch.Tensor | None = None
        holder.reset = self

    def __call__(self) -> None:
        if self.pinned is not None:
            self.generator.set_state(self.pinned)
        self.order = self.generator.get_state()
        self.draw()

    def remove(self) -> None:
        if vars(self.holder).get("reset") is self:
            del self.holder.reset


def generators(loaders: Iterable[Any]) -> dict[str, tuple[Any, torch.Generator]]:
    """The generators of the samplers Lightning wraps, by a key stable across processes (the loader's index
    and the wrapper's place): key -> (the wrapper's dataset, which draws the order, and the generator)."""
    found: dict[str, tuple[Any, torch.Generator]] = {}
    for index, loader in enumerate(loaders):
        batch_sampler = getattr(loader, "batch_sampler", None)
        for place, sampler in (("sampler", getattr(loader, "sampler", None)),
                               ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
            if not isinstance(sampler, DistributedSamplerWrapper):
                continue
            holder = sampler.dataset   # Lightning's _DatasetSamplerWrapper over the user's sampler
            generator = getattr(getattr(holder, "_sampler", None), "generator", None)
            if isinstance(generator, torch.Generator):
                found[f"{index}.{place}"] = (holder, generator)
    return found


def watch(loaders: Iterable[Any], resumed: bool) -> dict[str, Draws]:
    """Start watching the draws of every wrapped sampler (at the start of fit, after Lightning drew the first
    epoch's order). ``resumed`` False: the first order's state is searched from the generator's seed."""
    watched = {}
    for key, (holder, generator) in generators(loaders).items():
        draws = vars(holder).get("reset")
        watched[key] = draws if isinstance(draws, Draws) else Draws(holder, generator)
        if not resumed and watched[key].order is None:
            watched[key].order = first_order(key, holder, generator)
    return watched


def first_order(key: str, holder: Any, generator: torch.Generator) -> torch.Tensor | None:
    """The state the first epoch's order was drawn from: one of the first few draws from the generator's seed
    (a generator nothing drew from before the loader), found by drawing them again and comparing with the order
    the epoch uses; the generator is left as it was. None, said once, when none gives it."""
    now = generator.get_state()
    generator.manual_seed(generator.initial_seed())
    try:
        for _ in range(SEARCH):
            state = generator.get_state()
            if list(holder._sampler) == getattr(holder, "_sampler_list", None):
                return state
    finally:
        generator.set_state(now)
    logger.warning("the sampler behind loader %s had drawn from its generator before the first epoch (its seed "
                   "does not give the first epoch's order): a resume within the first epoch cannot draw that "
                   "order again and trains on another one; later epochs resume exactly", key)
    return None


def record(watched: dict[str, Draws]) -> dict[str, Any]:
    """What a snapshot holds: per wrapped sampler, the state its current order was drawn from, and the state now."""
    return {"order": {key: d.order for key, d in watched.items() if d.order is not None},
            "now": {key: d.generator.get_state() for key, d in watched.items()}}


@contextlib.contextmanager
def drawn_from(watched: dict[str, Draws], saved: dict[str, Any] | None, mid_epoch: bool) -> Iterator[None]:
    """Around the creation of the resumed epoch's iterator. Mid-epoch, every draw starts from the state the
    snapshot's order was drawn from, and the generator goes on from the snapshot's state after; at an epoch's
    end, the generator starts from the snapshot's state, and the iterator draws as the uninterrupted one did."""
    order, now = (saved or {}).get("order") or {}, (saved or {}).get("now") or {}
    missing = [key for key in watched if key not in (order if mid_epoch else now)]
    if saved is not None and missing:
        logger.warning("the resumed snapshot holds no generator state for the sampler behind loader %s: the resumed "
                       "epoch draws another order than the interrupted one", ", ".join(missing))
    for key, draws in watched.items():
        if mid_epoch:
            draws.pinned = order.get(key)
        elif key in now:
            draws.generator.set_state(now[key])
    try:
        yield
    finally:
        for key, draws in watched.items():
            if draws.pinned is not None:
                draws.pinned = None
                if key in now:
                    draws.generator.set_state(now[key])


def unwatch(watched: dict[str, Draws]) -> None:
    for draws in watched.values():
        draws.remove()
