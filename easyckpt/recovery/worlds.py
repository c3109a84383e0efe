"""Another world's snapshots in memory: which steps every new rank can reshard from them, and where each old
rank's snapshot is (the planning and discovery of the reshard tier, ``easyckpt.recovery.reshard``).

When a job restarts with N ranks while the M-rank world that saved a step still holds it in memory (this
node's shared memory keeps every old rank's slots, named by rank; in a multi-node job an agent may hold a
replica of a rank whose node is gone), the new ranks read it from there:

* **Planning** (pure functions, unit-tested in one process): each new rank lists the old snapshots it can
  reach (:class:`Held`: old rank, step, M, where); :func:`complete_steps` keeps the steps at which it reaches
  every old rank 0..M-1; :func:`agree` intersects every new rank's list (one ``all_gather`` of a few ints), so
  all ranks try the same steps in the same order, and a step some rank cannot reach whole is left to disk.
* **Discovery** (:func:`discover`): this node's slots of other worlds, and the replicas agents hold of their
  ranks (each one's manifest says the saved world's size).

Slot lifetime: new rank r's slot files are named like old rank r's, and old rank r's snapshot is read before
the new rank snapshots anything (``load`` runs before training, and the reads end inside ``dcp.load``'s final
collective, so no rank writes while another still reads). Old ranks >= N have no successor to overwrite their
slots: they stay (ignored by the agent, which watches only the current world's slots) until the new world has
a safe step of its own past the resumed one; then :func:`release_old_world` unlinks them (the agent also
unlinks every slot of the job when it ends cleanly, and ``easyckpt clean`` removes them).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from easyckpt.collectives import all_gather_ints
from easyckpt.node import replicas as replica
from easyckpt.recovery.template import Template
from easyckpt.recovery.tier import Loaded, Offer, Offered
from easyckpt_wire import protocol
from easyckpt_wire.protocol import ProtocolError
from easyckpt_wire.records import Manifest, PeerNode, PeerTable, PingReply, RecordError, SlotMeta
from easyckpt_wire.shm import SlotFormatError, SlotMap, list_slots
from easyckpt_wire.transfer import PeerClient, PeerError

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

    @property
    def note(self) -> str:
        return f"of the {self.world_size}-rank world"


class Judged(Protocol):
    """A step offered with its health verdict: a :class:`Candidate`, or the reshard tier's ``Offered``."""

    @property
    def step(self) -> int: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def note(self) -> str: ...


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


def merge(ordered: Sequence[tuple[int, str]], resharding: Sequence[Judged], *, rank: int = 0,
          allow_unhealthy: bool = False) -> list[tuple[int, str]]:
    """``recovery``'s candidate list with the steps every rank can reshard from another world's memory: newest
    first; at one step this world's own memory first, then another world's memory, then replicas, then disk.
    An unhealthy one is passed over (said once) unless ``allow_unhealthy``; a step this world holds in its own
    memory on every rank is not resharded. Pure: the same on every rank."""
    unhealthy = [c for c in resharding if not c.healthy]
    if unhealthy and not allow_unhealthy:
        logger.warning("rank %d: passing over unhealthy snapshots in memory of another world: %s", rank,
                       ", ".join(f"step {c.step} {c.note}".rstrip() for c in unhealthy))
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
    for rank, path, slot in _slots(directory, job_id):
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
    found.held = [Held(rank, step, m, LOCAL, best[(rank, step, m)][1]) for rank, step, m in sorted(found.local)]
    return found


def add_replicas(found: Reachable, peers: PeerTable, listings: Mapping[str, Mapping[int, Any]], world_size: int,
                 timeout: float, silent: replica.Silent, steps: int = 3) -> None:
    """Old ranks' snapshots that agents hold (a survey's listings: node -> {step: ListRow}), for the newest
    ``steps`` steps at which the ranks held here and there could make a whole old world. Each one's manifest is
    read (it says the saved world's size); a tensor is served by the nodes whose listing has its checksum. An
    agent that does not answer a read joins ``silent`` and is asked nothing more in this load."""
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
                got = _read_manifest(peers, node, probe, step, timeout, silent)
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
                    manifest = manifests.get((rank, node)) or _read_manifest(peers, node, rank, step, timeout, silent)
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


def _read_manifest(peers: PeerTable, node: str, rank: int, step: int, timeout: float,
                   silent: replica.Silent) -> Manifest | None:
    """Old rank ``rank``'s manifest of ``step`` from ``node``'s agent (the replica tier's MANIFEST request); None
    when it has none, or did not answer (now or earlier in this load)."""
    if node in silent:
        return None
    client = PeerClient(peers.endpoint(node), peers.token, timeout=timeout)
    try:
        return replica.read_manifest(client, rank, step)
    except (PeerError, ProtocolError, RecordError) as exc:
        logger.info("manifest of rank %d step %d from node %s: %s", rank, step, node, exc)
        replica.hush(silent, node, exc, f"the manifest of saved rank {rank} step {step}")
        return None
    finally:
        client.close()


