"""On-disk layout (Checkpoint 2.0 style), version 1: names and the rule for "complete".

::

    save_dir/
      iteration_0000100/
        metadata.json      # the commit marker: written last; a directory without it is incomplete
        common.json        # per-rank skeletons (non-tensor state), exactly round-trippable
        easyckpt-model-0000000-0000002.safetensors   # rank 0 of 2, model tensors
        easyckpt-opt-0000000-0000002.safetensors     # rank 0 of 2, optimizer tensors (a replicated
                                                     #   DTensor shard: only in its replica group's writer's
                                                     #   file; the others' records say "stored_by")
      latest_checkpointed_iteration.txt
      easyckpt-audit.log
      easyckpt-audit.node-<node id>.log              # object stores, multi-node: each node's own lines (below)
      easyckpt-audit.log.<UTC time>                  # object stores: a log's lines before it passed 4 MiB
      .tmp-iteration_0000100-<pid>/                  # a persist in progress (or a dead writer's)
      .aside-iteration_0000100-<pid>/                # the old copy while replace_dir swaps a step in
      .trash-iteration_0000100-<pid>/                # an iteration being deleted
      .stage-iteration_0000100/                      # multi-node: every node's agent adds its ranks'
        node-<node id>.json                          #   files, then this; the leader commits the step
      .abandoned-<UTC time>/iteration_0000120/       # a timeline a resume abandoned (easyckpt_wire.timeline)

The agent writes this layout; the library and the CLI read it. Both use the functions here so that
"complete" means the same thing on both sides. Every byte goes through a ``Storage``
(``easyckpt_wire.storage``): the readers below take one (``iterations``, ``metadata``, ``tracker``...), and
their older path forms (``list_iterations(save_dir)``...) open the save_dir's. The scratch names above
(``.tmp-``, ``.aside-``, ``.trash-``, ``.stage-``) are the POSIX implementation's.
"""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import xxhash

from easyckpt_wire.storage import Storage, StorageLike, as_path, open_storage, posix

# The POSIX publishing helpers, here for the callers that know them by these names.
from easyckpt_wire.storage.posix import exchange_dirs, fsync_dir, settle_aside, write_file_atomic  # noqa: F401

METADATA_FORMAT = "easyckpt-ckpt2"
METADATA_VERSION = 1
METADATA = "metadata.json"
COMMON = "common.json"
TRACKER = "latest_checkpointed_iteration.txt"
AUDIT_LOG = "easyckpt-audit.log"
TMP_PREFIX = ".tmp-iteration_"
TRASH_PREFIX = ".trash-iteration_"
# An export of iteration N still owed (TrainerWrapper's checkpoint-N): rotation spares the iteration while
# the hold file exists, so a crash between the persist and the export cannot lose checkpoint-N for good.
EXPORT_HOLD_PREFIX = ".export-hold-"
ASIDE_PREFIX = ".aside-iteration_"
# An object store has no temporary directory to rename: an iteration in progress holds a lease object named so
# (``easyckpt_wire.storage.s3``) until its commit object is written; clean-up leaves a live writer's alone.
LEASE_PREFIX = ".easyckpt-"
STAGE_PREFIX = ".stage-iteration_"
STAGE_RE = re.compile(r"^\.stage-iteration_(\d{7,})$")
NODE_FILE_RE = re.compile(r"^node-[A-Za-z0-9_.-]{1,64}\.json$")
CHECKSUM_ALGO = "xxh3_128"
# The two JSON documents carry checksums too: a flipped byte in a key name still parses, and loaded as is it hands
# a rank a state under a wrong name. The marker's is over its own bytes without this field (the field is last);
# common.json's is in the marker. Iterations written before these fields existed are read unchecked.
MARKER_CHECKSUM = "marker_xxh3_128"
COMMON_CHECKSUM = "common_xxh3_128"
ITERATION_RE = re.compile(r"^iteration_(\d{7,})$")
TMP_RE = re.compile(r"^\.(?:tmp|trash)-iteration_(\d{7,})-(\d+)$")
ASIDE_RE = re.compile(r"^\.aside-iteration_(\d{7,})-(\d+)$")
RANK_FILE_RE = re.compile(r"^easyckpt-(model|opt)-(\d{7})-(\d{7})\.safetensors$")
OPT_KEYS = ("optim", "optimizer", "opt")


