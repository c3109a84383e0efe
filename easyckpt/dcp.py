"""``torch.distributed.checkpoint`` over easyckpt's on-disk layout, and the resharded load built on it.

``StorageReader(iteration_dir)`` lets ``dcp.load(state_dict, storage_reader=...)`` read an ``iteration_N``
directory: every rank's saved tensors become DCP chunks of their global tensors (a DTensor's shard at its
offsets; a plain tensor as a whole), so DCP's own load planning decides which saved ranges each rank
of the new world reads; nothing here reshards by hand. Keys are DCP's: the dotted path of the state
(``model.0.weight``, ``optim.state.0.exp_avg``), so a natural ``{"model": model.state_dict()}`` loads.

Where several ranks hold the same range (a replicated DTensor, or a plain tensor every rank holds) one copy
is served: the lowest rank's, which for a replicated DTensor is in its replica group's writer's file
(``stored_by`` in metadata.json: the other ranks of the group did not write theirs). Non-tensor values
(ints, lists) are served from rank 0's state.

``read_resharded`` is the disk tier of ``Checkpointer.load(state_dict)`` when the saved world size differs
from this job's: DTensors through ``dcp.load``, every other value of the state (plain tensors, RNG states,
data position) from one saved rank, by the rule of ``sharding.source_rank``.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from easyckpt import storage
from easyckpt.snapshot.state import torch_dtype
from easyckpt_wire import layout
from easyckpt_wire.records import ShardSpec
from easyckpt_wire.storage import as_path, open_storage, posix

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One saved range of a global tensor: which rank's file holds it, under which name."""

    rank: int
    file: str
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    checksum: str


@dataclasses.dataclass(slots=True)
class SavedTensor:
    global_shape: tuple[int, ...]
    dtype: str
    sharded: bool
    chunks: list[Chunk]


@dataclasses.dataclass(frozen=True, slots=True)
class _Value:
    value: Any


@dataclasses.dataclass(slots=True)
class CheckpointIndex:
    """An iteration directory as DCP sees it: its global tensors by DCP key, and rank 0's plain values."""

    path: Path
    step: int
    world_size: int
    tensors: dict[str, SavedTensor]
    values: dict[str, Any]
    keys: dict[int, dict[str, str]]   # rank -> {easyckpt tensor name: DCP key}


def _keys_of(skeleton: Any, n_tensors: int) -> tuple[dict[int, str], dict[str, Any]]:
    """({tensor index: DCP key}, {DCP key: non-tensor value}) of one rank's saved state, keyed exactly as
    ``dcp.load`` flattens a state dict (DCP's own ``flatten_state_dict``)."""
    from easyckpt.snapshot.state import unflatten

    marks = [torch.empty(0) for _ in range(n_tensors)]
    state = unflatten(skeleton, marks)
    if not isinstance(state, Mapping):
        return {}, {}
    flat, _ = flatten_state_dict(dict(state))
    ids = {id(m): i for i, m in enumerate(marks)}
    keys: dict[int, str] = {}
    values: dict[str, Any] = {}
    for key, value in flat.items():
        index = ids.get(id(value))
        if index is not None:
            keys[index] = key
        elif not _holds_mark(value, ids):   # a tuple with an array in it is neither a tensor nor a plain value
            values[key] = value
    return keys, values


def _holds_mark(value: Any, ids: Mapping[int, int]) -> bool:
    if isinstance(value, torch.Tensor):
        return id(value) in ids
    if isinstance(value, Mapping):
        return any(_holds_mark(v, ids) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_mark(v, ids) for v in value)
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class SavedRange:
    """One tensor of one saved rank as the index needs it: its position in the rank's flat state, what it is,
    and where its bytes are (``Chunk``'s rank, file and checksum)."""

    index: int
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    shard: ShardSpec | None
    owner: int
    file: str
    checksum: str


