"""Replicas: what this agent holds for other nodes, and the tcp server that hands it out.

* **Manifests.** For every committed snapshot of a local rank the agent computes an xxh3-128 of each
  tensor (in its own thread, off the training path, checking the slot's generation afterwards so a
  snapshot overwritten meanwhile is not described). A manifest is the slot's metadata (tensor index,
  plain values) plus those checksums. Two tensors with the same checksum at the same step are
  interchangeable, so data-parallel replicas are found without any configuration.
* **Buddy backups.** Each manifest is pushed to the next node's agent (the node list sorted by id,
  in a ring) with the bytes of its small tensors (RNG states, data positions, counters: the
  rank-private part of a data-parallel state), read while hashing. The buddy keeps both, and pulls
  only the large tensors its own ranks do not hold at that step (unique shards, unless
  ``replicate_unique`` is off) once its own ranks' snapshot of that step is hashed: so a rank whose
  whole node is gone can still be rebuilt, and a data-parallel backup never reads the sender's slots
  after they may have been rewritten.
* **Server.** A ROUTER socket on tcp answers LIST, MANIFEST, FETCH and PUSH from holders of the job
  token, and takes STATE and VERDICT news (``easyckpt_agent.jobwide``) without a reply, in its own thread.
  FETCH sends tensor bytes zero-copy from the slot's mmap (or the backup store) with an xxh3-64 per
  chunk computed at send time; a slot rewritten since it was hashed is refused rather than served.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import xxhash
import zmq

from easyckpt_agent.jobwide import Courier
from easyckpt_wire import protocol
from easyckpt_wire.faults import fault_point
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.records import FetchReply, ListReply, ListRow, Manifest, PeerTable, RecordError, SlotMeta
from easyckpt_wire.shm import SlotFormatError, SlotMap
from easyckpt_wire.transfer import PeerClient, PeerError, tensor_checksum

logger = logging.getLogger(__name__)

KEEP_STEPS = 2                # backups kept per rank: the newest two, and those of steps local ranks hold
SMALL_TENSOR = 1 << 20        # with replicate_unique=False only unique tensors up to this size are pulled
INLINE_BYTES = 256 << 10      # tensors up to this size travel with their manifest's PUSH
INLINE_TOTAL = 16 << 20       # ... up to this much per PUSH (the rest is pulled)
PULL_TIMEOUT = 10.0           # seconds a buddy waits for one chunk of a backup (a dead predecessor's pull fails)


@dataclasses.dataclass(slots=True)
class LocalManifest:
    path: Path
    generation: int
    step: int
    manifest: Manifest
    where: dict[bytes, tuple[int, int]]   # checksum -> (offset, nbytes) in the slot
    inline: dict[bytes, bytes] = dataclasses.field(default_factory=dict)   # small tensors' bytes, read when hashed


class Holdings:
    """Thread-safe: what this agent can serve (local slots, backups from peers, backed-up tensors)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.lock = threading.Lock()
        self.hashed = threading.Condition(self.lock)   # notified when a local manifest is added
        self.local: dict[tuple[int, int], LocalManifest] = {}          # (rank, slot) ->
        self.backups: dict[tuple[int, int], Manifest] = {}             # (rank, step) ->
        self.blobs: dict[bytes, bytearray] = {}                        # checksum -> bytes
        self.local_ranks: frozenset[int] = frozenset()                 # replaced (not mutated) by the main loop
        # Steps this node's ranks still hold (the safe step among them): their backups stay whatever newer
        # ones arrive, or losing the node they came from could leave no step its ranks can get. Replaced
        # (not mutated) by the main loop.
        self.keep: frozenset[int] = frozenset()

    def set_local(self, rank: int, slot: int, entry: LocalManifest) -> None:
        with self.lock:
            self.local[(rank, slot)] = entry
            self.hashed.notify_all()

    def inline_at(self, step: int) -> list[list[bytes]]:
        """[checksum, bytes] of the small tensors of this node's snapshots of ``step`` (for the PUSH)."""
        with self.lock:
            blobs = {c: b for e in self.local.values() if e.step == step for c, b in e.inline.items()}
        return [[checksum, data] for checksum, data in blobs.items()]

    def forget_local(self, keep: set[tuple[int, int]]) -> None:
        with self.lock:
            for key in set(self.local) - keep:
                del self.local[key]

    def hashed_steps(self) -> set[int]:
        """Steps for which every local rank's snapshot has a manifest."""
        ranks = self.local_ranks
        steps: dict[int, set[int]] = {}
        with self.lock:
            for entry in self.local.values():
                steps.setdefault(entry.step, set()).add(entry.manifest.rank)
        return {step for step, held in steps.items() if ranks and held >= ranks}

    def backed_up_steps(self, ranks: list[int]) -> set[int]:
        """Steps at which every one of ``ranks`` has a manifest here and each of its tensors is held here."""
        with self.lock:
            steps = {s for r, s in self.backups if r in ranks}
        complete = set()
        for step in steps:
            held = self.checksums_at(step)
            with self.lock:
                manifests = [self.backups.get((rank, step)) for rank in ranks]
            if all(m is not None and all(c in held for c in m.checksums) for m in manifests):
                complete.add(step)
        return complete

    def local_at(self, step: int) -> list[Manifest]:
        with self.lock:
            return [e.manifest for e in self.local.values() if e.step == step]

    def checksums_at(self, step: int) -> set[bytes]:
        with self.lock:
            held = {c for e in self.local.values() if e.step == step for c in e.where}
            for (_rank, s), manifest in self.backups.items():
                if s == step:
                    held.update(c for c in manifest.checksums if c in self.blobs)
            return held

    def add_backup(self, manifest: Manifest) -> None:
        rank, step = manifest.rank, manifest.step
        with self.lock:
            self.backups[(rank, step)] = manifest
            steps = sorted((s for r, s in self.backups if r == rank and s not in self.keep), reverse=True)
            for old in steps[KEEP_STEPS:]:
                del self.backups[(rank, old)]
            wanted = {c for m in self.backups.values() for c in m.checksums}
            for checksum in set(self.blobs) - wanted:
                del self.blobs[checksum]

    def add_blob(self, checksum: bytes, data: bytearray) -> None:
        with self.lock:
            if any(checksum in m.checksums for m in self.backups.values()):
                self.blobs[checksum] = data

    def listing(self) -> list[ListRow]:
        """What this agent holds, newest step first."""
        with self.lock:
            steps = {e.step for e in self.local.values()} | {s for _, s in self.backups}
        rows = []
        for step in sorted(steps, reverse=True):
            with self.lock:
                ranks = {e.manifest.rank for e in self.local.values() if e.step == step}
                ranks |= {r for r, s in self.backups if s == step}
            rows.append(ListRow(step, frozenset(ranks), frozenset(self.checksums_at(step))))
        return rows

    def has_hashed(self, rank: int, slot: int, generation: int) -> bool:
        with self.lock:
            entry = self.local.get((rank, slot))
            return entry is not None and entry.generation == generation

    def checksums_of(self, path: Path, generation: int) -> tuple[bytes, ...] | None:
        """The checksums taken of this write (``generation``) of the local slot at ``path``; None if not hashed."""
        with self.lock:
            return next((e.manifest.checksums for e in self.local.values()
                         if e.path == path and e.generation == generation), None)

    def manifest(self, rank: int, step: int) -> Manifest | None:
        with self.lock:
            for entry in self.local.values():
                if entry.step == step and entry.manifest.rank == rank:
                    return entry.manifest
            return self.backups.get((rank, step))

    def locate(self, step: int, checksum: bytes, copy: int = 0) -> tuple[str, Any]:
        """The ``copy``-th copy held here: ("slot", (path, generation, offset, nbytes)), ("blob", bytes)
        or ("none", None). A requester that got a corrupted copy asks for the next one."""
        with self.lock:
            copies: list[tuple[str, Any]] = [
                ("slot", (e.path, e.generation, *e.where[checksum]))
                for _, e in sorted(self.local.items()) if e.step == step and checksum in e.where]
            if checksum in self.blobs:
                copies.append(("blob", self.blobs[checksum]))
        return copies[copy] if copy < len(copies) else ("none", None)