def iteration_dirname(step: int) -> str:
    return f"iteration_{step:07d}"


def replace_dir(src: Path, final: Path, *, aside: Path | None = None, trash: Path | None = None) -> Path | None:
    """Publish the directory ``src`` as ``final`` (``easyckpt_wire.storage.posix.replace_dir``), swapping with
    this module's ``exchange_dirs``."""
    return posix.replace_dir(src, final, aside=aside, trash=trash, exchange=exchange_dirs)


def stage_dirname(step: int) -> str:
    return f"{STAGE_PREFIX}{step:07d}"


def node_file_name(node: str) -> str:
    return "node-" + _node_part(node) + ".json"


def node_audit_log(node: str) -> str:
    """The audit log of one node's own lines (its part of a multi-node persist) on a storage whose appends
    rewrite the object (``Storage.shared_appends`` false): one log that every node appends to would make each
    append race every other node's, and a persist's appends cost grow with the square of the node count."""
    return f"easyckpt-audit.node-{_node_part(node)}.log"


def _node_part(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node)[:64]


def rank_file_name(group: str, rank: int, world_size: int) -> str:
    return f"easyckpt-{group}-{rank:07d}-{world_size:07d}.safetensors"


def tensor_group(name: str) -> str:
    """Which file of the rank a tensor goes to: optimizer state apart from the model, as Megatron does."""
    top = name.split("/", 1)[0].lower()
    return "opt" if top in OPT_KEYS or top.startswith("optim") else "model"


class CheckpointFormatError(RuntimeError):
    """A checkpoint directory that is damaged or not ours."""


def link_replicas(ranks_meta: dict[str, Any], where: str) -> None:
    """Complete, in place, the metadata.json records of replicated shards that another rank wrote.

    A rank whose copy of a replicated DTensor shard its replica group's writer puts on disk (the rule is
    ``easyckpt.snapshot.sharding.writer_coordinate``) has a record with ``stored_by`` (the writer's rank) and the
    writer's ``file``; this gives it the writer's checksum, so that every reader, older builds included,
    reads it from there like any other record. Raises CheckpointFormatError naming the tensor and both
    ranks when the writer did not save that tensor with the same shape and dtype: such an iteration would
    not load, so it is never committed."""
    by_rank: dict[str, dict[str, Any]] = {}
    for rank, info in ranks_meta.items():
        for record in info["tensors"]:
            if "stored_by" not in record:
                by_rank.setdefault(rank, {})[record["name"]] = record
    for rank, info in ranks_meta.items():
        for record in info["tensors"]:
            writer = record.get("stored_by")
            if writer is None:
                continue
            if str(writer) not in ranks_meta:
                raise CheckpointFormatError(
                    f"{where}: rank {rank}'s tensor {record['name']!r} is replicated and stored by rank {writer}, "
                    f"which is not among the saved ranks {sorted(ranks_meta, key=int)}")
            source = by_rank.get(str(writer), {}).get(record["name"])
            if source is None or (source["shape"], source["dtype"], source["file"]) != (
                    record["shape"], record["dtype"], record["file"]):
                found = "lacks it" if source is None else (f"has it as {source['dtype']} {source['shape']} in "
                                                           f"{source['file']}")
                raise CheckpointFormatError(
                    f"{where}: rank {rank}'s tensor {record['name']!r} ({record['dtype']} {record['shape']}) is "
                    f"replicated and stored by rank {writer} in {record['file']}, but rank {writer}'s state {found}: "
                    "the ranks of one replica group must hold the same DTensor")
            record[CHECKSUM_ALGO] = source[CHECKSUM_ALGO]


# reading, over a Storage ---------------------------------------------------------------------------------
def dump_json(payload: Any) -> bytes:
    """The layout's JSON bytes: compact, so that a parsed document dumps back to the very bytes it was read from."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def json_checksum(raw: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(raw)


def marker_bytes(meta: dict[str, Any]) -> bytes:
    """A commit marker's bytes, its checksum last (``parse_metadata`` checks it)."""
    return dump_json({**meta, MARKER_CHECKSUM: json_checksum(dump_json(meta))})


