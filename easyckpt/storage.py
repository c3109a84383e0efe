"""Reading the on-disk layout: choose iterations, read one rank's tensors, verify every checksum.

The agent writes the layout (see ``easyckpt_wire.layout``); this side trusts nothing it reads: each
tensor's dtype and shape in the safetensors header must match metadata.json, and every byte is
checked against its xxh3-128 before the tensor is used. Every byte is read through the save_dir's
``Storage`` (``easyckpt_wire.storage``): a safetensors file is a ``TensorFile`` over its ranges (an mmap on
POSIX), which the DCP reader (``easyckpt.dcp``) uses too.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy
import torch
import xxhash

from easyckpt.snapshot.state import torch_dtype
from easyckpt.tools import checks
from easyckpt_wire import health, layout, timeline
from easyckpt_wire.layout import CheckpointFormatError
from easyckpt_wire.records import ShardSpec
from easyckpt_wire.storage import BlobReader, Storage, is_url, open_storage

logger = logging.getLogger(__name__)


class CheckpointCorruptError(CheckpointFormatError):
    """A file of a complete-looking checkpoint is missing, truncated or fails its checksum."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorRecord:
    index: int
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    checksum: str
    shard: ShardSpec | None = None   # a DTensor's local shard (metadata.json has its placements)
    stored_by: int | None = None     # a replicated shard written once for its group: the writer's rank


@dataclasses.dataclass(frozen=True, slots=True)
class RankEntry:
    """What one rank needs from an iteration directory, before any tensor byte is read."""

    path: Path
    step: int
    rank: int
    skeleton: Any
    records: list[TensorRecord]


def marked_steps(save_dir: Path) -> list[int]:
    """The steps of save_dir's iterations that carry their completion marker, none parsed (a big model's
    metadata.json is megabytes); [] for an object store, whose listing may retry for minutes, and for a save_dir that
    cannot be listed (at DEBUG: a warning's check, and an unreadable save_dir is said where it matters)."""
    if is_url(save_dir):
        return []
    try:
        return [done for done, _, marked in layout.iterations(open_storage(save_dir)) if marked]
    except OSError as exc:
        logger.debug("cannot list %s: %s", save_dir, exc)
        return []


def newest_first(save_dir: Path) -> list[int]:
    """Complete iterations an automatic load tries, newest first: the tracked one and older ones
    (``timeline.load_order``); every complete one, with a warning, when the tracker names none."""
    complete = [step for step, _ in layout.complete_iterations(save_dir)]
    tracker = layout.read_tracker(save_dir)
    steps = timeline.load_order(complete, tracker)
    if tracker is not None and tracker not in complete:
        logger.warning("%s names iteration %d, which is missing or incomplete; using the newest complete "
                       "iteration (%s) instead", save_dir / layout.TRACKER, tracker, steps[0] if steps else "none")
    elif steps and len(steps) < len(complete):
        newer = sorted(set(complete) - set(steps))
        published = _published_untracked(save_dir, tracker, complete)
        if published is not None:
            logger.warning("%s names iteration %d, but iteration %d was published after it by a persist that died "
                           "before it updated the tracker (%s says so): loading from iteration %d",
                           save_dir / layout.TRACKER, tracker, published, layout.AUDIT_LOG, published)
            return timeline.load_order(complete, published)
        logger.info("%s: iterations %s are newer than the tracked one (%d): an abandoned timeline, or the tracker set "
                    "back by hand; not loaded", save_dir, newer, steps[0])
    return steps


def _published_untracked(save_dir: Path, tracker: int | None, complete: list[int]) -> int | None:
    """``timeline.published_untracked`` over save_dir's audit log (None when it cannot be read: the tracker stands)."""
    try:
        text = open_storage(save_dir).read(layout.AUDIT_LOG).decode("utf-8", errors="replace")
    except OSError as exc:
        logger.info("%s: cannot read %s (%s): iterations newer than the tracked one are not loaded", save_dir,
                    layout.AUDIT_LOG, exc)
        return None
    return timeline.published_untracked(text.splitlines(), tracker, complete)


def iteration_health(iteration_dir: Path) -> health.RankHealth | None:
    """The job's verdict in ``metadata.json`` (None: the iteration has no ``health`` key, or it is unreadable)."""
    try:
        raw = layout.read_metadata(iteration_dir)
    except CheckpointFormatError:
        return None
    if "health" not in raw:
        return None
    try:
        return health.RankHealth.from_wire(raw["health"], str(iteration_dir / layout.METADATA))
    except ValueError as exc:
        logger.warning("%s", exc)
        return None


