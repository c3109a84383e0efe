"""The data position of a mid-epoch resume, for dataloaders Lightning cannot restore itself.

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
from collections.abc import Iterable, Iterator
from typing import Any

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
