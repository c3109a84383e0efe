"""The node agent's main loop: answer ranks, and every round carry out what its parts decide.

One loop thread owns the ZeroMQ socket and all bookkeeping. Each round (:meth:`Agent._tick`) reads the slot
headers (``easyckpt_agent.watcher``) and hands them to the agent's parts, each a module of its own:

* ``easyckpt_agent.protection``: the safe step and the job's steps, held with shared flocks on their slots, and the
  control block that ranks read before they choose a slot (invariant 9);
* ``easyckpt_agent.scheduler`` and ``easyckpt_agent.claims``: which step to persist, claimed (its slots held) only when every
  local rank holds it and the persister is free; persists run one at a time in a worker thread, so the loop
  keeps answering while gigabytes go to disk; failures are episodes published to the ranks;
* ``easyckpt_agent.node_agreement``: across nodes, this node's state to the leader and the leader's verdict carried out
  (the rules are ``easyckpt_agent.agreement``'s, the transport ``easyckpt_agent.jobwide``'s, backups
  ``easyckpt_agent.cluster``'s);
* ``easyckpt_agent.resume``: a rank resumed at an older step, a new timeline (invariant 10);
* ``easyckpt_agent.lifecycle``: wake-ups, shutdown on a signal, and exit once the ranks are gone.

A rank cannot overwrite a held slot; it never waits for one either (training never waits for the agent).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from easyckpt_agent import policy
from easyckpt_agent.cluster import NodeReplication
from easyckpt_agent.lifecycle import Lifecycle, WakePipe, newest_in_memory
from easyckpt_agent.node_agreement import NodeAgreement
from easyckpt_agent.persister import AuditLog, clean_leftovers
from easyckpt_agent.protection import RETRY_POLL, Protection
from easyckpt_agent.resume import Resume
from easyckpt_agent.roles import Announcements
from easyckpt_agent.scheduler import PersistScheduler
from easyckpt_agent.timeline import DiskTimeline
from easyckpt_agent.watcher import Watcher
from easyckpt_wire import protocol
from easyckpt_wire.control import ControlWriter, control_path
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.records import ByeReply, PingReply

logger = logging.getLogger(__name__)

LOOP_STALL_WARN = 1.0   # seconds one loop step may take before the log says so

Handler = Callable[[bytes, Any, dict[str, Any]], None]   # (identity, request id, message)


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
    serve_peers: bool = False            # start the replica server at once (standalone agents under torchrun)
    # SIGTERM/SIGINT: how long the agent may go on persisting before it exits. Under Kubernetes the pod
    # is killed 30 s after its SIGTERM (terminationGracePeriodSeconds), under systemd 90 s.
    shutdown_timeout: float = 20.0
    # The pid of the training rank that started this agent (None: started by hand or by the torchrun launcher):
    # under a tree-killing launcher a signal while that rank is its parent, or was an instant before, is a process-tree
    # kill (lifecycle.is_tree_kill).
    started_by: int | None = None

    def __post_init__(self) -> None:
        if self.save_storage_interval < 0:
            raise ValueError(f"save_storage_interval must be >= 0, got {self.save_storage_interval}")
        if self.max_ckpt_num < 1:
            raise ValueError(f"max_ckpt_num must be >= 1, got {self.max_ckpt_num}")
        if self.persist_threads < 1:
            raise ValueError(f"persist_threads must be >= 1, got {self.persist_threads}")
        if self.idle_timeout <= 0 or self.poll_interval <= 0:
            raise ValueError("idle_timeout and poll_interval must be positive")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.save_dir = config.save_dir
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self.audit = AuditLog(self.save_dir)
        self.watcher = Watcher(config.shm_dir, config.job_id)
        self.timeline = DiskTimeline(self.save_dir, self.audit)
        self.protection = Protection(self.watcher, ControlWriter(control_path(config.shm_dir, config.job_id)))
        self.announced = Announcements()   # due steps passed over (single node: while a persist ran)
        self.scheduler = PersistScheduler(settings=config, save_dir=self.save_dir, audit=self.audit,
                                          timeline=self.timeline, watcher=self.watcher, holds=self.protection.holds,
                                          announced=self.announced, multi=lambda: self.cluster.peers is not None,
                                          checksums_of=lambda path, gen: self.cluster.holdings.checksums_of(path, gen))
        self.wake = WakePipe()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.started = time.time()
        # Multi-node only: started by the first HELLO of a job spanning nodes, active once PEERS arrives.
        self.cluster = NodeReplication(node=config.node_id, bind_host=config.bind_host, port=config.port,
                                       save_dir=self.save_dir, audit=self.audit, watcher=self.watcher,
                                       ctx=self.ctx, max_ckpt_num=lambda: self.config.max_ckpt_num,
                                       complete=self.scheduler.persisted, port_file=config.job_dir / "agent.port",
                                       rotate=lambda keep: self.timeline.rotate(self.config.max_ckpt_num, keep),
                                       wake=self.wake.wake, floor=self.scheduler.floor,
                                       stored_at=lambda: self.scheduler.stored_at)
        self.agreement = NodeAgreement(settings=config, cluster=self.cluster, protection=self.protection,
                                       scheduler=self.scheduler, watcher=self.watcher, announced=self.announced)
        self.resumer = Resume(save_dir=self.save_dir, node_id=config.node_id, audit=self.audit, timeline=self.timeline,
                              watcher=self.watcher, scheduler=self.scheduler, protection=self.protection,
                              agreement=self.agreement, cluster=self.cluster, publish=self._publish)
        self.life = Lifecycle(settings=config, watcher=self.watcher, scheduler=self.scheduler,
                              protection=self.protection, cluster=self.cluster)
        self._handlers: dict[Kind, Handler] = {
            Kind.HELLO: self._hello, Kind.BYE: self._bye, Kind.FLUSH: self._flush, Kind.RESUME: self._on_resume,
            Kind.STATUS: self._status, Kind.PING: self._ping, Kind.PEERS: self._peers, Kind.MANIFEST: self._manifest}

    @property
    def ended_cleanly(self) -> bool:
        """The job is over and nothing of it is left in memory: its runtime dir can go."""
        return self.life.ended_cleanly

    @property
    def hand_over(self) -> bool:
        """A process-tree kill took this agent down with its ranks and the slots stay: a detached agent must
        take them over (:func:`easyckpt_agent.lifecycle.start_successor`) once this one let go of the lock."""
        return self.life.hand_over

    @property
    def hung_writer(self) -> bool:
        """An abandoned persist's thread did not stop: the process must not join it."""
        return self.life.hung_writer

    # the loop -------------------------------------------------------------------------------------------
    def run(self) -> int:
        socket_path = self.config.job_dir / "agent.sock"
        if socket_path.exists():
            socket_path.unlink()  # a dead agent's; we hold the lock, so no live one owns it
        self.sock.bind(protocol.agent_endpoint(self.config.job_dir))
        os.chmod(socket_path, 0o600)
        if self.config.serve_peers:
            self.cluster.start_server()
        try:
            for path in clean_leftovers(self.save_dir, self.audit):
                logger.info("removed leftover %s", path)
        except OSError as exc:   # the store down as the agent starts: the ranks' memory still needs it
            logger.warning("cannot look for what dead writers left in %s (%s): the next persist does", self.save_dir,
                           exc)
        logger.info("agent pid %d serving job %s: save_dir=%s shm_dir=%s", os.getpid(), self.config.job_id,
                    self.save_dir, self.config.shm_dir)
        wake = self.wake.open(self.config.job_dir)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        previous = self.life.install_signal_handlers()
        try:
            while True:
                if self.life.stop_signal is not None:
                    # A goodbye already sent decides what stop() keeps (a failed run's memory stays).
                    self._receive()
                    self.life.stop()
                    break
                wait = RETRY_POLL if self.protection.retry_soon() else self.config.poll_interval
                ready = dict(poller.poll(max(1, round(wait * 1000))))
                if wake in ready:
                    self.wake.drain()
                if self.sock in ready:
                    started = time.monotonic()
                    self._receive()
                    _warn_if_slow("answering requests", started)
                started = time.monotonic()
                self._tick()
                _warn_if_slow("a round of bookkeeping", started)
                if self.life.should_exit():
                    break
        finally:
            self._shutdown()
            self.wake.close()
            self.life.restore_signal_handlers(previous)
        return 0

    def _tick(self) -> None:
        watcher, scheduler, protection = self.watcher, self.scheduler, self.protection
        watcher.scan()
        scheduler.finish_inflight()
        if watcher.abandoned:
            self.resumer.invalidate_abandoned()
        for proc in watcher.newly_dead():
            if proc.ended_before:
                logger.info("rank %d (pid %d) had ended before this agent adopted its slots; they are kept for a "
                            "restart", proc.rank, proc.pid)
            else:
                logger.warning("rank %d (pid %d) %s", proc.rank, proc.pid,
                               "exited after its run failed" if proc.failed else "died without closing")
            scheduler.failed_ranks.add(proc.rank)
        ranks = watcher.local_ranks()
        held = {rank: watcher.committed(rank) for rank in ranks}
        common = policy.common_steps(held, watcher.local_world_size)
        # A peer's backup is worth keeping while this node's ranks still hold that step (the tensors they
        # share with the peer's ranks are served from these slots): the safe step's among them.
        self.cluster.holdings.keep = frozenset(step for steps in held.values() for step in steps)
        self.cluster.tick()
        multi = self.cluster.peers is not None
        if multi:
            self.agreement.agree(ranks, held, common)
        else:
            protection.leave_job()
            if protection.advance_safe(ranks, held, common, self._publish):
                self.cluster.safe_step = protection.safe
        scheduler.schedule(ranks, held, common, multi=multi)
        self._publish()
        scheduler.answer(self._send)

    def _publish(self) -> None:
        scheduler = self.scheduler
        held = scheduler.held_steps()
        # A step held for a persist (claimed on a rank's request, or at a failure) is not passed over, whatever was
        # announced before: the ranks' waiters read this word.
        self.protection.publish(persisted=scheduler.persisted, failure=scheduler.failure, failures=scheduler.failures,
                                passed=[step for step in self.announced.recent if step not in held],
                                decided=self.agreement.decided(), held=held, gated=self.cluster.peers is not None)

    def _shutdown(self) -> None:
        scheduler = self.scheduler
        scheduler.claims.release(lambda step: True)
        self.protection.release()
        scheduler.pool.shutdown(wait=not self.life.hung_writer, cancel_futures=True)
        self.cluster.close()
        scheduler.flushes.abandon("the agent exited before every local rank held it")
        scheduler.answer(self._send, force=True)
        self.sock.close()
        self.ctx.term()
        self.watcher.close()
        # The block stays (unless unlinked): ranks keep its safe step, a new agent adopts it.
        self.protection.control.close()

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
        handler = self._handlers.get(kind)
        if handler is None:
            logger.warning("dropped a %s message: not a request", kind.name)
            return
        try:
            handler(identity, message.get("id"), message)
        except Exception as exc:
            # One request must not take the agent down with it: the ranks' snapshots in memory would be left with
            # no agent to persist or serve them (a store read during a RESUME once did, while the store was down).
            logger.exception("%s request of rank %s failed in the agent (a bug; the agent goes on)", kind.name,
                             message.get("rank"))
            self._send(identity, protocol.reply(False, id=message.get("id"),
                                                error=f"the agent failed on {kind.name}: {type(exc).__name__}: {exc}"))

    def _hello(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        rank = message["rank"]
        self.watcher.register(rank, message["pid"], message.get("pid_start"))
        proc = self.watcher.ranks[rank]
        proc.said_bye = proc.failed = False   # a new Checkpointer of a process that closed one
        self.watcher.set_shape(message["world_size"], message["local_world_size"])
        self._adopt_config(message)
        self.scheduler.failed_ranks.discard(rank)
        if message["world_size"] > message["local_world_size"]:
            self.cluster.start_server()
        else:
            self.cluster.run_alone()
        self._send(identity, protocol.reply(True, id=request_id, pid=os.getpid()))

    def _bye(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        proc = self.watcher.ranks.get(message["rank"])
        # An older library sends no "failed": its goodbye always ends the job on this node.
        failed = message.get("failed") is True
        if proc is not None and proc.pid == message["pid"]:
            proc.failed, proc.said_bye = failed, not failed
        if failed:
            logger.warning("rank %d leaves after its run failed: this node's snapshots stay in memory for the "
                           "restart", message["rank"])
        else:
            logger.info("rank %d said goodbye", message["rank"])
        if message["wait"]:
            self.scheduler.flushes.bye_waiters.append((identity, request_id))
        else:
            self._send(identity, protocol.reply(True, id=request_id,
                                                **ByeReply(failure=self.scheduler.failure_dict()).to_wire()))

    def _flush(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        scheduler = self.scheduler
        scheduler.flushes.request(message["rank"], message["step"], self.watcher, scheduler.claims,
                                  scheduler.durable())
        self.announced.withdraw(message["step"])
        if message["wait"]:
            scheduler.flushes.waiters.append((identity, request_id, message["step"]))

    def _on_resume(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        self._send(identity, self._resume(message["rank"], message["step"], message["stale"], request_id))

    def _resume(self, rank: int, step: int, stale: list[list[int]], request_id: Any) -> bytes:
        """A rank resumed at ``step``: a new timeline (invariant 10; ``easyckpt_agent.resume``)."""
        reply = self.resumer.resume(rank, step, stale)
        return protocol.reply(reply.error is None, id=request_id, **reply.to_wire())

    def _status(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        self._send(identity, protocol.reply(True, id=request_id, **self.status()))

    def _ping(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        replica = self.cluster.replica
        endpoint = replica.endpoint if replica else None
        token = replica.token if replica else None
        self._send(identity, protocol.reply(True, id=request_id, **PingReply(
            os.getpid(), self.config.node_id, endpoint, token).to_wire()))

    def _manifest(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        # A local rank about to read its own slot: the checksums this agent took of it when it was committed.
        manifest = self.cluster.holdings.manifest(message["rank"], message["step"])
        if manifest is None:
            self._send(identity, protocol.reply(False, id=request_id, error=f"rank {message['rank']}'s snapshot of "
                                                f"step {message['step']} is not hashed here (yet)"))
            return
        try:   # 16 bytes a tensor: past the control socket's usual 1 MiB for ranks with ~60,000 tensors
            blob = protocol.encode(Kind.REPLY, limit=protocol.MAX_PEER_MESSAGE_BYTES, ok=True, id=request_id,
                                   generation=manifest.generation, checksums=list(manifest.checksums))
        except ProtocolError as exc:
            blob = protocol.reply(False, id=request_id, error=f"checksums of step {message['step']}: {exc}")
        self._send(identity, blob)

    def _peers(self, identity: bytes, request_id: Any, message: dict[str, Any]) -> None:
        problem = self.cluster.set_peers(message)
        self._send(identity, protocol.reply(problem is None, id=request_id, error=problem))

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
                          "step": header.step if header else None,
                          # the agent has checksummed this very snapshot (a read of it is verified)
                          "hashed": header is not None and self.cluster.holdings.has_hashed(rank, slot, header.generation)})
        ranks = [{"rank": p.rank, "pid": p.pid, "alive": p.alive(), "finished": p.said_bye, "failed": p.failed}
                 for p in sorted(self.watcher.ranks.values(), key=lambda p: p.rank)]
        scheduler, config = self.scheduler, self.config
        last, no_rank_since = scheduler.last_persist, self.life.no_rank_since
        return {**self.cluster.status(), "pid": os.getpid(), "job_id": config.job_id, "save_dir": str(self.save_dir),
                "shm_dir": str(config.shm_dir), "uptime": time.time() - self.started,
                "save_storage_interval": config.save_storage_interval,
                "max_ckpt_num": config.max_ckpt_num, "ranks": ranks, "slots": slots,
                "persisted_step": scheduler.persisted, "persisting": scheduler.inflight_step(),
                # No rank alive: the agent keeps the slots this much longer, then exits (`easyckpt status` says when).
                "idle_timeout": config.idle_timeout, "idle_exit_in": None if no_rank_since is None else
                max(0.0, config.idle_timeout - (time.monotonic() - no_rank_since)),
                "persist_failure": scheduler.failure_dict(), "persist_failures": scheduler.failures,
                "flush_requested": sorted(scheduler.flushes.wanted), "safe_step": self.protection.safe,
                **self.agreement.status(newest_in_memory(self.watcher)),
                "held_steps": sorted(scheduler.held_steps()),
                "last_persist": None if last is None else {"step": last.step, "bytes": last.nbytes,
                                                           "seconds": last.seconds, "path": str(last.path)}}


def _warn_if_slow(what: str, started: float) -> None:
    # Ranks' requests (HELLO, FLUSH, STATUS) wait while the loop is busy: a stall here is what makes
    # them time out, so it is named in the log rather than left to guess.
    took = time.monotonic() - started
    if took > LOOP_STALL_WARN:
        logger.warning("the agent loop spent %.1fs on %s; requests waited meanwhile", took, what)
