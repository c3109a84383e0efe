"""A rank's side of multi-node replicas: introduce the node agents to each other, find a replica of
this rank's state, and pull it into this rank's own slot.

Introduction (once per run, in ``Checkpointer.__init__``): every rank learns its agent's tcp endpoint
and node id, the ranks exchange them with a collective, rank 0 draws a random job token and
broadcasts it, and every rank hands its agent the token, the node list and the leader (the node of
rank 0). Nothing travels through the rendezvous but fixed-size integer tensors, so nothing from the
network is unpickled.

Recovery: each rank asks every agent what it holds (LIST), reads the manifest of its own rank at the
newest steps some agent knows, and a step is *obtainable* for it when every tensor checksum of that
manifest is held by a reachable agent. The fetch writes straight into the rank's own slot, chunk by
chunk, trying the next holder of a tensor when one fails or hangs; the slot is committed only when
every tensor matches its checksum, and is then read like any snapshot in memory.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import psutil
import zmq

from easyckpt.collectives import all_gather_text
from easyckpt.slots import RankSlots
from easyckpt_wire.protocol import Kind, ProtocolError, split_checksums
from easyckpt_wire.shm import format_bytes, pack_meta, slot_size
from easyckpt_wire.transfer import FetchError, PeerClient, PeerError

logger = logging.getLogger(__name__)

_FIELD = 256          # bytes per rank for "node\nendpoint" in the exchange
CANDIDATE_STEPS = 2   # replica steps considered per rank, like the two slots of memory
MAX_COPIES = 8        # copies of one tensor tried on one node (DP ranks of a node hold the same tensors)


class ReplicaError(RuntimeError):
    """This rank's state could not be rebuilt from replicas."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerSet:
    token: str
    node: str
    leader: str
    nodes: dict[str, dict[str, Any]]   # node -> {"endpoint", "ranks"}

    def ordered(self) -> list[str]:
        """This node first (loopback is cheapest), then the others by name: the same order everywhere."""
        return [self.node] + sorted(n for n in self.nodes if n != self.node)


Request = Callable[..., dict[str, Any]]   # (kind, timeout, **fields) -> reply: a rank's session or one-off


def introduce(request: Request, *, rank: int, world_size: int, replicate_unique: bool, timeout: float,
              training: bool = True) -> PeerSet:
    """Collective: every rank's agent learns the job token, the other agents and the leader (rank 0's node).

    ``training=False`` is the standalone launcher (``easyckpt.agents``): one process per node and no
    training ranks yet, so every node is listed with no ranks and the job as one rank; the training job
    that comes later introduces the same agents again with its own ranks, token and leader."""
    info = request(Kind.PING, timeout)
    node, endpoint = info.get("node"), info.get("endpoint")
    if not isinstance(node, str) or not isinstance(endpoint, str):
        raise ReplicaError(f"rank {rank}: the node agent has no replica server (reply {info}); "
                           "is it an older easyckpt-agent?")
    rows = [row.split("\n", 1) for row in all_gather_text(f"{node}\n{endpoint}", world_size, field=_FIELD)]
    token = secrets.token_hex(16) if rank == 0 else "0" * 32
    token = all_gather_text(token, world_size, field=_FIELD)[0]
    nodes: dict[str, dict[str, Any]] = {}
    for other, (name, address) in enumerate(rows):
        entry = nodes.setdefault(name, {"endpoint": address, "ranks": []})
        if entry["endpoint"] != address:
            raise ReplicaError(f"node id {name!r} names two agents ({entry['endpoint']} and {address}, rank {other}): "
                               "give every node its own EASYCKPT_NODE_ID")
        if training:
            entry["ranks"].append(other)
    peers = PeerSet(token, node, rows[0][0], nodes)
    reply = request(Kind.PEERS, timeout, token=token, node=node, leader=peers.leader,
                    nodes=[{"node": n, **v} for n, v in sorted(nodes.items())],
                    world_size=world_size if training else 1, replicate_unique=replicate_unique)
    if not reply.get("ok"):
        raise ReplicaError(f"rank {rank}: the agent of node {node} refused the peer list: {reply.get('error')}")
    all_gather_text("", world_size, field=_FIELD)  # every agent knows the token before any rank asks one for data
    logger.info("rank %d: node %s, %d nodes %s, leader %s", rank, node, len(nodes), sorted(nodes), peers.leader)
    return peers