def disk_health(save_dir: Path, steps: Iterable[int]) -> dict[int, health.RankHealth]:
    """The verdict on each iteration of ``steps``: from ``health_ckpts.json``, else its ``metadata.json``
    (a step neither names is neutral, i.e. healthy). A corrupt index is a warning, not a failed load."""
    entries: dict[int, health.HealthEntry] = {}
    try:
        entries = {e.step: e for e in health.read_health_file(save_dir) or []}
    except health.HealthFileError as exc:
        logger.warning("%s; using each iteration's %s instead", exc, layout.METADATA)
    found = {}
    for step in steps:
        entry = entries.get(step)
        if entry is not None:
            found[step] = health.RankHealth(True, entry.healthy, entry.reasons)
        else:
            found[step] = iteration_health(save_dir / layout.iteration_dirname(step)) or health.NEUTRAL
    return found


def iteration_step(iteration_dir: Path) -> int:
    """The step of an explicit ``iteration_N`` directory (``load_dir=``), which must be complete."""
    match = layout.ITERATION_RE.match(iteration_dir.name)
    if match is None:
        raise CheckpointFormatError(f"{iteration_dir} is not an iteration_N directory of an easyckpt save_dir")
    meta = layout.read_metadata(iteration_dir)
    if meta.get("step") != int(match.group(1)):
        raise CheckpointFormatError(f"{iteration_dir}/{layout.METADATA} says step {meta.get('step')}")
    return int(match.group(1))


def rank_entry(iteration_dir: Path, rank: int, world_size: int | None) -> RankEntry:
    """Rank ``rank``'s part of ``iteration_dir``; with ``world_size``, the iteration must have been written by
    that many ranks (None: any, for a resharded load that reads another world's ranks)."""
    meta = layout.read_metadata(iteration_dir)
    step = meta["step"]
    if world_size is not None and meta.get("world_size") != world_size:
        raise CheckpointFormatError(
            f"{iteration_dir} (step {step}) was written by {meta.get('world_size')} ranks, this job has "
            f"{world_size}: load it with Checkpointer.load(state_dict), which reshards from disk"
        )
    store, key = layout.locate(iteration_dir)
    try:
        info = meta["ranks"][str(rank)]
        common = layout.read_common(store, key, meta)
        skeleton = common["ranks"][str(rank)]["skeleton"]
        # A replicated shard that its group's writer saved has the writer's file and checksum in its record
        # (layout.link_replicas): it reads from there like any other.
        records = [TensorRecord(t["index"], t["name"], t["kind"], t["dtype"], tuple(t["shape"]), t["nbytes"],
                                t["file"], t[layout.CHECKSUM_ALGO], _shard(t, iteration_dir, rank), t.get("stored_by"))
                   for t in info["tensors"]]
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{iteration_dir}: {exc.filename} is missing") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{iteration_dir}: rank {rank} entry is damaged ({type(exc).__name__}: {exc})") from None
    return RankEntry(iteration_dir, step, rank, skeleton, sorted(records, key=lambda r: r.index))


def _shard(record: dict[str, Any], iteration_dir: Path, rank: int) -> ShardSpec | None:
    """The sharding of one metadata.json tensor record; None for a whole tensor (no ``placements``: written
    before sharded state existed, or not a DTensor)."""
    if "placements" not in record:
        return None
    where = f"{iteration_dir / layout.METADATA} (rank {rank})"
    coordinate = record.get("coordinate")
    writer = None if coordinate is None else record.get("stored_by", rank)
    return ShardSpec.from_wire([record["global_shape"], record["offsets"], record["placements"], record["mesh_shape"],
                                coordinate, writer], where, f"tensor {record['name']!r}", tuple(record["shape"]))


class TensorFileError(ValueError):
    """A safetensors file whose header cannot be read, or a tensor it does not hold as it says."""