def build_manifest(slot: SlotMap, meta: SlotMeta, generation: int, node: str, *,
                   inline: bool = True) -> LocalManifest | None:
    """Hash every tensor of a committed slot, keeping a copy of the small ones (up to ``INLINE_TOTAL`` in all,
    for the PUSH to a buddy: none when ``inline`` is off, on one node); None if the slot was rewritten
    meanwhile."""
    checksums: list[bytes] = []
    where: dict[bytes, tuple[int, int]] = {}
    kept: dict[bytes, bytes] = {}
    budget = INLINE_TOTAL if inline else 0
    for entry in meta.tensors:
        with slot.data(entry.offset, entry.nbytes) as view:
            checksum = tensor_checksum(view)
            if entry.nbytes <= min(INLINE_BYTES, budget) and checksum not in kept:
                kept[checksum] = bytes(view)
                budget -= entry.nbytes
        checksums.append(checksum)
        where.setdefault(checksum, (entry.offset, entry.nbytes))
    if slot.generation() != generation:
        return None   # the copies too may be of the next snapshot
    manifest = Manifest.of(meta, checksums, node, generation)
    manifest.to_wire()   # encoded here, in the hash thread, not by the server thread at each request
    return LocalManifest(slot.path, generation, meta.step, manifest, where, kept)