@dataclasses.dataclass(slots=True)
class Survey:
    """What every reachable agent holds: node -> {step: (ranks with a manifest, checksums)}."""

    listings: dict[str, dict[int, tuple[set[int], set[bytes]]]]
    unreachable: dict[str, str]


def survey(peers: PeerSet, timeout: float) -> Survey:
    """Ask every agent at once what it holds; a dead or hung one costs ``timeout`` and is left out."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    clients = {node: PeerClient(peers.nodes[node]["endpoint"], peers.token, timeout=timeout, ctx=ctx)
               for node in peers.ordered()}
    listings, unreachable = {}, {}
    try:
        for node, client in clients.items():   # sequential, but a dead node only costs its timeout once
            try:
                rows = client.call(Kind.LIST)["steps"]
                listings[node] = {int(step): (set(ranks), split_checksums(blob))
                                  for step, ranks, blob in rows}
            except (PeerError, ProtocolError, KeyError, TypeError, ValueError) as exc:
                unreachable[node] = str(exc)
    finally:
        for client in clients.values():
            client.close()
    return Survey(listings, unreachable)


def own_checksums(peers: PeerSet, rank: int, step: int, timeout: float) -> tuple[int, list[bytes]] | None:
    """(slot generation, tensor checksums) the node agent computed for this rank's snapshot of ``step``,
    so that a read from memory is verified too; None when the agent has not hashed it."""
    client = PeerClient(peers.nodes[peers.node]["endpoint"], peers.token, timeout=timeout)
    try:
        manifest = client.call(Kind.MANIFEST, rank=rank, step=step)["manifest"]
        return int(manifest["generation"]), list(manifest["checksums"])
    except (PeerError, ProtocolError, KeyError, TypeError, ValueError):
        return None
    finally:
        client.close()


@dataclasses.dataclass(slots=True)
class ReplicaPlan:
    step: int
    manifest: dict[str, Any]
    holders: list[list[str]]      # per tensor: nodes holding its checksum at that step, cheapest first
    manifest_node: str


def plan(peers: PeerSet, found: Survey, rank: int, timeout: float) -> dict[int, ReplicaPlan]:
    """The steps (newest first, at most CANDIDATE_STEPS) whose whole state this rank can pull."""
    order = [n for n in peers.ordered() if n in found.listings]
    steps = sorted({s for rows in found.listings.values() for s, (ranks, _) in rows.items() if rank in ranks},
                   reverse=True)
    plans: dict[int, ReplicaPlan] = {}
    for step in steps:
        if len(plans) >= CANDIDATE_STEPS:
            break
        for node in (n for n in order if rank in found.listings[n].get(step, (set(), set()))[0]):
            client = PeerClient(peers.nodes[node]["endpoint"], peers.token, timeout=timeout)
            try:
                manifest = client.call(Kind.MANIFEST, rank=rank, step=step)["manifest"]
            except (PeerError, ProtocolError, KeyError) as exc:
                logger.warning("rank %d: manifest of step %d from node %s: %s", rank, step, node, exc)
                continue
            finally:
                client.close()
            holders = [[n for n in order if c in found.listings[n].get(step, (set(), set()))[1]]
                       for c in manifest["checksums"]]
            missing = [entry[0] for entry, h in zip(manifest["tensors"], holders) if not h]
            if missing:
                logger.info("rank %d: step %d is not obtainable from replicas: no agent holds %s%s", rank, step,
                            ", ".join(missing[:3]), f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            else:
                plans[step] = ReplicaPlan(step, manifest, holders, node)
            break
    return plans


def fetch(peers: PeerSet, replica: ReplicaPlan, slots: RankSlots, *, rank: int, timeout: float) -> dict[str, Any]:
    """Rebuild this rank's snapshot of ``replica.step`` in one of its own slots; returns transfer stats."""
    manifest = replica.manifest
    meta = {k: v for k, v in manifest.items() if k not in ("checksums", "node", "generation")}
    # The snapshot now belongs to this process and this node's agent (a rank may come back elsewhere).
    meta.update(pid=os.getpid(), pid_start=psutil.Process().create_time(), created=time.time(),
                local_world_size=slots.local_world_size)
    blob = pack_meta(meta)
    data_len = max((e[4] + e[5] for e in manifest["tensors"]), default=0)
    index = slots.choose()
    if index is None:
        raise ReplicaError(f"rank {rank}: no slot of {slots.directory} is free for the replica of step {replica.step}")
    try:
        slot = slots.ensure(index, slot_size(data_len, len(blob)))
    except BaseException:
        stale = slots.maps[index]
        if stale is not None:
            stale.unlock()
        raise
    generation = slots.next_generation()
    slot.begin_write(generation=generation, rank=rank, world_size=slots.world_size, job_id=slots.job_id)
    clients: dict[str, PeerClient] = {}
    served: dict[str, list[float]] = {}
    started = time.perf_counter()
    try:
        for entry, checksum, holders in zip(manifest["tensors"], manifest["checksums"], replica.holders):
            name, offset, nbytes = entry[0], entry[4], entry[5]
            if nbytes == 0:
                continue
            problems: list[str] = []
            for node in holders:
                client = clients.get(node) or clients.setdefault(
                    node, PeerClient(peers.nodes[node]["endpoint"], peers.token, timeout=timeout))
                begun = time.perf_counter()
                if _fetch_one(client, replica.step, checksum, slot.data(offset, nbytes), problems,
                              what=f"rank {rank}: {name} of step {replica.step} from node {node}"):
                    stats = served.setdefault(node, [0.0, 0.0])
                    stats[0] += nbytes
                    stats[1] += time.perf_counter() - begun
                    break
            else:
                raise ReplicaError(f"rank {rank}: tensor {name} of step {replica.step} could not be fetched from "
                                   f"any holder: {'; '.join(problems) or 'none'}")
        slot.commit(generation=generation, step=replica.step, data_len=data_len, meta=blob, rank=rank,
                    world_size=slots.world_size, job_id=slots.job_id)
    except BaseException:
        slot.invalidate()
        raise
    finally:
        slot.unlock()
        for client in clients.values():
            client.close()
    seconds = time.perf_counter() - started
    for node, (nbytes, spent) in sorted(served.items()):
        logger.info("rank %d: node %s (%s) served %s of step %d at %.2f GB/s", rank, node,
                    peers.nodes[node]["endpoint"], format_bytes(nbytes), replica.step,
                    nbytes / spent / 1e9 if spent else 0.0)
    return {"seconds": seconds, "bytes": sum(v[0] for v in served.values()),
            "peers": {n: v[0] for n, v in served.items()}}


def _fetch_one(client: PeerClient, step: int, checksum: bytes, view: memoryview, problems: list[str], *,
               what: str) -> bool:
    """Try each copy the node holds until one verifies; False (with the reasons) if none does."""
    try:
        for copy in range(MAX_COPIES):
            try:
                client.fetch_into(step, checksum, view, copy=copy)
                return True
            except FetchError as exc:  # bad bytes in this copy: the node may hold another
                problems.append(str(exc))
                logger.warning("%s: copy %d is bad (%s); trying another copy", what, copy, exc)
            except PeerError as exc:   # refused (no such copy) or hung: the next node
                problems.append(str(exc))
                if copy == 0 or "no copy" not in str(exc):
                    logger.warning("%s failed (%s); trying the next holder", what, exc)
                return False
        return False
    finally:
        view.release()
