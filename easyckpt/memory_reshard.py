"""Resume on another world size straight from the saved world's memory (no disk round trip).

When a job restarts with N ranks while the M-rank world that saved a step still holds it in memory (this
node's shared memory keeps every old rank's slots, named by rank; in a multi-node job an agent may hold a
replica of a rank whose node is gone), the new ranks read it from there:

* **Planning** (pure functions, unit-tested in one process): each new rank lists the old snapshots it can
  reach (:class:`Held`: old rank, step, M, where); :func:`complete_steps` keeps the steps at which it reaches
  every old rank 0..M-1; :func:`agree` intersects every new rank's list (one ``all_gather`` of a few ints), so
  all ranks try the same steps in the same order, and a step some rank cannot reach whole is left to disk.
* **Reading**: :class:`MemoryReader` is ``easyckpt.dcp.StorageReader`` over those snapshots instead of an
  iteration directory: the same DCP ``Metadata`` (global shapes, each saved shard's offsets from its slot
  record's ``ShardSpec``), served from zero-copy views of the slots (or from tensors pulled whole from a
  replica, checksum-verified by the transfer), so ``dcp.load``'s planning decides who reads which ranges,
  exactly as for the resharded load from disk. Rank-private values follow ``sharding.source_rank``.

Slot lifetime: new rank r's slot files are named like old rank r's, and old rank r's snapshot is read before
the new rank snapshots anything (``load`` runs before training, and the reads end inside ``dcp.load``'s final
collective, so no rank writes while another still reads). Every old slot is read under a shared flock with its
generation checked before and after. Old ranks >= N have no successor to overwrite their slots: they stay
(ignored by the agent, which watches only the current world's slots) until the new world has a safe step of
its own past the resumed one; then :func:`release_old_world` unlinks them (the agent also unlinks every slot
of the job when it ends cleanly, and ``easyckpt clean`` removes them).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from easyckpt import sharding
from easyckpt.collectives import all_gather_ints
from easyckpt.dcp import CheckpointIndex, Chunk, SavedRange, StorageReader, _Value, build_index
from easyckpt.state import torch_dtype
from easyckpt_wire.records import Manifest, PeerTable, SlotMeta
from easyckpt_wire.shm import SlotFormatError, SlotMap, format_bytes, list_slots
from easyckpt_wire.transfer import PeerClient, PeerError, tensor_checksum

logger = logging.getLogger(__name__)

MAX_CANDIDATES = 4   # (step, saved world) pairs each rank reports: the slots of one rank hold at most a few steps
LOCAL = "local"      # Held.where of a snapshot in this node's shared memory
SOURCE = "reshard"   # recovery's candidate source for a step read from another world's memory
_ORDER = {"memory": 0, SOURCE: 1, "replica": 2, "disk": 3}


class MemoryReshardError(SlotFormatError):
    """A snapshot of the saved world could not be read from memory (torn, overwritten, a replica gone)."""


# planning: pure --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """One old rank's snapshot of one step that this new rank can reach."""

    rank: int            # in the saved world
    step: int
    world_size: int      # of the saved world (M)
    where: str = LOCAL   # LOCAL (this node's shared memory) or the node whose agent holds a replica
    healthy: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    step: int
    world_size: int      # of the saved world
    healthy: bool = True


def complete_steps(held: Iterable[Held], world_size: int) -> list[Candidate]:
    """The (step, M) at which every old rank 0..M-1 is reachable, for M other than ``world_size`` (the same world
    resumes through the ordinary memory tier), newest first; unhealthy when any old rank's snapshot is."""
    ranks: dict[tuple[int, int], set[int]] = {}
    healthy: dict[tuple[int, int], bool] = {}
    for h in held:
        if h.world_size == world_size or not 0 <= h.rank < h.world_size:
            continue
        key = (h.step, h.world_size)
        ranks.setdefault(key, set()).add(h.rank)
        healthy[key] = healthy.get(key, True) and h.healthy
    found = [Candidate(step, m, healthy[(step, m)]) for (step, m), got in ranks.items() if len(got) == m]
    return sorted(found, key=lambda c: (-c.step, -c.world_size))


