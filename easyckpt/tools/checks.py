"""Checking an ``iteration_N`` directory without torch: what ``easyckpt ls`` and ``easyckpt verify`` report.

Two depths. ``damage`` looks at what metadata.json promises without reading tensor bytes: every rank's
files exist, and each safetensors file has exactly the size its header length and metadata.json's tensors
add up to (8 bytes + header + data): a deleted or truncated file shows in milliseconds. ``verify_iteration``
reads every byte: each tensor's dtype, shape and byte range in the safetensors header must match
metadata.json, and its bytes must match the xxh3-128 checksum there. The safetensors format is simple
enough (a little-endian u64 header length, a JSON header, raw bytes) to check with ``mmap`` and ``json``,
so neither pays torch's import (seconds) and the CLI stays quick. Every byte is read through the save_dir's
``Storage`` (a file's ranges: an mmap on POSIX).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from easyckpt_wire import layout
from easyckpt_wire.layout import CheckpointFormatError
from easyckpt_wire.shm import format_bytes
from easyckpt_wire.storage import BlobReader, Storage

MAX_HEADER = 100 << 20   # the safetensors reference implementation's bound on the JSON header


def _own_records(meta: dict[str, Any], where: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(rank, record) of every tensor record as its file holds it: a replicated shard that another rank of its
    group stored (``stored_by``) is checked once, under the writer's rank."""
    try:
        ranks = meta["ranks"]
        for rank_text in sorted(ranks, key=int):
            rank = int(rank_text)
            for record in ranks[rank_text]["tensors"]:
                writer = record.get("stored_by")
                if writer is None or writer == rank:
                    yield rank, record
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"{where / layout.METADATA}: the rank entries are damaged "
                                    f"({type(exc).__name__}: {exc})") from None


def _expected_files(meta: dict[str, Any], where: Path) -> dict[str, tuple[int, int]]:
    """{file name: (writer rank, data bytes)} from metadata.json."""
    files: dict[str, tuple[int, int]] = {}
    try:
        for rank_text, info in meta["ranks"].items():
            for name in info.get("files", []):
                files.setdefault(name, (int(rank_text), 0))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"{where / layout.METADATA}: the rank entries are damaged "
                                    f"({type(exc).__name__}: {exc})") from None
    for rank, record in _own_records(meta, where):
        writer, size = files.get(record["file"], (rank, 0))
        files[record["file"]] = (writer, size + int(record["nbytes"]))
    return files


def dir_bytes(path: Path) -> int:
    """Bytes of the files directly in ``path``, as ``storage.iteration_bytes`` counts them (without torch);
    files (or the whole iteration) that the agent's rotation removes meanwhile count 0."""
    store, key = layout.locate(path)
    return sum(entry.size for entry in store.entries(key, sizes=True) if entry.size >= 0)


def _key(iteration: str, name: str) -> str:
    return f"{iteration}/{name}" if iteration else name


def _header_length(reader: BlobReader) -> int:
    if reader.size < 8:
        raise CheckpointFormatError(f"{reader.where} is truncated: {reader.size} bytes, not even a safetensors header")
    with reader.view(0, 8) as raw:
        length = int.from_bytes(raw, "little")
    if length > MAX_HEADER:
        raise CheckpointFormatError(f"{reader.where} is not a safetensors file (header length {length})")
    return length


def damage(iteration_dir: Path) -> str | None:
    """What is wrong with ``iteration_dir`` judged by sizes alone (None: nothing seen). Reads metadata.json,
    the existence of common.json, and 8 bytes of each tensor file."""
    store, key = layout.locate(iteration_dir)
    try:
        meta = layout.metadata(store, key)
        if not store.exists(_key(key, layout.COMMON)):
            return f"{store.where(_key(key, layout.COMMON))} is missing"
        step = meta.get("step")
        for name, (rank, data) in sorted(_expected_files(meta, iteration_dir).items()):
            problem = _size_problem(store, _key(key, name), step, rank, data)
            if problem is not None:
                return problem
    except CheckpointFormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"{exc.filename or iteration_dir}: {exc.strerror or exc}"
    return None


def _size_problem(store: Storage, key: str, step: Any, rank: int, data: int) -> str | None:
    try:
        with store.open(key) as reader:
            size, header = reader.size, _header_length(reader)
    except FileNotFoundError:
        return f"{store.where(key)} (step {step}, rank {rank}) is missing"
    expected = 8 + header + data
    if size != expected:
        what = "truncated" if size < expected else "longer than its tensors"
        return (f"{store.where(key)} (step {step}, rank {rank}) is {what}: {format_bytes(size)} ({size} bytes), "
                f"{layout.METADATA} and its header make {expected} bytes")
    return None