def build_index(path: Path, step: int, world_size: int,
                ranks: Callable[[int], tuple[Any, int, Iterable[SavedRange]]]) -> CheckpointIndex:
    """The saved world as DCP sees it, from each rank's (skeleton, number of tensors, tensors): a DTensor's
    ShardSpec gives its global shape and offsets; a plain tensor is whole. Used for an iteration on disk
    (``checkpoint_index``) and for the saved world's snapshots in memory (``easyckpt.recovery.reshard``)."""
    tensors: dict[str, SavedTensor] = {}
    values: dict[str, Any] = {}
    keys: dict[int, dict[str, str]] = {}
    for rank in range(world_size):
        skeleton, count, saved_ranges = ranks(rank)
        index_keys, rank_values = _keys_of(skeleton, count)
        if rank == 0:
            values = rank_values
        saved_ranges = list(saved_ranges)
        keys[rank] = {r.name: index_keys[r.index] for r in saved_ranges if r.index in index_keys}
        for record in saved_ranges:
            key = index_keys.get(record.index)
            if key is None or record.kind != "torch":
                continue
            spec = record.shard
            global_shape = spec.global_shape if spec is not None else record.shape
            offsets = spec.offsets if spec is not None else (0,) * len(record.shape)
            saved = tensors.setdefault(key, SavedTensor(global_shape, record.dtype, spec is not None, []))
            if (saved.global_shape, saved.dtype) != (global_shape, record.dtype):
                # A rank-private plain tensor whose shape differs between ranks: DCP sees rank 0's.
                logger.debug("%s: rank %d's %s differs from rank 0's; DCP serves the lower rank's", path, rank, key)
                continue
            if 0 in record.shape or any(c.offsets == offsets and c.shape == record.shape for c in saved.chunks):
                continue   # empty, or a copy of a range a lower rank saved (replicated)
            saved.chunks.append(Chunk(record.owner, record.file, record.name, offsets, record.shape, record.checksum))
    return CheckpointIndex(path, step, world_size, tensors, values, keys)


def checkpoint_index(iteration_dir: Path) -> CheckpointIndex:
    """Read ``metadata.json`` and ``common.json`` of ``iteration_dir`` (no tensor bytes)."""
    meta = layout.read_metadata(iteration_dir)
    world_size = meta.get("world_size")
    if type(world_size) is not int or world_size < 1:
        raise storage.CheckpointCorruptError(f"{iteration_dir / layout.METADATA}: world_size is {world_size!r}")

    def rank_view(rank: int) -> tuple[Any, int, list[SavedRange]]:
        entry = storage.rank_entry(iteration_dir, rank, None)
        # A replicated shard stored by its group's writer: the writer's file, so the chunk names that rank.
        return entry.skeleton, len(entry.records), [
            SavedRange(r.index, r.name, r.kind, r.dtype, r.shape, r.shard,
                       r.stored_by if r.stored_by is not None else rank, r.file, r.checksum) for r in entry.records]

    return build_index(iteration_dir, int(meta["step"]), world_size, rank_view)


DEEPSPEED_STAGE = "deepspeed.stage"
DEEPSPEED_VERSION = "deepspeed.ds_version"   # with the stage: the engine's info TrainerWrapper snapshots
DEEPSPEED_PARTITIONED = "deepspeed.partitioned."   # ZeRO-3: {parameter name: full shape} of the partitioned ones


def deepspeed_stage(values: Mapping[str, Any]) -> int | None:
    """The ZeRO stage of a TrainerWrapper snapshot under DeepSpeed (``values``: its iteration's plain values), else
    None (a state of one's own that happens to hold a ``deepspeed.stage`` is no such snapshot)."""
    stage = values.get(DEEPSPEED_STAGE)
    return stage if isinstance(stage, int) and DEEPSPEED_VERSION in values else None


def deepspeed_partitions(keys: Iterable[str], values: Mapping[str, Any]) -> list[str]:
    """Those of ``keys`` (DCP keys of an iteration whose plain values are ``values``) that each rank of a
    TrainerWrapper snapshot under DeepSpeed ZeRO holds its own partition of, under the same name (sorted; none for
    any other iteration): the optimizer state from ZeRO-1 on, the partitioned parameters under ZeRO-3."""
    stage = deepspeed_stage(values)
    if stage is None:
        return []
    model = {"model." + key[len(DEEPSPEED_PARTITIONED):] for key in values if key.startswith(DEEPSPEED_PARTITIONED)}
    return sorted(key for key in keys if (stage >= 1 and key.startswith("optim.")) or key in model)