def encode(candidates: Sequence[Candidate], limit: int = MAX_CANDIDATES) -> list[int]:
    """A fixed-size int vector for the all_gather: (step, M, unhealthy) per candidate, -1 padded."""
    flat: list[int] = []
    for c in list(candidates)[:limit]:
        flat += [c.step, c.world_size, int(not c.healthy)]
    return flat + [-1] * (3 * limit - len(flat))


def agree(rows: Sequence[Sequence[int]]) -> list[Candidate]:
    """The candidates every rank reported (``encode``d rows, one per rank), newest first; unhealthy when any
    rank says so. The same answer on every rank."""
    common: set[tuple[int, int]] | None = None
    bad: set[tuple[int, int]] = set()
    for row in rows:
        mine = set()
        for i in range(0, len(row) - 2, 3):
            step, m, unhealthy = row[i], row[i + 1], row[i + 2]
            if step >= 0 and m > 0:
                mine.add((step, m))
                if unhealthy:
                    bad.add((step, m))
        common = mine if common is None else common & mine
    return sorted((Candidate(s, m, (s, m) not in bad) for s, m in common or ()), key=lambda c: (-c.step, -c.world_size))


def choose(held: Iterable[Held], candidate: Candidate, order: Sequence[str] = ()) -> dict[int, Held]:
    """For each old rank of ``candidate``, where to read it: this node's memory first, then replicas in
    ``order`` (cheapest node first; nodes not in it after, by name)."""
    rank_of = {node: i for i, node in enumerate(order)}
    best: dict[int, Held] = {}

    def cost(h: Held) -> tuple[int, int, str]:
        return (0 if h.where == LOCAL else 1, rank_of.get(h.where, len(rank_of)), h.where)

    for h in held:
        if (h.step, h.world_size) != (candidate.step, candidate.world_size):
            continue
        if h.rank not in best or cost(h) < cost(best[h.rank]):
            best[h.rank] = h
    return best


def merge(ordered: Sequence[tuple[int, str]], resharding: Sequence[Candidate], *, rank: int = 0,
          allow_unhealthy: bool = False) -> list[tuple[int, str]]:
    """``recovery``'s candidate list with the steps every rank can reshard from another world's memory: newest
    first; at one step this world's own memory first, then another world's memory, then replicas, then disk.
    An unhealthy one is passed over (said once) unless ``allow_unhealthy``. Pure: the same on every rank."""
    unhealthy = [c for c in resharding if not c.healthy]
    if unhealthy and not allow_unhealthy:
        logger.warning("rank %d: passing over unhealthy snapshots in memory of another world: %s", rank,
                       ", ".join(f"step {c.step} of the {c.world_size}-rank world" for c in unhealthy))
    steps = {c.step for c in resharding if c.healthy or allow_unhealthy} - {s for s, src in ordered if src == "memory"}
    merged = list(ordered) + [(s, SOURCE) for s in steps]
    return sorted(merged, key=lambda c: (-c[0], _ORDER.get(c[1], len(_ORDER))))


def pick(resharding: Sequence[Candidate], step: int) -> Candidate:
    """The candidate of ``step`` (of two worlds that saved the same step, the larger: first in ``agree``'s order)."""
    return next(c for c in resharding if c.step == step)


def describe_sources(chosen: Mapping[int, Held]) -> str:
    """``ranks 0-3 local shm`` / ``ranks 0-1 local shm, ranks 2-3 replica from node1`` for the log."""
    by_where: dict[str, list[int]] = {}
    for rank, h in sorted(chosen.items()):
        by_where.setdefault(h.where, []).append(rank)
    parts = []
    for where, ranks in sorted(by_where.items(), key=lambda kv: (kv[0] != LOCAL, kv[0])):
        span = f"rank {ranks[0]}" if len(ranks) == 1 else (
            f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else f"ranks {ranks}")
        parts.append(f"{span} {'local shm' if where == LOCAL else 'replica from ' + where}")
    return ", ".join(parts)