class MapCache:
    """Read-only maps of slot files owned by one thread (never shared with the agent's main loop)."""

    def __init__(self) -> None:
        self.maps: dict[Path, SlotMap] = {}
        self.retired: list[SlotMap] = []

    def get(self, path: Path) -> SlotMap:
        slot = self.maps.get(path)
        if slot is None:
            slot = self.maps[path] = SlotMap(path, writable=False)
        elif slot.size != path.stat().st_size:
            self.retired.append(slot)       # zmq may still be sending from its pages
            slot = self.maps[path] = SlotMap(path, writable=False)
        for old in list(self.retired):
            try:
                old.close()
                self.retired.remove(old)
            except BufferError:
                pass
        return slot


class ReplicaServer(threading.Thread):
    """Serves this agent's holdings to token holders over tcp."""

    def __init__(self, holdings: Holdings, ctx: zmq.Context, bind_host: str, port: int,
                 on_push: Callable[[dict[str, Any]], None], on_news: Callable[[Kind, dict[str, Any]], None],
                 port_file: Path | None = None) -> None:
        super().__init__(name="replica-server", daemon=True)
        self.holdings = holdings
        self.token: str | None = None
        self.on_push = on_push
        self.on_news = on_news
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_PEER_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._bind_previous_or_any(bind_host, port_file)
        self.endpoint = f"tcp://{bind_host}:{port}"
        self.maps = MapCache()
        self.stopping = threading.Event()
        self.served_bytes = 0
        self.refused = 0
        self.dropped = 0
        self._last_warning = 0.0

    def _bind_previous_or_any(self, bind_host: str, port_file: Path | None) -> int:
        """A restarted agent takes its predecessor's port when it can: the other nodes' agents and the
        ranks' peer lists keep naming it, so replication resumes without a new introduction."""
        previous = None
        if port_file is not None:
            try:
                previous = int(port_file.read_text())
            except (OSError, ValueError):
                pass
        port = None
        if previous:
            try:
                self.sock.bind(f"tcp://{bind_host}:{previous}")
                port = previous
            except zmq.ZMQError as exc:
                logger.info("port %d of the previous agent is taken (%s): binding another", previous, exc)
        if port is None:
            port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        if port_file is not None:
            try:   # best effort: a failure here must not leave the bound socket behind (ctx.term() would hang on it)
                port_file.write_text(f"{port}\n")
            except OSError as exc:
                logger.warning("cannot record the replica server's port %d in %s (%s): a restarted agent binds "
                               "another one, and the other nodes learn it from the ranks' next introduction", port,
                               port_file, exc)
        return port

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.sock.poll(100):
                    try:
                        self._serve_one()
                    except Exception:  # the thread must outlive any one request: PING still advertises it
                        self.dropped += 1
                        logger.exception("replica server failed on a request; serving on")
        finally:
            self.sock.close(linger=0)

    def _warn(self, text: str, *args: Any) -> None:
        """Rate-limited: a flood of garbage must not flood the log too."""
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            logger.warning(text + " (%d refused, %d malformed so far)", *args, self.refused, self.dropped)

    def _serve_one(self) -> None:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return
        if len(frames) != 2:
            self.dropped += 1
            self._warn("replica server dropped a message of %d frames", len(frames))
            return
        identity, blob = frames
        try:
            kind, message = protocol.decode(blob, limit=protocol.MAX_PEER_MESSAGE_BYTES)
        except ProtocolError as exc:
            self.dropped += 1
            self._warn("replica server dropped a malformed message: %s", exc)
            return
        request_id = message.get("id")
        if kind not in protocol.PEER_KINDS:
            self.dropped += 1
            self._warn("replica server dropped a %s message: not a peer request", kind.name)
            return
        if not protocol.token_ok(message, self.token):
            self.refused += 1
            # Each incarnation of a job has its own token: after a node restart the other nodes' agents may ask
            # with the old one for a moment (their coverage survey), which is harmless and said as such.
            self._warn("replica server refused a %s request without this job's token (harmless right after a node "
                       "restart: an agent still asking with the job's previous token; otherwise a process of "
                       "another job is reaching this port)", kind.name)
            if kind not in protocol.NO_REPLY_KINDS:
                self._reply(identity, False, request_id, error="not a member of this job (wrong or missing token)")
            return
        if kind in protocol.NO_REPLY_KINDS:
            try:
                self.on_news(kind, message)
            except (KeyError, TypeError, ValueError) as exc:
                self.dropped += 1
                self._warn("replica server dropped %s news: %s", kind.name, exc)
            return
        try:
            if kind == Kind.LIST:
                listing = ListReply(self.holdings.node, tuple(self.holdings.listing()))
                self._reply(identity, True, request_id, **listing.to_wire())
            elif kind == Kind.MANIFEST:
                manifest = self.holdings.manifest(message["rank"], message["step"])
                if manifest is None:
                    self._reply(identity, False, request_id,
                                error=f"no manifest of rank {message['rank']} at step {message['step']} here")
                else:
                    self._reply(identity, True, request_id, manifest=manifest.to_wire())
            elif kind == Kind.FETCH:
                self._fetch(identity, request_id, message)
            elif kind == Kind.PUSH:
                self.on_push(message)
                self._reply(identity, True, request_id)
        except (KeyError, TypeError, ValueError, SlotFormatError, OSError) as exc:
            self.dropped += 1
            self._warn("replica server could not answer a %s request: %s: %s", kind.name, type(exc).__name__, exc)
            self._reply(identity, False, request_id, error=f"{type(exc).__name__}: {exc}")

    def _reply(self, identity: bytes, ok: bool, request_id: Any, data: Any = None, **fields: Any) -> bool:
        try:
            header = protocol.encode(Kind.REPLY, limit=protocol.MAX_PEER_MESSAGE_BYTES, ok=ok, id=request_id, **fields)
        except ProtocolError as exc:
            header = protocol.encode(Kind.REPLY, ok=False, id=None, error=str(exc))
        try:
            if data is None:
                self.sock.send_multipart([identity, header], zmq.NOBLOCK)
            else:
                self.sock.send_multipart([identity, header, data], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            logger.debug("reply dropped: %s", exc)
            return False

    def _fetch(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        step, checksum, offset, length = message["step"], message["checksum"], message["offset"], message["length"]
        copy = message.get("copy", 0)
        if type(copy) is not int or not 0 <= copy < 64:
            raise ValueError(f"copy {copy!r} is not an int in [0, 64)")
        fault_point("agent.replica.fetch", step=step)
        where, found = self.holdings.locate(step, checksum, copy)
        if where == "slot":
            path, generation, start, nbytes = found
            if offset + length > nbytes:
                raise ValueError(f"range {offset}+{length} beyond the tensor's {nbytes} bytes")
            slot = self.maps.get(path)
            view = slot.data(start + offset, length)
            digest = xxhash.xxh3_64_intdigest(view)
            if slot.generation() != generation:
                view.release()
                self._reply(identity, False, request_id, error=f"step {step} in {path} was overwritten")
                return
        elif where == "blob":
            if offset + length > len(found):
                raise ValueError(f"range {offset}+{length} beyond the tensor's {len(found)} bytes")
            view = memoryview(found)[offset:offset + length]
            digest = xxhash.xxh3_64_intdigest(view)
        else:
            self._reply(identity, False, request_id, code=protocol.NO_COPY,
                        error=f"no copy {copy} of tensor {checksum.hex()} at step {step} here")
            return
        if self._reply(identity, True, request_id, data=view, **FetchReply(digest).to_wire()):
            self.served_bytes += length


class BuddyPuller:
    """Pulls, in its own thread, the large tensors of a peer's manifests that no local rank holds.

    Only the newest push counts: a backup that falls behind moves straight to the newest step. A pull waits
    for this node's own ranks' snapshot of that step to be hashed (what they hold need not travel), or for a
    newer push, whichever comes first: an event, not a timeout."""

    def __init__(self, holdings: Holdings, peers_getter: Callable[[], PeerTable | None]) -> None:
        self.holdings = holdings
        self.peers = peers_getter
        self.pulled_bytes = 0
        self._queued: tuple[str, int, list[Manifest]] | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="buddy", daemon=True)
        self._thread.start()

    def submit(self, origin: str, step: int, manifests: list[Manifest]) -> None:
        with self.holdings.hashed:
            if self._queued is None or self._queued[1] <= step:
                self._queued = (origin, step, manifests)
            self.holdings.hashed.notify_all()

    def _next(self) -> tuple[str, int, list[Manifest]] | None:
        """The newest queued pull once this node's own snapshot of its step is hashed (None: closing)."""
        with self.holdings.hashed:
            while not self._closing:
                queued = self._queued
                if queued is not None and queued[1] in self._hashed_locked():
                    self._queued = None
                    return queued
                self.holdings.hashed.wait()
        return None

    def _hashed_locked(self) -> set[int]:
        ranks = self.holdings.local_ranks
        steps: dict[int, set[int]] = {}
        for entry in self.holdings.local.values():
            steps.setdefault(entry.step, set()).add(entry.manifest.rank)
        return {step for step, held in steps.items() if ranks and held >= ranks}

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._pull_missing(*job)
            except Exception:  # the thread must outlive one bad pull
                logger.exception("backup of node %s's step %d failed", job[0], job[1])

    def _pull_missing(self, origin: str, step: int, manifests: list[Manifest]) -> None:
        peers: PeerTable | None = self.peers()
        if peers is None or origin not in peers.nodes:
            return
        held = self.holdings.checksums_at(step)
        missing = [(entry, checksum) for manifest in manifests for entry, checksum in zip(manifest.tensors,
                                                                                           manifest.checksums)
                   if checksum not in held and (peers.replicate_unique or entry.nbytes <= SMALL_TENSOR)]
        if not missing:
            return
        client = PeerClient(peers.endpoint(origin), peers.token, timeout=PULL_TIMEOUT)
        started, nbytes = time.monotonic(), 0
        try:
            for entry, checksum in missing:
                if checksum in held:
                    continue
                if entry.nbytes * 2 > psutil.virtual_memory().available:
                    logger.warning("not backing up %s of node %s's step %d: %d bytes, and only %d are free",
                                   entry.name, origin, step, entry.nbytes, psutil.virtual_memory().available)
                    return
                buffer = bytearray(entry.nbytes)
                client.fetch_into(step, checksum, memoryview(buffer))
                self.holdings.add_blob(checksum, buffer)
                held.add(checksum)
                nbytes += entry.nbytes
        except PeerError as exc:
            # The sender rewrote that slot meanwhile (its agent no longer holds the step), or is gone: the next
            # push names a newer step.
            logger.info("backup of node %s's step %d incomplete: %s; the next step's is pulled", origin, step, exc)
            return
        finally:
            client.close()
        self.pulled_bytes += nbytes
        logger.info("backed up %d bytes of node %s's step %d (tensors no local rank holds) in %.3fs",
                    nbytes, origin, step, time.monotonic() - started)

    def close(self) -> None:
        with self.holdings.hashed:
            self._closing = True
            self.holdings.hashed.notify_all()
        self._thread.join(timeout=PULL_TIMEOUT + 1)


def push_manifests(courier: Courier, peers: PeerTable, step: int, manifests: list[Manifest],
                   blobs: list[list[bytes]]) -> None:
    """Hand the buddy this node's manifests of ``step`` and the bytes of their small tensors, without waiting for
    an answer: a buddy that is gone (its node lost) must not hold up the pushes of the next steps to its
    replacement. A push that cannot go out now is dropped (the next step's push says more)."""
    buddy = peers.buddy()
    if buddy is None:
        return
    if not courier.send(peers.endpoint(buddy), Kind.PUSH, peers.token, node=peers.node, step=step,
                        manifests=[m.to_wire() for m in manifests], blobs=blobs):
        logger.debug("step %d's manifests not handed to buddy node %s: not connected", step, buddy)


def survey_coverage(peers: PeerTable, holdings: Holdings, timeout: float = 2.0) -> dict[str, Any]:
    """For the newest step this node holds: how many nodes hold each rank's tensors in memory.

    A rank part with a single copy is lost with its node; ``single`` names such tensors (a few).
    """
    listings: dict[str, dict[int, ListRow]] = {}
    unreachable = []
    for node, info in sorted(peers.nodes.items()):
        if node == peers.node:
            rows = holdings.listing()
        else:
            client = PeerClient(info.endpoint, peers.token, timeout=timeout)
            try:
                rows = list(ListReply.from_wire(client.call(Kind.LIST), f"agent {info.endpoint}").rows)
            except (PeerError, ProtocolError, RecordError) as exc:
                unreachable.append(node)
                logger.debug("coverage: node %s unreachable: %s", node, exc)
                continue
            finally:
                client.close()
        listings[node] = {row.step: row for row in rows}
    with holdings.lock:
        steps = [e.step for e in holdings.local.values()]
    if not steps:
        return {"step": None, "ranks": {}, "unreachable": unreachable, "as_of": time.time()}
    step = max(steps)
    nothing = ListRow(step, frozenset(), frozenset())
    ranks: dict[str, Any] = {}
    for rank in range(peers.world_size):
        manifest = holdings.manifest(rank, step)
        if manifest is None:
            for node, listing in listings.items():
                if node != peers.node and rank in listing.get(step, nothing).ranks:
                    client = PeerClient(peers.endpoint(node), peers.token, timeout=timeout)
                    try:
                        manifest = Manifest.from_wire(client.call(Kind.MANIFEST, rank=rank, step=step)["manifest"],
                                                      f"agent {client.endpoint}")
                        break
                    except (PeerError, ProtocolError, RecordError, KeyError):
                        continue
                    finally:
                        client.close()
        if manifest is None:
            ranks[str(rank)] = {"copies": 0, "manifest_nodes": [], "single": []}
            continue
        counts = [sum(1 for rows in listings.values() if c in rows.get(step, nothing).checksums)
                  for c in manifest.checksums]
        names = [entry.name for entry in manifest.tensors]
        ranks[str(rank)] = {
            "copies": min(counts, default=0), "tensors": len(counts),
            "manifest_nodes": sorted(n for n, rows in listings.items() if rank in rows.get(step, nothing).ranks),
            "single": [n for n, c in zip(names, counts) if c == 1][:5],
            "missing": [n for n, c in zip(names, counts) if c == 0][:5]}
    return {"step": step, "ranks": ranks, "unreachable": unreachable, "as_of": time.time()}
