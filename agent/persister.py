"""Persister: committed shared-memory slots -> one durable ``iteration_N`` directory.

Every byte goes from the slot's mmap straight into the safetensors file (no copy through Python
objects), each file is fsynced once, the directory is built under a temporary name and renamed into
place, the parent is fsynced, and only then is the tracker replaced (invariant 3). The clean-up of dead
writers' leftovers deletes only directories whose names and contents are ours, and every write and
delete is written to the audit log first (invariant 5). Rotation and the moves of a resume's abandoned
iterations live in ``agent.timeline`` (invariant 10).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import psutil
import xxhash

from easyckpt_wire import health as wire_health
from easyckpt_wire import layout
from easyckpt_wire.faults import fault_point
from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.records import SlotMeta, TensorEntry
from easyckpt_wire.shm import PAGE, SlotMap, format_bytes

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20        # large ranges are written in chunks of this size


@dataclasses.dataclass(slots=True)
class RankSnapshot:
    """One rank's committed slot, held under a shared lock by the agent while it is persisted."""

    rank: int
    slot: SlotMap
    meta: SlotMeta


class PersistFailed(Exception):
    """A persist that did not reach disk, in one line: the path, the errno, and the space it needed.

    Raised instead of the OSError from deep in a writer thread, whose 40-line traceback says nothing that
    the path and the errno do not, and whose frames would keep views of the slots alive.
    """

    def __init__(self, step: int, path: Path | str, errno_: int, strerror: str, *, needed: int | None = None,
                 free: int | None = None) -> None:
        self.step, self.path, self.errno, self.strerror = step, str(path), errno_, strerror
        self.needed, self.free = needed, free
        super().__init__(self.text())

    def text(self) -> str:
        return f"{self.path}: [Errno {self.errno}] {self.strerror}" if self.errno else f"{self.path}: {self.strerror}"

    def describe(self) -> str:
        space = ""
        if self.needed is not None and self.free is not None:
            space = f" (needs {format_bytes(self.needed)}; {format_bytes(self.free)} were free when it started)"
        return f"persist of step {self.step} failed: {self.text()}{space}"


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None: it does not say)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    if stat.f_blocks == 0:   # some FUSE and network file systems report nothing: no judgement then
        return None
    return stat.f_bavail * stat.f_frsize


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


def enough_space(needed: int, free: int | None) -> bool:
    """Whether a persist of ``needed`` bytes may start: a file system that does not say is given the benefit
    of the doubt (the write itself then fails cleanly if it must)."""
    return free is None or needed <= free


