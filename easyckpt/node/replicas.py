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
every tensor matches its checksum, and is then read like any snapshot in memory. An agent that did
not answer in time is not asked again during that load (``Silent``): the ladder tries older steps
next, and each would wait the whole ``peer_timeout`` for it again.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import zmq

from easyckpt.collectives import all_gather_text
from easyckpt.snapshot.slots import RankSlots
from easyckpt_wire import procs
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.records import ListReply, ListRow, Manifest, PeerNode, PeerTable, PingReply, RecordError
from easyckpt_wire.shm import format_bytes, pack_meta, slot_size
from easyckpt_wire.transfer import FetchError, NoCopyError, PeerClient, PeerError, PeerTimeout

logger = logging.getLogger(__name__)

_FIELD = 256          # bytes per rank for "node\nendpoint" in the exchange
# Replica steps considered per rank: every step an agent lists (it keeps each peer rank's two newest backups and
# those of every step its own ranks hold, a handful). Not only the newest two: a node loss resumes from a step the
# survivors still hold, often the node-safe step a few steps back, while the two newest backups are of steps the
# survivors have overwritten (CI, 2026-11-27: backups of 8 and 9 planned, the survivors held 10, 6, 5 and 0, and
# the job went to disk at 0 although node-safe step 5 was held and backed up). A plan costs one small request.
CANDIDATE_STEPS = 8
MAX_COPIES = 8        # copies of one tensor tried on one node (DP ranks of a node hold the same tensors)


class ReplicaError(RuntimeError):
    """This rank's state could not be rebuilt from replicas."""


# The nodes whose agent did not answer within peer_timeout during one load, with what went unanswered. A hung
# agent made a resume wait for it once per step tried (test_multinode.py's hung peer: steps 14, 13 and 12, three
# times peer_timeout, before the disk); asked once, it now costs one timeout per load.
Silent = dict[str, str]


def hush(silent: Silent, node: str, exc: Exception, who: str) -> None:
    """Remember ``node`` as silent for the rest of the load when ``exc`` is its timeout; said once."""
    if not isinstance(exc, PeerTimeout) or node in silent:
        return
    silent[node] = str(exc)
    logger.warning("%s: the agent of node %s did not answer (%s): it is not asked again during this load", who, node,
                   exc)


Request = Callable[..., dict[str, Any]]   # (kind, timeout, **fields) -> reply: a rank's session or one-off


def introduce(request: Request, *, rank: int, world_size: int, replicate_unique: bool, timeout: float,
              training: bool = True) -> PeerTable:
    """Collective: every rank's agent learns the job token, the other agents and the leader (rank 0's node).

    ``training=False`` is the standalone launcher (``easyckpt.node.launcher``): one process per node and no
    training ranks yet, so every node is listed with no ranks and the job as one rank; the training job
    that comes later introduces the same agents again with its own ranks, token and leader."""
    try:
        ping = PingReply.from_wire(request(Kind.PING, timeout), "the node agent's PING reply")
    except RecordError as exc:
        raise ReplicaError(f"rank {rank}: {exc}") from None
    node, endpoint = ping.node, ping.endpoint
    if node is None or endpoint is None:
        raise ReplicaError(f"rank {rank}: the node agent has no replica server (node {node}, endpoint {endpoint}); "
                           "is it an older easyckpt-agent?")
    rows = [row.split("\n", 1) for row in all_gather_text(f"{node}\n{endpoint}", world_size, field=_FIELD)]
    token = secrets.token_hex(16) if rank == 0 else "0" * 32
    token = all_gather_text(token, world_size, field=_FIELD)[0]
    addresses: dict[str, str] = {}
    ranks: dict[str, list[int]] = {}
    for other, (name, address) in enumerate(rows):
        known = addresses.setdefault(name, address)
        if known != address:
            raise ReplicaError(f"node id {name!r} names two agents ({known} and {address}, rank {other}): "
                               "give every node its own EASYCKPT_NODE_ID")
        ranks.setdefault(name, [])
        if training:
            ranks[name].append(other)
    peers = PeerTable(token, node, rows[0][0], {n: PeerNode(a, tuple(ranks[n])) for n, a in addresses.items()},
                      world_size=world_size if training else 1, replicate_unique=replicate_unique)
    reply = request(Kind.PEERS, timeout, **peers.to_wire())
    if not reply.get("ok"):
        raise ReplicaError(f"rank {rank}: the agent of node {node} refused the peer list: {reply.get('error')}")
    all_gather_text("", world_size, field=_FIELD)  # every agent knows the token before any rank asks one for data
    logger.info("rank %d: node %s, %d nodes %s, leader %s", rank, node, len(peers.nodes), sorted(peers.nodes), peers.leader)
    return peers


