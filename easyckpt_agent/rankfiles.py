"""The persister's byte path: committed shared-memory slots -> one safetensors file per rank and group, written
into a pending iteration of the ``Storage`` (``easyckpt_wire.storage``).

Every byte goes from the slot's mmap straight to the storage's writer (no copy through Python objects), in
parts of at most ``_CHUNK`` bytes (``_Throttle.PIECE`` under ``EASYCKPT_PERSIST_MBPS``), between which the
agent's shutdown (``ABORT``) stops a persist. A replicated DTensor shard is written once per replica group,
by its writer rank; the others' records say ``stored_by``. What makes the files a checkpoint (marker,
publish, tracker) is ``easyckpt_agent.commit`` and ``easyckpt_agent.persister`` (one node) or
``easyckpt_agent.stages`` (several).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

# Not used here by name: the O_DIRECT writer (easyckpt_wire.storage.posix._Writer) imports numpy at its first write
# (the library's readers must not pay it). In the agent that made the first persist 100-250 ms slower than the
# rest, so that at full speed it often still ran at the next due step, which was then passed over. Loaded at
# agent start instead (about 70 ms, while the ranks are still importing torch).
import numpy  # noqa: F401
import xxhash

from easyckpt_wire import layout
from easyckpt_wire.faults import fault_point
from easyckpt_wire.records import SlotMeta, TensorEntry
from easyckpt_wire.shm import PAGE, SlotMap
from easyckpt_wire.storage import Pending

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20        # large ranges are written in parts of this size
PERSIST_MBPS_ENV = "EASYCKPT_PERSIST_MBPS"


@dataclasses.dataclass(slots=True)
class RankSnapshot:
    """One rank's committed slot, held under a shared lock by the agent while it is persisted."""

    rank: int
    slot: SlotMap
    meta: SlotMeta
    # The xxh3-128 of each tensor that the agent took of this very slot write after its commit (None: not hashed
    # yet): the persist compares the checksums it computes anyway, so bytes changed in shared memory since the
    # commit are never written to storage with a checksum that vouches for them.
    checksums: tuple[bytes, ...] | None = None


class SlotChanged(ValueError):
    """A tensor's bytes in a slot no longer match the checksum the agent took after its commit."""

    def __init__(self, path: object, text: str) -> None:
        self.path = str(path)
        super().__init__(text)


class PersistAborted(RuntimeError):
    """The agent is shutting down and its shutdown_timeout ran out: the persist stops between two writes;
    ``persist`` removes its temporary directory on the way out, so no partial iteration is left."""


# Set by the agent's shutdown (agent.server): one persist runs at a time and abandoning it means the
# process is about to exit, so one flag for the process is enough.
ABORT = threading.Event()


