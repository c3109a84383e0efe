"""The data position and RNGs of a resume: a mid-epoch position for dataloaders Lightning cannot restore itself.

Lightning restores the position of a stateful loader (one with ``state_dict``/``load_state_dict``, such as
torchdata's ``StatefulDataLoader``) from the fit loop's state, which every snapshot carries; those are left to
it (under DDP, Lightning 2.6.6's own mid-epoch resume of a ``StatefulDataLoader`` did not give back the
uninterrupted run's batches when we measured it, with or without easyckpt). A plain
``DataLoader`` has no state: Lightning resumes its batch counter mid-epoch but iterates the loader from the
epoch's first batch again (it warns "your dataloader is not resumable"), so the batches after a resume are
not the ones the uninterrupted run saw. :func:`skip_consumed` makes them so: the resumed epoch's first
iteration leaves out the batches the epoch had consumed, at the index level (no sample is loaded for them)
when the loader has a sampler, by reading them otherwise (an ``IterableDataset``). The sampler's order is
the epoch's own (``DistributedSampler`` seeds it with seed + epoch), so skipping whole batches of it lands
exactly where the run was.
"""
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.seed import _set_rng_states
from torch.utils.data import DataLoader

logger = logging.getLogger(__name__)


class SkipFirst:
    """An index sampler (a batch sampler, or the sampler of a loader without automatic batching) whose
    next iteration leaves out its first ``count`` items; later iterations are the wrapped one's. Other
    attributes (``sampler``, ``batch_size``, ``drop_last``, ``set_epoch``) are the wrapped one's, so
    Lightning's per-epoch ``set_epoch`` still reaches the sampler."""

    def __init__(self, wrapped: Iterable[Any], count: int) -> None:
        self.wrapped = wrapped
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.wrapped), count, None)

    def __len__(self) -> int:
        return len(self.wrapped)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":   # not set yet (copy, pickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def is_stateful(loader: Any) -> bool:
    """Lightning saves and restores this loader's position itself (``lightning.fabric`` ``_Stateful``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def index_skippable(loader: Any) -> bool:
    """The loader draws its batches from an index sampler, so batches can be skipped without loading them."""
    if not isinstance(loader, DataLoader) or _iterable_dataset(loader):
        return False
    return loader.batch_sampler is not None or loader.sampler is not None


def skip_consumed(loader: DataLoader[Any], count: int) -> None:
    """Make the next iteration of ``loader`` (``index_skippable``) start after its first ``count`` batches.

    The loader's index sampler is replaced by a :class:`SkipFirst`. ``DataLoader`` refuses that assignment
    after construction to keep its live iterators consistent; the caller creates this epoch's iterator
    afresh after the change, and :func:`restore` puts the original back at the end of the epoch."""
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    object.__setattr__(loader, name, SkipFirst(getattr(loader, name), count))


def restore(loader: Any) -> None:
    """Put back what :func:`skip_consumed` replaced (at the end of the resumed epoch)."""
    if not isinstance(loader, DataLoader):
        return
    for name in ("batch_sampler", "sampler"):
        value = getattr(loader, name, None)
        if isinstance(value, SkipFirst):
            object.__setattr__(loader, name, value.wrapped)


def _iterable_dataset(loader: DataLoader[Any]) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(loader.dataset, IterableDataset)


def drop_from(iterator: Iterator[Any], count: int) -> None:
    """Read and drop ``count`` batches: the way to a mid-epoch position of a loader without a sampler."""
    for _ in range(count):
        next(iterator)


def consumed(trainer: Any) -> int:
    """Batches of the resumed epoch already trained on: where Lightning's epoch loop continues counting
    (``_TrainingEpochLoop.reset``: a state saved at a batch end counts that batch as completed, and an epoch
    completed so is over)."""
    loop = trainer.fit_loop.epoch_loop
    if not loop.restarting or not math.isfinite(trainer.num_training_batches):
        return 0
    count = loop.batch_progress.current.completed + (1 if loop.restarted_on_train_batch_end else 0)
    return 0 if count >= trainer.num_training_batches else count


def continue_after_resume(trainer: Any, rng: dict[str, Any] | None) -> list[Any]:
    """At the start of a resumed fit (``on_train_start``, before the first batch is drawn): the resumed epoch
    leaves out the batches it had consumed, unless Lightning restores the loaders itself (stateful ones), and
    the RNGs (``rng``: this rank's, from the snapshot) continue. Returns the loaders to :func:`restore` at the
    end of the epoch."""
    fit_loop = trainer.fit_loop
    loaders = list(fit_loop._combined_loader.flattened) if fit_loop._combined_loader is not None else []
    fetcher = fit_loop._data_fetcher
    stateful = bool(loaders) and all(is_stateful(loader) for loader in loaders)
    count = consumed(trainer)
    skipped: list[Any] = []
    if count and not stateful and fetcher is not None:
        # the epoch Lightning's fit loop hands the samplers (``epoch_progress.current.processed``)
        epoch = int(getattr(fit_loop.epoch_progress.current, "processed", trainer.current_epoch))
        if all(index_skippable(loader) for loader in loaders):
            for loader in loaders:
                skip_consumed(loader, count)
                set_epoch(loader, epoch)
            skipped = loaders
            iter(fetcher)   # this epoch's iterator afresh, over the skipping samplers
            how = "skipped in the sampler"
        else:
            iter(fetcher)
            assert fetcher.iterator is not None
            drop_from(fetcher.iterator, count)
            how = "read and dropped"
        logger.info("resumed mid-epoch: the first %d batches of epoch %d were %s", count, epoch, how)
    if rng is not None:
        _set_rng_states(numpy_rng(rng))
        if not count and not stateful and fetcher is not None and trainer.current_epoch > 0:
            # The run resumed at an epoch's end; the uninterrupted run created the next epoch's iterator after
            # it, drawing the loader's seed from the global RNG: so does this one, in the same order.
            iter(fetcher)
    return skipped


def set_epoch(loader: Any, epoch: int) -> None:
    """What Lightning's fit loop does at each epoch start (``_set_sampler_epoch``), needed before this epoch's
    iterator is created again."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        method = getattr(sampler, "set_epoch", None)
        if callable(method):
            method(epoch)


def portable_rng(states: dict[str, Any]) -> dict[str, Any]:
    """numpy's RNG state with its key array as a tensor: the .ckpt files Lightning writes then stay loadable
    with ``torch.load(weights_only=True)``, as a plain Lightning Trainer loads them."""
    numpy_state = states.get("numpy")
    if numpy_state is not None:
        name, keys, *rest = numpy_state
        states["numpy"] = (name, torch.from_numpy(keys.copy()), *rest)
    return states


def numpy_rng(states: dict[str, Any]) -> dict[str, Any]:
    """The RNG states as ``_set_rng_states`` takes them (numpy's key array back from a tensor)."""
    numpy_state = states.get("numpy")
    if numpy_state is not None and isinstance(numpy_state[1], torch.Tensor):
        name, keys, *rest = numpy_state
        states = {**states, "numpy": (name, keys.numpy(), *rest)}
    return states
