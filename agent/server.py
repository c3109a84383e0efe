"""The node agent's main loop: answer ranks, claim due snapshots, persist them, flush on failure.

One loop thread owns the ZeroMQ socket and all bookkeeping; persists run one at a time in a worker
thread so the loop keeps answering while gigabytes go to disk. A due snapshot is *claimed* per rank as
soon as that rank commits it: the agent takes a shared flock on the slot and writes the slot's
generation into the header's ack field, which tells the rank not to overwrite that slot (the rank
skips a snapshot instead; training never waits for the agent).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq

from easyckpt_wire import layout, protocol
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.shm import SlotFormatError, list_slots

from agent.persister import (AuditLog, PersistStats, RankSnapshot, clean_leftovers, commit_stage, describe,
                             drop_stage, persist, persist_shards, rotate, stage_steps)
from agent.replica import (BuddyPuller, Holdings, MapCache, Peers, ReplicaServer, build_manifest,
                           push_manifests, survey_coverage)
from agent.watcher import SlotInfo, Watcher

logger = logging.getLogger(__name__)

STAGE_WAIT = 120.0  # how long a leader whose ranks finished waits for other nodes' shards
MAX_TENSOR_BYTES = 1 << 40  # a manifest naming a bigger tensor is refused (the buddy would allocate it)
PIN_TIMEOUT = 60.0  # a step pinned for a lost peer is released when no newer backup completes this long


def _logged(function: Any, *args: Any) -> None:
    """Run a background task; a thread pool would swallow its exception."""
    try:
        function(*args)
    except Exception:
        logger.exception("background task %s failed", getattr(function, "__name__", function))


@dataclasses.dataclass(kw_only=True)
class AgentConfig:
    save_dir: Path
    job_id: str
    shm_dir: Path
    job_dir: Path
    save_storage_interval: int = 0       # 0: learn it from the ranks
    max_ckpt_num: int = 3
    log_file_path: str | None = None
    idle_timeout: float = 300.0
    poll_interval: float = 0.02
    persist_threads: int = 2             # safetensors files written in parallel
    node_id: str = "localhost"
    bind_host: str = "127.0.0.1"         # the replica server's address (multi-node jobs only)
    port: int = 0                        # 0: any free port

    def __post_init__(self) -> None:
        if self.save_storage_interval < 0:
            raise ValueError(f"save_storage_interval must be >= 0, got {self.save_storage_interval}")
        if self.max_ckpt_num < 1:
            raise ValueError(f"max_ckpt_num must be >= 1, got {self.max_ckpt_num}")
        if self.persist_threads < 1:
            raise ValueError(f"persist_threads must be >= 1, got {self.persist_threads}")
        if self.idle_timeout <= 0 or self.poll_interval <= 0:
            raise ValueError("idle_timeout and poll_interval must be positive")


@dataclasses.dataclass(slots=True)
class Claim:
    info: SlotInfo
    generation: int


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.save_dir = config.save_dir
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.audit = AuditLog(self.save_dir)
        self.watcher = Watcher(config.shm_dir, config.job_id)
        self.claims: dict[int, dict[int, Claim]] = {}   # step -> rank -> claim
        self.persisted: int | None = max((s for s, _ in layout.complete_iterations(self.save_dir)), default=None)
        self.last_persist: PersistStats | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="persist")
        self.inflight: tuple[int, concurrent.futures.Future[PersistStats]] | None = None
        self.waiters: list[tuple[bytes, Any]] = []   # (identity, request id) of BYE(wait=True)
        self.failed_ranks: set[int] = set()
        self.given_up = -1  # the newest step whose persist failed: not retried, a newer one will be
        self.no_rank_since: float | None = None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.started = time.time()
        # Multi-node only (started by the first HELLO of a job spanning several nodes):
        self.holdings = Holdings(config.node_id)
        self.peers: Peers | None = None
        self.replica: ReplicaServer | None = None
        self.hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hash")
        self.surveyor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="survey")
        self.hashing: set[tuple[int, int, int]] = set()     # (rank, slot, generation) queued or hashed
        self.pushed: set[int] = set()
        self.puller = BuddyPuller(self.holdings, lambda: self.peers)
        self._hash_maps = MapCache()
        self.coverage: dict[str, Any] | None = None
        self._coverage_at = 0.0
        self._stages_at = 0.0
        self._stage_wait_since: float | None = None
        self.complete: int | None = self.persisted      # newest complete multi-node checkpoint (leader)
        self.holds: dict[int, set[tuple[Any, ...]]] = {}  # id(slot map) -> why we hold its shared flock
        self.pinned: dict[int, SlotInfo] = {}
        self.pinned_step: int | None = None
        self._pinned_at = 0.0

    # lifecycle --------------------------------------------------------------------------------------
    def run(self) -> int:
        socket_path = self.config.job_dir / "agent.sock"
        if socket_path.exists():
            socket_path.unlink()  # a dead agent's; we hold the lock, so no live one owns it
        self.sock.bind(protocol.agent_endpoint(self.config.job_dir))
        os.chmod(socket_path, 0o600)
        for path in clean_leftovers(self.save_dir, self.audit):
            logger.info("removed leftover %s", path)
        logger.info("agent pid %d serving job %s: save_dir=%s shm_dir=%s", os.getpid(), self.config.job_id,
                    self.save_dir, self.config.shm_dir)
        try:
            while True:
                if self.sock.poll(int(self.config.poll_interval * 1000)):
                    self._receive()
                self._tick()
                if self._should_exit():
                    break
        finally:
            self._shutdown()
        return 0

    def _awaiting_stages(self) -> bool:
        """Leader: staged steps other nodes are still writing (bounded by STAGE_WAIT once ranks finish)."""
        if self.peers is None or not self.peers.is_leader:
            return False
        pending = [s for s in stage_steps(self.save_dir) if self.complete is None or s > self.complete]
        if not pending:
            return False
        if self.watcher.any_alive():
            self._stage_wait_since = None
            return True
        now = time.monotonic()
        self._stage_wait_since = self._stage_wait_since or now
        if now - self._stage_wait_since < STAGE_WAIT:
            return True
        logger.warning("staged steps %s never got every node's shards within %.0fs: not committed", pending, STAGE_WAIT)
        return False

    def _should_exit(self) -> bool:
        if self.inflight is not None or self.claims or self._awaiting_stages():
            return False
        if self.watcher.all_said_bye():
            logger.info("every local rank finished cleanly: exiting")
            self._unlink_slots()
            return True
        if self.watcher.any_alive():
            self.no_rank_since = None
            return False
        now = time.monotonic()
        self.no_rank_since = self.no_rank_since or now
        if now - self.no_rank_since < self.config.idle_timeout:
            return False
        newest = self.watcher.common_steps()
        if not newest or (self.persisted is not None and newest[0] <= self.persisted):
            logger.info("no rank alive for %.0fs and the newest snapshot is on disk: exiting",
                        self.config.idle_timeout)
            self._unlink_slots()
        else:
            logger.warning("no rank alive for %.0fs; step %d is only in memory, its slots are kept in %s",
                           self.config.idle_timeout, newest[0], self.config.shm_dir)
        return True

    def _unlink_slots(self) -> None:
        self.watcher.close()
        for path in list_slots(self.config.shm_dir, self.config.job_id).values():
            path.unlink(missing_ok=True)
            logger.info("unlinked %s", path)

    def _shutdown(self) -> None:
        self._release_claims(lambda step: True)
        for info in self.pinned.values():
            self._release(info, ("replica",))
        self.pool.shutdown(wait=True)
        self.hasher.shutdown(wait=True, cancel_futures=True)
        self.surveyor.shutdown(wait=True, cancel_futures=True)
        self.puller.close()
        if self.replica is not None:
            self.replica.stop()
        self._answer_waiters(force=True)
        self.sock.close()
        self.ctx.term()
        self.watcher.close()

    # messages ---------------------------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames (expected 2)", len(frames))
                continue
            identity, blob = frames
            try:
                kind, message = protocol.decode(blob)
            except ProtocolError as exc:
                logger.warning("dropped a malformed message: %s", exc)
                continue
            self._handle(identity, kind, message)

    def _handle(self, identity: bytes, kind: Kind, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        if kind == Kind.HELLO:
            self.watcher.register(message["rank"], message["pid"], message.get("pid_start"))
            self.watcher.set_shape(message["world_size"], message["local_world_size"])
            self._adopt_config(message)
            self.failed_ranks.discard(message["rank"])
            if message["world_size"] > message["local_world_size"]:
                self._start_replica_server()
            self._send(identity, protocol.reply(True, id=request_id, pid=os.getpid()))
        elif kind == Kind.BYE:
            proc = self.watcher.ranks.get(message["rank"])
            if proc is not None and proc.pid == message["pid"]:
                proc.said_bye = True
            logger.info("rank %d said goodbye", message["rank"])
            if message["wait"]:
                self.waiters.append((identity, request_id))
            else:
                self._send(identity, protocol.reply(True, id=request_id))
        elif kind == Kind.STATUS:
            self._send(identity, protocol.reply(True, id=request_id, **self.status()))
        elif kind == Kind.PING:
            self._send(identity, protocol.reply(True, id=request_id, pid=os.getpid(), node=self.config.node_id,
                                                endpoint=self.replica.endpoint if self.replica else None))
        elif kind == Kind.PEERS:
            self._set_peers(identity, request_id, message)
        else:
            logger.warning("dropped a %s message: not a request", kind.name)

    def _start_replica_server(self) -> None:
        if self.replica is None:
            self.replica = ReplicaServer(self.holdings, self.ctx, self.config.bind_host, self.config.port,
                                         self._on_push)
            self.replica.start()
            logger.info("replica server of node %s listening on %s", self.config.node_id, self.replica.endpoint)

    def _set_peers(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        nodes: dict[str, dict[str, Any]] = {}
        for item in message["nodes"]:
            if not (isinstance(item, dict) and isinstance(item.get("node"), str) and isinstance(item.get("endpoint"), str)
                    and isinstance(item.get("ranks"), list) and all(isinstance(r, int) for r in item["ranks"])):
                self._send(identity, protocol.reply(False, id=request_id, error=f"malformed node entry {item!r}"))
                return
            nodes[item["node"]] = {"endpoint": item["endpoint"], "ranks": item["ranks"]}
        if message["node"] != self.config.node_id or message["leader"] not in nodes or len(message["token"]) < 16:
            self._send(identity, protocol.reply(False, id=request_id, error=(
                f"PEERS for node {message['node']!r} (leader {message['leader']!r}) reached the agent of node "
                f"{self.config.node_id!r}: set EASYCKPT_NODE_ID alike for the ranks and their agent")))
            return
        self._start_replica_server()
        peers = Peers(token=message["token"], node=message["node"], leader=message["leader"], nodes=nodes,
                      world_size=message["world_size"], replicate_unique=message["replicate_unique"])
        if self.peers is None or (peers.token, peers.nodes, peers.leader) != (self.peers.token, self.peers.nodes,
                                                                             self.peers.leader):
            logger.info("job spans nodes %s; leader %s; buddy %s", sorted(nodes), peers.leader, peers.buddy())
        self.peers = peers
        assert self.replica is not None
        self.replica.token = peers.token
        self._send(identity, protocol.reply(True, id=request_id))

    def _on_push(self, message: dict[str, Any]) -> None:
        """Server thread: a peer handed us its ranks' manifests of one step."""
        peers = self.peers
        if peers is None or message["node"] != peers.predecessor():
            raise ValueError(f"PUSH from node {message['node']!r}: only node "
                             f"{peers.predecessor() if peers else None!r} hands this one its manifests")
        manifests = message["manifests"]
        for manifest in manifests:
            if not (isinstance(manifest, dict) and isinstance(manifest.get("rank"), int)
                    and manifest.get("step") == message["step"] and isinstance(manifest.get("tensors"), list)
                    and isinstance(manifest.get("checksums"), list)
                    and len(manifest["checksums"]) == len(manifest["tensors"])
                    and all(isinstance(c, bytes) and len(c) == protocol.CHECKSUM_BYTES for c in manifest["checksums"])
                    and all(isinstance(e, list) and len(e) >= 7 and isinstance(e[0], str) and isinstance(e[4], int)
                            and isinstance(e[5], int) and 0 <= e[4] and 0 <= e[5] <= MAX_TENSOR_BYTES
                            for e in manifest["tensors"])):
                raise ValueError(f"PUSH from node {message['node']!r} holds a malformed manifest")
        for manifest in manifests:
            self.holdings.add_backup(manifest)
        self.puller.submit(message["node"], message["step"], manifests)

    def _replicate(self) -> None:
        """Hash new local snapshots, hand complete steps to the buddy, refresh coverage (all off-loop)."""
        live = set()
        self.holdings.local_ranks = frozenset(self.watcher.local_ranks())
        for (rank, slot), info in self.watcher.slots.items():
            header = info.header
            if header is None or not header.committed or info.meta is None or info.meta_generation != header.generation:
                continue
            live.add((rank, slot))
            key = (rank, slot, header.generation)
            if key not in self.hashing:
                self.hashing = {k for k in self.hashing if k[:2] != (rank, slot)} | {key}
                self.hasher.submit(_logged, self._hash, rank, slot, info.path, info.meta, header.generation)
        self.holdings.forget_local(live)
        for step in sorted(self.holdings.hashed_steps() - self.pushed):
            self.pushed = {s for s in self.pushed if s > step - 8} | {step}
            self.hasher.submit(_logged, push_manifests, self.peers, step, self.holdings.local_at(step))
        now = time.monotonic()
        if now - self._coverage_at > 2.0:
            self._coverage_at = now
            self.surveyor.submit(_logged, self._refresh_coverage)

    def _hash(self, rank: int, slot: int, path: Path, meta: dict[str, Any], generation: int) -> None:
        maps = self._hash_maps
        try:
            entry = build_manifest(maps.get(path), meta, generation, self.config.node_id)
        except (OSError, SlotFormatError) as exc:
            logger.warning("cannot hash %s: %s", path, exc)
            return
        if entry is not None:
            self.holdings.set_local(rank, slot, entry)

    def _refresh_coverage(self) -> None:
        if self.peers is not None:
            self.coverage = survey_coverage(self.peers, self.holdings)

    def _adopt_config(self, message: dict[str, Any]) -> None:
        new = (message["save_storage_interval"], message["max_ckpt_num"], message["log_file_path"])
        old = (self.config.save_storage_interval, self.config.max_ckpt_num, self.config.log_file_path)
        if new != old:
            logger.info("config from rank %d: save_storage_interval=%d max_ckpt_num=%d log_file_path=%s",
                        message["rank"], *new)
            (self.config.save_storage_interval, self.config.max_ckpt_num,
             self.config.log_file_path) = new

    def _send(self, identity: bytes, blob: bytes) -> None:
        try:
            self.sock.send_multipart([identity, blob], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("reply dropped: %s", exc)

    def status(self) -> dict[str, Any]:
        slots = []
        for (rank, slot), info in sorted(self.watcher.slots.items()):
            header = info.header
            slots.append({"rank": rank, "slot": slot, "path": str(info.path), "bytes": info.map.size,
                          "state": header.state.name if header else "UNREADABLE",
                          "step": header.step if header else None})
        ranks = [{"rank": p.rank, "pid": p.pid, "alive": p.alive(), "finished": p.said_bye}
                 for p in sorted(self.watcher.ranks.values(), key=lambda p: p.rank)]
        last = self.last_persist
        peers = self.peers
        multi = {"node": self.config.node_id, "endpoint": self.replica.endpoint if self.replica else None,
                 "leader": peers.leader if peers else None, "buddy": peers.buddy() if peers else None,
                 "nodes": {n: v["endpoint"] for n, v in peers.nodes.items()} if peers else {},
                 "coverage": self.coverage, "complete_step": self.complete, "pinned_step": self.pinned_step,
                 "served_bytes": self.replica.served_bytes if self.replica else 0,
                 "refused": self.replica.refused if self.replica else 0,
                 "malformed": self.replica.dropped if self.replica else 0}
        return {**multi, "pid": os.getpid(), "job_id": self.config.job_id, "save_dir": str(self.save_dir),
                "shm_dir": str(self.config.shm_dir), "uptime": time.time() - self.started,
                "save_storage_interval": self.config.save_storage_interval,
                "max_ckpt_num": self.config.max_ckpt_num, "ranks": ranks, "slots": slots,
                "persisted_step": self.persisted, "persisting": self.inflight[0] if self.inflight else None,
                "last_persist": None if last is None else {"step": last.step, "bytes": last.nbytes,
                                                           "seconds": last.seconds, "path": str(last.path)}}

    # persisting -------------------------------------------------------------------------------------
    def _tick(self) -> None:
        self.watcher.scan()
        self._finish_inflight()
        for proc in self.watcher.newly_dead():
            logger.warning("rank %d (pid %d) died without closing", proc.rank, proc.pid)
            self.failed_ranks.add(proc.rank)
        ssi = self.config.save_storage_interval
        for rank in self.watcher.local_ranks():
            for step, info in self.watcher.committed(rank).items():
                due = ssi > 0 and step % ssi == 0
                if due and step > self._floor():
                    self._claim(step, rank, info)
                elif due and info.header is not None and info.map.read_ack() != info.header.generation:
                    info.map.write_ack(info.header.generation)  # on disk already: free the rank's slot
        if self.peers is not None:
            self._replicate()
            self._pin_replicated()
            self._commit_stages()
        if self.failed_ranks:
            self._flush_on_failure()
        self._drop_unreachable_claims()
        self._start_ready_persist()
        self._answer_waiters()

    def _floor(self) -> int:
        """Steps at or below this are on disk, or were given up on: never persisted again."""
        return max(-1 if self.persisted is None else self.persisted, self.given_up)

    def _claim(self, step: int, rank: int, info: SlotInfo) -> bool:
        held = self.claims.setdefault(step, {})
        if rank in held:
            return True
        header = info.header
        if header is None or not self._hold(info, ("persist", step)):
            return False
        current = info.map.header()
        if not current.committed or current.generation != header.generation or current.step != step:
            self._release(info, ("persist", step))
            return False
        info.map.write_ack(current.generation)
        held[rank] = Claim(info, current.generation)
        return True

    # slot holds: a shared flock keeps the rank from overwriting a slot (it skips a snapshot instead) --
    def _hold(self, info: SlotInfo, reason: tuple[Any, ...]) -> bool:
        """Several reasons share the one flock of a slot's fd; it is dropped when the last one goes."""
        reasons = self.holds.setdefault(id(info.map), set())
        if not reasons and not info.map.try_lock(exclusive=False):
            return False
        reasons.add(reason)
        return True

    def _release(self, info: SlotInfo, reason: tuple[Any, ...]) -> None:
        reasons = self.holds.get(id(info.map), set())
        reasons.discard(reason)
        if not reasons:
            self.holds.pop(id(info.map), None)
            try:
                info.map.unlock()
            except (OSError, ValueError):  # the watcher closed the map (file gone): the flock went with it
                pass

    def _pin_replicated(self) -> None:
        """Keep the newest step this node can serve in full to a lost predecessor node.

        The buddy backup of a step arrives a few milliseconds after the peer's ranks commit it; without
        a pin, this node's ranks could overwrite their copy of that step before it is complete, and a
        peer dying in that window could only come back from disk. So the local slots of the newest
        step whose backup is complete stay shared-locked: the ranks skip a snapshot rather than
        overwrite them (training never waits), and the pin moves on with the next complete backup.
        """
        assert self.peers is not None
        predecessor = self.peers.predecessor()
        wanted: dict[int, SlotInfo] = {}
        if predecessor is not None:
            ranks = self.watcher.local_ranks()
            local = set.intersection(*(set(self.watcher.committed(r)) for r in ranks)) if ranks else set()
            complete = self.holdings.backed_up_steps(self.peers.nodes[predecessor]["ranks"]) & local
            step = max(complete, default=None)
            if step is not None and step != self.pinned_step:
                self.pinned_step, self._pinned_at = step, time.monotonic()
            if step is not None and time.monotonic() - self._pinned_at < PIN_TIMEOUT:
                wanted = {id(info.map): info for r in ranks for s, info in self.watcher.committed(r).items() if s == step}
            elif step is not None and self.pinned:
                logger.warning("no newer complete backup from node %s for %.0fs: unpinning step %d",
                               predecessor, PIN_TIMEOUT, step)
        for key, info in list(self.pinned.items()):
            if key not in wanted:
                self._release(info, ("replica",))
                del self.pinned[key]
        for key, info in wanted.items():
            if key not in self.pinned and self._hold(info, ("replica",)):
                self.pinned[key] = info

    def _flush_on_failure(self) -> None:
        """Ranks died: persist the newest snapshot every local rank holds, if disk lacks it."""
        common = self.watcher.common_steps()
        if not common or common[0] <= self._floor():
            self.failed_ranks.clear()
            return
        step = common[0]
        if all(self._claim(step, rank, self.watcher.committed(rank)[step]) for rank in self.watcher.local_ranks()):
            logger.warning("flush on failure: persisting step %d, the newest snapshot of every local rank", step)
            self.failed_ranks.clear()

    def _drop_unreachable_claims(self) -> None:
        """Release claims on a step some rank will never commit (it moved past it without it)."""
        for step in list(self.claims):
            if self.persisted is not None and step <= self.persisted:
                self._release_claims(lambda s, step=step: s == step)
                continue
            for rank in self.watcher.local_ranks():
                if rank in self.claims[step]:
                    continue
                held = self.watcher.committed(rank)
                proc = self.watcher.ranks.get(rank)
                finished = proc is not None and (proc.said_bye or proc.dead)
                moved_on = held and step not in held and min(held) > step
                if moved_on or (finished and step not in held):
                    logger.warning("step %d cannot be persisted: rank %d no longer holds it", step, rank)
                    self._release_claims(lambda s, step=step: s == step)
                    break

    def _release_claims(self, which: Any) -> None:
        for step in [s for s in self.claims if which(s)]:
            for claim in self.claims.pop(step).values():
                self._release(claim.info, ("persist", step))

    def _start_ready_persist(self) -> None:
        if self.inflight is not None:
            return
        ranks = self.watcher.local_ranks()
        for step in sorted(self.claims, reverse=True):
            if len(ranks) >= self.watcher.local_world_size and set(self.claims[step]) >= ranks:
                snaps = [RankSnapshot(rank, claim.info.map, claim.info.meta or {})
                         for rank, claim in self.claims[step].items()]
                if any(not snap.meta or snap.meta.get("step") != step for snap in snaps):
                    continue  # metadata not read yet for this generation: next tick
                self.inflight = (step, self.pool.submit(self._persist, step, snaps))
                return

    def _persist(self, step: int, snaps: list[RankSnapshot]) -> PersistStats:
        world_size = snaps[0].meta["world_size"]
        if len(snaps) != world_size:
            if self.peers is None:
                raise RuntimeError(
                    f"this node holds ranks {sorted(s.rank for s in snaps)} of a {world_size}-rank job but no rank "
                    "told this agent the job's other nodes (PEERS): a multi-node checkpoint needs every node's "
                    "shards before its commit marker, so nothing is written"
                )
            return persist_shards(self.save_dir, step, snaps, self.config.node_id, self.audit,
                                  self.config.persist_threads)
        stats = persist(self.save_dir, step, snaps, self.audit, self.config.persist_threads)
        rotate(self.save_dir, self.config.max_ckpt_num, step, self.audit)
        return stats

    def _commit_stages(self) -> None:
        """Leader: publish each staged step whose every rank is durable; drop superseded stages."""
        now = time.monotonic()
        if self.peers is None or not self.peers.is_leader or now - self._stages_at < 0.2:
            return
        self._stages_at = now
        for step in sorted(stage_steps(self.save_dir), reverse=True):
            if self.complete is not None and step <= self.complete:
                drop_stage(self.save_dir, step, self.audit, f"superseded by complete step {self.complete}")
                continue
            try:
                stats = commit_stage(self.save_dir, step, self.audit)
            except OSError as exc:
                logger.warning("cannot commit staged step %d: %s", step, exc)
                continue
            if stats is not None:
                self.complete = step
                rotate(self.save_dir, self.config.max_ckpt_num, step, self.audit)
                logger.info("committed step %d: every node's shards are durable (%s)", step, describe(stats, 0))

    def _finish_inflight(self) -> None:
        if self.inflight is None or not self.inflight[1].done():
            return
        step, future = self.inflight
        self.inflight = None
        try:
            stats = future.result()
        except Exception:
            logger.exception("persist of step %d to %s failed; the snapshot stays in memory", step, self.save_dir)
            self.given_up = max(self.given_up, step)
            self._release_claims(lambda s: s <= step)
            return
        self.persisted = step if self.persisted is None else max(step, self.persisted)
        self.last_persist = stats
        line = describe(stats, len(self.claims.get(step, {})))
        logger.info(line)
        self._release_claims(lambda s: s <= step)
        if self.config.log_file_path:
            try:
                with open(self.config.log_file_path, "a", encoding="utf-8") as handle:
                    handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
            except OSError as exc:
                logger.warning("cannot append to log_file_path %s: %s", self.config.log_file_path, exc)

    def _answer_waiters(self, force: bool = False) -> None:
        if not self.waiters or (not force and (self.inflight is not None or self.claims or self._awaiting_stages())):
            return
        for identity, request_id in self.waiters:
            self._send(identity, protocol.reply(True, id=request_id, persisted=self.persisted))
        self.waiters.clear()