def _check_file(store: Storage, key: str, records: list[dict[str, Any]], step: Any, rank: int) -> None:
    try:
        reader = store.open(key)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{store.where(key)} (step {step}, rank {rank}) is missing") from None
    with reader:
        path = reader.where
        size = reader.size
        length = _header_length(reader)
        if size < 8 + length:
            raise CheckpointFormatError(f"{path} (step {step}) is not a readable safetensors file: truncated header")
        try:
            with reader.view(8, length) as raw:
                header = json.loads(bytes(raw))
        except ValueError as exc:
            raise CheckpointFormatError(f"{path} (step {step}) is not a readable safetensors file: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointFormatError(f"{path} (step {step}) is not a readable safetensors file: bad header")
        # Views of the file are not copies (a tensor may be gigabytes).
        _check_records(path, reader, header, 8 + length, records, step, rank)


def _check_records(path: str, reader: BlobReader, header: dict[str, Any], data_start: int,
                   records: list[dict[str, Any]], step: Any, rank: int) -> None:
    size = reader.size
    for record in records:
        name = record["name"]
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise CheckpointFormatError(f"{path}: tensor {name!r} of step {step} is unreadable: not in the file")
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: tensor {name!r} of step {step} has no valid data_offsets in the "
                                        "file's header") from None
        if list(entry.get("shape", ())) != list(record["shape"]) or entry.get("dtype") != record["dtype"]:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} is {entry.get('dtype')} {tuple(entry.get('shape', ()))}, metadata "
                f"says {record['dtype']} {tuple(record['shape'])}")
        if not 0 <= begin <= end or end - begin != int(record["nbytes"]) or data_start + end > size:
            raise CheckpointFormatError(f"{path}: tensor {name!r} of step {step} is unreadable: its bytes "
                                        f"{begin}-{end} are not all in the file (truncated?)")
        with reader.view(data_start + begin, end - begin) as part:
            digest = xxhash.xxh3_128_hexdigest(part)
        if digest != record[layout.CHECKSUM_ALGO]:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} of step {step}, rank {rank} fails its {layout.CHECKSUM_ALGO} "
                "checksum: the file is corrupted")


def verify_iteration(iteration_dir: Path) -> str | None:
    """Read every tensor of ``iteration_dir`` and check it against metadata.json; the first problem, or None."""
    store, key = layout.locate(iteration_dir)
    try:
        meta = layout.metadata(store, key)
        step = meta.get("step")
        try:
            common = layout.read_common(store, key, meta)
            lacking = [rank for rank in meta["ranks"] if "skeleton" not in common["ranks"][rank]]
            if lacking:
                return f"{iteration_dir}: {layout.COMMON} lacks the non-tensor state of ranks {lacking}"
        except FileNotFoundError:
            return f"{iteration_dir}: {layout.COMMON} is missing"
        except (KeyError, TypeError, ValueError) as exc:
            return f"{iteration_dir}: {layout.COMMON} is damaged ({type(exc).__name__}: {exc})"
        by_file: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        for rank, record in _own_records(meta, iteration_dir):
            by_file.setdefault(record["file"], (rank, []))[1].append(record)
        for name, (rank, records) in sorted(by_file.items()):
            _check_file(store, _key(key, name), records, step, rank)
    except CheckpointFormatError as exc:
        return str(exc)
    except (KeyError, TypeError, ValueError) as exc:
        return f"{iteration_dir / layout.METADATA}: damaged ({type(exc).__name__}: {exc})"
    except OSError as exc:
        return f"{exc.filename or iteration_dir}: {exc.strerror or exc}"
    return None


# An iteration with no commit marker: a persist under way, or one that failed (on an object store its files are
# written in place); never loaded, so not damage. ``easyckpt clean`` (or the next persist) removes a dead one.
INCOMPLETE = f"incomplete: no {layout.METADATA}"


def verify(save_dir: Path) -> list[tuple[int, Path, str | None]]:
    """Every iteration of ``save_dir`` (or the one ``iteration_N`` directory given), fully read; (step, path,
    problem or None) for each, oldest first; ``INCOMPLETE`` for one without its commit marker."""
    if layout.ITERATION_RE.match(save_dir.name):
        rows = [row for row in layout.list_iterations(save_dir.parent) if row[1].name == save_dir.name]
    else:
        rows = layout.list_iterations(save_dir)
    return [(step, path, verify_iteration(path) if complete else INCOMPLETE)
            for step, path, complete in rows]