# discovery --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class LocalSlot:
    path: Path
    generation: int


@dataclasses.dataclass(slots=True)
class Reachable:
    """What this rank can reach of other worlds' snapshots, and how to open each."""

    held: list[Held] = dataclasses.field(default_factory=list)
    local: dict[tuple[int, int, int], LocalSlot] = dataclasses.field(default_factory=dict)   # (rank, step, M) ->
    manifests: dict[tuple[int, int, str], Manifest] = dataclasses.field(default_factory=dict)  # (rank, step, node)
    holders: dict[tuple[int, int, str], list[list[str]]] = dataclasses.field(default_factory=dict)
    peers: PeerTable | None = None   # the agents the replicas above are read from


def local_snapshots(directory: Path, job_id: str, world_size: int) -> Reachable:
    """Committed slots of this job in ``directory`` written by a world of another size (the newer generation of
    a step held twice). A slot that cannot be read is left out (the disk has the step, or not)."""
    found = Reachable()
    best: dict[tuple[int, int, int], tuple[int, bool]] = {}
    for (rank, _index), path in sorted(list_slots(directory, job_id).items()):
        try:
            slot = SlotMap(path, writable=False)
        except (OSError, SlotFormatError):
            continue
        try:
            header = slot.header()
            if not header.committed or header.job_id != job_id or header.world_size == world_size \
                    or header.rank != rank:
                continue
            meta = SlotMeta.from_wire(slot.read_meta(header), str(path))
            if slot.generation() != header.generation or meta.step != header.step:
                continue
            key = (rank, header.step, header.world_size)
            if key not in best or best[key][0] < header.generation:
                best[key] = (header.generation, meta.health.healthy)
                found.local[key] = LocalSlot(path, header.generation)
        except (OSError, ValueError, SlotFormatError) as exc:
            logger.debug("slot %s of another world unreadable: %s", path, exc)
        finally:
            slot.close(drop_exported=True)
    found.held = [Held(rank, step, m, LOCAL, best[(rank, step, m)][1]) for rank, step, m in sorted(found.local)]
    return found


def add_replicas(found: Reachable, peers: PeerTable, listings: Mapping[str, Mapping[int, Any]], world_size: int,
                 timeout: float, steps: int = 3) -> None:
    """Old ranks' snapshots that agents hold (a survey's listings: node -> {step: ListRow}), for the newest
    ``steps`` steps at which the ranks held here and there could make a whole old world. Each one's manifest is
    read (it says the saved world's size); a tensor is served by the nodes whose listing has its checksum."""
    from easyckpt.replica import _manifest  # the same MANIFEST request the replica tier sends

    order = [n for n in peers.ordered() if n in listings]
    all_steps = sorted({s for rows in listings.values() for s in rows}, reverse=True)
    tried = 0
    for step in all_steps:
        if tried >= steps:
            break
        listed = {r for n in order for r in getattr(listings[n].get(step), "ranks", ())}
        sizes = {m for (_, s, m) in found.local if s == step}
        manifests: dict[tuple[int, str], Manifest] = {}
        if not sizes and listed:
            probe = max(listed)   # the highest old rank exists only in the old world when it shrank
            # not every node lists every step (a KeyError here once hid every replica behind "could not be surveyed")
            for node in (n for n in order if probe in getattr(listings[n].get(step), "ranks", ())):
                got = _read_manifest(peers, node, probe, step, timeout, _manifest)
                if got is not None:
                    manifests[(probe, node)] = got
                    sizes.add(got.meta.world_size)
                    break
        sizes.discard(world_size)
        if not sizes:
            continue
        tried += 1
        for m in sizes:
            local = {r for (r, s, size) in found.local if s == step and size == m}
            if not set(range(m)) <= local | listed:
                continue
            for rank in sorted(set(range(m)) - local):
                for node in (n for n in order if rank in getattr(listings[n].get(step), "ranks", ())):
                    manifest = manifests.get((rank, node)) or _read_manifest(peers, node, rank, step, timeout, _manifest)
                    if manifest is None or manifest.meta.world_size != m or manifest.step != step:
                        continue
                    holders = [[n for n in order if c in getattr(listings[n].get(step), "checksums", ())]
                               for c in manifest.checksums]
                    if any(not h for e, h in zip(manifest.tensors, holders) if e.nbytes):
                        continue
                    found.manifests[(rank, step, node)] = manifest
                    found.holders[(rank, step, node)] = holders
                    found.held.append(Held(rank, step, m, node, manifest.meta.health.healthy))
                    break


