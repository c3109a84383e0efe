"""Reading the on-disk layout: choose iterations, read one rank's tensors, verify every checksum.

The agent writes the layout (see ``easyckpt_wire.layout``); this side trusts nothing it reads: each
tensor's dtype and shape in the safetensors header must match metadata.json, and every byte is
checked against its xxh3-128 before the tensor is used.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open

from easyckpt import checks
from easyckpt_wire import health, layout, timeline
from easyckpt_wire.layout import CheckpointFormatError
from easyckpt_wire.records import ShardSpec

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
        logger.info("%s: iterations %s are newer than the tracked one (%d): an abandoned timeline, or a persist "
                    "that died before it updated the tracker; not loaded", save_dir,
                    sorted(set(complete) - set(steps)), steps[0])
    return steps


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
    try:
        info = meta["ranks"][str(rank)]
        with open(iteration_dir / layout.COMMON, encoding="utf-8") as handle:
            common = json.load(handle)
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


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def read_tensors(entry: RankEntry) -> Iterator[tuple[TensorRecord, torch.Tensor]]:
    """Every tensor of the rank, checked against metadata.json and its checksum (CPU tensors)."""
    by_file: dict[str, list[TensorRecord]] = {}
    for record in entry.records:
        by_file.setdefault(record.file, []).append(record)
    for file_name, records in by_file.items():
        path = entry.path / file_name
        try:
            handle = safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path} (step {entry.step}, rank {entry.rank}) is missing"
                                         + _stored_by_note(records, entry.rank)) from None
        except Exception as exc:  # safetensors raises its own error type for damaged headers
            raise CheckpointCorruptError(f"{path} (step {entry.step}) is not a readable safetensors file: {exc}") from None
        with handle:
            for record in records:
                try:
                    tensor = handle.get_tensor(record.name)
                except Exception as exc:
                    raise CheckpointCorruptError(
                        f"{path}: tensor {record.name!r} of step {entry.step} is unreadable: {exc}") from None
                if tuple(tensor.shape) != record.shape:
                    raise CheckpointCorruptError(
                        f"{path}: tensor {record.name!r} has shape {tuple(tensor.shape)}, metadata says {record.shape}")
                if xxhash.xxh3_128_hexdigest(_tensor_bytes(tensor)) != record.checksum:
                    raise CheckpointCorruptError(
                        f"{path}: tensor {record.name!r} of step {entry.step}, rank {entry.rank} fails its "
                        f"{layout.CHECKSUM_ALGO} checksum: the file is corrupted")
                yield record, tensor


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
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
