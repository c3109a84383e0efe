"""Shared-memory slot format, version 2: one file per rank per slot in ``EASYCKPT_SHM_DIR``.

A slot file is laid out as::

    [0, 4096)                  header (struct below), written only by the owning rank
    [4096, 4096 + data_len)    tensor bytes: each file's tensors back to back (dtype-aligned) from a page boundary
    [meta_offset, +meta_len)   msgpack metadata: skeleton, tensor index, rank, step

The header is a seqlock: a writer makes ``generation`` odd and ``state`` WRITING before it touches a
byte, and only after every byte is in place writes the metadata, step, lengths, ``state`` COMMITTED
and an even ``generation``. A reader checks the generation before and after it reads; a changed or
odd generation means the read is discarded (invariant 1). The committed header carries an xxh64 of its
own fields (version 2): a byte flipped in memory would otherwise turn the step, the rank or a length
into another plausible value that nothing else checks (a soak once resumed "step 2089670227099910147").
Writers and readers also take ``flock`` locks on the file (exclusive to write, shared to read); the
kernel drops them when a process dies, so a ``kill -9`` never leaves a slot locked.
"""
from __future__ import annotations

import dataclasses
import enum
import fcntl
import logging
import mmap
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import xxhash

logger = logging.getLogger(__name__)
# slot file -> the generation whose damaged header this process reported (a process maps one file several times)
_DAMAGE_REPORTED: dict[Path, int] = {}

MAGIC = b"EZCKSLOT"
FORMAT_VERSION = 2
# The O_DIRECT alignment of memory, file offset and length: each file's tensors start on a page of the
# slot (the stager's plan) so the agent writes them to disk in one aligned range (the persister).
PAGE = 4096
HEADER_SIZE = PAGE
DATA_OFFSET = HEADER_SIZE
TENSOR_ALIGN = 64
MAX_META_BYTES = 256 << 20

# magic, version, state, step, generation, data_offset, data_len, meta_offset, meta_len,
# meta_checksum, rank, world_size, committed_at, job_id, then header_checksum: the xxh64 of the
# SEALED_BYTES before it as they read once the slot is committed (state COMMITTED, even generation)
_HEADER = struct.Struct("<8sIIqQQQQQQiid64sQ")
SEALED_BYTES = _HEADER.size - 8
HEADER_BYTES = _HEADER.size

DEFAULT_SHM_DIR = "/dev/shm"
SHM_DIR_ENV = "EASYCKPT_SHM_DIR"
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COMMITTED = 2