def _read_manifest(peers: PeerTable, node: str, rank: int, step: int, timeout: float, read: Any) -> Manifest | None:
    from easyckpt_wire.protocol import ProtocolError
    from easyckpt_wire.records import RecordError

    client = PeerClient(peers.endpoint(node), peers.token, timeout=timeout)
    try:
        return read(client, rank, step)  # type: ignore[no-any-return]
    except (PeerError, ProtocolError, RecordError) as exc:
        logger.info("manifest of rank %d step %d from node %s: %s", rank, step, node, exc)
        return None
    finally:
        client.close()


def discover(directory: Path, job_id: str, world_size: int, peers: PeerTable | None, survey: Any,
             timeout: float) -> Reachable:
    """This node's slots of other worlds, and (multi-node) the replicas agents hold of their ranks. Never
    raises: every rank goes on to the collective ``agreed`` (what it could not see, it does not offer)."""
    try:
        found = local_snapshots(directory, job_id, world_size)
    except Exception as exc:  # never raised past here: the agreement that follows is a collective
        logger.warning("slots of another world in %s could not be listed: %s", directory, exc)
        found = Reachable()
    try:
        if peers is None:
            # A job on one node has no peer table, but this node's agent may still hold replicas of the ranks of
            # a lost node from when the job spanned nodes (a job that shrank to the surviving node).
            peers = this_nodes_agent(job_id, timeout)
            if peers is not None:
                from easyckpt import replica

                survey = replica.survey(peers, timeout)
        if peers is not None and survey is not None:
            found.peers = peers
            add_replicas(found, peers, survey.listings, world_size, timeout)
    except Exception as exc:  # the replicas are a bonus: this node's memory and the disk still serve
        logger.warning("replicas of another world's ranks could not be surveyed (%s: %s): a resume on another "
                       "world size uses this node's memory and the disk only", type(exc).__name__, exc)
    return found


def this_nodes_agent(job_id: str, timeout: float) -> PeerTable | None:
    """A one-node peer table of this node's agent when it runs a replica server that a multi-node run of this
    job set up (its endpoint and token from PING on the private ipc socket); None otherwise."""
    from easyckpt_wire import protocol
    from easyckpt_wire.records import PeerNode, PingReply, RecordError

    job_dir = protocol.runtime_base() / protocol.job_dir_name(job_id)   # not created here: no agent, no replicas
    if not job_dir.is_dir() or not protocol.agent_running(job_dir):
        return None
    try:
        ping = PingReply.from_wire(protocol.request_agent(job_dir, protocol.Kind.PING, min(timeout, 5.0)),
                                   "the node agent's PING reply")
    except (protocol.AgentNoReply, RecordError, protocol.ProtocolError) as exc:
        logger.debug("this node's agent: %s", exc)
        return None
    if ping.endpoint is None or ping.token is None or ping.node is None:
        return None
    return PeerTable(ping.token, ping.node, ping.node, {ping.node: PeerNode(ping.endpoint, ())})


def agreed(found: Reachable, world_size: int) -> list[Candidate]:
    """Collective: the (step, M) every rank of the job can reshard from memory, newest first."""
    return agree(all_gather_ints(encode(complete_steps(found.held, world_size)), world_size))


# reading ----------------------------------------------------------------------------------------------------
class _Source:
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


class _LocalSource(_Source):
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