def parse_metadata(raw: bytes, where: str) -> dict[str, Any]:
    """A commit marker's bytes, checked for our format, version and checksum (CheckpointFormatError naming
    ``where``); the checksum field is not in what it returns."""
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise CheckpointFormatError(f"{where} is unreadable: {exc}") from None
    if isinstance(meta, dict) and MARKER_CHECKSUM in meta:
        expected = meta.pop(MARKER_CHECKSUM)
        if json_checksum(dump_json(meta)) != expected:
            raise CheckpointFormatError(f"{where} fails its {CHECKSUM_ALGO} checksum: the commit marker is corrupted")
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise CheckpointFormatError(f"{where} is not an easyckpt checkpoint (format {meta.get('format')!r})"
                                    if isinstance(meta, dict) else f"{where} is not a JSON object")
    if meta.get("format_version") != METADATA_VERSION:
        raise CheckpointFormatError(
            f"{where} has format version {meta.get('format_version')!r}, this build reads {METADATA_VERSION}"
        )
    return meta


def metadata(store: Storage, iteration: str = "") -> dict[str, Any]:
    """The parsed commit marker of the iteration ``iteration`` (a key; "": the storage's root is the
    iteration); raises CheckpointFormatError if it is incomplete or not ours."""
    key = f"{iteration}/{METADATA}" if iteration else METADATA
    try:
        raw = store.read(key)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{store.where(iteration)} has no {METADATA}: it is incomplete") from None
    except OSError as exc:
        raise CheckpointFormatError(f"{store.where(key)} is unreadable: {exc}") from None
    return parse_metadata(raw, store.where(key))