def discover(directory: Path, job_id: str, world_size: int, peers: PeerTable | None,
             survey: replica.Survey | None, timeout: float, silent: replica.Silent) -> Reachable:
    """This node's slots of other worlds, and (multi-node) the replicas agents hold of their ranks. Never
    raises: every rank goes on to the collective ``agreed`` (what it could not see, it does not offer).
    ``silent``: the load's agents that did not answer (``replicas.Silent``), filled here too."""
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
                survey = replica.survey(peers, timeout)
        if peers is not None and survey is not None:
            found.peers = peers
            add_replicas(found, peers, survey.listings, world_size, timeout, silent)
    except Exception as exc:  # the replicas are a bonus: this node's memory and the disk still serve
        logger.warning("replicas of another world's ranks could not be surveyed (%s: %s): a resume on another "
                       "world size uses this node's memory and the disk only", type(exc).__name__, exc)
    return found


def this_nodes_agent(job_id: str, timeout: float) -> PeerTable | None:
    """A one-node peer table of this node's agent when it runs a replica server that a multi-node run of this
    job set up (its endpoint and token from PING on the private ipc socket); None otherwise."""
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


def release_old_world(directory: Path, job_id: str, world_size: int, keep: Collection[int] = ()) -> list[Path]:
    """Unlink this node's slots of old ranks >= ``world_size`` written by another world (their successors do
    not exist, so nothing else ever frees them); a slot locked by anyone (a reader, the agent) is left for the
    agent's cleanup at the end of the job. Returns the paths removed."""
    removed = []
    for _rank, path, slot in _slots(directory, job_id, skip=lambda rank: rank < world_size or rank in keep):
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
    return removed


def _slots(directory: Path, job_id: str, skip: Callable[[int], bool] = lambda rank: False,
           ) -> Iterator[tuple[int, Path, SlotMap]]:
    """This job's slot files in ``directory`` that open, read-only, rank by rank; each closed once the caller moves
    on (a file that does not open is left out: another world's slot can vanish or be half made at any time)."""
    for (rank, _index), path in sorted(list_slots(directory, job_id).items()):
        if skip(rank):
            continue
        try:
            slot = SlotMap(path, writable=False)
        except (OSError, SlotFormatError):
            continue
        try:
            yield rank, path, slot
        finally:
            slot.close(drop_exported=True)


class OtherWorldTier:
    """Steps a world of another size saved and every rank of this one reaches whole in memory (``worlds``).

    Collective, its offer too: which (step, saved world size) a rank may read depends on every rank reaching
    every old rank, so ``offer()`` agrees with the other ranks (one small ``all_gather``)."""

    source = SOURCE
    collective = True

    def __init__(self, directory: Path, job_id: str, *, rank: int, world_size: int, peers: PeerTable | None = None,
                 survey: replica.Survey | None = None, timeout: float = 120.0, peer_timeout: float = 10.0,
                 silent: replica.Silent | None = None) -> None:
        self.directory, self.job_id, self.rank, self.world_size = directory, job_id, rank, world_size
        self.peers, self.survey, self.timeout, self.peer_timeout = peers, survey, timeout, peer_timeout
        self.silent = {} if silent is None else silent   # agents that did not answer in this load
        self.found = Reachable()
        self.candidates: list[Candidate] = []

    def offer(self) -> Offer:
        self.found = discover(self.directory, self.job_id, self.world_size, self.peers, self.survey, self.peer_timeout,
                              self.silent)
        self.candidates = agreed(self.found, self.world_size)
        return Offer(tuple(Offered(c.step, c.healthy, (), c.note) for c in self.candidates))

    def holds(self, step: int) -> bool:
        return any(c.step == step for c in self.candidates)

    def read(self, step: int, template: Template) -> Loaded:
        if not self.holds(step):
            raise MemoryReshardError(f"rank {self.rank}: no world of another size left step {step} in memory")
        # The reading goes through DCP, whose import (with DTensor's, about a second) every worker would pay at
        # start-up for a tier that reads in few jobs: imported when it reads.
        from easyckpt.recovery import reshard
        return reshard.read(self.found, pick(self.candidates, step), rank=self.rank, world_size=self.world_size,
                            template=template, peers=self.peers, timeout=self.timeout, peer_timeout=self.peer_timeout,
                            silent=self.silent)