@dataclasses.dataclass(frozen=True, slots=True)
class PersistStats:
    step: int
    path: Path
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class AuditLog:
    """Append-only JSON lines in ``save_dir/easyckpt-audit.log``, one per write or delete."""

    def __init__(self, save_dir: Path) -> None:
        self.path = save_dir / layout.AUDIT_LOG

    def record(self, op: str, path: Path, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "pid": os.getpid(), "op": op, "path": str(path), **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_safetensors(path: Path, snap: RankSnapshot, entries: list[tuple[int, TensorEntry]],
                       step: int) -> list[dict]:
    """Write one safetensors file from the slot; returns the metadata.json records of its tensors.

    Tensors go to the file in slot order. The stager lays each file's tensors out back to back from a
    page boundary, so the whole data part is one range of the slot: it is written with O_DIRECT
    straight from shared memory (no page cache to fill, which on these VMs is what makes buffered
    writes slow), and the JSON header is padded so that the data starts on a page in the file too.
    """
    entries = sorted(entries, key=lambda item: item[1].offset)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "easyckpt_step": str(step),
                                               "easyckpt_rank": str(snap.rank)}}
    records = []
    position = 0
    for index, entry in entries:
        shape = list(entry.shape)
        header[entry.name] = {"dtype": entry.dtype, "shape": shape,
                              "data_offsets": [position, position + entry.nbytes]}
        position += entry.nbytes
        with snap.slot.data(entry.offset, entry.nbytes) as view:
            digest = xxhash.xxh3_128_hexdigest(view)
        record = _record(index, entry, path.name)
        record[layout.CHECKSUM_ALGO] = digest
        records.append(record)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % PAGE)  # JSON allows the padding; safetensors readers skip it
    data_start = 8 + len(blob)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _pwrite_all(fd, memoryview(len(blob).to_bytes(8, "little") + blob), 0)
            for run_offset, run_bytes, file_offset in _runs(entries, data_start):
                _write_range(fd, path, snap.slot.data(run_offset, run_bytes), file_offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.filename is None:   # pwrite and fsync do not say which file: the message must
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    return records


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


def _runs(entries: list[tuple[int, TensorEntry]], data_start: int) -> list[tuple[int, int, int]]:
    """(slot offset, bytes, file offset) of each stretch of tensors that lie back to back in the slot."""
    runs: list[list[int]] = []
    file_offset = data_start
    for _, entry in entries:
        offset, nbytes = entry.offset, entry.nbytes
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += nbytes
        else:
            runs.append([offset, nbytes, file_offset])
        file_offset += nbytes
    return [(a, b, c) for a, b, c in runs]


def _write_range(fd: int, path: Path, view: memoryview, file_offset: int) -> None:
    """Write ``view`` at ``file_offset``: the page-aligned bulk with O_DIRECT where the file system
    allows it, the rest (and everything, where it does not) through the page cache."""
    # Every view of the slot is released on the way out, error or not (``with``): a view that an exception's
    # traceback keeps alive stops the agent from unmapping the slot later.
    with view:
        bulk = len(view) - len(view) % PAGE
        direct = -1
        if bulk and numpy.frombuffer(view, numpy.uint8).ctypes.data % PAGE == 0 and file_offset % PAGE == 0:
            try:
                direct = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT (tmpfs, some FUSE)
                    raise
        try:
            done = 0
            if direct >= 0:
                for start in range(0, bulk, _CHUNK):
                    with view[start:min(start + _CHUNK, bulk)] as chunk:
                        _pwrite_all(direct, chunk, file_offset + start)
                done = bulk
            for start in range(done, len(view), _CHUNK):
                with view[start:start + _CHUNK] as chunk:
                    _pwrite_all(fd, chunk, file_offset + start)
        finally:
            if direct >= 0:
                os.close(direct)


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


PERSIST_MBPS_ENV = "EASYCKPT_PERSIST_MBPS"
BACKGROUND_NICE = 10   # set by the agent's CLI (--nice)


def lower_priority() -> None:
    """Thread initializer for the agent's bulk work (persist, hashing, backups): only these threads run at
    a lower CPU priority (Linux nice is per thread and inherited by the threads they start), so that
    the loop that declares safe steps answers ranks at once even when training takes every core."""
    if BACKGROUND_NICE:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
        except OSError as exc:   # not permitted here: the work still runs, at the caller's priority
            logger.debug("cannot lower this thread's priority: %s", exc)
_THROTTLE = _throttle_from_env()


class PersistAborted(RuntimeError):
    """The agent is shutting down and its shutdown_timeout ran out: the persist stops between two writes;
    ``persist`` removes its temporary directory on the way out, so no partial iteration is left."""


# Set by the agent's shutdown (agent.server): one persist runs at a time and abandoning it means the
# process is about to exit, so one flag for the process is enough.
ABORT = threading.Event()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        end = len(data) if _THROTTLE is None else min(len(data), done + _Throttle.PIECE)
        if _THROTTLE is not None:
            _THROTTLE.take(end - done)
        if ABORT.is_set():   # checked after the pacing too: it may have slept for seconds
            # No view of the slot may live on in this frame: the exception's traceback keeps the frame, and
            # a view keeps the slot's mmap exported (BufferError when the agent closes it on its way out).
            del data
            raise PersistAborted("persist abandoned: the agent is shutting down")
        with data[done:end] as piece:
            written = os.pwrite(fd, piece, offset + done)
        done += written


def _write_json(path: Path, payload: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, separators=(",", ":"), allow_nan=False)
        handle.flush()
        os.fsync(handle.fileno())


def check_space(save_dir: Path, step: int, snapshots: list[RankSnapshot]) -> tuple[int, int | None]:
    """Say how much a persist needs and how much is free before anything is written; raise PersistFailed
    (ENOSPC) at once when it cannot fit, instead of filling the file system up for nothing."""
    needed, free = bytes_needed(snapshots), free_bytes(save_dir)
    logger.info("persisting step %d to %s: about %s to write, %s free", step, save_dir, format_bytes(needed),
                "unknown" if free is None else format_bytes(free))
    if not enough_space(needed, free):
        raise PersistFailed(step, save_dir, errno.ENOSPC, "not enough free space for this persist, nothing written",
                            needed=needed, free=free)
    return needed, free


def _failure(exc: BaseException, step: int, where: Path, needed: int | None, free: int | None) -> PersistFailed | None:
    """An OSError as a one-line PersistFailed (None for anything else, which is a bug worth its traceback).
    The traceback's frames are cleared: they hold views of the slots, which must not outlive the persist."""
    if isinstance(exc, PersistFailed):
        return exc
    if not isinstance(exc, OSError):
        return None
    traceback.clear_frames(exc.__traceback__)
    return PersistFailed(step, exc.filename or where, exc.errno or 0, exc.strerror or str(exc), needed=needed,
                         free=free)


def _discard(path: Path, step: int, audit: AuditLog) -> None:
    """Remove a failed persist's temporary directory; the audit line is best effort (the disk may be full
    or read-only: the failure itself is what must be reported, not a second one)."""
    if not path.exists():
        return
    try:
        audit.record("delete", path, step=step, reason="persist failed")
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        logger.warning("could not remove the failed persist's %s; the next agent start removes it", path)


def persist(save_dir: Path, step: int, snapshots: list[RankSnapshot], audit: AuditLog, threads: int = 2,
            publishing: Callable[[int], contextlib.AbstractContextManager[bool]] | None = None) -> PersistStats:
    """Write ``iteration_<step>`` atomically from the given ranks' slots. An OSError (a full or read-only
    disk) comes out as PersistFailed, after the temporary directory is removed.

    ``publishing(step)``: held while the directory and the tracker are published; yields False when a
    resume abandoned the step meanwhile (invariant 10): the copy is then removed and ``StepAbandoned``
    raised instead."""
    started = time.monotonic()
    needed, free = check_space(save_dir, step, snapshots)
    tmp = save_dir / f"{layout.TMP_PREFIX}{step:07d}-{os.getpid()}"
    final = save_dir / layout.iteration_dirname(step)
    trash = None
    failure: PersistFailed | None = None
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        audit.record("write-begin", tmp, step=step)
        nbytes = _fill(tmp, step, snapshots, threads)
        with publishing(step) if publishing is not None else contextlib.nullcontext(True) as current:
            if not current:
                audit.record("delete", tmp, step=step, reason="a resume abandoned this step while it was persisted")
                shutil.rmtree(tmp, ignore_errors=True)
                raise StepAbandoned(f"step {step} was abandoned by a resume while it was persisted: not published")
            # A step persisted before and not moved aside (a tracker that lagged a crash) is replaced.
            trash = _replace(tmp, final, save_dir, step, audit)
            audit.record("write", final, step=step, bytes=nbytes)
            fault_point("agent.persist.before_tracker", step=step)
            write_tracker(save_dir, step, audit)
    except BaseException as exc:
        _discard(tmp, step, audit)
        failure = _failure(exc, step, tmp, needed, free)
        if failure is None:
            raise
    if failure is not None:
        raise failure   # outside the handler: no chained OSError (nor its frames) rides along
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    record_health(save_dir, step, wire_health.combine({s.rank: s.meta.health for s in snapshots}), audit)
    return PersistStats(step, final, nbytes, time.monotonic() - started)


def record_health(save_dir: Path, step: int, verdict: RankHealth, audit: AuditLog) -> None:
    """After the tracker names ``step``: rewrite ``health_ckpts.json`` (atomically) with its entry, keeping
    only entries of iterations still on disk. Only when a rank reported metrics or the file exists already:
    a job that does not use health sees no new file. A failure here is logged; the step is durable anyway."""
    path = save_dir / wire_health.HEALTH_FILE
    if not verdict.reporting and not path.exists():
        return
    try:
        try:
            entries = wire_health.read_health_file(save_dir) or []
        except wire_health.HealthFileError as exc:
            logger.warning("%s; it is rewritten from this persist on (older entries are lost)", exc)
            entries = []
        kept = [s for s, _ in layout.complete_iterations(save_dir)]
        new = wire_health.entry_for(step, layout.iteration_dirname(step), verdict)
        wire_health.write_health_file(save_dir, wire_health.updated(entries, new, kept))
        audit.record("health", path, step=step, healthy=verdict.healthy, reasons=list(verdict.reasons))
    except OSError as exc:
        logger.warning("cannot update %s after step %d: %s", path, step, exc)
    if not verdict.healthy:
        logger.warning("step %d is unhealthy: %s (recorded in %s)", step, "; ".join(verdict.reasons), path)


def forget_health(save_dir: Path, audit: AuditLog) -> None:
    """Drop the entries of iterations no longer on disk (rotation, a resume's moves) from an existing
    ``health_ckpts.json``."""
    path = save_dir / wire_health.HEALTH_FILE
    try:
        entries = wire_health.read_health_file(save_dir)
        if entries is None:
            return
        kept = [s for s, _ in layout.complete_iterations(save_dir)]
        left = wire_health.updated(entries, None, kept)
        if len(left) != len(entries):
            wire_health.write_health_file(save_dir, left)
            audit.record("health", path, dropped=sorted({e.step for e in entries} - {e.step for e in left}))
    except (OSError, wire_health.HealthFileError) as exc:
        logger.warning("cannot update %s: %s", path, exc)


def _replace(src: Path, final: Path, save_dir: Path, step: int, audit: AuditLog) -> Path | None:
    """Publish ``src`` as ``final`` (``layout.replace_dir``); returns the replaced copy's trash path."""
    if final.exists():
        audit.record("delete", final, step=step, reason="replaced by a new persist of the same step")
    pid = os.getpid()
    return layout.replace_dir(src, final, aside=save_dir / f"{layout.ASIDE_PREFIX}{step:07d}-{pid}",
                              trash=save_dir / f"{layout.TRASH_PREFIX}{step:07d}-{pid}")


class StepAbandoned(RuntimeError):
    """A persist finished after a resume abandoned its step: nothing was published."""


def _fill(tmp: Path, step: int, snapshots: list[RankSnapshot], threads: int) -> int:
    """Every rank's safetensors files, common.json, and last the commit marker; returns tensor bytes."""
    world_size = snapshots[0].meta.world_size
    ranks_meta, common, nbytes = _write_rank_files(tmp, step, snapshots, threads)
    _write_marker(tmp, step, world_size, ranks_meta, common, nbytes,
                  wire_health.combine({s.rank: s.meta.health for s in snapshots}))
    return nbytes


def _write_marker(tmp: Path, step: int, world_size: int, ranks_meta: dict[str, Any], common: dict[str, Any],
                  nbytes: int, verdict: RankHealth = NEUTRAL) -> None:
    # Before anything of the marker: a replicated shard whose writer's file lacks it fails the persist here.
    layout.link_replicas(ranks_meta, f"step {step} in {tmp}")
    _write_json(tmp / layout.COMMON, {"format": layout.METADATA_FORMAT, "step": step, "ranks": common})
    fault_point("agent.persist.before_marker", step=step)
    _write_json(tmp / layout.METADATA, {
        "format": layout.METADATA_FORMAT, "format_version": layout.METADATA_VERSION, "step": step,
        "world_size": world_size, "framework": "pytorch", "created": time.time(),
        "checksum_algo": layout.CHECKSUM_ALGO, "bytes": nbytes, "health": verdict.to_wire(), "ranks": ranks_meta,
    })
    layout.fsync_dir(tmp)


def _write_rank_files(tmp: Path, step: int, snapshots: list[RankSnapshot],
                      threads: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The ranks' safetensors files in ``tmp``: (their metadata.json entries, common.json entries, bytes)."""
    world_size = snapshots[0].meta.world_size
    ranks_meta: dict[str, Any] = {}
    common: dict[str, Any] = {}
    nbytes = 0
    jobs = []
    own = own_shards(snapshots)
    kept: list[str] = []
    for snap in sorted(snapshots, key=lambda s: s.rank):
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
        futures = [pool.submit(_write_safetensors, tmp / name, snap, entries, step) for snap, name, entries in jobs]
        for (snap, _, _), future in zip(jobs, futures):
            ranks_meta[str(snap.rank)]["tensors"] += future.result()
            fault_point("agent.persist.after_file", step=step)
    return ranks_meta, common, nbytes


# Multi-node (invariant 3: complete only when every node's shards are durable) -------------------------
def persist_shards(save_dir: Path, step: int, snapshots: list[RankSnapshot], node: str, audit: AuditLog,
                   threads: int = 2) -> PersistStats:
    """This node's part of a multi-node checkpoint: its ranks' files in the shared stage directory, then
    ``node-<id>.json`` (fsynced, renamed into place) saying they are durable. The leader commits."""
    started = time.monotonic()
    needed, free = check_space(save_dir, step, snapshots)
    stage = save_dir / layout.stage_dirname(step)
    world_size = snapshots[0].meta.world_size
    failure: PersistFailed | None = None
    try:
        stage.mkdir(exist_ok=True)
        audit.record("write-begin", stage, step=step, node=node)
        ours = [stage / name for snap in snapshots for name in os.listdir(stage)
                if (m := layout.RANK_FILE_RE.match(name)) and int(m.group(2)) == snap.rank]
        for stale in ours:  # an earlier attempt of this node at the same step
            stale.unlink()
        ranks_meta, common, nbytes = _write_rank_files(stage, step, snapshots, threads)
        note = stage / layout.node_file_name(node)
        tmp = note.with_suffix(f".tmp{os.getpid()}")
        _write_json(tmp, {"node": node, "step": step, "world_size": world_size, "bytes": nbytes,
                          "ranks": ranks_meta, "common": common,
                          "health": {str(s.rank): s.meta.health.to_wire() for s in snapshots}})
        os.rename(tmp, note)
        layout.fsync_dir(stage)
    except BaseException as exc:
        try:
            audit.record("write-failed", stage, step=step, node=node)
        except OSError:
            pass   # best effort: the disk may be full or read-only
        failure = _failure(exc, step, stage, needed, free)
        if failure is None:
            raise
    if failure is not None:
        raise failure
    audit.record("write", stage, step=step, node=node, bytes=nbytes, ranks=sorted(int(r) for r in ranks_meta))
    return PersistStats(step, stage, nbytes, time.monotonic() - started)


def stage_progress(save_dir: Path, step: int) -> tuple[int | None, dict[str, Any]]:
    """(world size, {rank: (metadata entry, common entry, bytes share, health)}) from the nodes that
    finished; a rank's health is its verdict from the node's note (neutral from an older agent's note)."""
    stage = save_dir / layout.stage_dirname(step)
    world_size, ranks = None, {}
    for name in sorted(os.listdir(stage)):
        if not layout.NODE_FILE_RE.match(name):
            continue
        try:
            with open(stage / name, encoding="utf-8") as handle:
                note = json.load(handle)
        except (OSError, ValueError) as exc:
            logger.warning("unreadable %s: %s", stage / name, exc)
            continue
        if note.get("step") != step:
            continue
        world_size = note["world_size"]
        for rank, entry in note["ranks"].items():
            try:
                verdict = RankHealth.from_wire((note.get("health") or {}).get(rank), str(stage / name))
            except (ValueError, AttributeError) as exc:
                logger.warning("%s: rank %s's health is unreadable (%s): taken as not reporting", stage / name, rank, exc)
                verdict = NEUTRAL
            ranks[rank] = (entry, note["common"][rank], note["bytes"] / max(1, len(note["ranks"])), verdict)
    return world_size, ranks


def commit_stage(save_dir: Path, step: int, audit: AuditLog) -> PersistStats | None:
    """Leader only: once every rank's files are durable, write the marker and publish the step."""
    started = time.monotonic()
    stage = save_dir / layout.stage_dirname(step)
    world_size, ranks = stage_progress(save_dir, step)
    if world_size is None or sorted(int(r) for r in ranks) != list(range(world_size)):
        return None
    nbytes = int(sum(share for _, _, share, _ in ranks.values()))
    verdict = wire_health.combine({int(r): h for r, (_, _, _, h) in ranks.items()})
    # Every rank's note is in (so every writer's file is durable); a record that names a writer without that
    # tensor stops the commit before the notes go (CheckpointFormatError: the stage is never published).
    layout.link_replicas({r: e for r, (e, _, _, _) in ranks.items()}, f"step {step} in {stage}")
    for name in os.listdir(stage):
        if layout.NODE_FILE_RE.match(name):
            os.unlink(stage / name)
    _write_marker(stage, step, world_size, {r: e for r, (e, _, _, _) in ranks.items()},
                  {r: c for r, (_, c, _, _) in ranks.items()}, nbytes, verdict)
    final = save_dir / layout.iteration_dirname(step)
    trash = _replace(stage, final, save_dir, step, audit)
    if trash is not None:
        shutil.rmtree(trash)
    audit.record("write", final, step=step, bytes=nbytes, nodes="all")
    fault_point("agent.persist.before_tracker", step=step)
    write_tracker(save_dir, step, audit)
    record_health(save_dir, step, verdict, audit)
    return PersistStats(step, final, nbytes, time.monotonic() - started)


def drop_stage(save_dir: Path, step: int, audit: AuditLog, reason: str) -> None:
    stage = save_dir / layout.stage_dirname(step)
    if stage.is_dir():
        audit.record("delete", stage, step=step, reason=reason)
        shutil.rmtree(stage, ignore_errors=True)
        logger.info("removed %s (%s)", stage, reason)


def drop_own_shards(save_dir: Path, step: int, node: str, ranks: list[int], audit: AuditLog) -> None:
    """Remove this node's files (its ``ranks``' and its note) from the stage of ``step``, leaving other
    nodes' alone: they were written for a step a resume abandoned meanwhile."""
    stage = save_dir / layout.stage_dirname(step)
    try:
        names = os.listdir(stage)
    except FileNotFoundError:
        return
    ours = [n for n in names if n == layout.node_file_name(node)
            or ((m := layout.RANK_FILE_RE.match(n)) is not None and int(m.group(2)) in ranks)]
    for name in ours:
        audit.record("delete", stage / name, step=step, node=node, reason="abandoned by a resume while persisted")
        (stage / name).unlink(missing_ok=True)


def stage_steps(save_dir: Path) -> list[int]:
    try:
        return sorted(int(m.group(1)) for name in os.listdir(save_dir) if (m := layout.STAGE_RE.match(name)))
    except FileNotFoundError:
        return []


def write_tracker(save_dir: Path, step: int, audit: AuditLog) -> None:
    layout.write_file_atomic(save_dir / layout.TRACKER, f"{step}\n")
    audit.record("tracker", save_dir / layout.TRACKER, step=step)


def clean_leftovers(save_dir: Path, audit: AuditLog) -> list[Path]:
    """Remove temporary directories of dead writers and iteration directories without a marker."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(save_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        tmp = layout.TMP_RE.match(entry.name)
        if tmp and entry.is_dir(follow_symlinks=False):
            pid = int(tmp.group(2))
            if pid != os.getpid() and psutil.pid_exists(pid):
                continue  # a live writer (another agent of this save_dir?) still owns it
            audit.record("delete", path, step=int(tmp.group(1)), reason="leftover of a dead writer")
            shutil.rmtree(path)
            removed.append(path)
            continue
        aside = layout.ASIDE_RE.match(entry.name)
        if aside and entry.is_dir(follow_symlinks=False):
            step, pid = int(aside.group(1)), int(aside.group(2))
            if pid != os.getpid() and psutil.pid_exists(pid):
                continue
            final = save_dir / layout.iteration_dirname(step)
            restore = not final.exists()
            audit.record("rename" if restore else "delete", path, step=step,
                         reason="a replace that died: the old copy goes back" if restore else "leftover of a dead writer")
            layout.settle_aside(path, final, save_dir / f"{layout.TRASH_PREFIX}{step:07d}-{pid}")
            removed.append(path)
            continue
        match = layout.ITERATION_RE.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not (path / layout.METADATA).exists():
            names = os.listdir(path)
            if all(layout.RANK_FILE_RE.match(n) or n == layout.COMMON for n in names):
                audit.record("delete", path, step=int(match.group(1)), reason="incomplete: no commit marker")
                shutil.rmtree(path)
                removed.append(path)
            else:
                logger.warning("%s has no %s but holds files that are not ours: left alone",
                               path, layout.METADATA)
    for path in removed:
        logger.info("cleaned up %s", path)
    return removed


def describe(stats: PersistStats, ranks: int) -> str:
    return (f"persisted step={stats.step} ranks={ranks} bytes={stats.nbytes} ({format_bytes(stats.nbytes)}) "
            f"seconds={stats.seconds:.4f} GB/s={stats.gbps:.2f} path={stats.path}")
