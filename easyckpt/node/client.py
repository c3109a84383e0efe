"""The rank's side of the agent: find it, start it when none runs, and talk to it without blocking.

Whether an agent runs is answered by its lock (an flock the agent holds for its whole life), not by a
pid file that a dead agent leaves behind. The agent is started detached (own session) so that
torchrun tearing down the worker group does not take it along; two ranks that start one at the same
moment are harmless, because the loser of the lock exits at once.
"""
from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from easyckpt_wire import faults, procs, protocol
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.records import ByeReply, FlushReply, RecordError, ResumeReply

logger = logging.getLogger(__name__)

_CHECK_EVERY = 1.0  # seconds between liveness checks on the training path
_REPLY_LOOK = 0.25  # seconds between looks at the agent a request went to, while its reply is awaited
# argparse's exit status: the agent refused the command line this rank gave it, and would refuse it every time
USAGE_EXIT = 2
_RESPAWN_MAX = 60.0  # seconds: the longest wait before starting again an agent that keeps failing at start


class AgentTimeout(TimeoutError):
    pass


class AgentGone(AgentTimeout):
    """The agent a request went to exited before it answered; another may serve the job already (ask it again)."""


class Unanswered(str):
    """Why the agent did not answer a request in time (hung or stopped): asking it again would wait as long again.
    Returned where a reason is (``AgentClient.checksums``), so callers that only show it need not know."""


class NoAgent(RuntimeError):
    """No agent runs for the job and none could be started (the request was not sent)."""


class AgentRefused(RuntimeError):
    """The agent this rank started refused its command line: nothing can be persisted, so no agent is started
    again."""