class _ReplicaSource(_Source):
    """An old rank's snapshot held by agents: each tensor pulled whole (verified against its checksum by the
    transfer) from the first holder that serves it."""

    owned = True

    def __init__(self, rank: int, node: str, manifest: Manifest, holders: list[list[str]], peers: PeerTable,
                 timeout: float) -> None:
        self.rank, self.where, self.meta = rank, node, manifest.meta
        self.manifest, self.holders, self.peers, self.timeout = manifest, holders, peers, timeout
        self.clients: dict[str, PeerClient] = {}
        self.fetched: dict[int, torch.Tensor] = {}
        self.bytes = 0

    def tensor(self, index: int) -> torch.Tensor:
        if index in self.fetched:
            return self.fetched[index]
        from easyckpt.replica import _fetch_one

        entry = self.meta.tensors[index]
        buffer = bytearray(entry.nbytes)
        problems: list[str] = []
        for node in self.holders[index] if entry.nbytes else ():
            client = self.clients.get(node) or self.clients.setdefault(
                node, PeerClient(self.peers.endpoint(node), self.peers.token, timeout=self.timeout))
            if _fetch_one(client, self.meta.step, self.manifest.checksums[index], memoryview(buffer), problems,
                          what=f"{entry.name} of rank {self.rank} step {self.meta.step} from node {node}"):
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


def memory_index(sources: Mapping[int, _Source], step: int, world_size: int) -> CheckpointIndex:
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

    def __init__(self, sources: Mapping[int, _Source], index: CheckpointIndex) -> None:
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
            if isinstance(info, _Value):
                buffer = io.BytesIO()
                torch.save(info.value, buffer)   # a value decoded from the slot's msgpack skeleton
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            assert isinstance(info, Chunk)
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
                 timeout: float, peer_timeout: float, checksums: Any = None) -> dict[int, _Source]:
    """Open every old rank's snapshot of ``candidate`` (every one is needed for the Metadata; only the ranges
    DCP plans are read). ``checksums(rank, step)``: the local agent's checksums of a slot, or None."""
    opened: dict[int, _Source] = {}
    try:
        for rank in range(candidate.world_size):
            h = chosen.get(rank)
            if h is None:
                raise MemoryReshardError(f"no snapshot of saved rank {rank} at step {candidate.step} is reachable")
            if h.where == LOCAL:
                expected = checksums(rank, candidate.step) if checksums is not None else None
                opened[rank] = _LocalSource(rank, found.local[(rank, candidate.step, candidate.world_size)],
                                            candidate.step, timeout, expected)
            else:
                table = found.peers or peers
                assert table is not None
                key = (rank, candidate.step, h.where)
                opened[rank] = _ReplicaSource(rank, h.where, found.manifests[key], found.holders[key], table,
                                              peer_timeout)
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


