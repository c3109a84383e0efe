"""The data position and RNGs of a resume: a mid-epoch position for dataloaders Lightning cannot restore itself.

Lightning restores the position of a stateful loader (one with ``state_dict``/``load_state_dict``, such as
torchdata's ``StatefulDataLoader``) from the fit loop's state, which every snapshot carries, but in 2.6.6 it
creates the resumed epoch's iterator before it sets that epoch on the samplers; and under DDP the order of a
sampler it wraps comes from a generator nobody saves (:mod:`easyckpt.lightning.sampling`). So after Lightning's
restore, a stateful loader gets its saved state again with the epoch set, its wrapped sampler drawing from the
recorded generator state, and the iterator is created afresh (:func:`reload`). A plain
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

from easyckpt.lightning import sampling

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


def start_next_epoch_as_uninterrupted(trainer: Any) -> None:
    """A resume from a state saved at the last batch end of an epoch: Lightning's ``reset`` counts that epoch
    finished, but the restart stage it set stays until the end of the *next* epoch, whose start then skips the
    ``on_train_epoch_start`` hooks and the ready/started counts (lightning 2.6: ``_FitLoop.on_advance_start``). The
    counts saved later are then one epoch behind, and a resume from such a state sets the wrong epoch on the
    samplers (another order than the uninterrupted run). Called at ``on_train_start`` (after ``reset``): clears the
    stage, so the next epoch starts as it did in the uninterrupted run."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if not (getattr(fit_loop, "restarted_mid_epoch", False) and epoch_loop.restarted_on_train_batch_end
            and epoch_loop.batch_progress.is_last_batch):
        return
    progress = fit_loop.epoch_progress.current
    if not progress.ready == progress.started == progress.processed == progress.completed:
        return   # not the counts Lightning's reset leaves after an epoch's last batch: leave them alone
    fit_loop.reset_restart_stage()
    logger.info("resumed at the end of epoch %d: the next epoch starts as in the uninterrupted run (its "
                "on_train_epoch_start hooks run)", progress.processed - 1)


def continue_after_resume(trainer: Any, rng: dict[str, Any] | None, watched: dict[str, sampling.Draws],
                          saved: dict[str, Any] | None, loader_states: list[dict[str, Any]] | None) -> list[Any]:
    """At the start of a resumed fit (``on_train_start``, before the first batch is drawn): the resumed epoch
    leaves out the batches it had consumed and draws the order the uninterrupted run drew, and the RNGs
    (``rng``: this rank's, from the snapshot) continue.

    A plain loader's consumed batches are skipped here. A stateful one (``StatefulDataLoader``) is given its
    saved state (``loader_states``, from Lightning's loop state) again once the resumed epoch is set on its
    sampler, when Lightning's own restore would get the order wrong (an epoch after the first, or a sampler
    Lightning wraps: ``watched``, whose generator states the snapshot holds in ``saved``). Returns the loaders to
    :func:`restore` at the end of the epoch."""
    fit_loop = trainer.fit_loop
    loaders = train_loaders(trainer)
    fetcher = fit_loop._data_fetcher
    stateful = bool(loaders) and all(is_stateful(loader) for loader in loaders)
    count = consumed(trainer)
    # the epoch Lightning's fit loop hands the samplers (``epoch_progress.current.processed``); at an epoch's
    # end, Lightning's restore has already counted the finished epoch processed: the next one
    epoch = int(getattr(fit_loop.epoch_progress.current, "processed", trainer.current_epoch))
    skipped: list[Any] = []
    if count and fetcher is not None:
        if stateful and loader_states and (watched or epoch > 0):
            reload(loaders, loader_states, epoch)
            with sampling.drawn_from(watched, saved, mid_epoch=True):
                iter(fetcher)
            logger.info("resumed mid-epoch: the loaders' saved positions (batch %d of epoch %d) reloaded once "
                        "the epoch was set", count, epoch)
        elif not stateful:
            by_index = all(index_skippable(loader) for loader in loaders)
            if by_index:
                for loader in loaders:
                    skip_consumed(loader, count)
                    set_epoch(loader, epoch)
                skipped = loaders
            with sampling.drawn_from(watched, saved, mid_epoch=True):
                iter(fetcher)   # this epoch's iterator afresh (over the skipping samplers)
            if not by_index:
                assert fetcher.iterator is not None
                drop_from(fetcher.iterator, count)
            logger.info("resumed mid-epoch: the first %d batches of epoch %d were %s, so the epoch goes on where it "
                        "was (Lightning's warning that the dataloader is not resumable does not apply)", count, epoch,
                        "skipped in the sampler" if by_index else "read and dropped")
    if rng is not None:
        _set_rng_states(numpy_rng(rng))
        if not count and fetcher is not None and trainer.current_epoch > 0:
            # The run resumed at an epoch's end; the uninterrupted run created the next epoch's iterator after
            # it, drawing the loader's seed from the global RNG: so does this one, in the same order, with the
            # next epoch set on the samplers (Lightning does not create it again: it resumes).
            for loader in loaders:
                set_epoch(loader, epoch)
            with sampling.drawn_from(watched, saved, mid_epoch=False):
                iter(fetcher)
    return skipped


def train_loaders(trainer: Any) -> list[Any]:
    """The fit loop's training dataloaders (none before Lightning set them up)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def reload(loaders: list[Any], loader_states: list[dict[str, Any]], epoch: int) -> None:
    """Give each stateful loader its saved state again (Lightning's order: ``CombinedLoader._state_dicts``), with
    the resumed epoch set on its sampler first: the next ``iter()`` then fast-forwards that epoch's order."""
    stateful = [loader for loader in loaders if is_stateful(loader)]
    if len(stateful) != len(loader_states):
        raise RuntimeError(f"the resumed checkpoint holds {len(loader_states)} dataloader states, the trainer has "
                           f"{len(stateful)} stateful loaders: define the dataloaders the run was saved with")
    for loader, state in zip(stateful, loader_states):
        set_epoch(loader, epoch)
        loader.load_state_dict(state)


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