class SlotFormatError(RuntimeError):
    """A slot file is not ours, is from another format version, or its metadata is damaged."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotHeader:
    state: SlotState
    step: int
    generation: int
    data_len: int
    meta_offset: int
    meta_len: int
    meta_checksum: int
    rank: int
    world_size: int
    committed_at: float
    job_id: str
    # COMMITTED with an even generation, yet its fields fail their checksum twice alike: changed in memory
    # after the commit (a writer's store in progress reads as WRITING instead)
    damaged: bool = False

    @property
    def committed(self) -> bool:
        return self.state == SlotState.COMMITTED and self.generation % 2 == 0 and not self.damaged


def shm_dir() -> Path:
    return Path(os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR)


# File systems whose files live in memory: what "shared memory" must be for a snapshot to be near-free.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def filesystem_type(path: Path, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the file system holding ``path`` (its longest mount point prefix in ``mounts``), None
    where that cannot be told (no /proc, an unreadable table)."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as handle:
            table = handle.read().splitlines()
        target = os.path.realpath(path)
    except OSError:
        return None
    best, kind = "", None
    for line in table:
        fields = line.split()
        if len(fields) < 3:
            continue
        # Spaces and the like in a mount point are octal escapes (\040) in the table.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def check_job_id(job_id: str) -> str:
    if not _JOB_ID_RE.match(job_id):
        raise ValueError(
            f"job id {job_id!r} is invalid: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "(set EASYCKPT_JOB_ID accordingly)"
        )
    return job_id


def slot_path(directory: Path, job_id: str, rank: int, slot: int) -> Path:
    return directory / f"easyckpt-{job_id}-r{rank:06d}-s{slot}"


_SLOT_NAME_RE = re.compile(r"^easyckpt-(?P<job>[A-Za-z0-9_.-]+)-r(?P<rank>\d{6})-s(?P<slot>\d)$")
MAX_SLOTS = 8  # slot indices are one digit in the file name


def list_slots(directory: Path, job_id: str) -> dict[tuple[int, int], Path]:
    """All slot files of ``job_id`` in ``directory`` as {(rank, slot): path}."""
    found: dict[tuple[int, int], Path] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return found
    for name in names:
        match = _SLOT_NAME_RE.match(name)
        if match and match.group("job") == job_id:
            found[(int(match.group("rank")), int(match.group("slot")))] = directory / name
    return found


def align(value: int, to: int = TENSOR_ALIGN) -> int:
    return (value + to - 1) // to * to


def pack_meta(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def meta_checksum(blob: bytes | memoryview) -> int:
    return xxhash.xxh64_intdigest(blob)


class SlotMap:
    """An mmap of one slot file that follows the file when its writer grows it.

    Used by both sides: the rank writes through it, the agent and a restarted rank read through it.
    """

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        self.writable = writable
        self.fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        self.mm: mmap.mmap | None = None
        self._map()

    def _map(self) -> None:
        size = os.fstat(self.fd).st_size
        if size < HEADER_SIZE:
            raise SlotFormatError(f"{self.path}: {size} bytes is smaller than a slot header")
        access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
        self.mm = mmap.mmap(self.fd, size, access=access)

    @property
    def size(self) -> int:
        assert self.mm is not None
        return len(self.mm)

    def refresh(self) -> None:
        """Re-map if the writer grew the file since we mapped it (or if it is unmapped)."""
        if self.mm is None or os.fstat(self.fd).st_size != len(self.mm):
            self.unmap()
            self._map()

    def unmap(self, *, drop_exported: bool = False) -> None:
        """Unmap; raises BufferError while a view of the map is alive, unless ``drop_exported``: then only
        our reference goes, and the mapping lives on until its last view does (an exception's traceback may
        hold one, and a process on its way out must not fail on it)."""
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                if not drop_exported:
                    raise
            self.mm = None

    def close(self, *, drop_exported: bool = False) -> None:
        """Unmap and close the file; a second call does nothing."""
        self.unmap(drop_exported=drop_exported)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # locks -----------------------------------------------------------------------------------------
    def try_lock(self, *, exclusive: bool) -> bool:
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def lock_shared(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.try_lock(exclusive=False):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"slot read lock on {self.path}: still held for writing after {timeout:.1f}s"
                )
            time.sleep(0.005)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    # header ----------------------------------------------------------------------------------------
    def header(self) -> SlotHeader:
        assert self.mm is not None
        raw = self.mm[:HEADER_BYTES]
        (magic, version, state, step, generation, _data_off, data_len, meta_offset, meta_len, checksum,
         rank, world_size, committed_at, job, sealed) = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise SlotFormatError(f"{self.path}: not an easyckpt slot (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise SlotFormatError(
                f"{self.path}: slot format version {version}, this build reads {FORMAT_VERSION}; "
                "delete the file or use the easyckpt version that wrote it"
            )
        try:
            slot_state = SlotState(state)
        except ValueError:
            raise SlotFormatError(f"{self.path}: unknown slot state {state}") from None
        damaged = False
        committed = slot_state == SlotState.COMMITTED and generation % 2 == 0
        if committed and xxhash.xxh64_intdigest(raw[:SEALED_BYTES]) != sealed:
            # Read without a lock, a header can be caught between a writer's stores: changed bytes on a second
            # read mean a write in progress, the same bytes mean the header itself is damaged.
            if self.mm[:HEADER_BYTES] != raw:
                slot_state = SlotState.WRITING
            else:
                damaged = True
                if _DAMAGE_REPORTED.get(self.path) != generation:   # once per snapshot and process, not per read
                    _DAMAGE_REPORTED[self.path] = generation
                    logger.warning("the header of %s fails its checksum (changed in memory after its commit; it "
                                   "reads step %d): that snapshot is never loaded, persisted or served", self.path,
                                   step)
        return SlotHeader(slot_state, step, generation, data_len, meta_offset, meta_len, checksum,
                          rank, world_size, committed_at, job.rstrip(b"\0").decode("ascii", "replace"), damaged)

    def generation(self) -> int:
        assert self.mm is not None
        return struct.unpack_from("<Q", self.mm, 24)[0]

    def read_meta(self, header: SlotHeader) -> dict[str, Any]:
        """The metadata of a committed header, checksum verified."""
        assert self.mm is not None
        end = header.meta_offset + header.meta_len
        if header.meta_len > MAX_META_BYTES or end > self.size or header.meta_offset < DATA_OFFSET:
            raise SlotFormatError(f"{self.path}: metadata range [{header.meta_offset}, {end}) is invalid")
        blob = self.mm[header.meta_offset:end]
        if meta_checksum(blob) != header.meta_checksum:
            raise SlotFormatError(f"{self.path}: metadata checksum mismatch for step {header.step}")
        try:
            meta = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types for garbage
            raise SlotFormatError(f"{self.path}: metadata does not decode: {exc}") from None
        if not isinstance(meta, dict) or meta.get("v") != FORMAT_VERSION:
            raise SlotFormatError(f"{self.path}: metadata has no version {FORMAT_VERSION} marker")
        if meta.get("step", header.step) != header.step:
            # Each is checksummed, so only a writer could make them disagree; an agent that took the header's
            # word would wait forever for metadata of that step (a claim that never starts).
            raise SlotFormatError(f"{self.path}: the header says step {header.step}, its metadata step "
                                  f"{meta.get('step')!r}")
        return meta

    def data(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of ``nbytes`` of tensor data at ``offset`` from the data region start."""
        assert self.mm is not None
        start = DATA_OFFSET + offset
        if offset < 0 or nbytes < 0 or start + nbytes > self.size:
            raise SlotFormatError(f"{self.path}: tensor range [{start}, {start + nbytes}) out of bounds")
        return memoryview(self.mm)[start:start + nbytes]

    # writer side (the owning rank) ---------------------------------------------------------------------
    def init_empty(self, *, rank: int, world_size: int, job_id: str) -> None:
        assert self.mm is not None and self.writable
        _HEADER.pack_into(self.mm, 0, MAGIC, FORMAT_VERSION, SlotState.EMPTY, -1, 0, DATA_OFFSET, 0, 0, 0,
                          0, rank, world_size, 0.0, job_id.encode("ascii"), 0)

    def invalidate(self) -> None:
        """Mark a committed slot EMPTY (its step belongs to an abandoned timeline); caller holds LOCK_EX."""
        assert self.mm is not None and self.writable
        struct.pack_into("<I", self.mm, 12, SlotState.EMPTY)

    def begin_write(self, *, generation: int, rank: int, world_size: int, job_id: str) -> None:
        """Mark the slot WRITING under ``generation`` (odd; the commit makes it ``generation + 1``).

        The owning rank numbers writes across all of its slots, so the higher generation is always the
        newer snapshot, even when a resumed job wrote the same step twice.
        """
        assert self.mm is not None and self.writable and generation % 2 == 1
        _HEADER.pack_into(self.mm, 0, MAGIC, FORMAT_VERSION, SlotState.WRITING, -1, generation,
                          DATA_OFFSET, 0, 0, 0, 0, rank, world_size, 0.0, job_id.encode("ascii"), 0)

    def commit(self, *, generation: int, step: int, data_len: int, meta: bytes, rank: int,
               world_size: int, job_id: str) -> None:
        """Publish the slot: metadata first, then the header that makes it visible."""
        assert self.mm is not None and self.writable
        meta_offset = align(DATA_OFFSET + data_len)
        if meta_offset + len(meta) > self.size:
            raise SlotFormatError(
                f"{self.path}: metadata of {len(meta)} bytes does not fit the slot of {self.size} bytes"
            )
        self.mm[meta_offset:meta_offset + len(meta)] = meta
        fields = (DATA_OFFSET, data_len, meta_offset, len(meta), meta_checksum(meta), rank, world_size, time.time(),
                  job_id.encode("ascii"))
        committed = _HEADER.pack(MAGIC, FORMAT_VERSION, SlotState.COMMITTED, step, generation + 1, *fields, 0)
        sealed = xxhash.xxh64_intdigest(committed[:SEALED_BYTES])
        # Two stores: all fields under the WRITING state first, then the same bytes with only state and
        # generation changed, so a reader that sees COMMITTED and an even generation sees every field.
        _HEADER.pack_into(self.mm, 0, MAGIC, FORMAT_VERSION, SlotState.WRITING, step, generation, *fields, sealed)
        _HEADER.pack_into(self.mm, 0, MAGIC, FORMAT_VERSION, SlotState.COMMITTED, step, generation + 1, *fields,
                          sealed)


def slot_size(data_len: int, meta_len: int) -> int:
    """File size for a slot holding ``data_len`` tensor bytes and ``meta_len`` metadata bytes."""
    return align(align(DATA_OFFSET + data_len) + meta_len, mmap.PAGESIZE)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