class AgentClient:
    def __init__(self, *, job_id: str, save_dir: Path, shm_dir: Path, rank: int, world_size: int,
                 local_world_size: int, hello: dict[str, Any], idle_timeout: float, spawn: bool) -> None:
        self.job_id = job_id
        self.save_dir = save_dir
        self.shm_dir = shm_dir
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.hello_fields = hello
        self.idle_timeout = idle_timeout
        self.spawn_allowed = spawn
        self.job_dir = protocol.runtime_dir(job_id)
        self.waker = protocol.Waker(self.job_dir)
        # The process-wide context: a context of our own, collected with a Checkpointer that was dropped
        # without close() (in a reference cycle its socket is not closed first), blocks forever in term().
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._last_check = 0.0
        self.spawned = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._settled = True   # whether the fate of the agent this rank started was said (_settle_spawn)
        self.refused: str | None = None   # why the agent refused its command line (then none is started again)
        # Agents this rank started that failed before serving, in a row: each next start waits twice as long
        self._failed_starts = 0
        self._next_spawn = 0.0
        self._peers: dict[str, Any] | None = None   # the last PEERS sent: a restarted agent gets it again
        self._introduced_to = ""   # the pid (agent.pid) serving when this rank last sent HELLO (and PEERS)

    # liveness ---------------------------------------------------------------------------------------
    def alive(self) -> bool:
        """True while some process holds the job's agent lock, or the agent we started is still starting."""
        if self._proc is not None and self._proc.poll() is None:
            return True
        return protocol.agent_running(self.job_dir)

    def ensure(self, *, force: bool = False) -> None:
        """Start an agent if none runs (checked at most once a second unless forced); never waits."""
        now = time.monotonic()
        if not force and now - self._last_check < _CHECK_EVERY:
            return
        self._last_check = now
        self._drain()
        self._settle_spawn()
        if self.alive():
            if self.sock is None:
                self._connect()
            else:
                self._reintroduce()
            return
        if self.spawn_allowed and self.refused is None and now >= self._next_spawn:
            if self.spawned:
                logger.warning("rank %d: the easyckpt agent of job %s is gone; starting a new one", self.rank, self.job_id)
            self._spawn()
        self._connect()

    def _spawn(self) -> None:
        # This file's own path, not ``easyckpt.__file__``: under an editable install a directory named easyckpt
        # where the job runs (Lightning's default save_dir, <default_root_dir>/easyckpt) is imported as an empty
        # namespace package in the real one's place (setuptools' finder comes after the path scan), with no
        # __file__: a Lightning job's second run failed here with a TypeError (2026-12-06).
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # The agent is not a torchrun worker: without these it cannot mistake itself for the launcher of
        # ``torchrun -m easyckpt_agent`` (MASTER_ADDR stays: it picks the address other nodes reach the agent at).
        for name in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE"):
            env.pop(name, None)
        if not env.get(faults.ENV, "").startswith("agent."):
            env.pop(faults.ENV, None)  # a rank's fault point must not fire in the agent
        command = [sys.executable, "-m", "easyckpt_agent", "--save-dir", str(self.save_dir), "--job-id", self.job_id,
                   "--shm-dir", str(self.shm_dir), "--idle-timeout", str(self.idle_timeout),
                   "--save-storage-interval", str(self.hello_fields["save_storage_interval"]),
                   "--max-ckpt-num", str(self.hello_fields["max_ckpt_num"]), "--started-by", str(os.getpid())]
        if self.hello_fields.get("log_file_path"):
            command += ["--log-file", self.hello_fields["log_file_path"]]
        # Again: an agent that ended cleanly removed the directory (a later Checkpointer of this process).
        protocol.runtime_dir(self.job_id)
        with open(self.job_dir / "agent.log", "ab") as log:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True, env=env, cwd="/")
        self._proc = proc
        self._settled = False
        self.spawned += 1

    def _settle_spawn(self, *, answered: bool = False) -> None:
        """Say once whether the agent this rank started is the job's: ranks that start one at the same moment
        all spawn, and every one but the lock's winner exits at once as a duplicate, which is no news (DEBUG).
        ``answered``: the job's agent just answered, so one that is not ours is another rank's."""
        proc = self._proc
        if proc is None or self._settled:
            return
        serving = self._serving_pid()
        if serving == str(proc.pid):
            logger.info("rank %d started the easyckpt agent (pid %d, log %s)", self.rank, proc.pid,
                        self.job_dir / "agent.log")
            self._failed_starts = 0
        elif answered or proc.poll() == 0:
            logger.debug("rank %d: the agent it started (pid %d) exited as a duplicate; agent pid %s serves job %s",
                         self.rank, proc.pid, serving or "?", self.job_id)
        elif proc.returncode == USAGE_EXIT:
            self.refused = (f"the easyckpt agent refused the command line rank {self.rank} started it with: "
                            f"{_last_line(self.job_dir / 'agent.log')}")
            logger.error("rank %d: %s. No agent is started again, so nothing is persisted (%s)", self.rank,
                         self.refused, self.job_dir / "agent.log")
        elif proc.poll() is not None:
            self._failed_starts += 1
            wait = min(_RESPAWN_MAX, _CHECK_EVERY * 2 ** (self._failed_starts - 1))
            self._next_spawn = time.monotonic() + wait
            logger.warning("rank %d: the easyckpt agent it started (pid %d) exited with code %d before serving (%d in "
                           "a row; the next start in %.0f s): see %s", self.rank, proc.pid, proc.returncode,
                           self._failed_starts, wait, self.job_dir / "agent.log")
        else:
            return   # still starting: decided at a later check
        self._settled = True

    def wait_ready(self, timeout: float) -> bool:
        """At start-up only (never in the training loop): give a just-started agent time to come up.

        Retries in short rounds, so that an agent that was just exiting (it still held its lock when we
        looked) is replaced instead of waited for.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request(Kind.PING, min(1.0, max(0.05, deadline - time.monotonic())))
                self._settle_spawn(answered=True)
                return True
            except AgentTimeout as exc:
                if time.monotonic() >= deadline:
                    logger.warning("%s; training goes on, snapshots are persisted once an agent runs", exc)
                    return False
            self.ensure(force=True)
            if self.refused is not None:
                raise AgentRefused(self.refused)

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        # The agent's checksums of a large rank's snapshot (MANIFEST) can pass 1 MiB; the socket is local (ipc).
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_PEER_MESSAGE_BYTES)
        self.sock.connect(protocol.agent_endpoint(self.job_dir))
        self._introduce()

    def _introduce(self) -> None:
        self._introduced_to = self._serving_pid()
        self.send(Kind.HELLO, rank=self.rank, pid=os.getpid(), world_size=self.world_size,
                  local_world_size=self.local_world_size, **self.hello_fields)
        if self._peers is not None:
            self.send(Kind.PEERS, **self._peers)

    def _reintroduce(self) -> None:
        """Another agent took over the job since this rank's HELLO: a replacement another rank started, or a
        spare this rank started that lost the start-up race, came up late and took the lock of an agent that
        died. The socket reconnects by itself, but the new agent never heard HELLO or PEERS: without PEERS it
        cannot persist a multi-node step (it waits PEERS_GRACE, then fails it). Sent again; the pid file is
        read here at most once a second (``ensure``)."""
        serving = self._serving_pid()
        if serving and serving != self._introduced_to:
            # At start-up the agent this rank just started writes its pid once it holds the job's lock, often after
            # this rank's first HELLO went out (the socket queues it for the agent): no news.
            logger.log(logging.INFO if self._introduced_to else logging.DEBUG,
                       "rank %d: agent pid %s now serves job %s (was %s): introducing this rank to it", self.rank,
                       serving, self.job_id, self._introduced_to or "?")
            self._introduce()

    # messages ---------------------------------------------------------------------------------------
    def send(self, kind: Kind, **fields: Any) -> int:
        """Queue a message without blocking; returns its id (0 if it was dropped)."""
        if self.sock is None:
            return 0
        request_id = next(self._ids)
        try:
            self.sock.send(protocol.encode(kind, id=request_id, **fields), zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("rank %d: agent queue full, %s dropped", self.rank, kind.name)
            return 0
        return request_id

    def request(self, kind: Kind, timeout: float, **fields: Any) -> dict[str, Any]:
        """Send and wait for the matching reply; raises AgentTimeout naming the request, AgentGone when the agent it
        went to exited before answering."""
        if kind == Kind.PEERS:
            self._peers = fields
        # The agent that gets it, by (pid, start): one that dies before it answers may be replaced before this rank
        # looks again (another local rank starts the new one), and the new one never got the request. An agent
        # alive at every look was once taken for an answer on its way: a rank's FLUSH at close() waited
        # close_timeout (600 s) and its job hung at torchrun's exit barrier (soak seed 1319, fault 24). Named before
        # the send: named after it, an agent that died in between was no addressee at all (the pid file still names
        # it, dead), and its replacement was waited on for an answer it never got a question for (1 run in 10 of
        # test_a_request_whose_agent_dies_and_is_replaced..., which kills the agent as soon as the request is sent).
        addressee = self._serving_agent()
        request_id = self.send(kind, **fields)
        deadline = time.monotonic() + timeout
        while request_id:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.sock is None or not self.sock.poll(int(min(remaining, _REPLY_LOOK) * 1000)):
                if remaining <= 0 or self.sock is None:
                    break
                gone = self._gone_before_answering(addressee)
                if gone:
                    raise AgentGone(f"agent {kind.name} request of rank {self.rank}: {gone} (agent log: "
                                    f"{self.job_dir / 'agent.log'})")
                continue
            try:
                _, message = protocol.decode(self.sock.recv(), limit=protocol.MAX_PEER_MESSAGE_BYTES)
            except ProtocolError as exc:
                logger.warning("rank %d: dropped a malformed reply from the agent: %s", self.rank, exc)
                continue
            if message.get("id") == request_id:
                return message
        raise AgentTimeout(f"agent {kind.name} request of rank {self.rank}: no reply within {timeout:.0f}s "
                           f"(agent log: {self.job_dir / 'agent.log'})")

    def _serving_agent(self) -> tuple[int, float] | None:
        """(pid, start) of the live agent named by the job's pid file; None when none is named (an agent writes it
        once it holds the lock) or the one named is dead (a killed agent leaves its file behind)."""
        pid = self._serving_pid()
        if not pid.isdigit():
            return None
        try:
            return int(pid), procs.start_time(int(pid))
        except (ProcessLookupError, PermissionError):
            return None

    def _gone_before_answering(self, addressee: tuple[int, float] | None) -> str | None:
        """Why the reply to a request that went to ``addressee`` cannot come any more, or None while it can."""
        if not self.alive():
            return "the agent exited before answering"
        if addressee is not None and not procs.is_alive(*addressee):
            serving = self._serving_pid()   # still the dead one's until the new agent holds the lock
            return (f"the agent that got it (pid {addressee[0]}) exited before answering, and another agent (pid "
                    f"{serving if serving and serving != str(addressee[0]) else '?'}) serves the job now")
        return None

    def _ask(self, kind: Kind, timeout: float, **fields: Any) -> dict[str, Any]:
        """request(), started or restarted as needed, and asked again of the agent that took over when the one it
        went to dies before answering (the new one adopts the slots; the dead one's answer never comes). Raises
        NoAgent when no agent runs, AgentTimeout when ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            self.ensure(force=True)   # an agent that died is replaced
            if not self.alive():
                raise NoAgent(f"rank {self.rank}: no easyckpt agent runs for job {self.job_id}")
            try:
                return self.request(kind, max(0.0, deadline - time.monotonic()), **fields)
            except AgentGone as exc:
                if time.monotonic() >= deadline:
                    raise
                logger.warning("%s; asking again", exc)

    def flush(self, step: int, *, wait: bool, timeout: float) -> FlushReply | None:
        """Ask the agent to persist ``step`` now. With ``wait``, block (bounded) for its answer: a reply
        with ``persisted`` (the newest step durable on this node) and ``committed``, or ``error``; None when
        no agent answered in time. Without, return None at once (the agent does not answer)."""
        if not wait:
            self.ensure()
            if not self.send(Kind.FLUSH, rank=self.rank, step=step, wait=False):
                logger.warning("rank %d: the request to persist step %d did not reach the agent (no agent, or "
                               "its queue is full); the step stays in memory", self.rank, step)
            return None
        try:
            return FlushReply.from_wire(self._ask(Kind.FLUSH, timeout, rank=self.rank, step=step, wait=True),
                                        "agent FLUSH reply")
        except NoAgent:
            return None
        except RecordError as exc:   # an agent of another build: no answer a program could act on
            logger.warning("rank %d: %s", self.rank, exc)
            return None
        except AgentTimeout as exc:
            logger.warning("%s", exc)
            return None

    def resume(self, step: int, stale: list[list[int]], *, timeout: float) -> ResumeReply | None:
        """Tell the agent this rank resumed at ``step`` (a new timeline: it moves newer iterations aside and
        persists the new timeline's steps) and which of its slots ([index, generation]) hold abandoned
        steps it could not invalidate. Waits (bounded) for the reply; None when no agent answered."""
        try:
            return ResumeReply.from_wire(self._ask(Kind.RESUME, timeout, rank=self.rank, step=step, stale=stale),
                                         "agent RESUME reply")
        except NoAgent:
            logger.warning("rank %d: no easyckpt agent runs for job %s to record the resume at step %d; iterations "
                           "newer than it in %s stay where they are until a later resume", self.rank, self.job_id,
                           step, self.save_dir)
            return None
        except (AgentTimeout, RecordError) as exc:
            logger.warning("%s; iterations newer than step %d in %s stay until the agent hears of the resume",
                           exc, step, self.save_dir)
            return None

    def checksums(self, step: int, *, timeout: float) -> tuple[int, list[bytes]] | str:
        """(slot generation, tensor checksums) the agent took of this rank's snapshot of ``step`` when it was
        committed, to verify a read from memory; otherwise why not (no agent, not hashed yet, no answer)."""
        if not self.alive():
            return f"no easyckpt agent runs for job {self.job_id}"
        try:
            reply = self.request(Kind.MANIFEST, timeout, rank=self.rank, step=step)
        except AgentGone as exc:   # another agent may serve the job already: the next step may ask it
            return str(exc)
        except AgentTimeout as exc:
            return Unanswered(exc)
        generation, checksums = reply.get("generation"), reply.get("checksums")
        if not reply.get("ok"):
            return str(reply.get("error", "the agent refused"))
        if type(generation) is not int or not isinstance(checksums, list) or not all(
                isinstance(c, bytes) and len(c) == protocol.CHECKSUM_BYTES for c in checksums):
            return f"malformed MANIFEST reply from the agent: generation {generation!r:.40}, checksums {checksums!r:.80}"
        return generation, checksums

    def _drain(self) -> None:
        while self.sock is not None:
            try:
                self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self, *, wait: bool, timeout: float, failed: bool = False) -> ByeReply | None:
        """Say goodbye; with ``wait`` block (bounded) until the agent has persisted what is due. ``failed``:
        the run failed, it did not end; the agent keeps this node's memory for the restart."""
        reply = None
        deadline = time.monotonic() + timeout
        serving = ""
        try:
            while True:
                self.ensure(force=True)
                serving = self._serving_pid()
                if not self.alive():
                    if self.spawn_allowed:
                        logger.warning("rank %d: no easyckpt agent runs for job %s; due snapshots stay in %s "
                                       "unpersisted", self.rank, self.job_id, self.shm_dir)
                    break
                try:
                    reply = ByeReply.from_wire(self.request(Kind.BYE, max(0.0, deadline - time.monotonic()),
                                                            rank=self.rank, pid=os.getpid(), wait=wait, failed=failed),
                                               "agent BYE reply")
                    break
                except AgentGone as exc:   # the goodbye goes to the agent that took over (it adopted the slots)
                    if time.monotonic() >= deadline:
                        raise
                    logger.warning("%s; saying goodbye to it", exc)
        except (AgentTimeout, RecordError) as exc:
            logger.warning("%s", exc)
        finally:
            self.detach()
            if reply is not None:
                self._stop_spare_agent(serving)
        return reply

    def _serving_pid(self) -> str:
        """The pid in the job's agent.pid file (written by the agent that holds the lock), or ''."""
        try:
            return (self.job_dir / "agent.pid").read_text().strip()
        except OSError:
            return ""

    def _stop_spare_agent(self, serving: str) -> None:
        """The job's agent (pid ``serving``) answered our goodbye, so an agent this rank started that is another
        process lost a start-up race or is still starting: left alone, a slow one takes the lock once the job's
        agent has exited and waits out its idle timeout for ranks that never come (a stray process and control
        block after a clean end). One that might still have to persist for us (no agent answered) is kept."""
        proc = self._proc
        if proc is None or proc.poll() is not None or str(proc.pid) in (serving, self._serving_pid()):
            return
        logger.debug("rank %d: stopping the agent it started (pid %d): agent pid %s serves job %s", self.rank,
                     proc.pid, serving or "?", self.job_id)
        proc.terminate()

    def detach(self) -> None:
        """Close the socket without a word to the agent (it notices the process is gone)."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.waker.close()


class AgentElsewhereError(RuntimeError):
    """The job's agent that already runs watches another shared-memory directory than this rank writes to."""