def refuse_deepspeed(path: Path, values: Mapping[str, Any], what: str) -> None:
    """Raise ValueError for a TrainerWrapper snapshot under DeepSpeed (``values``: its iteration's plain values): each
    rank holds its ZeRO partition of the optimizer state (under ZeRO-3 of the weights too) under names that are the
    same on every rank, so ``what`` (anything that takes such a name for one tensor) would get rank 0's slice."""
    stage = deepspeed_stage(values)
    if stage is not None:
        weights = " and of the weights" if stage == 3 else ""
        raise ValueError(f"{path} is a DeepSpeed ZeRO-{stage} snapshot of TrainerWrapper: each rank holds its "
                         f"own partition of the optimizer state{weights} in DeepSpeed's layout, which {what} cannot "
                         "represent. Take the model's weights with easyckpt convert --to hf, or the Trainer's "
                         "checkpoint-N folder (DeepSpeed's own layout, which its zero_to_fp32.py consolidates)")


class StorageReader(dcp.StorageReader):
    """A ``torch.distributed.checkpoint.StorageReader`` of one easyckpt ``iteration_N`` directory.

    ``verify=True`` (the default) checks every saved range it touches against its xxh3-128 before use, once
    per load, which reads that range whole even when only part of it is needed (for FSDP-style dim-0 shards
    between world sizes that divide each other, the whole ranges are what is needed anyway); ``verify=False``
    reads only the pages of the needed boxes, unverified. Either way the files are mapped and each box is
    copied once, from the mapping straight into its target.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        super().__init__()
        self.path = as_path(path)   # an s3:// iteration stays a URL
        self.verify = verify
        self.load_id = str(uuid.uuid4())
        self.index: CheckpointIndex | None = None
        self.storage_data: dict[MetadataIndex, Chunk | _Value] = {}
        self.verified: set[tuple[str, str]] = set()   # (file, tensor) checked in this load: once per range

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = as_path(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self.index = None
        self.verified = set()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            layout.read_metadata(as_path(checkpoint_id))
        except layout.CheckpointFormatError:
            return False
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.index is None:
            self.index = checkpoint_index(self.path)
        state: dict[str, Any] = {}
        data: dict[MetadataIndex, Chunk | _Value] = {}
        for key, saved in self.index.tensors.items():
            state[key] = TensorStorageMetadata(
                TensorProperties(dtype=torch_dtype(saved.dtype)), torch.Size(saved.global_shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.shape)) for c in saved.chunks])
            for chunk in saved.chunks:
                data[MetadataIndex(key, torch.Size(chunk.offsets))] = chunk
        for key, value in self.index.values.items():
            state[key] = BytesStorageMetadata()
            data[MetadataIndex(key)] = _Value(value)
        return Metadata(state_dict_metadata=state, storage_data=data,
                        storage_meta=StorageMeta(checkpoint_id=str(self.path), load_id=self.load_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        values = {index.fqn: info.value for index, info in self.storage_data.items() if isinstance(info, _Value)}
        partitioned = deepspeed_partitions((item.storage_index.fqn for item in plan.items), values)
        if partitioned:
            more = f" (and {len(partitioned) - 1} more)" if len(partitioned) > 1 else ""
            refuse_deepspeed(self.path, values, f"a load of {partitioned[0]!r}{more} as one whole tensor")
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[tuple[ReadItem, Chunk]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if isinstance(info, _Value):
                buffer = io.BytesIO()
                torch.save(info.value, buffer)   # a value decoded from common.json, not bytes read from disk
                buffer.seek(0)
                planner.load_bytes(item, buffer)
            else:
                per_file.setdefault(info.file, []).append((item, info))
        for file_name, items in per_file.items():
            self._read_file(self.path / file_name, items, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, path: Path, items: list[tuple[ReadItem, Chunk]], planner: LoadPlanner) -> None:
        first = items[0][1]
        store, key = layout.locate(self.path)
        try:
            file = storage.TensorFile(store, f"{key}/{path.name}" if key else path.name)
        except FileNotFoundError:
            raise storage.CheckpointCorruptError(
                f"{path} is missing: it holds rank {first.rank}'s shard of {first.name!r} and "
                f"{len(items) - 1} more saved ranges needed here. Restore the file, or load another iteration "
                f"(`easyckpt verify {path.parent.parent}` lists the complete ones)") from None
        except storage.TensorFileError as exc:
            raise storage.CheckpointCorruptError(f"{path} is not a readable safetensors file: {exc}") from None
        with file:
            self._read_items(path, _FileView(file), items, planner)

    def _read_items(self, path: Path, view: _FileView, items: list[tuple[ReadItem, Chunk]],
                    planner: LoadPlanner) -> None:
        for item, chunk in items:
            if self.verify and (path.name, chunk.name) not in self.verified:
                view.verify(chunk)
                self.verified.add((path.name, chunk.name))
            box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            data = view.tensor(chunk)[box]   # a view of the mapped file: only the pages of the box are read
            target = planner.resolve_tensor(item).detach()
            if target.shape != data.shape:
                raise storage.CheckpointCorruptError(
                    f"{path}: {chunk.name!r} range {tuple(item.storage_offsets)}+{tuple(item.lengths)} gave "
                    f"{tuple(data.shape)}, the target needs {tuple(target.shape)}")
            target.copy_(data)
            planner.commit_tensor(item, target)


class _FileView:
    """One saved safetensors file (``storage.TensorFile``) for the reads of one ``read_data``: a saved range
    is hashed where it lies (no copy) and a requested box is copied straight from the file's view into its
    target, so a part of a range reads only its own pages. (Read-only: a private writable map would be
    charged to the commit limit for the whole file where the kernel does not overcommit.)"""

    def __init__(self, file: storage.TensorFile) -> None:
        self.file = file
        self.path = file.where

    def _range(self, chunk: Chunk) -> tuple[int, int, torch.dtype]:
        try:
            begin, end, dtype, shape = self.file.entry(chunk.name)
        except storage.TensorFileError:
            raise storage.CheckpointCorruptError(
                f"{self.path}: tensor {chunk.name!r} (rank {chunk.rank}) is missing from the file or its header "
                "entry is damaged; load another iteration") from None
        if shape != chunk.shape:
            raise storage.CheckpointCorruptError(
                f"{self.path}: tensor {chunk.name!r} has shape {shape}, metadata says {chunk.shape}")
        try:
            begin, end = self.file.span(begin, end, dtype, shape)
        except storage.TensorFileError as exc:
            raise storage.CheckpointCorruptError(
                f"{self.path}: tensor {chunk.name!r} has {exc}: the file is truncated or damaged") from None
        return begin, end, dtype

    def verify(self, chunk: Chunk) -> None:
        begin, end, _ = self._range(chunk)
        with self.file.view(begin, end) as data:
            ok = xxhash.xxh3_128_hexdigest(data) == chunk.checksum
        if not ok:
            raise storage.CheckpointCorruptError(
                f"{self.path}: tensor {chunk.name!r} (rank {chunk.rank}) fails its {layout.CHECKSUM_ALGO} checksum: "
                "the file is corrupted; load another iteration")

    def tensor(self, chunk: Chunk) -> torch.Tensor:
        begin, end, dtype = self._range(chunk)
        return storage.view_as_tensor(self.file.view(begin, end), dtype, chunk.shape)


def load_into(state: dict[str, Any], iteration_dir: Path, *, no_dist: bool = False) -> None:
    """Fill ``state`` ({DCP key: DTensor or tensor}) from ``iteration_dir`` with DCP's default load planning;
    collective over the default process group when one is initialised (``no_dist``: in this process alone,
    whole tensors)."""
    try:
        with warnings.catch_warnings():
            if no_dist:
                # DCP warns that it "assumes the intent is to load in a single process" even when told so: once per
                # export and conversion, in a user's log. (Not thread-safe, as catch_warnings never is: at worst
                # another thread's warning in these milliseconds is filtered by this rule too, which names one text.)
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=StorageReader(iteration_dir), no_dist=no_dist)
    except CheckpointException as exc:
        # A BaseException that every rank receives (DCP gathers the failures): turned into the error a failed
        # read is everywhere else, so that load() moves every rank on to the next candidate together, and a
        # thread that reads an iteration (an exporter) catches it as an Exception.
        problems = "; ".join(f"rank {rank}: {error}" for rank, (error, _) in sorted(exc.failures.items()))
        raise storage.CheckpointCorruptError(
            f"{iteration_dir}: reading through torch.distributed.checkpoint failed: {problems}") from None


def iteration_of(src: Path) -> Path:
    """``src`` itself when it is an iteration directory, else the newest complete iteration of the save_dir."""
    if open_storage(src).exists(layout.METADATA):
        return src
    steps = storage.newest_first(src)
    if not steps:
        raise layout.CheckpointFormatError(f"{src} holds no complete iteration_N directory (`easyckpt ls {src}`)")
    return src / layout.iteration_dirname(steps[0])


# What wrappers add to a module's state_dict names: DDP's module (every name, as torch's own
# consume_prefix_in_state_dict_if_present takes it) and torch.compile's OptimizedModule (at any depth: a compiled
# submodule too). nanoGPT's train.py snapshots ``raw_model.state_dict()`` of a compiled model: every name began with
# ``_orig_mod.``, which a plain model's load_state_dict refuses.
DDP_PREFIX = "module."
COMPILED_PART = "_orig_mod."


def unwrapped_names(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """{name: the name an unwrapped model has} and which wrappers' parts were removed; the names as they are when
    removing them would make two names one."""
    names = list(names)
    new = {name: ".".join(part for part in name.split(".") if part != COMPILED_PART[:-1]) for name in names}
    if len(set(new.values())) != len(names):
        new = {name: name for name in names}
    removed = [COMPILED_PART] if any(new[name] != name for name in names) else []
    if names and all(name.startswith(DDP_PREFIX) for name in new.values()):
        short = {name: unwrapped[len(DDP_PREFIX):] for name, unwrapped in new.items()}
        if len(set(short.values())) == len(names):
            new, removed = short, [DDP_PREFIX, *removed]
    return new, removed


# A top-level entry of TrainerWrapper's snapshot of a peft model (``easyckpt.transformers.snapshot.FROZEN_KEY``,
# not imported: this module does not import transformers): its model entry holds what trains, not the frozen base.
PEFT_FROZEN_KEY = "peft_frozen_base"


@dataclasses.dataclass(frozen=True, slots=True)
class Consolidated:
    step: int
    shapes: dict[str, tuple[int, ...]]   # name in the file -> shape
    removed: list[str]                   # the wrappers' name parts taken out (DDP's "module.", ...)
    frozen_left_out: int                 # a peft model's frozen base parameters, not in the snapshot (0: whole)


# Whole model tensors by the state's model names, for an iteration whose tensors DCP cannot assemble (None: it can).
Assembler = Callable[[Path, CheckpointIndex], "dict[str, torch.Tensor] | None"]


def consolidate_model(src: Path, out: Path, assemble: Assembler | None = None) -> Consolidated:
    """Write the model's full tensors of ``src`` (a save_dir's newest iteration, or one iteration_N) as one
    safetensors file ``out``, names without the ``model.`` prefix and without the parts DDP and torch.compile add
    (:func:`unwrapped_names`): what ``model.load_state_dict`` of an unsharded, unwrapped model takes (of a peft
    model's snapshot by TrainerWrapper, which leaves the frozen base out: what trains, for
    ``load_state_dict(strict=False)`` of the peft model). The shards are assembled by DCP's load planning into
    whole tensors, in this process alone, unless ``assemble`` gives them (the flat partitions of a DeepSpeed ZeRO-3
    snapshot, which are no DTensor shards)."""
    iteration_dir = iteration_of(src)
    index = checkpoint_index(iteration_dir)
    assembled = assemble(iteration_dir, index) if assemble is not None else None
    if assembled is not None:
        names = {f"model.{name}": name for name in assembled}
        full = {f"model.{name}": value for name, value in assembled.items()}
    else:
        group_of = {key: layout.tensor_group(name) for name, key in index.keys.get(0, {}).items()}
        names = {key: key[len("model."):] for key in index.tensors if key.startswith("model.")}
        if not names:   # a state without a top-level "model": every tensor of the model file
            names = {key: key for key in index.tensors if group_of.get(key) == "model"}
    if not names:
        raise layout.CheckpointFormatError(f"{iteration_dir} holds no model tensors to convert")
    unwrapped, removed = unwrapped_names(names.values())
    names = {key: unwrapped[name] for key, name in names.items()}
    if assembled is None:
        full = {key: torch.empty(index.tensors[key].global_shape, dtype=torch_dtype(index.tensors[key].dtype))
                for key in names}
        load_into(full, iteration_dir, no_dist=True)
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tensors, seen = {}, set()
    for key, value in full.items():   # a name tied to another (lm_head to the embedding) gets a copy of its own
        tensors[names[key]] = value.clone() if id(value) in seen else value.contiguous()
        seen.add(id(value))
    save_file(tensors, str(tmp),
              metadata={"format": "pt", "easyckpt_step": str(index.step), "easyckpt_source": str(iteration_dir)})
    posix.publish_file(tmp, out)
    frozen = sum(1 for key in index.values if key.startswith(PEFT_FROZEN_KEY + "."))
    return Consolidated(index.step, {names[key]: tuple(value.shape) for key, value in full.items()}, removed, frozen)


# planning: which saved files a rank of another world reads ------------------------------------------------
def files_needed(state_dict: dict[str, Any], iteration_dir: Path) -> dict[str, list[str]]:
    """{file name in ``iteration_dir``: the DCP keys read from it} for loading ``state_dict`` (any template:
    DTensors of the new layout, plain tensors for whole copies) by this process's rank in its meshes, planned
    by DCP's own ``DefaultLoadPlanner`` over the easyckpt ``StorageReader``; no tensor byte is read. Values
    that are not tensors come from ``common.json``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = StorageReader(iteration_dir)
    metadata = reader.read_metadata()
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(state_dict, metadata, True)
    files: dict[str, list[str]] = {}
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        name = layout.COMMON if isinstance(info, _Value) else info.file
        keys = files.setdefault(name, [])
        if item.dest_index.fqn not in keys:
            keys.append(item.dest_index.fqn)
    return files