def read(found: Reachable, candidate: Candidate, *, rank: int, world_size: int, template: Mapping[str, Any],
         peers: PeerTable | None, timeout: float, peer_timeout: float) -> tuple[str, tuple[Any, list[Any], str, int]]:
    """Collective: every rank of the job calls it for the same candidate. Returns (``"memory"`` when every old
    rank came from this node's shared memory, else ``"replica"``; (skeleton, values, description, bytes)) in the
    shape ``recovery``'s readers return. Mirrors ``recovery._read_resharded``: DTensors through ``dcp.load``,
    every other value from one saved rank (``sharding.source_rank``); a template that does not fit fails on
    every rank before any rank reads."""
    from easyckpt import replica
    from easyckpt.recovery import StateMismatchError, _check_template, _place, _Record, dcp_targets, shown

    started = now()
    step, saved = candidate.step, candidate.world_size
    table = found.peers or peers
    chosen = choose(found.held, candidate, table.ordered() if table is not None else ())
    source = sharding.source_rank(rank, saved)
    checksums = None
    if table is not None:   # this node's agent hashed its slots (multi-node): verify, as the memory tier does
        def checksums(r: int, s: int) -> tuple[int, list[bytes]] | None:
            assert table is not None
            return replica.own_checksums(table, r, s, peer_timeout)
    sources: dict[int, _Source] = {}
    into: dict[str, Any] = {}      # DCP key -> what dcp.load fills
    handed: dict[int, Any] = {}    # tensor index of the source rank -> what the loaded state holds
    problems: list[str] = []
    failure: Exception | None = None
    index: CheckpointIndex | None = None
    try:
        sources = open_sources(found, chosen, candidate, peers=peers, timeout=timeout, peer_timeout=peer_timeout,
                               checksums=checksums)
        index = memory_index(sources, step, saved)
        meta, keys = sources[source].meta, index.keys[source]
        into, handed, problems = dcp_targets(((i, e.name, e.dtype, e.shape, e.shard) for i, e in enumerate(meta.tensors)),
                                             keys, template, f"saved rank {source} (step {step})", MemoryReshardError)
    except Exception as exc:  # raised after the vote below: no rank may be left waiting in it
        failure = exc
    try:
        codes = [row[0] for row in all_gather_ints([2 if problems else 1 if failure else 0], world_size)]
        if failure is not None:
            raise failure
        if problems:
            raise StateMismatchError(
                f"the state passed to load() does not match the checkpoint of step {step} (memory of the {saved}-rank "
                f"world that saved it): {shown(problems)}. A resharded load changes how tensors are split, not their global "
                "shapes: build the model and optimizer with the configuration of the run that saved it")
        if max(codes) == 2:
            raise StateMismatchError(f"another rank's state does not fit step {step} (memory of the {saved}-rank "
                                     "world); see its log")
        if max(codes):
            raise MemoryReshardError(f"rank(s) {[r for r, c in enumerate(codes) if c]} could not open the {saved}-rank "
                                     f"world's snapshots of step {step}; see their logs")
        assert index is not None
        nbytes = 0
        if into:   # the same on every rank: every rank saved the same structure
            reader = MemoryReader(sources, index)
            load_into(into, reader)
            nbytes = reader.bytes
        meta = sources[source].meta
        records = [_Record(i, e.name, e.kind, e.dtype, e.shape, e.shard) for i, e in enumerate(meta.tensors)]
        private = private_records(meta)
        _check_template([records[i] for i in private], dict(template), step, f"memory of the {saved}-rank world")
        values: list[Any] = [None] * len(records)
        for i, value in handed.items():
            values[i] = value
        owned = sources[source].owned
        for i in private:
            tensor = sources[source].tensor(i)
            values[i] = _place(records[i], tensor, dict(template), owned=owned)
            nbytes += meta.tensors[i].nbytes
            del tensor
        sources[source].check()
    finally:
        for opened in sources.values():
            opened.close()
    where = "memory" if all(h.where == LOCAL for h in chosen.values()) else "replica"
    checked = sum(1 for o in sources.values() if getattr(o, "checksums", None) is not None)
    logger.info("rank %d: %s%s", rank, summary(step, saved, world_size, chosen, nbytes, now() - started, source),
                f"; the tensors read from {checked} local slots checked against the agent's checksums" if checked else "")
    return where, (meta.skeleton, values, f"memory of the {saved}-rank world ({describe_sources(chosen)})", nbytes)


def release_old_world(directory: Path, job_id: str, world_size: int, keep: Collection[int] = ()) -> list[Path]:
    """Unlink this node's slots of old ranks >= ``world_size`` written by another world (their successors do
    not exist, so nothing else ever frees them); a slot locked by anyone (a reader, the agent) is left for the
    agent's cleanup at the end of the job. Returns the paths removed."""
    removed = []
    for (rank, _index), path in sorted(list_slots(directory, job_id).items()):
        if rank < world_size or rank in keep:
            continue
        try:
            slot = SlotMap(path, writable=False)
        except (OSError, SlotFormatError):
            continue
        try:
            header = slot.header()
            if header.world_size == world_size or not slot.try_lock(exclusive=True):
                continue
            try:
                path.unlink(missing_ok=True)
                removed.append(path)
            finally:
                slot.unlock()
        except (OSError, SlotFormatError) as exc:
            logger.debug("cannot release %s: %s", path, exc)
        finally:
            slot.close(drop_exported=True)
    return removed


def now() -> float:
    return time.perf_counter()