class TensorFile:
    """One saved safetensors file, read through its ``Storage``: the header parsed once; a tensor's bytes are a
    view of the file (no copy: a mapping on POSIX), hashed where they lie and copied once into their tensor.
    Raises FileNotFoundError, TensorFileError (what is wrong, for the caller's message) or OSError."""

    def __init__(self, store: Storage, key: str) -> None:
        self.where = store.where(key)
        self.reader: BlobReader = store.open(key)
        try:
            size = self.reader.size
            if size < 8:
                raise TensorFileError(f"{size} bytes, not even a safetensors header")
            with self.reader.view(0, 8) as raw:
                length = int.from_bytes(raw, "little")
            if not 0 < length <= size - 8:
                raise TensorFileError(f"a header of {length} bytes in a file of {size}")
            with self.reader.view(8, length) as raw:
                header = json.loads(bytes(raw))
            if not isinstance(header, dict):
                raise TensorFileError("the header is not a JSON object")
        except ValueError as exc:
            self.reader.close()
            raise TensorFileError(str(exc)) from None
        self.header: dict[str, Any] = header
        self.start, self.size = 8 + length, size

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reader.close()

    def check_whole(self) -> None:
        """The data region holds every tensor the header promises (a truncated file fails here, as
        safetensors' own reader refuses it)."""
        ends = [entry["data_offsets"][1] for name, entry in self.header.items()
                if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
                and len(entry["data_offsets"]) == 2 and isinstance(entry["data_offsets"][1], int)]
        if max(ends, default=0) > self.size - self.start:
            raise TensorFileError(f"truncated: its header promises {max(ends)} bytes of tensors, the file holds "
                                  f"{self.size - self.start}")

    def entry(self, name: str) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
        """(begin, end, dtype, shape) of tensor ``name`` as the header says, offsets in the data region."""
        info: Any = self.header.get(name)
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            return begin, end, torch_dtype(info["dtype"]), tuple(int(d) for d in info["shape"])
        except (TypeError, KeyError, ValueError):
            raise TensorFileError("it is not in the file, or its header entry is damaged") from None

    def span(self, begin: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
        """The file offsets of a tensor's bytes, once they are checked to fit its shape and the file."""
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= self.size - self.start or end - begin != count * dtype.itemsize:
            raise TensorFileError(f"data offsets [{begin}, {end}) that do not fit its shape {shape} or the file "
                                  f"({self.size} bytes)")
        return self.start + begin, self.start + end

    def view(self, begin: int, end: int) -> memoryview:
        return self.reader.view(begin, end - begin)


def as_tensor(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new CPU tensor holding a copy of ``data`` (which may be a view of a mapped file)."""
    out = torch.empty(shape, dtype=dtype)
    if len(data):
        out.reshape(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(data, numpy.uint8)
    return out


def view_as_tensor(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data`` itself, no copy (read it only: it may be a read-only mapping)."""
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # The view is only ever read (copied into its target), so torch's warning that it cannot mark a
        # tensor read-only says nothing here.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype).view(shape)


def read_tensors(entry: RankEntry) -> Iterator[tuple[TensorRecord, torch.Tensor]]:
    """Every tensor of the rank, checked against metadata.json and its checksum (CPU tensors)."""
    by_file: dict[str, list[TensorRecord]] = {}
    for record in entry.records:
        by_file.setdefault(record.file, []).append(record)
    store, key = layout.locate(entry.path)
    for file_name, records in by_file.items():
        path = entry.path / file_name
        try:
            handle = TensorFile(store, f"{key}/{file_name}" if key else file_name)
            handle.check_whole()
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path} (step {entry.step}, rank {entry.rank}) is missing"
                                         + _stored_by_note(records, entry.rank)) from None
        except (TensorFileError, OSError) as exc:
            raise CheckpointCorruptError(f"{path} (step {entry.step}) is not a readable safetensors file: {exc}") from None
        with handle:
            for record in records:
                yield record, _read_one(handle, record, entry)


def _read_one(handle: TensorFile, record: TensorRecord, entry: RankEntry) -> torch.Tensor:
    path = handle.where
    try:
        begin, end, dtype, shape = handle.entry(record.name)
        if shape == record.shape:
            begin, end = handle.span(begin, end, dtype, shape)
    except TensorFileError as exc:
        raise CheckpointCorruptError(f"{path}: tensor {record.name!r} of step {entry.step} is unreadable: {exc}") from None
    if shape != record.shape:
        raise CheckpointCorruptError(f"{path}: tensor {record.name!r} has shape {shape}, metadata says {record.shape}")
    with handle.view(begin, end) as data:
        if xxhash.xxh3_128_hexdigest(data) != record.checksum:
            raise CheckpointCorruptError(
                f"{path}: tensor {record.name!r} of step {entry.step}, rank {entry.rank} fails its "
                f"{layout.CHECKSUM_ALGO} checksum: the file is corrupted")
        return as_tensor(data, dtype, shape)


def _stored_by_note(records: list[TensorRecord], rank: int) -> str:
    """For a missing file that another rank wrote: which replicated tensor rank ``rank`` needed from it."""
    shared = [r for r in records if r.stored_by is not None and r.stored_by != rank]
    if not shared:
        return ""
    more = f" and {len(shared) - 1} more replicated tensors" if len(shared) > 1 else ""
    return (f": rank {shared[0].stored_by} wrote it, holding tensor {shared[0].name!r}{more} once for its replica "
            f"group (rank {rank}'s copy was in memory only). Restore the file, or load another iteration")


def verify(save_dir: Path) -> list[tuple[int, Path, str | None]]:
    """Re-read every complete iteration; (step, path, problem or None) for each, oldest first (``checks.verify``,
    which reads the files without torch)."""
    return checks.verify(save_dir)


def iteration_bytes(path: Path) -> int:
    return checks.dir_bytes(path)
