"""The node agent's main loop: answer ranks, claim due snapshots, persist them, flush on failure.

One loop thread owns the ZeroMQ socket and all bookkeeping; persists run one at a time in a worker
thread so the loop keeps answering while gigabytes go to disk. Every round it reads the slot headers
and lets ``policy`` decide: the safe step (invariant 9), held with shared flocks on its slots and
published in the control block that ranks read before they choose a slot, and the due step to
persist, *claimed* (its slots held) only when every local rank holds it and the persister is free. A
rank cannot overwrite a held slot; it never waits for one either (training never waits for the agent).

A persist that fails (a full or read-only disk) is one line in the log and a failure episode published
in the control block, which the ranks report (a WARNING when it starts and when it ends, ``stats()``,
``flush()``, ``close()`` raising PersistError); the step stays in memory, and when every rank finished
while the newest step is not durable after a failure, the slots are kept rather than unlinked.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import zmq

from agent import agreement, persister, policy
from agent.agreement import NodeState, Verdict
from agent.cluster import NodeReplication
from agent.persister import (
    AuditLog,
    PersistFailed,
    PersistStats,
    RankSnapshot,
    StepAbandoned,
    clean_leftovers,
    describe,
    drop_own_shards,
    lower_priority,
    persist,
    persist_shards,
    stage_steps,
)
from agent.roles import Announcements, RoleHolds
from agent.timeline import DiskTimeline
from agent.watcher import SlotHolds, SlotInfo, Watcher
from easyckpt_wire import layout, protocol, timeline
from easyckpt_wire.control import ControlWriter, PersistFailure, control_path
from easyckpt_wire.episode import Episode
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.records import ByeReply, FlushReply, PingReply, ResumeReply
from easyckpt_wire.shm import list_slots

logger = logging.getLogger(__name__)

LOOP_STALL_WARN = 1.0   # seconds one loop step may take before the log says so
ABORT_TIMEOUT = 10.0    # an abandoned persist must stop within this long after its writers are told to

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
        self.timeline = DiskTimeline(self.save_dir, self.audit)
        # The newest step of the current timeline on disk (what a load follows: the tracker, invariant 10);
        # a newer complete iteration is of an abandoned timeline, or lost the race with the tracker.
        self.persisted: int | None = timeline.head([s for s, _ in layout.complete_iterations(self.save_dir)],
                                                   layout.read_tracker(self.save_dir))
        self.last_persist: PersistStats | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="persist", initializer=lower_priority)
        self.inflight: tuple[int, concurrent.futures.Future[PersistStats]] | None = None
        self.inflight_epoch = 0   # the timeline's epoch when the persist in flight started
        self.waiters: list[tuple[bytes, Any]] = []   # (identity, request id) of BYE(wait=True)
        self.flush_wanted: set[int] = set()          # steps a rank asked to persist now (FLUSH)
        self.flush_waiters: list[tuple[bytes, Any, int]] = []   # (identity, request id, step) of FLUSH(wait=True)
        self.flush_failed: dict[int, str] = {}       # requested step -> why it cannot be persisted
        self.failed_ranks: set[int] = set()
        self.given_up = -1  # the newest step whose persist failed: not retried, a newer one will be
        # The failure episode in progress (the newest persist failed), published in the control block for the
        # ranks to report; failures counts them over the agent's life.
        self.failure: PersistFailure | None = None
        self.failures = 0
        self._failures_before = 0   # failures before the episode in progress
        self.no_rank_since: float | None = None
        self.control = ControlWriter(control_path(config.shm_dir, config.job_id))
        adopted = self.control.adopted
        # The predecessor's word stands until this agent holds the step itself: ranks keep it meanwhile.
        self.safe: int | None = adopted.safe if adopted is not None else None
        self.safe_holds: list[SlotInfo] = []
        self.holds = SlotHolds()
        # Multi-node (agent.agreement): the steps held for the job (job-safe, candidate, node-safe), the newest
        # verdict's node-safe step, the newest due step the leader said to take (acted on once) and those this
        # node could not take, and the due steps passed over job-wide.
        self.roles = RoleHolds(self.holds)
        self.node_safe: int | None = None
        self.took = -1
        self.lost: set[int] = set()
        self.announced = Announcements()
        self.wake_fd = -1
        self.passed = Episode(logger, logging.INFO)   # due steps passed over while a persist ran
        self.last_passed = -1
        self.passed_since_claim = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self.started = time.time()
        self.stop_signal: int | None = None   # SIGTERM/SIGINT received: the loop ends and _stop() runs
        self.given_up_on_stop = False   # _stop() abandoned a persist or saw one fail
        self.hung_writer = False     # an abandoned persist's thread did not stop: the process must not join it
        self.ended_cleanly = False   # the job is over and nothing of it is left in memory: its runtime dir can go
        # Multi-node only: started by the first HELLO of a job spanning nodes, active once PEERS arrives.
        self.cluster = NodeReplication(node=config.node_id, bind_host=config.bind_host, port=config.port,
                                       save_dir=self.save_dir, audit=self.audit, watcher=self.watcher,
                                       ctx=self.ctx, max_ckpt_num=lambda: self.config.max_ckpt_num,
                                       complete=self.persisted, port_file=config.job_dir / "agent.port",
                                       rotate=lambda keep: self.timeline.rotate(self.config.max_ckpt_num, keep),
                                       wake=self._wake, floor=self._floor)

    # lifecycle --------------------------------------------------------------------------------------
    def run(self) -> int:
        socket_path = self.config.job_dir / "agent.sock"
        if socket_path.exists():
            socket_path.unlink()  # a dead agent's; we hold the lock, so no live one owns it
        self.sock.bind(protocol.agent_endpoint(self.config.job_dir))
        os.chmod(socket_path, 0o600)
        if self.config.serve_peers:
            self.cluster.start_server()
        for path in clean_leftovers(self.save_dir, self.audit):
            logger.info("removed leftover %s", path)
        logger.info("agent pid %d serving job %s: save_dir=%s shm_dir=%s", os.getpid(), self.config.job_id,
                    self.save_dir, self.config.shm_dir)
        wake = self.wake_fd = self._open_wake()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        previous = self._install_signal_handlers()
        try:
            while True:
                if self.stop_signal is not None:
                    self._stop()
                    break
                ready = dict(poller.poll(int(self.config.poll_interval * 1000)))
                if wake in ready:
                    self._drain_wake(wake)
                if self.sock in ready:
                    started = time.monotonic()
                    self._receive()
                    self._warn_if_slow("answering requests", started)
                started = time.monotonic()
                self._tick()
                self._warn_if_slow("a round of bookkeeping", started)
                if self._should_exit():
                    break
        finally:
            self._shutdown()
            self.wake_fd = -1
            os.close(wake)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 0

    # shutdown on a signal -------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}   # an agent run inside a test's thread: signals are the host process's business
        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None:
            # A second signal: stop waiting for the disk (the write loop checks the flag between writes).
            persister.ABORT.set()
            return
        self.stop_signal = signum

    def _stop(self) -> None:
        """SIGTERM/SIGINT: finish (or, past shutdown_timeout, abandon) the persist in flight, persist the
        newest snapshot every local rank holds if disk lacks it and time is left, then let go of the slots
        only if nothing in them is newer than disk and no rank of the job still runs. One log line says
        what happened."""
        name = signal.Signals(self.stop_signal or signal.SIGTERM).name
        timeout = self.config.shutdown_timeout
        deadline = time.monotonic() + timeout
        done: list[str] = []
        self.given_up_on_stop = False
        if self.inflight is not None:
            done.append(self._stop_wait_inflight(deadline))
        self.watcher.scan(relist_every=0)
        common = self.watcher.common_steps()
        newest = common[0] if common else None
        if newest is not None and newest > self._floor():
            if self.cluster.peers is not None:
                done.append(f"step {newest} not persisted (a multi-node iteration needs every node's files)")
            elif time.monotonic() >= deadline:
                done.append(f"no time left to persist step {newest} (shutdown_timeout={timeout:g}s)")
            else:
                ranks = self.watcher.local_ranks()
                self._release_claims(lambda s: s != newest)
                if self._claim_all(newest, ranks, {rank: self.watcher.committed(rank) for rank in ranks}):
                    self.watcher.scan(relist_every=0)   # the claimed slots' metadata for the persister
                    self._start_ready_persist()
                if self.inflight is not None:
                    done.append(self._stop_wait_inflight(deadline))
                else:
                    done.append(f"step {newest} could not be claimed (a rank was rewriting its slot) "
                                "or its metadata was unreadable")
        alive = [proc.rank for proc in self.watcher.ranks.values() if proc.alive()]
        newest_now = self.watcher.common_steps()
        on_disk = not newest_now or (self.persisted is not None and newest_now[0] <= self.persisted)
        if alive:
            done.append(f"slots kept: rank(s) {alive} still run")
        elif on_disk:
            self._unlink_slots()
            self.ended_cleanly = True
            done.append("slots unlinked (everything in them is on disk)")
        else:
            done.append(f"slots kept in {self.config.shm_dir}: step {newest_now[0]} is newer than disk "
                        f"({self.persisted}); resume from them by restarting the job, or remove them with "
                        f"`easyckpt clean --job-id {self.config.job_id}`")
        # A warning only when something is left undone (memory newer than disk, a persist abandoned or failed).
        level = logging.INFO if self.ended_cleanly or (alive and on_disk and not self.given_up_on_stop) else logging.WARNING
        logger.log(level, "agent stopped by %s (shutdown_timeout=%gs, %.1fs used): %s; exiting with 0", name, timeout,
                   timeout - max(0.0, deadline - time.monotonic()), "; ".join(done))

    def _stop_wait_inflight(self, deadline: float) -> str:
        """Wait for the persist in flight until ``deadline``, then abandon it; says which happened."""
        assert self.inflight is not None
        step, future = self.inflight
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            persister.ABORT.set()
            try:   # the writers stop at their next write (at most one 4 MiB piece, or one fsync, away)
                future.result(timeout=ABORT_TIMEOUT)
            except concurrent.futures.TimeoutError:
                self.inflight = None
                self.given_up_on_stop = True
                self.hung_writer = True
                return (f"the persist of step {step} did not stop within {ABORT_TIMEOUT:g}s of being abandoned "
                        f"(abort timeout; a write or fsync hangs): its temporary directory may be left in "
                        f"{self.save_dir} and is removed by the next agent")
            except persister.PersistAborted as exc:
                exc.__traceback__ = None   # its frames hold the writers' locals: nothing may pin the slots' maps
            except Exception as exc:  # noqa: BLE001 -- a persist fails in many ways; logged by _finish_inflight_failed
                self._finish_inflight_failed(step, exc)
                self.given_up_on_stop = True
                return f"the persist of step {step} failed ({exc})"
            else:   # it was past its last write when told to stop
                self._finish_inflight()
                return f"finished the persist of step {step} (past shutdown_timeout: it was too far along to stop)"
            self.inflight = None
            self.given_up_on_stop = True
            self._release_claims(lambda s: s <= step)
            return (f"the persist of step {step} was abandoned when shutdown_timeout ran out: its temporary "
                    f"directory was removed, newest on disk: "
                    f"{'nothing' if self.persisted is None else 'step ' + str(self.persisted)}")
        except Exception as exc:  # noqa: BLE001 -- a persist fails in many ways; logged by _finish_inflight_failed
            self._finish_inflight_failed(step, exc)
            self.given_up_on_stop = True
            return f"the persist of step {step} failed ({exc})"
        self._finish_inflight()
        return f"finished the persist of step {step}"

    def _finish_inflight_failed(self, step: int, exc: BaseException) -> None:
        logger.error("persist of step %d to %s failed: %s", step, self.save_dir, exc)
        self.inflight = None
        self.given_up = max(self.given_up, step)
        self._release_claims(lambda s: s <= step)

    def _open_wake(self) -> int:
        path = protocol.wake_path(self.config.job_dir)
        path.unlink(missing_ok=True)
        os.mkfifo(path, 0o600)
        # O_RDWR: a FIFO read end with no writer would poll as hung up, over and over.
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def _wake(self) -> None:
        """Another thread (the replica server, with news from other nodes) wakes the loop at once."""
        fd = self.wake_fd
        if fd >= 0:
            try:
                os.write(fd, b"n")
            except (BlockingIOError, OSError):   # full of wake-ups already, or closing
                pass

    @staticmethod
    def _drain_wake(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass

    def _warn_if_slow(self, what: str, started: float) -> None:
        # Ranks' requests (HELLO, FLUSH, STATUS) wait while the loop is busy: a stall here is what makes
        # them time out, so it is named in the log rather than left to guess.
        took = time.monotonic() - started
        if took > LOOP_STALL_WARN:
            logger.warning("the agent loop spent %.1fs on %s; requests waited meanwhile", took, what)

    def _should_exit(self) -> bool:
        if self.inflight is not None or self.claims or self.cluster.awaiting_stages():
            return False
        if self.watcher.all_said_bye():
            in_memory = self._newest_in_memory()
            if self.failure is not None and in_memory is not None and in_memory > self._durable():
                # The ranks' close() was told (PersistError); what only memory holds stays there.
                logger.warning("every local rank finished, but persisting failed (%s): step %d is only in memory, so "
                               "the job's slots are kept in %s (easyckpt-%s-*). Fix the disk and run the job again to "
                               "resume from them; `easyckpt status %s` shows them and how to remove them",
                               self.failure.describe(), in_memory, self.config.shm_dir, self.config.job_id, self.save_dir)
                self._release_safe()
                return True
            logger.info("every local rank finished cleanly: exiting")
            self._unlink_slots()
            self.ended_cleanly = True
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
            self.ended_cleanly = True
        else:
            logger.warning("no rank alive for %.0fs; step %d is only in memory, its slots are kept in %s",
                           self.config.idle_timeout, newest[0], self.config.shm_dir)
        return True

    def _newest_in_memory(self) -> int | None:
        """The newest step any local rank holds committed."""
        return max((step for rank in self.watcher.local_ranks() for step in self.watcher.committed(rank)),
                   default=None)

    def _unlink_slots(self) -> None:
        self._release_safe()
        self.watcher.close()
        for path in list_slots(self.config.shm_dir, self.config.job_id).values():
            path.unlink(missing_ok=True)
            logger.info("unlinked %s", path)
        self.control.close(unlink=True)

    def _release_safe(self) -> None:
        for info in self.safe_holds:
            self.holds.release(info, ("safe",))
        self.safe_holds = []
        self.roles.release()

    def _shutdown(self) -> None:
        self._release_claims(lambda step: True)
        self._release_safe()
        self.pool.shutdown(wait=not self.hung_writer, cancel_futures=True)
        self.cluster.close()
        self._answer_waiters(force=True)
        for step in self.flush_wanted:
            self.flush_failed.setdefault(step, "the agent exited before every local rank held it")
        self.flush_wanted.clear()
        self._answer_flush_waiters()
        self.sock.close()
        self.ctx.term()
        self.watcher.close()
        self.control.close()   # the block stays (unless unlinked): ranks keep its safe step, a new agent adopts it

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
            self.watcher.ranks[message["rank"]].said_bye = False   # a new Checkpointer of a process that closed one
            self.watcher.set_shape(message["world_size"], message["local_world_size"])
            self._adopt_config(message)
            self.failed_ranks.discard(message["rank"])
            if message["world_size"] > message["local_world_size"]:
                self.cluster.start_server()
            else:
                self.cluster.run_alone()
            self._send(identity, protocol.reply(True, id=request_id, pid=os.getpid()))
        elif kind == Kind.BYE:
            proc = self.watcher.ranks.get(message["rank"])
            if proc is not None and proc.pid == message["pid"]:
                proc.said_bye = True
            logger.info("rank %d said goodbye", message["rank"])
            if message["wait"]:
                self.waiters.append((identity, request_id))
            else:
                self._send(identity, protocol.reply(True, id=request_id, **ByeReply(failure=self._failure_dict()).to_wire()))
        elif kind == Kind.FLUSH:
            self._request_flush(message["rank"], message["step"])
            if message["wait"]:
                self.flush_waiters.append((identity, request_id, message["step"]))
        elif kind == Kind.RESUME:
            self._send(identity, self._resume(message["rank"], message["step"], message["stale"], request_id))
        elif kind == Kind.STATUS:
            self._send(identity, protocol.reply(True, id=request_id, **self.status()))
        elif kind == Kind.PING:
            endpoint = self.cluster.replica.endpoint if self.cluster.replica else None
            token = self.cluster.replica.token if self.cluster.replica else None
            self._send(identity, protocol.reply(True, id=request_id, **PingReply(
                os.getpid(), self.config.node_id, endpoint, token).to_wire()))
        elif kind == Kind.PEERS:
            problem = self.cluster.set_peers(message)
            self._send(identity, protocol.reply(problem is None, id=request_id, error=problem))
        else:
            logger.warning("dropped a %s message: not a request", kind.name)

    def _resume(self, rank: int, step: int, stale: list[list[int]], request_id: Any) -> bytes:
        """A rank resumed at ``step``: a new timeline (invariant 10). Newer iterations are moved aside (by
        the agent that commits them), newer steps are forgotten here so that the new timeline's are
        persisted again, and the rank's snapshots of newer steps that it could not invalidate (this agent
        held them) are ignored and let go. Every rank sends the same step; only the first call moves
        anything."""
        for slot, generation in stale:
            self.watcher.abandoned.add((rank, slot, generation))
        commits = self.cluster.peers is None or self.cluster.peers.is_leader
        error = None
        try:
            result = self.timeline.abandon_after(step, commits=commits)
            moved, tracker = result.moved, result.tracker
        except OSError as exc:
            error = (f"could not move the iterations newer than step {step} aside in {self.save_dir}: {exc}; an "
                     "automatic load follows the tracker, fix the directory and resume again")
            logger.error("rank %d resumed at step %d: %s", rank, step, error)
            moved, tracker = [], layout.read_tracker(self.save_dir)
        complete = [s for s, _ in layout.complete_iterations(self.save_dir)]
        before = (self.persisted, self.given_up)
        self.persisted, self.given_up = policy.floor_after_resume(complete, step, self.persisted, self.given_up)
        if before != (self.persisted, self.given_up):
            logger.info("rank %d resumed at step %d: a new timeline; newest step on disk %s -> %s (steps after it "
                        "are persisted again)", rank, step, before[0], self.persisted)
        if self.cluster.complete is not None and self.cluster.complete > step:
            self.cluster.complete = policy.tracker_after_resume(complete, step)
        inflight = self._inflight_step()
        if not commits:
            # A shard of this node that an abandoned persist left in a stage must not complete the new
            # timeline's iteration of that number (the leader drops whole stages; this covers a late one).
            for staged in stage_steps(self.save_dir):
                if staged > step and staged != inflight:   # the one in flight is dropped once it finishes
                    drop_own_shards(self.save_dir, staged, self.config.node_id, sorted(self.watcher.local_ranks()),
                                    self.audit)
        if self.last_passed > step:
            self.last_passed = -1
        # Step numbers of the abandoned timeline come again on the new one: nothing of theirs is taken, lost
        # or passed over, and the job-wide agreement starts again from what every node holds now.
        self.took = min(self.took, step)
        self.lost = {s for s in self.lost if s <= step}
        self.announced.forget_after(step)
        self.cluster.jobwide.rewind(step, decided=self._floor())
        # Not the persist in flight: it reads its slots until it finishes (and then publishes nothing).
        self._release_claims(lambda s: s > step and s != inflight)
        for wanted in [s for s in self.flush_wanted if s > step]:
            self.flush_wanted.discard(wanted)
            self.flush_failed[wanted] = f"the job resumed at step {step}: step {wanted} was abandoned"
        # Steps at or below the resumed one stay held: other nodes' ranks may be pulling the resumed step from
        # these very slots right now (multi-node recovery).
        self.roles.release(lambda s: s > step or self._holds_abandoned(self.roles.held[s]))
        if self.node_safe is not None and self.node_safe > step:
            self.node_safe = None
        if self.safe is not None and (self.safe > step or self._holds_abandoned(self.safe_holds)):
            for info in self.safe_holds:
                self.holds.release(info, ("safe",))
            self.safe, self.safe_holds = None, []   # the next round declares a step of the new timeline safe
            self.cluster.safe_step = None
        self._publish()
        return protocol.reply(error is None, id=request_id,
                              **ResumeReply(moved, tracker, self.persisted, error).to_wire())

    def _holds_abandoned(self, holds: list[SlotInfo]) -> bool:
        return any(info.header is not None and (info.rank, info.slot, info.header.generation) in self.watcher.abandoned
                   for info in holds)

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
                          # multi-node: the agent has checksummed this very snapshot (a read of it is verified)
                          "hashed": header is not None and self.cluster.holdings.has_hashed(rank, slot, header.generation)})
        ranks = [{"rank": p.rank, "pid": p.pid, "alive": p.alive(), "finished": p.said_bye}
                 for p in sorted(self.watcher.ranks.values(), key=lambda p: p.rank)]
        last = self.last_persist
        multi = self.cluster.status()
        return {**multi, "pid": os.getpid(), "job_id": self.config.job_id, "save_dir": str(self.save_dir),
                "shm_dir": str(self.config.shm_dir), "uptime": time.time() - self.started,
                "save_storage_interval": self.config.save_storage_interval,
                "max_ckpt_num": self.config.max_ckpt_num, "ranks": ranks, "slots": slots,
                "persisted_step": self.persisted, "persisting": self.inflight[0] if self.inflight else None,
                # No rank alive: the agent keeps the slots this much longer, then exits (`easyckpt status` says when).
                "idle_timeout": self.config.idle_timeout, "idle_exit_in": None if self.no_rank_since is None else
                max(0.0, self.config.idle_timeout - (time.monotonic() - self.no_rank_since)),
                "persist_failure": self._failure_dict(), "persist_failures": self.failures,
                "flush_requested": sorted(self.flush_wanted), "safe_step": self.safe,
                **self._protection(),
                "held_steps": sorted(set(self.claims) | ({self.inflight[0]} if self.inflight else set())),
                "last_persist": None if last is None else {"step": last.step, "bytes": last.nbytes,
                                                           "seconds": last.seconds, "path": str(last.path)}}

    def _protection(self) -> dict[str, Any]:
        """What a failure now would cost: the newest step a local rank committed, and how far the job-safe
        step (a rank kill) and, across nodes, the node-safe step (a node loss) trail it."""
        newest = self._newest_in_memory()
        multi = self.cluster.peers is not None
        verdict = self.cluster.jobwide.verdict if multi else None
        return {"newest_step": newest, "job_safe_lag": agreement.lag(newest, self.safe),
                "node_safe_step": self.node_safe if multi else None,
                "node_safe_lag": agreement.lag(newest, self.node_safe) if multi else None,
                "passed_over": list(self.announced.recent), "took": self.took if multi else None,
                "verdict_age": time.monotonic() - self.cluster.jobwide.verdict_at if verdict is not None else None}

    # persisting -------------------------------------------------------------------------------------
    def _tick(self) -> None:
        self.watcher.scan()
        self._finish_inflight()
        if self.watcher.abandoned:
            self._invalidate_abandoned()
        for proc in self.watcher.newly_dead():
            logger.warning("rank %d (pid %d) died without closing", proc.rank, proc.pid)
            self.failed_ranks.add(proc.rank)
        ranks = self.watcher.local_ranks()
        held = {rank: self.watcher.committed(rank) for rank in ranks}
        common = policy.common_steps(held, self.watcher.local_world_size)
        # A peer's backup is worth keeping while this node's ranks still hold that step (the tensors they
        # share with the peer's ranks are served from these slots): the safe step's among them.
        self.cluster.holdings.keep = frozenset(step for steps in held.values() for step in steps)
        self.cluster.tick()
        multi = self.cluster.peers is not None
        if multi:
            self._agree(ranks, held, common)
        else:
            if self.roles.steps:   # the job shrank to this node: its safe step is this node's again
                self.roles.release()
                self.node_safe = None
            self._advance_safe(ranks, held, common)
        for step in self.flush_wanted:   # asked for by the ranks: claimed rank by rank as each commits it
            if step > self._durable():
                for rank in ranks:
                    if step in held[rank]:
                        self._claim(step, rank, held[rank][step])
        if not multi:   # across nodes the leader decides which due steps are persisted (_agree)
            self._persist_due(ranks, held, common)
        if self.failed_ranks:
            self._flush_on_failure()
        if self.cluster.peers is None and self.watcher.all_said_bye():
            self._flush_missed_due(common)
        self._drop_unreachable_claims()
        self._drop_unreachable_flushes()
        self._start_ready_persist()
        self._publish()
        self._answer_waiters()
        self._answer_flush_waiters()

    def _persist_due(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: frozenset[int]) -> None:
        """Single node: claim the newest due step every local rank holds when the persister is free; one that
        arrives while it is busy is passed over (logged once per episode)."""
        busy = self.inflight is not None or bool(self.claims)
        floor, interval = self._floor(), self.config.save_storage_interval
        due = policy.due_to_claim(common, floor=floor, interval=interval, busy=busy)
        if due is not None and self._claim_all(due, ranks, held):
            if not self.passed_since_claim:   # the persister keeps up again: the episode is over
                self.passed.end("persists keep up with save_storage_interval again at step %d; due steps were "
                                "passed over meanwhile", due)
            self.passed_since_claim = False
        skipped = policy.passed_over(common, floor=floor, interval=interval, busy=busy)
        if skipped is not None and skipped not in self.claims and skipped != self._inflight_step() \
                and skipped != self.last_passed:
            self.last_passed = skipped   # counted once per step, not per loop turn
            self.passed_since_claim = True
            self.announced.recent = sorted({*self.announced.recent, skipped})[-agreement.PASSED_KEPT:]
            self.passed.hit("due step %d passed over: the persist of step %s is still running (a persist takes "
                            "longer than save_storage_interval=%d steps); the next due step after it is persisted",
                            skipped, self._inflight_step(), interval)

    def _agree(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: frozenset[int]) -> None:
        """Multi-node (``agent.agreement``): tell the leader this node's state, and carry out the newest verdict:
        persist the due step it takes, hold the steps it protects, hear the due steps it passed over."""
        peers = self.cluster.peers
        assert peers is not None
        if self.safe_holds:   # the job became multi-node: the single-node safe step gives way to the job's
            for info in self.safe_holds:
                self.holds.release(info, ("safe",))
            self.safe_holds = []
        interval = self.config.save_storage_interval
        state = NodeState(self.config.node_id, local=agreement.newest(common),
                          held=agreement.newest(self._held_everywhere(ranks)),
                          backed=agreement.newest(self.cluster.backed_up() or ()), busy=self._inflight_step(),
                          took=self.took, lost=agreement.newest(self.lost))
        verdict = self.cluster.jobwide.exchange(state, peers, interval=interval,
                                                committed=self.cluster.complete if peers.is_leader else None)
        persisting = set(self.claims) | {s for s in (self._inflight_step(),) if s is not None}
        present = set(common) | self.roles.steps
        decided = max(self._floor(), verdict.decided if verdict is not None else -1)
        due = agreement.due_to_hold(present, interval=interval, decided=decided)
        if verdict is None:
            # Nothing heard from the leader yet (or since a resume): what is held stays held, and a due step
            # is held for the leader to decide.
            plan = sorted(self.roles.steps, reverse=True)
            plan += [due] if due is not None and due not in plan else []
            self.roles.apply(plan[:max(0, self.watcher.slots_per_rank() - 1 - len(persisting))], ranks, held,
                             skip=persisting)
            return
        self._take(verdict, ranks, held)
        self.announced.hear(verdict, interval)
        floor = agreement.persist_floor(verdict, present)
        persisting |= {floor} if floor is not None else set()
        plan = agreement.plan_holds(slots=self.watcher.slots_per_rank(), persisting=persisting, due=due,
                                    job_safe=verdict.job_safe, candidate=verdict.candidate,
                                    node_safe=verdict.node_safe, present=present)
        if set(plan) - persisting != self.roles.steps:
            self.control.begin_move()   # ranks that find no free slot meanwhile wait for the move, not skip
        if self.roles.apply(plan, ranks, held, skip=persisting):
            logger.debug("holding %s for the job (plan %s, persisting %s; verdict %s)", sorted(self.roles.steps), plan,
                         sorted(persisting), verdict)
        everywhere = self._held_everywhere(ranks)
        self.safe = max((s for s in everywhere if verdict.job_safe is not None and s <= verdict.job_safe), default=None)
        self.node_safe = verdict.node_safe if verdict.node_safe in everywhere else None
        self.cluster.safe_step = self.safe

    def _take(self, verdict: Verdict, ranks: set[int], held: dict[int, dict[int, SlotInfo]]) -> None:
        """The leader said to persist due step ``verdict.take`` on every node (acted on once)."""
        step = verdict.take
        if step is None or step <= self.took:
            return
        self.took = step
        if step <= self._floor() or step in self.claims or step == self._inflight_step():
            return
        if self.inflight is not None:
            why = f"its persister is busy with step {self._inflight_step()}"
        else:
            why = "" if self._claim_all(step, ranks, held) else "a local rank no longer holds it"
        if why:
            self.lost.add(step)
            logger.warning("the leader said to persist due step %d on every node, but this node cannot: %s", step, why)

    def _held_everywhere(self, ranks: set[int]) -> set[int]:
        """Steps whose slots this agent holds on every local rank (for the job, a persist or a claim)."""
        claimed = {step for step, by in self.claims.items() if ranks and set(by) >= ranks}
        return set(self.roles.steps) | claimed | ({self.inflight[0]} if self.inflight is not None else set())

    def _invalidate_abandoned(self) -> None:
        """Snapshots of an abandoned timeline that their rank could not invalidate (this agent held them):
        invalidate each once nothing holds it, so that no later load, in this process or after a crash,
        takes it for the job's memory."""
        for rank, slot, generation in sorted(self.watcher.abandoned):
            info = self.watcher.slots.get((rank, slot))
            if info is None or self.holds.reasons.get(id(info.map)) or not info.map.try_lock(exclusive=True):
                continue
            try:
                header = info.map.header()
                if header.committed and header.generation == generation:
                    info.map.invalidate()
                    logger.info("invalidated rank %d's slot %d with step %d of the abandoned timeline", rank, slot,
                                header.step)
            finally:
                info.map.unlock()
            self.watcher.abandoned.discard((rank, slot, generation))

    def _inflight_step(self) -> int | None:
        return self.inflight[0] if self.inflight is not None else None

    def _advance_safe(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: frozenset[int]) -> None:
        """Move the safe step to what ``policy.next_safe`` says: hold every local rank's slot of the new step
        first (all or none: a rank already rewriting one makes the step unsafe), publish it, then let go
        of the old one. The control block's odd generation tells a rank that finds no free slot meanwhile
        to wait for the move instead of skipping."""
        target = policy.next_safe(common, self.safe)
        if target == self.safe and (target is None or self.safe_holds and not self._safe_superseded(ranks, held)):
            return
        self.control.begin_move()
        taken = [] if target is None else self.holds.hold_all(ranks, held, target, ("safe",))
        if taken is None:
            self._publish()   # the move failed: the old safe step stands
            return
        for info in self.safe_holds:
            self.holds.release(info, ("safe",))
        if target != self.safe:
            logger.debug("safe step %s -> %s", self.safe, target)
        self.safe, self.safe_holds = target, taken
        self.cluster.safe_step = target
        self._publish()

    def _safe_superseded(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]]) -> bool:
        """A rank snapshotted the safe step again (a save point after the step's own snapshot): the hold
        moves to the newer copy, so that the rank can drop the stale one and reuse its slot."""
        assert self.safe is not None
        newest = {(held[rank][self.safe].path, held[rank][self.safe].header.generation)   # type: ignore[union-attr]
                  for rank in ranks if self.safe in held[rank]}
        holding = {(info.path, info.header.generation) for info in self.safe_holds   # type: ignore[union-attr]
                   if info.header is not None}
        return bool(newest) and newest != holding

    def _publish(self) -> None:
        self.control.set_persist(self.persisted, self.failure, self.failures)
        self.control.set_job(self.node_safe, self.announced.recent, self._decided())
        held = frozenset(self.claims) | ({self.inflight[0]} if self.inflight else set()) | self.roles.steps
        self.control.publish(self.safe, held, gated=self.cluster.peers is not None)

    def _decided(self) -> int:
        """Due steps at or below this are decided (on disk, persisting, claimed or passed over): ranks spare
        their newest due step above it (``easyckpt.slot_choice``)."""
        verdict = self.cluster.jobwide.verdict if self.cluster.peers is not None else None
        return max(self._floor(), self.last_passed, max(self.claims, default=-1), self._inflight_step() or -1,
                   verdict.decided if verdict is not None else -1)

    def _floor(self) -> int:
        """Steps at or below this are on disk, or were given up on: never persisted again unless a rank asks."""
        return max(self._durable(), self.given_up)

    def _durable(self) -> int:
        """Steps at or below this are on disk. A rank's explicit request (FLUSH: flush(), close()) retries a
        step whose persist failed: the disk may have been fixed since."""
        return -1 if self.persisted is None else self.persisted

    def _failure_dict(self) -> dict[str, Any] | None:
        return None if self.failure is None else self.failure.as_dict()

    def _claim(self, step: int, rank: int, info: SlotInfo) -> bool:
        held = self.claims.setdefault(step, {})
        if rank in held:
            return True
        if not self.holds.hold_if_current(info, step, ("persist", step)):
            if not held:
                del self.claims[step]
            return False
        assert info.header is not None
        held[rank] = Claim(info, info.header.generation)
        return True

    def _claim_all(self, step: int, ranks: set[int], held: dict[int, dict[int, SlotInfo]]) -> bool:
        """Claim ``step`` on every local rank, or on none."""
        fresh = step not in self.claims
        if all(self._claim(step, rank, held[rank][step]) for rank in sorted(ranks)):
            return True
        if fresh:
            self._release_claims(lambda s: s == step)
        return False

    def _flush_on_failure(self) -> None:
        """Ranks died: persist the newest snapshot every local rank holds, if disk lacks it."""
        self.watcher.scan()   # the round's scan may predate the dead rank's last commit
        common = self.watcher.common_steps()
        if not common or common[0] <= self._floor():
            self.failed_ranks.clear()
            return
        step = common[0]
        ranks = self.watcher.local_ranks()
        if self._claim_all(step, ranks, {rank: self.watcher.committed(rank) for rank in ranks}):
            logger.warning("flush on failure: persisting step %d, the newest snapshot of every local rank", step)
            self.failed_ranks.clear()

    def _request_flush(self, rank: int, step: int) -> None:
        if step in self.flush_wanted or step <= self._durable():   # asked already, or on disk
            return
        # The rank asks once its copy is committed: see that copy (in a slot file perhaps created just now),
        # not an older one.
        self.watcher.scan(relist_every=0)
        logger.info("rank %d asks for step %d to be persisted now: persisting it once every local rank holds it",
                    rank, step)
        self.flush_wanted.add(step)
        self.flush_failed.pop(step, None)
        info = self.watcher.committed(rank).get(step)
        if info is not None:
            self._claim(step, rank, info)   # at once: the rank goes on snapshotting into its other slots

    def _drop_unreachable_flushes(self) -> None:
        """Forget requested steps that are on disk, or that some local rank will never hold."""
        for step in sorted(self.flush_wanted):
            if step <= self._durable():
                self.flush_wanted.discard(step)
                continue
            if any(self._never_holds(rank, step) for rank in self.watcher.local_ranks()):
                self.watcher.scan(relist_every=0)   # not on the word of a listing up to 0.25 s old
            for rank in self.watcher.local_ranks():
                if why := self._never_holds(rank, step):
                    why = f"rank {rank} {why}"
                    logger.warning("requested persist of step %d given up: %s", step, why)
                    self.flush_wanted.discard(step)
                    self.flush_failed[step] = why
                    self._release_claims(lambda s, step=step: s == step)
                    break

    def _answer_flush_waiters(self) -> None:
        if not self.flush_waiters:
            return
        waiting = []
        for identity, request_id, step in self.flush_waiters:
            if self.persisted is not None and self.persisted >= step:
                # In a multi-node job ``persisted`` is this node's durable shards; the leader renames the
                # iteration into place once every node's are.
                committed = (self.save_dir / layout.iteration_dirname(self.persisted)).is_dir()
                self._send(identity, protocol.reply(True, id=request_id,
                                                    **FlushReply(self.persisted, committed).to_wire()))
            elif step not in self.flush_wanted:
                error = self.flush_failed.get(step, f"persisting step {self.given_up} failed (see the agent log)")
                self._send(identity, protocol.reply(False, id=request_id, **FlushReply(
                    self.persisted, error=error, failure=self._failure_dict()).to_wire()))
            else:
                waiting.append((identity, request_id, step))
        self.flush_waiters = waiting
        still = {step for _, _, step in waiting} | self.flush_wanted
        self.flush_failed = {s: why for s, why in self.flush_failed.items() if s in still}

    def _flush_missed_due(self, common: frozenset[int]) -> None:
        """The job finished, but its last due snapshot never reached disk (passed over while an older step
        was persisted): persist the newest snapshot instead of losing the tail."""
        step = policy.tail_to_persist(common, floor=self._floor(), interval=self.config.save_storage_interval)
        if step is None or step in self.claims or self.inflight is not None:
            return
        ranks = self.watcher.local_ranks()
        if self._claim_all(step, ranks, {rank: self.watcher.committed(rank) for rank in ranks}):
            logger.warning("due step %d never reached disk (passed over while an older step was persisted): "
                           "persisting step %d, the newest snapshot of every rank, before the job's memory is "
                           "released", step // self.config.save_storage_interval * self.config.save_storage_interval,
                           step)

    def _drop_unreachable_claims(self) -> None:
        """Release claims on a step some rank will never commit (it moved past it without it)."""
        for step in list(self.claims):
            if self.persisted is not None and step <= self.persisted:
                self._release_claims(lambda s, step=step: s == step)
                continue
            for rank in self.watcher.local_ranks():
                if rank not in self.claims[step] and (why := self._never_holds(rank, step)):
                    logger.warning("step %d cannot be persisted: rank %d %s", step, rank, why)
                    self._release_claims(lambda s, step=step: s == step)
                    if step in self.flush_wanted:   # or the next round would claim it again
                        self.flush_wanted.discard(step)
                        self.flush_failed[step] = f"rank {rank} {why}"
                    break

    def _never_holds(self, rank: int, step: int) -> str:
        """Why ``rank`` will never hold ``step`` committed (it moved past it, or ended without it); "" if it may."""
        proc = self.watcher.ranks.get(rank)
        return policy.never_holds(step, set(self.watcher.committed(rank)),
                                  ended=proc is not None and (proc.said_bye or proc.dead))

    def _release_claims(self, which: Any) -> None:
        for step in [s for s in self.claims if which(s)]:
            for claim in self.claims.pop(step).values():
                self.holds.release(claim.info, ("persist", step))

    def _start_ready_persist(self) -> None:
        if self.inflight is not None:
            return
        ranks = self.watcher.local_ranks()
        for step in sorted(self.claims, reverse=True):
            if len(ranks) >= self.watcher.local_world_size and set(self.claims[step]) >= ranks:
                metas = {rank: claim.info.meta for rank, claim in self.claims[step].items()}
                if any(meta is None or meta.step != step for meta in metas.values()):
                    continue  # metadata not read yet for this generation: next tick
                snaps = [RankSnapshot(rank, claim.info.map, meta) for (rank, claim), meta
                         in zip(self.claims[step].items(), metas.values()) if meta is not None]
                self.inflight_epoch = self.timeline.epoch
                self.inflight = (step, self.pool.submit(self._persist, step, snaps, self.inflight_epoch))
                return

    def _persist(self, step: int, snaps: list[RankSnapshot], epoch: int) -> PersistStats:
        world_size = snaps[0].meta.world_size
        if len(snaps) != world_size:
            if self.cluster.peers is None:
                raise RuntimeError(
                    f"this node holds ranks {sorted(s.rank for s in snaps)} of a {world_size}-rank job but no rank "
                    "told this agent the job's other nodes (PEERS): a multi-node checkpoint needs every node's "
                    "shards before its commit marker, so nothing is written"
                )
            return persist_shards(self.save_dir, step, snaps, self.config.node_id, self.audit,
                                  self.config.persist_threads)
        stats = persist(self.save_dir, step, snaps, self.audit, self.config.persist_threads,
                        publishing=lambda s: self.timeline.publishing(s, epoch))
        try:
            self.timeline.rotate(self.config.max_ckpt_num, step)
        except OSError as exc:   # the step is durable all the same; the next persist rotates again
            logger.warning("rotation after step %d failed: %s: %s", step, exc.filename or self.save_dir,
                           exc.strerror or exc)
        return stats

    def _finish_inflight(self) -> None:
        if self.inflight is None or not self.inflight[1].done():
            return
        step, future = self.inflight
        self.inflight = None
        abandoned = self.timeline.abandoned_since(self.inflight_epoch, step)
        try:
            stats = future.result()
        except StepAbandoned:
            logger.info("persist of step %d finished after the job resumed at an older step: not published", step)
            self._release_claims(lambda s: s == step)
            return
        except Exception as exc:
            if abandoned:   # not a failure of the new timeline: its step of this number is still persisted
                logger.warning("persist of step %d (abandoned by a resume meanwhile) failed: %s", step, exc)
                traceback.clear_frames(exc.__traceback__)
                self._release_claims(lambda s: s == step)
                return
            if isinstance(exc, PersistFailed):
                self._persist_failed(step, exc)
                return
            # not the disk: a bug, worth its traceback (once per failure)
            logger.exception("persist of step %d to %s failed", step, self.save_dir)
            traceback.clear_frames(exc.__traceback__)   # its frames hold views of the slots
            self._persist_failed(step, PersistFailed(step, self.save_dir, 0, f"{type(exc).__name__}: {exc}"))
            return
        if abandoned:
            # A node's shards (multi-node) written for a step a resume abandoned meanwhile: they must not
            # complete the new timeline's iteration of that number.
            drop_own_shards(self.save_dir, step, self.config.node_id, sorted(self.claims.get(step, {})), self.audit)
            self._release_claims(lambda s: s == step)
            return
        self.persisted = step if self.persisted is None else max(step, self.persisted)
        self.last_persist = stats
        if self.failure is not None:
            logger.warning("persists succeed again: step %d is on disk after %d failed persist(s) since %s",
                           step, self.failure.failures - self._failures_before, time.strftime(
                               "%H:%M:%S", time.localtime(self.failure.since)))
            self.failure = None
        line = describe(stats, len(self.claims.get(step, {})))
        logger.info(line)
        self._release_claims(lambda s: s <= step)
        if self.config.log_file_path:
            try:
                with open(self.config.log_file_path, "a", encoding="utf-8") as handle:
                    handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
            except OSError as exc:
                logger.warning("cannot append to log_file_path %s: %s", self.config.log_file_path, exc)

    def _persist_failed(self, step: int, exc: PersistFailed) -> None:
        """One line per failed persist; the step is not retried (a newer due step, or a rank's request, is)."""
        self.failures += 1
        now = time.time()
        if self.failure is None:
            self._failures_before = self.failures - 1
        since = now if self.failure is None else self.failure.since
        self.failure = PersistFailure(step, exc.errno, exc.text(), exc.needed, exc.free, since, now, self.failures)
        logger.warning("%s; the snapshot stays in memory and training goes on (failed persists in a row: %d)",
                       exc.describe(), self.failures - self._failures_before)
        self.given_up = max(self.given_up, step)
        self._release_claims(lambda s: s <= step)
        for wanted in [s for s in self.flush_wanted if s <= step]:
            self.flush_wanted.discard(wanted)
            self.flush_failed[wanted] = exc.describe()

    def _answer_waiters(self, force: bool = False) -> None:
        # Not for the leader's staged steps: a rank's close() waits for its own node's shards only; the
        # leader commits the step (or gives up after STAGE_WAIT) on its own before it exits.
        if not self.waiters or (not force and (self.inflight is not None or self.claims)):
            return
        for identity, request_id in self.waiters:
            self._send(identity, protocol.reply(True, id=request_id,
                                                **ByeReply(self.persisted, self._failure_dict()).to_wire()))
        self.waiters.clear()