@dataclasses.dataclass(slots=True)
class Survey:
    """What every reachable agent holds: node -> {step: (ranks with a manifest, checksums)}."""

    listings: dict[str, dict[int, ListRow]]
    unreachable: dict[str, str]

    def row(self, node: str, step: int) -> ListRow:
        return self.listings[node].get(step) or _NOTHING


_NOTHING = ListRow(-1, frozenset(), frozenset())


def survey(peers: PeerTable, timeout: float) -> Survey:
    """Ask every agent at once what it holds; a dead or hung one costs ``timeout`` and is left out."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    clients = {node: PeerClient(peers.endpoint(node), peers.token, timeout=timeout, ctx=ctx)
               for node in peers.ordered()}
    listings, unreachable = {}, {}
    try:
        for node, client in clients.items():   # sequential, but a dead node only costs its timeout once
            try:
                listings[node] = ListReply.from_wire(client.call(Kind.LIST), f"agent {client.endpoint}").by_step()
            except (PeerError, ProtocolError, RecordError) as exc:
                unreachable[node] = str(exc)
    finally:
        for client in clients.values():
            client.close()
    return Survey(listings, unreachable)


def own_checksums(peers: PeerTable, rank: int, step: int, timeout: float,
                  silent: Silent) -> tuple[int, list[bytes]] | None:
    """(slot generation, tensor checksums) the node agent computed for this rank's snapshot of ``step``,
    so that a read from memory is verified too; None when the agent has not hashed it or is ``silent``."""
    if peers.node in silent:
        return None
    client = PeerClient(peers.endpoint(peers.node), peers.token, timeout=timeout)
    try:
        manifest = read_manifest(client, rank, step)
        return manifest.generation, list(manifest.checksums)
    except (PeerError, ProtocolError, RecordError) as exc:
        hush(silent, peers.node, exc, f"rank {rank}")
        return None
    finally:
        client.close()


def read_manifest(client: PeerClient, rank: int, step: int) -> Manifest:
    """Rank ``rank``'s manifest of ``step`` from the agent ``client`` talks to (RecordError when it has none)."""
    reply = client.call(Kind.MANIFEST, rank=rank, step=step)
    if "manifest" not in reply:
        raise RecordError(f"agent {client.endpoint}", "MANIFEST reply", "manifest", "is missing")
    return Manifest.from_wire(reply["manifest"], f"agent {client.endpoint}")


@dataclasses.dataclass(slots=True)
class ReplicaPlan:
    step: int
    manifest: Manifest
    holders: list[list[str]]      # per tensor: nodes holding its checksum at that step, cheapest first
    manifest_node: str