def fsdp_template(index: CheckpointIndex, rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s template when every saved sharded tensor is split on dim 0 over ``world_size`` ranks
    (FSDP2's ``fully_shard`` layout; 0-dim tensors whole), as DTensors on a mesh of that rank built without
    process groups: a plan for a world that does not exist yet."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = DeviceMesh("cpu", torch.arange(world_size), _init_backend=False, _rank=rank)
    template: dict[str, Any] = {}
    for key, saved in index.tensors.items():
        if not saved.sharded:
            continue
        shape = torch.Size(saved.global_shape)
        placements = [Shard(0)] if shape else [Replicate()]
        local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        # An expanded scalar: the shape without memory (DCP's planner materialises meta tensors on a device)
        empty = torch.empty((), dtype=torch_dtype(saved.dtype)).expand(local)
        template[key] = DTensor.from_local(empty, mesh, placements, run_check=False, shape=shape,
                                           stride=torch.empty(shape, device="meta").stride())
    return template


def ranks_needed(src: Path, world_size: int) -> tuple[CheckpointIndex, dict[int, dict[str, list[str]]]]:
    """The seed's ``rank_list_for_transform``: for each rank of a ``world_size``-rank job that shards every
    tensor on dim 0 (FSDP2), {file: DCP keys} it reads from ``src`` (a save_dir's newest iteration or one
    iteration): its shards' ranges as DCP plans them, plus the files of the saved rank whose private values
    (plain tensors: RNG states, step counters) it takes by ``sharding.source_rank``."""
    from easyckpt.snapshot import sharding

    if world_size < 1:
        raise ValueError(f"--world-size {world_size}: needs at least one rank")
    iteration_dir = iteration_of(src)
    index = checkpoint_index(iteration_dir)
    plans: dict[int, dict[str, list[str]]] = {}
    for rank in range(world_size):
        files = files_needed(fsdp_template(index, rank, world_size), iteration_dir)
        source = sharding.source_rank(rank, index.world_size)
        entry = storage.rank_entry(iteration_dir, source, None)
        for record in entry.records:
            if record.shard is None:
                keys = files.setdefault(record.file, [])
                keys.append(index.keys[source].get(record.name, record.name))
        plans[rank] = files
    return index, plans