def read_common(store: Storage, iteration: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The parsed ``common.json`` of the iteration ``iteration`` (a key, "" as in ``metadata``), checked against
    the checksum its marker ``meta`` holds: FileNotFoundError when missing, CheckpointFormatError when damaged."""
    key = f"{iteration}/{COMMON}" if iteration else COMMON
    raw = store.read(key)
    expected = meta.get(COMMON_CHECKSUM)
    if expected is not None and json_checksum(raw) != expected:
        raise CheckpointFormatError(f"{store.where(key)} fails its {CHECKSUM_ALGO} checksum: it is corrupted")
    try:
        common = json.loads(raw)
    except ValueError as exc:
        raise CheckpointFormatError(f"{store.where(key)} is unreadable: {exc}") from None
    if not isinstance(common, dict):
        raise CheckpointFormatError(f"{store.where(key)} is not a JSON object")
    return common


def read_json(store: Storage, key: str) -> Any:
    """A JSON file of the layout (FileNotFoundError when missing; ValueError when it does not parse)."""
    return json.loads(store.read(key))


def iterations(store: Storage, prefix: str = "") -> list[tuple[int, str, bool]]:
    """Every ``iteration_N`` under ``prefix`` as (step, key, has its marker), oldest first."""
    found = []
    for entry in store.entries(prefix):
        match = ITERATION_RE.match(entry.name)
        if match and entry.is_dir:
            key = f"{prefix}/{entry.name}" if prefix else entry.name
            found.append((int(match.group(1)), key, store.exists(f"{key}/{METADATA}")))
    return sorted(found)


def complete(store: Storage) -> list[tuple[int, str]]:
    """(step, key) of the iterations whose commit marker exists and parses, oldest first."""
    done = []
    for step, key, has_marker in iterations(store):
        if not has_marker:
            continue
        try:
            meta = metadata(store, key)
        except CheckpointFormatError:
            continue
        if meta.get("step") == step:
            done.append((step, key))
    return done


def tracker(store: Storage) -> int | None:
    """The step ``latest_checkpointed_iteration.txt`` names (None: no tracker, or not a step)."""
    try:
        raw = store.read(TRACKER).strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    # bytes.isdigit(): ASCII digits only (a damaged tracker is passed over like any other unreadable one)
    return int(raw) if raw.isdigit() else None


def holds(store: Storage) -> set[int]:
    """Steps whose export is still owed (``export_hold`` files)."""
    return {int(e.name[len(EXPORT_HOLD_PREFIX):]) for e in store.entries()
            if e.name.startswith(EXPORT_HOLD_PREFIX) and e.name[len(EXPORT_HOLD_PREFIX):].isdigit()}


def stage_steps(store: Storage) -> list[int]:
    """Steps with a multi-node stage in progress."""
    return sorted(int(m.group(1)) for final in store.stages() if (m := ITERATION_RE.match(final)))


# the same readers by path (a save_dir, or one iteration directory) ---------------------------------------
def locate(directory: StorageLike) -> tuple[Storage, str]:
    """(the Storage of its save_dir, its key) of a directory in a save_dir (an ``iteration_N``), for readers
    given a path; a Storage stands for its own root."""
    path = as_path(directory) if not isinstance(directory, Storage) else None
    if path is None or path.name in ("", ".", ".."):
        return open_storage(directory), ""
    return open_storage(path.parent), path.name


def committed(store: Storage, key: str) -> bool:
    """Whether a published copy of the iteration ``key`` is in place: its commit marker. Its directory is not
    enough: on an object store a persist's files are under the final prefix before its commit object."""
    return store.exists(f"{key}/{METADATA}")


def present(directory: StorageLike) -> bool:
    """Whether the directory ``directory`` of a save_dir (an ``iteration_N``) is there, through its Storage."""
    store, key = locate(directory)
    return store.is_dir(key)


def read_metadata(iteration_dir: StorageLike) -> dict[str, Any]:
    """The parsed commit marker of ``iteration_dir``; raises CheckpointFormatError if incomplete."""
    store, name = locate(iteration_dir)
    return metadata(store, name)


def list_iterations(save_dir: Path) -> list[tuple[int, Path, bool]]:
    """Every ``iteration_N`` directory as (step, path, complete), oldest first."""
    return [(step, as_path(save_dir) / key, has_marker) for step, key, has_marker in iterations(open_storage(save_dir))]


def complete_iterations(save_dir: Path) -> list[tuple[int, Path]]:
    """Iterations whose commit marker exists and parses, oldest first."""
    return [(step, as_path(save_dir) / key) for step, key in complete(open_storage(save_dir))]


def read_tracker(save_dir: Path) -> int | None:
    return tracker(open_storage(save_dir))


def export_hold(save_dir: Path, step: int) -> Path:
    return save_dir / f"{EXPORT_HOLD_PREFIX}{step:07d}"


def hold_export(save_dir: StorageLike, step: int) -> None:
    """Spare iteration ``step`` from rotation until ``release_export``: its export is owed (written before the
    export is requested, so a crash in between cannot let rotation lose it)."""
    open_storage(save_dir).put(f"{EXPORT_HOLD_PREFIX}{step:07d}", b"")


def release_export(save_dir: StorageLike, step: int) -> None:
    """The export of ``step`` is written (or given up): rotation may delete the iteration again."""
    open_storage(save_dir).delete(f"{EXPORT_HOLD_PREFIX}{step:07d}")


class ExportHolds:
    """One hold file per step however many exports of it are under way: written with the first, removed with
    the last. Two exports of one step (two Lightning ``ModelCheckpoint``s, ``save_last``) once let the first one's
    release free the iteration, and rotation deleted it under the second (CI rehearsal 2026-11-30). Thread-safe."""

    def __init__(self, save_dir: StorageLike) -> None:
        self.save_dir = save_dir
        self._lock = threading.Lock()
        self._count: dict[int, int] = {}

    def hold(self, step: int) -> None:
        """Counted even when writing the file raises (OSError): ``release`` balances every ``hold``."""
        with self._lock:
            self._count[step] = self._count.get(step, 0) + 1
            if self._count[step] == 1:
                hold_export(self.save_dir, step)

    def release(self, step: int) -> None:
        """One export of ``step`` is done; the last one (or a hold no export of this process counts: a dead
        run's) removes the file."""
        with self._lock:
            left = self._count.pop(step, 0) - 1
            if left > 0:
                self._count[step] = left
            else:
                release_export(self.save_dir, step)

    def held(self) -> dict[int, int]:
        with self._lock:
            return dict(self._count)


def export_holds(save_dir: Path) -> set[int]:
    """Steps whose export is still owed (``export_hold`` files in ``save_dir``)."""
    return holds(open_storage(save_dir))