def plan(peers: PeerTable, found: Survey, rank: int, timeout: float, silent: Silent) -> dict[int, ReplicaPlan]:
    """The steps (newest first, at most CANDIDATE_STEPS) whose whole state this rank can pull."""
    order = [n for n in peers.ordered() if n in found.listings]
    steps = sorted({s for rows in found.listings.values() for s, row in rows.items() if rank in row.ranks},
                   reverse=True)
    plans: dict[int, ReplicaPlan] = {}
    for step in steps:
        if len(plans) >= CANDIDATE_STEPS:
            break
        for node in (n for n in order if rank in found.row(n, step).ranks and n not in silent):
            client = PeerClient(peers.endpoint(node), peers.token, timeout=timeout)
            try:
                manifest = read_manifest(client, rank, step)
            except (PeerError, ProtocolError, RecordError) as exc:
                logger.warning("rank %d: manifest of step %d from node %s: %s", rank, step, node, exc)
                hush(silent, node, exc, f"rank {rank}")
                continue
            finally:
                client.close()
            holders = [[n for n in order if c in found.row(n, step).checksums] for c in manifest.checksums]
            missing = [entry.name for entry, h in zip(manifest.tensors, holders) if not h]
            if missing:
                logger.info("rank %d: step %d is not obtainable from replicas: no agent holds %s%s", rank, step,
                            ", ".join(missing[:3]), f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            else:
                plans[step] = ReplicaPlan(step, manifest, holders, node)
            break
    return plans


def fetch(peers: PeerTable, replica: ReplicaPlan, slots: RankSlots, *, rank: int, timeout: float,
          silent: Silent) -> dict[str, Any]:
    """Rebuild this rank's snapshot of ``replica.step`` in one of its own slots; returns transfer stats. Holders in
    ``silent`` are passed over, and one that does not answer now joins them."""
    manifest = replica.manifest
    # The snapshot now belongs to this process and this node's agent (a rank may come back elsewhere).
    meta = dataclasses.replace(manifest.meta, pid=os.getpid(), pid_start=procs.start_time(),
                               created=time.time(), local_world_size=slots.local_world_size)
    blob = pack_meta(meta.to_wire())
    write = slots.write(slot_size(meta.data_len, len(blob)))
    if write is None:
        raise ReplicaError(f"rank {rank}: no slot of {slots.directory} is free for the replica of step {replica.step}")
    clients: dict[str, PeerClient] = {}
    served: dict[str, list[float]] = {}
    started = time.perf_counter()
    try:
        with write:
            for entry, checksum, holders in zip(manifest.tensors, manifest.checksums, replica.holders):
                if entry.nbytes == 0:
                    continue
                problems: list[str] = []
                for node in holders:
                    client = clients.get(node) or clients.setdefault(
                        node, PeerClient(peers.endpoint(node), peers.token, timeout=timeout))
                    begun = time.perf_counter()
                    if fetch_tensor(client, replica.step, checksum, write.data(entry), problems,
                                    what=f"rank {rank}: {entry.name} of step {replica.step} from node {node}",
                                    node=node, silent=silent, who=f"rank {rank}"):
                        stats = served.setdefault(node, [0.0, 0.0])
                        stats[0] += entry.nbytes
                        stats[1] += time.perf_counter() - begun
                        break
                else:
                    raise ReplicaError(f"rank {rank}: tensor {entry.name} of step {replica.step} could not be fetched "
                                       f"from any holder: {'; '.join(problems) or 'none'}")
            write.commit(replica.step, meta.data_len, blob)
    finally:
        for client in clients.values():
            client.close()
    seconds = time.perf_counter() - started
    for node, (nbytes, spent) in sorted(served.items()):
        logger.info("rank %d: node %s (%s) served %s of step %d at %.2f GB/s", rank, node,
                    peers.endpoint(node), format_bytes(nbytes), replica.step,
                    nbytes / spent / 1e9 if spent else 0.0)
    return {"seconds": seconds, "bytes": sum(v[0] for v in served.values()),
            "peers": {n: v[0] for n, v in served.items()}}


def fetch_tensor(client: PeerClient, step: int, checksum: bytes, view: memoryview, problems: list[str], *,
                 what: str, node: str, silent: Silent, who: str) -> bool:
    """Fill ``view`` with the tensor of ``checksum`` at ``step`` from ``node``'s agent (``client``), trying each
    copy it holds until one verifies; False (with the reasons in ``problems``) if none does. Releases ``view``.
    A node in ``silent`` is not asked; one that does not answer now joins it (``hush``, said as ``who``)."""
    try:
        if node in silent:
            problems.append(f"node {node}'s agent did not answer earlier in this load ({silent[node]})")
            return False
        for copy in range(MAX_COPIES):
            try:
                client.fetch_into(step, checksum, view, copy=copy)
                return True
            # The log gets the text, not the exception: a handler that keeps records (pytest's, a MemoryHandler)
            # would keep its traceback, whose frames hold views of the slot being filled, and the slot mapped.
            except FetchError as exc:  # bad bytes in this copy: the node may hold another
                problems.append(str(exc))
                logger.warning("%s: copy %d is bad (%s); trying another copy", what, copy, problems[-1])
            except NoCopyError as exc:   # every copy this node holds was tried: the next node
                problems.append(str(exc))
                if copy == 0:
                    logger.warning("%s failed (%s); trying the next holder", what, problems[-1])
                return False
            except PeerError as exc:   # refused or hung: the next node
                problems.append(str(exc))
                logger.warning("%s failed (%s); trying the next holder", what, problems[-1])
                hush(silent, node, exc, who)
                return False
        return False
    finally:
        view.release()
