"""The tier of another world's memory: a step saved by a world of another size, resharded straight from its
snapshots in memory (this node's slots of the old ranks, and agents' replicas of old ranks whose node is gone),
with no disk round trip. Which steps every rank can reach whole, and where each old rank's snapshot is, comes
from ``easyckpt.recovery.worlds``.

**Reading**: :class:`MemoryReader` is ``easyckpt.dcp.StorageReader`` over those snapshots instead of an
iteration directory: the same DCP ``Metadata`` (global shapes, each saved shard's offsets from its slot
record's ``ShardSpec``), served from zero-copy views of the slots (or from tensors pulled whole from a
replica, checksum-verified by the transfer), so ``dcp.load``'s planning decides who reads which ranges,
exactly as for the resharded load from disk. Rank-private values follow ``sharding.source_rank``. Every old
slot is read under a shared flock with its generation checked before and after.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from easyckpt.collectives import all_gather_ints
from easyckpt.dcp import CheckpointIndex, Chunk, SavedRange, StorageReader, build_index
from easyckpt.node import replicas as replica
from easyckpt.recovery.results import StateMismatchError
from easyckpt.recovery.template import Template, check_template, dcp_targets, place, resharded_mismatch
from easyckpt.recovery.tier import Loaded
from easyckpt.recovery.worlds import (
    LOCAL,
    Candidate,
    Held,
    LocalSlot,
    MemoryReshardError,
    Reachable,
    choose,
    describe_sources,
)
from easyckpt.snapshot import sharding
from easyckpt.snapshot.state import torch_dtype
from easyckpt_wire.records import Manifest, PeerTable, SlotMeta
from easyckpt_wire.shm import SlotMap, format_bytes
from easyckpt_wire.transfer import PeerClient, tensor_checksum

logger = logging.getLogger(__name__)


class OldSnapshot:
    """One old rank's snapshot, opened for the length of one load."""

    meta: SlotMeta
    where: str
    owned: bool   # tensor() hands out a fresh tensor (a replica), not a view of shared memory

    def tensor(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def check(self) -> None:
        """Raise when the snapshot changed since it was opened (its bytes read meanwhile are not to be used)."""

    def close(self) -> None:
        pass


def _view(data: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not len(data):
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype(dtype)).view(shape)


class LocalSnapshot(OldSnapshot):
    """A slot of this node under a shared flock: the owning rank is gone, and a writer (its successor of the
    same rank number) takes the exclusive lock only after the load."""

    owned = False

    def __init__(self, rank: int, slot: LocalSlot, step: int, timeout: float,
                 expected: tuple[int, list[bytes]] | None) -> None:
        self.rank, self.where, self.generation = rank, LOCAL, slot.generation
        # Writable only so that torch.frombuffer gets a writable buffer; nothing here writes.
        self.slot = SlotMap(slot.path, writable=True)
        try:
            self.slot.lock_shared(timeout)
            header = self.slot.header()
            if not header.committed or header.generation != slot.generation or header.step != step:
                raise MemoryReshardError(f"{slot.path}: rank {rank}'s snapshot of step {step} changed before it could "
                                         "be read")
            self.meta = SlotMeta.from_wire(self.slot.read_meta(header), str(slot.path))
        except BaseException:
            self.slot.close(drop_exported=True)
            raise
        self.checksums = expected[1] if expected is not None and expected[0] == slot.generation else None
        self.views: list[memoryview] = []

    def tensor(self, index: int) -> torch.Tensor:
        entry = self.meta.tensors[index]
        view = self.slot.data(entry.offset, entry.nbytes)
        if self.checksums is not None and tensor_checksum(view) != self.checksums[index]:
            raise MemoryReshardError(f"{self.slot.path}: tensor {entry.name} of step {self.meta.step} does not match "
                                     "the checksum the agent took when it was committed (memory corrupted?)")
        self.views.append(view)
        return _view(view, entry.dtype, entry.shape)

    def check(self) -> None:
        if self.slot.generation() != self.generation:
            raise MemoryReshardError(f"{self.slot.path}: overwritten while rank {self.rank}'s snapshot was read")

    def close(self) -> None:
        for view in self.views:
            view.release()
        self.views.clear()
        try:
            self.slot.unlock()
        finally:
            self.slot.close(drop_exported=True)


class ReplicaSnapshot(OldSnapshot):
    """An old rank's snapshot held by agents: each tensor pulled whole (verified against its checksum by the
    transfer) from the first holder that serves it. Holders in ``silent`` are passed over, and one that does not
    answer now joins them (as in the replica tier)."""

    owned = True

    def __init__(self, rank: int, node: str, manifest: Manifest, holders: list[list[str]], peers: PeerTable,
                 timeout: float, silent: replica.Silent) -> None:
        self.rank, self.where, self.meta = rank, node, manifest.meta
        self.manifest, self.holders, self.peers, self.timeout = manifest, holders, peers, timeout
        self.silent = silent
        self.clients: dict[str, PeerClient] = {}
        self.fetched: dict[int, torch.Tensor] = {}
        self.bytes = 0

    def tensor(self, index: int) -> torch.Tensor:
        if index in self.fetched:
            return self.fetched[index]
        entry = self.meta.tensors[index]
        buffer = bytearray(entry.nbytes)
        problems: list[str] = []
        for node in self.holders[index] if entry.nbytes else ():
            client = self.clients.get(node) or self.clients.setdefault(
                node, PeerClient(self.peers.endpoint(node), self.peers.token, timeout=self.timeout))
            if replica.fetch_tensor(client, self.meta.step, self.manifest.checksums[index], memoryview(buffer),
                                    problems, what=f"{entry.name} of rank {self.rank} step {self.meta.step} "
                                                   f"from node {node}",
                                    node=node, silent=self.silent, who=f"saved rank {self.rank}"):
                break
        else:
            if entry.nbytes:
                raise MemoryReshardError(f"tensor {entry.name} of saved rank {self.rank} step {self.meta.step} could "
                                         f"not be fetched from any holder: {'; '.join(problems) or 'none'}")
        self.bytes += entry.nbytes
        self.fetched[index] = tensor = _view(buffer, entry.dtype, entry.shape)
        return tensor

    def check(self) -> None:
        pass

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()
        self.fetched.clear()


def memory_index(sources: Mapping[int, OldSnapshot], step: int, world_size: int) -> CheckpointIndex:
    """The saved world's snapshots as DCP sees them (``dcp.build_index``, as for an iteration on disk). A
    chunk's file is the tensor's index in its slot, its checksum where it is read from (for messages)."""
    def rank_view(rank: int) -> tuple[Any, int, list[SavedRange]]:
        meta = sources[rank].meta
        return meta.skeleton, len(meta.tensors), [
            SavedRange(i, e.name, e.kind, e.dtype, e.shape, e.shard, rank, str(i), sources[rank].where)
            for i, e in enumerate(meta.tensors)]

    return build_index(Path(f"memory-step-{step}"), step, world_size, rank_view)


class MemoryReader(StorageReader):
    """``easyckpt.dcp.StorageReader`` over the saved world's snapshots in memory rather than an iteration
    directory: the same Metadata, each read served from the old rank's slot (or a replica) that saved it."""

    def __init__(self, sources: Mapping[int, OldSnapshot], index: CheckpointIndex) -> None:
        super().__init__(index.path)
        self.sources = sources
        self.index = index
        self.step = index.step
        self.bytes = 0   # of tensor data copied into this rank's state

    def reset(self, checkpoint_id: Any = None) -> None:
        pass   # the index is built once from the open slots; dcp.load resets its reader before it starts

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if not isinstance(info, Chunk):   # a plain value, decoded from the slot's msgpack skeleton
                buffer = io.BytesIO()
                torch.save(info.value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            data = self.sources[info.rank].tensor(int(info.file))
            box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            data = data[box] if box else data
            target = planner.resolve_tensor(item).detach()
            if target.shape != data.shape:
                raise MemoryReshardError(f"saved rank {info.rank}'s {info.name!r} range {tuple(item.storage_offsets)}"
                                         f"+{tuple(item.lengths)} gave {tuple(data.shape)}, the target needs "
                                         f"{tuple(target.shape)}")
            target.copy_(data)
            self.bytes += data.numel() * data.element_size()
            planner.commit_tensor(item, target)
        for source in self.sources.values():
            source.check()
        future: Future[None] = Future()
        future.set_result(None)
        return future


def open_sources(found: Reachable, chosen: Mapping[int, Held], candidate: Candidate, *, peers: PeerTable | None,
                 timeout: float, peer_timeout: float, silent: replica.Silent,
                 checksums: Any = None) -> dict[int, OldSnapshot]:
    """Open every old rank's snapshot of ``candidate`` (every one is needed for the Metadata; only the ranges
    DCP plans are read). ``checksums(rank, step)``: the local agent's checksums of a slot, or None. ``silent``:
    the load's agents that did not answer (``replicas.Silent``)."""
    opened: dict[int, OldSnapshot] = {}
    try:
        for rank in range(candidate.world_size):
            h = chosen.get(rank)
            if h is None:
                raise MemoryReshardError(f"no snapshot of saved rank {rank} at step {candidate.step} is reachable")
            if h.where == LOCAL:
                expected = checksums(rank, candidate.step) if checksums is not None else None
                opened[rank] = LocalSnapshot(rank, found.local[(rank, candidate.step, candidate.world_size)],
                                            candidate.step, timeout, expected)
            else:
                table = found.peers or peers
                assert table is not None
                key = (rank, candidate.step, h.where)
                opened[rank] = ReplicaSnapshot(rank, h.where, found.manifests[key], found.holders[key], table,
                                              peer_timeout, silent)
        return opened
    except BaseException:
        for source in opened.values():
            source.close()
        raise


def load_into(state: dict[str, Any], reader: MemoryReader) -> None:
    """``dcp.load`` with the memory reader; a failure on any rank reaches every rank (DCP gathers them) as a
    MemoryReshardError, so that ``load()`` moves all ranks to the next candidate together."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        problems = "; ".join(f"rank {rank}: {error}" for rank, (error, _) in sorted(exc.failures.items()))
        raise MemoryReshardError(f"resharding step {reader.step} from memory through "
                                 f"torch.distributed.checkpoint failed: {problems}") from None


def private_records(meta: SlotMeta) -> list[int]:
    """Indices of the source rank's tensors that are not DTensor shards (rank-private: RNG, plain tensors)."""
    return [i for i, e in enumerate(meta.tensors) if e.shard is None]


def summary(step: int, saved: int, world_size: int, chosen: Mapping[int, Held], nbytes: int, seconds: float,
            source_rank: int) -> str:
    return (f"step {step} resharded from memory, {saved} -> {world_size} ranks: {describe_sources(chosen)}; "
            f"{format_bytes(nbytes)} in {seconds:.3f}s; private values from saved rank {source_rank} "
            f"({sharding.private_rule(world_size, saved)})")




@dataclasses.dataclass(slots=True)
class _Opened:
    """One rank's side of a resharded read, after it opened every old rank's snapshot."""

    sources: dict[int, OldSnapshot]
    index: CheckpointIndex | None = None
    into: dict[str, Any] = dataclasses.field(default_factory=dict)     # DCP key -> what dcp.load fills
    handed: dict[int, Any] = dataclasses.field(default_factory=dict)   # source rank's tensor index -> state's value
    problems: list[str] = dataclasses.field(default_factory=list)      # the template's misfits
    failure: Exception | None = None

    def close(self) -> None:
        for opened in self.sources.values():
            opened.close()


def _open(found: Reachable, chosen: Mapping[int, Held], candidate: Candidate, source: int, template: Template, *,
          peers: PeerTable | None, timeout: float, peer_timeout: float, silent: replica.Silent) -> _Opened:
    """Open every old rank's snapshot and plan what ``dcp.load`` fills; never raises (the vote that follows is
    collective): a failure is kept in ``failure``."""
    table = found.peers or peers
    checksums = None
    if table is not None:   # this node's agent hashed its slots (multi-node): verify, as the memory tier does
        def checksums(r: int, s: int) -> tuple[int, list[bytes]] | None:
            assert table is not None
            return replica.own_checksums(table, r, s, peer_timeout, silent)
    opened = _Opened({})
    step = candidate.step
    try:
        opened.sources = open_sources(found, chosen, candidate, peers=peers, timeout=timeout,
                                      peer_timeout=peer_timeout, checksums=checksums, silent=silent)
        opened.index = memory_index(opened.sources, step, candidate.world_size)
        meta = opened.sources[source].meta
        opened.into, opened.handed, opened.problems = dcp_targets(
            ((i, e.name, e.dtype, e.shape, e.shard) for i, e in enumerate(meta.tensors)), opened.index.keys[source],
            template, f"saved rank {source} (step {step})", MemoryReshardError)
    except Exception as exc:  # raised after the vote: no rank may be left waiting in it
        opened.failure = exc
    return opened


def _vote(opened: _Opened, candidate: Candidate, world_size: int) -> None:
    """Collective: every rank says whether it can go on; all raise together when one cannot."""
    step, saved = candidate.step, candidate.world_size
    codes = [row[0] for row in all_gather_ints([2 if opened.problems else 1 if opened.failure else 0], world_size)]
    if opened.failure is not None:
        raise opened.failure
    if opened.problems:
        raise resharded_mismatch(step, f"memory of the {saved}-rank world that saved it", opened.problems)
    if max(codes) == 2:
        raise StateMismatchError(f"another rank's state does not fit step {step} (memory of the {saved}-rank "
                                 "world); see its log")
    if max(codes):
        raise MemoryReshardError(f"rank(s) {[r for r, c in enumerate(codes) if c]} could not open the {saved}-rank "
                                 f"world's snapshots of step {step}; see their logs")


def _fill(opened: _Opened, source: int, template: Template, step: int, saved: int) -> tuple[list[Any], int]:
    """Collective (``dcp.load``): the sharded tensors through DCP, the private ones from the source rank."""
    assert opened.index is not None
    nbytes = 0
    if opened.into:   # the same on every rank: every rank saved the same structure
        reader = MemoryReader(opened.sources, opened.index)
        load_into(opened.into, reader)
        nbytes = reader.bytes
    snapshot = opened.sources[source]
    private = private_records(snapshot.meta)
    check_template([snapshot.meta.tensors[i] for i in private], template, step, f"memory of the {saved}-rank world")
    values: list[Any] = [None] * len(snapshot.meta.tensors)
    for i, value in opened.handed.items():
        values[i] = value
    for i in private:
        tensor = snapshot.tensor(i)
        values[i] = place(snapshot.meta.tensors[i], tensor, template, owned=snapshot.owned)
        nbytes += snapshot.meta.tensors[i].nbytes
        del tensor
    snapshot.check()
    return values, nbytes


def read(found: Reachable, candidate: Candidate, *, rank: int, world_size: int, template: Template,
         peers: PeerTable | None, timeout: float, peer_timeout: float, silent: replica.Silent) -> Loaded:
    """Collective: every rank of the job calls it for the same candidate. ``Loaded.source`` is ``"memory"`` when
    every old rank came from this node's shared memory, else ``"replica"``. As the resharded read from disk
    (``easyckpt.recovery.disk``): DTensors through ``dcp.load``, every other value from one saved rank
    (``sharding.source_rank``); a template that does not fit fails on every rank before any rank reads. An agent
    that does not answer joins ``silent`` (``replicas.Silent``): the load's other candidates do not ask it again."""
    started = time.perf_counter()
    step, saved = candidate.step, candidate.world_size
    table = found.peers or peers
    chosen = choose(found.held, candidate, table.ordered() if table is not None else ())
    source = sharding.source_rank(rank, saved)
    opened = _open(found, chosen, candidate, source, template, peers=peers, timeout=timeout,
                   peer_timeout=peer_timeout, silent=silent)
    try:
        _vote(opened, candidate, world_size)
        values, nbytes = _fill(opened, source, template, step, saved)
    finally:
        opened.close()
    where = "memory" if all(h.where == LOCAL for h in chosen.values()) else "replica"
    checked = sum(1 for o in opened.sources.values() if getattr(o, "checksums", None) is not None)
    logger.info("rank %d: %s%s", rank, summary(step, saved, world_size, chosen, nbytes, time.perf_counter() - started,
                                               source),
                f"; the tensors read from {checked} local slots checked against the agent's checksums" if checked else "")
    return Loaded(opened.sources[source].meta.skeleton, values,
                  f"memory of the {saved}-rank world ({describe_sources(chosen)})", nbytes, where)