class _Throttle:
    """A cap on the persist write rate, shared by the writer threads (``EASYCKPT_PERSIST_MBPS``): leaves
    bandwidth to others on a shared file system, and reproduces a slow one in tests and benchmarks."""

    PIECE = 4 << 20

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def take(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + nbytes / self.rate
            delay = self.free_at - now - nbytes / self.rate
        if delay > 0:
            time.sleep(delay)   # pacing the writes, not waiting for an event


def _throttle_from_env() -> _Throttle | None:
    text = os.environ.get(PERSIST_MBPS_ENV, "").strip()
    if not text:
        return None
    try:
        mbps = float(text)
    except ValueError:
        raise ValueError(f"{PERSIST_MBPS_ENV}={text!r} is not a number of MB/s") from None
    if mbps <= 0:
        raise ValueError(f"{PERSIST_MBPS_ENV}={text!r} must be positive (unset it for no cap)")
    logger.info("persist writes capped at %.0f MB/s (%s)", mbps, PERSIST_MBPS_ENV)
    return _Throttle(mbps)


_THROTTLE = _throttle_from_env()


Own = dict[int, dict[str, tuple[tuple[int, ...], str, str]]]


def own_shards(snapshots: list[RankSnapshot]) -> Own:
    """{rank: {name: (shape, dtype, group)}} of the tensors each of these ranks writes as its own."""
    return {snap.rank: {e.name: (e.shape, e.dtype, e.group) for e in snap.meta.tensors
                        if e.shard is None or e.shard.written_by(snap.rank)} for snap in snapshots}


def stored_by(rank: int, entry: TensorEntry, own: Own) -> int | None:
    """The rank whose file holds ``rank``'s ``entry``, None for its own file: the writer of its replica group
    (``ShardSpec.writer``), unless that writer is persisted here and does not hold the same tensor (a state
    whose ranks differ), in which case ``rank`` keeps writing its own copy. A writer on another node is
    trusted here and checked at the leader's commit (``layout.link_replicas``)."""
    shard = entry.shard
    if shard is None or shard.writer is None or shard.written_by(rank):
        return None
    theirs = own.get(shard.writer)
    if theirs is not None and theirs.get(entry.name) != (entry.shape, entry.dtype, entry.group):
        return None
    return shard.writer


def bytes_needed(snapshots: list[RankSnapshot]) -> int:
    """What an iteration of these snapshots takes on disk, a little generously: the tensor bytes, each file's
    page-padded header and its last partial block, and the JSON files."""
    total = 0
    own = own_shards(snapshots)
    for snap in snapshots:
        tensors = [entry for entry in snap.meta.tensors if stored_by(snap.rank, entry, own) is None]
        groups = {entry.group for entry in tensors}
        total += sum(entry.nbytes for entry in tensors) + len(groups) * 2 * PAGE + 256 * len(tensors)
        total += len(json.dumps(snap.meta.skeleton, default=str)) + 256 * len(tensors)
    return total + 4 * PAGE


def _record(index: int, entry: TensorEntry, file_name: str) -> dict[str, Any]:
    """A tensor's metadata.json record, without its checksum."""
    shape = list(entry.shape)
    record: dict[str, Any] = {"name": entry.name, "index": index, "kind": entry.kind, "dtype": entry.dtype,
                              "shape": shape, "global_shape": shape, "offsets": [0] * len(shape),
                              "nbytes": entry.nbytes, "file": file_name}
    shard = entry.shard
    if shard is not None:   # a DTensor's local shard: what a resharded load plans with
        record.update(global_shape=list(shard.global_shape), offsets=list(shard.offsets),
                      placements=list(shard.placements), mesh_shape=list(shard.mesh_shape))
        if shard.coordinate is not None:
            record["coordinate"] = list(shard.coordinate)
    return record


def _stored_elsewhere(index: int, entry: TensorEntry, writer: int, world_size: int) -> dict[str, Any]:
    """The record of a replicated shard that another rank of its replica group writes (``ShardSpec.writer``):
    its ``file`` is the writer's, ``stored_by`` names the writer; ``layout.link_replicas`` adds the writer's
    checksum once every rank's records are known (on another node's agent, the writer's are not yet)."""
    record = _record(index, entry, layout.rank_file_name(entry.group, writer, world_size))
    record["stored_by"] = writer
    return record


def _runs(entries: list[tuple[int, TensorEntry]]) -> list[tuple[int, int]]:
    """(slot offset, bytes) of each stretch of tensors that lie back to back in the slot, in file order."""
    runs: list[list[int]] = []
    for _, entry in entries:
        if runs and runs[-1][0] + runs[-1][1] == entry.offset:
            runs[-1][1] += entry.nbytes
        else:
            runs.append([entry.offset, entry.nbytes])
    return [(a, b) for a, b in runs]


def _header(snap: RankSnapshot, entries: list[tuple[int, TensorEntry]], step: int, file_name: str,
            ) -> tuple[bytes, list[dict[str, Any]]]:
    """The safetensors header (its length, the JSON padded so that the data starts on a page) and the
    metadata.json records of the tensors, each with the xxh3-128 of its bytes in the slot."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "easyckpt_step": str(step),
                                               "easyckpt_rank": str(snap.rank)}}
    records = []
    position = 0
    for index, entry in entries:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [position, position + entry.nbytes]}
        position += entry.nbytes
        with snap.slot.data(entry.offset, entry.nbytes) as view:
            digest = xxhash.xxh3_128_digest(view)
        if snap.checksums is not None and index < len(snap.checksums) and snap.checksums[index] != digest:
            raise SlotChanged(snap.slot.path, f"tensor {entry.name!r} of rank {snap.rank}'s step {step} no longer "
                              "matches the checksum the agent took after its commit (shared memory changed or "
                              "corrupted since): not persisted")
        record = _record(index, entry, file_name)
        record[layout.CHECKSUM_ALGO] = digest.hex()
        records.append(record)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % PAGE)  # JSON allows the padding; safetensors readers skip it
    return len(blob).to_bytes(8, "little") + blob, records


def write_safetensors(pending: Pending, name: str, snap: RankSnapshot, entries: list[tuple[int, TensorEntry]],
                      step: int) -> list[dict[str, Any]]:
    """Write one safetensors file of ``pending`` from the slot; returns the metadata.json records of its tensors.

    Tensors go to the file in slot order. The stager lays each file's tensors out back to back from a
    page boundary, so the whole data part is one range of the slot, and the page-padded header makes it
    start on a page in the file too: the storage writes it straight from shared memory (O_DIRECT on POSIX).
    """
    entries = sorted(entries, key=lambda item: item[1].offset)
    head, records = _header(snap, entries, step, name)
    writer = pending.create(name)
    try:
        writer.write(head)
        for run_offset, run_bytes in _runs(entries):
            _write_run(writer, snap.slot, run_offset, run_bytes)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return records


def _write_run(writer: Any, slot: SlotMap, offset: int, nbytes: int) -> None:
    """One range of the slot, in parts, paced by the throttle and stopped by ``ABORT`` between two parts."""
    # Every view of the slot is released on the way out, error or not (``with``): a view that an exception's
    # traceback keeps alive stops the agent from unmapping the slot later.
    piece = _CHUNK if _THROTTLE is None else _Throttle.PIECE
    with slot.data(offset, nbytes) as view:
        for start in range(0, nbytes, piece):
            end = min(nbytes, start + piece)
            if _THROTTLE is not None:
                _THROTTLE.take(end - start)
            if ABORT.is_set():   # checked after the pacing too: it may have slept for seconds
                raise PersistAborted("persist abandoned: the agent is shutting down")
            with view[start:end] as part:
                writer.write(part)


def write_rank_files(pending: Pending, step: int, snapshots: list[RankSnapshot],
                     threads: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The ranks' safetensors files in ``pending``: (their metadata.json entries, common.json entries, bytes)."""
    world_size = snapshots[0].meta.world_size
    ranks_meta: dict[str, Any] = {}
    common: dict[str, Any] = {}
    nbytes = 0
    jobs = []
    own = own_shards(snapshots)
    kept: list[str] = []
    for snap in sorted(snapshots, key=lambda s: s.rank):
        by_group, elsewhere = _split(snap, own, world_size, kept)
        for group in sorted(by_group):
            jobs.append((snap, layout.rank_file_name(group, snap.rank, world_size), by_group[group]))
            nbytes += sum(entry.nbytes for _, entry in by_group[group])
        ranks_meta[str(snap.rank)] = {"files": [name for s, name, _ in jobs if s is snap], "tensors": elsewhere}
        common[str(snap.rank)] = {"skeleton": snap.meta.skeleton, "skeleton_version": snap.meta.skeleton_version}
    if kept:
        logger.warning("step %d: %d replicated shards are written by their own rank, not once per replica group, "
                       "because the group's writer does not hold the same tensor: %s", step, len(kept),
                       "; ".join(kept[:3]) + (" ..." if len(kept) > 3 else ""))
    # Files in parallel: while one thread waits on fsync another hashes and writes.
    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(jobs))), thread_name_prefix="write") as pool:
        futures = [pool.submit(write_safetensors, pending, name, snap, entries, step) for snap, name, entries in jobs]
        for (snap, _, _), future in zip(jobs, futures):
            ranks_meta[str(snap.rank)]["tensors"] += future.result()
            fault_point("agent.persist.after_file", step=step)
    return ranks_meta, common, nbytes


def _split(snap: RankSnapshot, own: Own, world_size: int,
           kept: list[str]) -> tuple[dict[str, list[tuple[int, TensorEntry]]], list[dict[str, Any]]]:
    """A rank's tensors by the file group it writes them to, and the records of those another rank writes."""
    by_group: dict[str, list[tuple[int, TensorEntry]]] = {}
    elsewhere = []
    for index, entry in enumerate(snap.meta.tensors):
        writer = stored_by(snap.rank, entry, own)
        if writer is None:
            by_group.setdefault(entry.group, []).append((index, entry))
            if entry.shard is not None and not entry.shard.written_by(snap.rank):
                kept.append(f"rank {snap.rank}'s {entry.name!r} (writer rank {entry.shard.writer} lacks it)")
        else:   # a replica group's copy that its writer rank puts on disk: one file holds it for all
            elsewhere.append(_stored_elsewhere(index, entry, writer, world_size))
    return by_group, elsewhere