def check_running_agent(job_dir: Path, *, job_id: str, shm_dir: Path, rank: int, timeout: float = 5.0) -> None:
    """Before a rank writes a slot: an agent of this job that already runs (an earlier run's, kept alive for a
    restart until its idle timeout) must watch this rank's ``shm_dir``. One that watches another would never see
    this run's snapshots, and ``close()`` would wait ``close_timeout`` for a persist that never comes (a rerun
    with another EASYCKPT_SHM_DIR). An agent that does not answer in ``timeout`` is left to the usual checks."""
    if not protocol.agent_running(job_dir):
        return
    try:
        report = query_status(job_dir, timeout)
    except (AgentTimeout, ProtocolError, OSError):
        return
    theirs = report.get("shm_dir")
    if not isinstance(theirs, str) or Path(theirs).resolve() == shm_dir.resolve():
        return
    idle = report.get("idle_exit_in")
    when = f"it exits by itself in {idle:.0f}s, " if isinstance(idle, (int, float)) else ""
    raise AgentElsewhereError(
        f"rank {rank}: the easyckpt agent of job {job_id} (pid {report.get('pid')}), still running from an earlier "
        f"run on {report.get('save_dir')}, watches shared memory in {theirs}, but this run's shm_dir is {shm_dir} "
        f"(EASYCKPT_SHM_DIR or shm_dir=): it would never see this run's snapshots. Run with shm_dir {theirs} to "
        f"resume from its memory, or stop it first ({when}or `kill {report.get('pid')}`; then "
        f"`easyckpt clean {report.get('save_dir')}` frees its memory)")


def query_status(job_dir: Path, timeout: float = 5.0) -> dict[str, Any]:
    """Ask the agent of one job on this node (its runtime directory) for its view (``easyckpt status``)."""
    try:
        return protocol.request_agent(job_dir, Kind.STATUS, timeout)
    except protocol.AgentNoReply as exc:
        raise AgentTimeout(str(exc)) from None


def _last_line(log: Path) -> str:
    """The last line of the agent's log: what it said as it exited (argparse's error)."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 4096))
            lines = handle.read().decode(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"(cannot read {log}: {exc})"
    return lines[-1] if lines else "(its log is empty)"
