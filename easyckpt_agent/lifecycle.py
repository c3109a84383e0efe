"""The agent's life: wake-ups of its loop, shutdown on a signal, and when it exits and what it leaves behind.

SIGTERM/SIGINT end the loop; :meth:`Lifecycle.stop` then finishes (or, past ``shutdown_timeout``, abandons)
the persist in flight, persists the newest snapshot every local rank holds if disk lacks it and time is
left, and lets go of the slots only if nothing in them is newer than disk, no rank of the job still
runs, none left saying its run failed and none still ran when the signal came (the job was torn down:
the memory is for its restart). If the signal came from a launcher that ends jobs by process trees (DeepSpeed's:
:func:`is_tree_kill`), what stays is handed to a detached successor (:func:`start_successor`), which waits for
the restart. A second signal stops waiting for the disk.
Without a signal the agent exits (:meth:`should_exit`, never while a persist, a claim or a leader's stage
is pending) once every local rank said goodbye, unlinking the slots (unless a failed persist left the newest step only in
memory), or once no rank has been alive for ``idle_timeout``, unlinking them only when the newest step
is on disk.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import psutil

from easyckpt_agent import persister
from easyckpt_agent.cluster import NodeReplication
from easyckpt_agent.protection import Protection
from easyckpt_agent.scheduler import PersistScheduler
from easyckpt_agent.watcher import Watcher
from easyckpt_wire import faults, protocol
from easyckpt_wire.control import PersistFailure
from easyckpt_wire.shm import list_slots

logger = logging.getLogger(__name__)

ABORT_TIMEOUT = 10.0    # an abandoned persist must stop within this long after its writers are told to
# Launchers that end a failed (or signalled) job by terminating each rank's process tree, children first, so that the
# agent a rank started goes down with it: the module in the command line of the rank's parent. Any launcher whose kill
# reaches the agent would do, but a kill of everything at once (systemd stopping a unit, SLURM cancelling a step)
# looks the same from inside and waits for every process: a successor there would delay that stop until its SIGKILL.
TREE_KILLING_LAUNCHERS = ("deepspeed.launcher.launch",)
# The ranks died and left nothing of the job in memory (before their first snapshot, say on a load that refused a
# damaged checkpoint): a restart gains nothing from the agent waiting idle_timeout, so it leaves sooner.
EMPTY_IDLE = 10.0


class LifeSettings(Protocol):
    """What the lifecycle reads of the agent's config (``AgentConfig``)."""

    save_dir: Path
    job_id: str
    shm_dir: Path
    idle_timeout: float
    shutdown_timeout: float
    started_by: int | None


class WakePipe:
    """A FIFO in the job's runtime directory: ranks (after a commit) and the agent's other threads (news from
    other nodes) wake the loop at once instead of at its next poll."""

    def __init__(self) -> None:
        self.fd = -1

    def open(self, job_dir: Path) -> int:
        path = protocol.wake_path(job_dir)
        path.unlink(missing_ok=True)
        os.mkfifo(path, 0o600)
        # O_RDWR: a FIFO read end with no writer would poll as hung up, over and over.
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        return self.fd

    def wake(self) -> None:
        fd = self.fd
        if fd >= 0:
            try:
                os.write(fd, b"n")
            except (BlockingIOError, OSError):   # full of wake-ups already, or closing
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def newest_in_memory(watcher: Watcher) -> int | None:
    """The newest step any local rank holds committed."""
    return max((step for rank in watcher.local_ranks() for step in watcher.committed(rank)), default=None)


class Lifecycle:
    def __init__(self, *, settings: LifeSettings, watcher: Watcher, scheduler: PersistScheduler,
                 protection: Protection, cluster: NodeReplication) -> None:
        self.settings = settings
        self.watcher = watcher
        self.scheduler = scheduler
        self.protection = protection
        self.cluster = cluster
        self.stop_signal: int | None = None   # SIGTERM/SIGINT received: the loop ends and stop() runs
        self.running_at_signal: list[int] = []   # the ranks that still ran when it came
        # The rank that started this agent runs under a launcher that ends jobs by process trees (known at start: by
        # the time of a signal the launcher is busy killing).
        self.launcher_kills_trees = launcher_kills_trees(settings.started_by)
        self.tree_kill = False   # the signal came from such a launcher (is_tree_kill)
        self.hand_over = False   # stop() kept the slots after a tree kill: a detached agent takes them over
        self.given_up_on_stop = False   # stop() abandoned a persist or saw one fail
        self.hung_writer = False     # an abandoned persist's thread did not stop: the process must not join it
        self.ended_cleanly = False   # the job is over and nothing of it is left in memory: its runtime dir can go
        self.no_rank_since: float | None = None

    # signals --------------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> dict[int, Any]:
        """Handle SIGTERM/SIGINT; returns the previous handlers (for :meth:`restore_signal_handlers`)."""
        if threading.current_thread() is not threading.main_thread():
            return {}   # an agent run inside a test's thread: signals are the host process's business
        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, self.on_signal)
        return previous

    @staticmethod
    def restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None:
            # A second signal: stop waiting for the disk (the write loop checks the flag between writes).
            persister.ABORT.set()
            return
        self.stop_signal = signum
        # Now, not when stop() runs: a launcher that ends a failed job's whole process tree (DeepSpeed's) signals
        # the agent an instant before the ranks, which are gone by then. What the loop has not yet seen die still
        # ran, as far as the job is concerned: a rank that died a moment before this handler ran (it had no time to
        # say that its run failed) was torn down with the job, not finished (is_alive() here lost that race).
        # No mutation of the watcher here (the loop may be half-way through it).
        running = [proc for proc in list(self.watcher.ranks.values()) if not (proc.said_bye or proc.dead or proc.reported)]
        self.running_at_signal = [proc.rank for proc in running]
        self.tree_kill = is_tree_kill(launcher_kills_trees=self.launcher_kills_trees, started_by=self.settings.started_by,
                                      parent=os.getppid(), running=[proc.pid for proc in running])

    # shutdown on a signal ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM/SIGINT: finish (or, past shutdown_timeout, abandon) the persist in flight, persist the
        newest snapshot every local rank holds if disk lacks it and time is left, then let go of the slots
        only if nothing in them is newer than disk, no rank of the job still runs, none left saying its run
        failed and none still ran when the signal came. One log line says what happened."""
        name = signal.Signals(self.stop_signal or signal.SIGTERM).name
        timeout = self.settings.shutdown_timeout
        deadline = time.monotonic() + timeout
        done: list[str] = []
        self.given_up_on_stop = False
        if self.scheduler.inflight is not None:
            done.append(self._wait_inflight(deadline))
        self.watcher.scan(relist_every=0)
        common = self.watcher.common_steps()
        if common and common[0] > self.scheduler.floor():
            done.append(self._persist_newest(common[0], deadline))
        alive = [proc.rank for proc in self.watcher.ranks.values() if proc.alive()]
        # The job did not end, it was torn down: a rank whose run failed was told that the agent keeps this node's
        # memory for a restart (its close() logs so), and one that still ran when the signal came did not finish.
        # DeepSpeed's launcher SIGTERMs a failed job's whole process tree, the agent with it: once the ranks were
        # gone this agent let go of memory that a ZeRO-2 restart then read from disk (CI, 2026-12-06).
        torn_down = sorted(proc.rank for proc in self.watcher.ranks.values() if proc.rank not in alive and (
            proc.failed or (proc.rank in self.running_at_signal and not proc.said_bye)))
        newest_now = self.watcher.common_steps()
        persisted = self.scheduler.persisted
        on_disk = not newest_now or (persisted is not None and newest_now[0] <= persisted)
        # After a tree kill a detached agent takes the slots over (below), and `easyckpt clean` refuses while it runs.
        clean = "" if self.tree_kill else f"`easyckpt clean --job-id {self.settings.job_id}` removes them"
        if alive:
            done.append(f"slots kept: rank(s) {alive} still run")
        elif torn_down:
            newer = "" if on_disk else f" (step {newest_now[0]} is newer than disk: {persisted})"
            done.append(f"slots kept in {self.settings.shm_dir} for a restart{newer}: rank(s) {torn_down} failed or "
                        f"still ran when {name} came" + (f"; {clean}" if clean else ""))
        elif on_disk:
            self.unlink_slots()
            self.ended_cleanly = True
            done.append("slots unlinked (everything in them is on disk)")
        else:
            done.append(f"slots kept in {self.settings.shm_dir}: step {newest_now[0]} is newer than disk "
                        f"({persisted}); resume from them by restarting the job" + (f", or {clean}" if clean else ""))
        if self.tree_kill and not self.ended_cleanly and list_slots(self.settings.shm_dir, self.settings.job_id):
            # Nothing else would ever free this memory without a rerun: the launcher ends the agent with its ranks,
            # where torchrun leaves it to wait idle_timeout (it lives in a session of its own). No slot yet (a rank
            # refused its launch): no successor, which would wait idle_timeout for nothing.
            self.hand_over = True
            done.append(f"the rank that started this agent is being terminated with it (a process-tree kill): a "
                        f"detached agent takes the slots over; it serves the restart, or leaves after "
                        f"{self.settings.idle_timeout:g} s (agent_idle_timeout) without one, unlinking what disk holds")
        # A warning only when something is left undone (memory newer than disk, a persist abandoned or failed).
        kept_for_restart = bool(alive or torn_down) and on_disk and not self.given_up_on_stop
        level = logging.INFO if self.ended_cleanly or kept_for_restart else logging.WARNING
        logger.log(level, "agent stopped by %s (shutdown_timeout=%gs, %.1fs used): %s; exiting with 0", name, timeout,
                   timeout - max(0.0, deadline - time.monotonic()), "; ".join(done))

    def _persist_newest(self, newest: int, deadline: float) -> str:
        """Persist ``newest`` (every local rank holds it, disk lacks it) before ``deadline``; says what happened."""
        scheduler = self.scheduler
        if self.cluster.peers is not None:
            return f"step {newest} not persisted (a multi-node iteration needs every node's files)"
        if time.monotonic() >= deadline:
            return f"no time left to persist step {newest} (shutdown_timeout={self.settings.shutdown_timeout:g}s)"
        scheduler.claims.release(lambda s: s != newest)
        if scheduler.claim_newest(newest):
            self.watcher.scan(relist_every=0)   # the claimed slots' metadata for the persister
            scheduler.start_ready()
        if scheduler.inflight is not None:
            return self._wait_inflight(deadline)
        return f"step {newest} could not be claimed (a rank was rewriting its slot) or its metadata was unreadable"

    def _wait_inflight(self, deadline: float) -> str:
        """Wait for the persist in flight until ``deadline``, then abandon it; says which happened."""
        scheduler = self.scheduler
        assert scheduler.inflight is not None
        step, future = scheduler.inflight
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return self._abandon_inflight(step, future)
        except Exception as exc:  # noqa: BLE001 -- a persist fails in many ways; logged by abandon_inflight
            scheduler.abandon_inflight(step, exc)
            self.given_up_on_stop = True
            return f"the persist of step {step} failed ({exc})"
        scheduler.finish_inflight()
        return f"finished the persist of step {step}"

    def _abandon_inflight(self, step: int, future: concurrent.futures.Future[Any]) -> str:
        """shutdown_timeout ran out: tell the writers to stop and wait (bounded) until they did."""
        scheduler = self.scheduler
        persister.ABORT.set()
        try:   # the writers stop at their next write (at most one 4 MiB piece, or one fsync, away)
            future.result(timeout=ABORT_TIMEOUT)
        except concurrent.futures.TimeoutError:
            scheduler.inflight = None
            self.given_up_on_stop = True
            self.hung_writer = True
            return (f"the persist of step {step} did not stop within {ABORT_TIMEOUT:g}s of being abandoned "
                    f"(abort timeout; a write or fsync hangs): its temporary directory may be left in "
                    f"{self.settings.save_dir} and is removed by the next agent")
        except persister.PersistAborted as exc:
            exc.__traceback__ = None   # its frames hold the writers' locals: nothing may pin the slots' maps
        except Exception as exc:  # noqa: BLE001 -- a persist fails in many ways; logged by abandon_inflight
            scheduler.abandon_inflight(step, exc)
            self.given_up_on_stop = True
            return f"the persist of step {step} failed ({exc})"
        else:   # it was past its last write when told to stop
            scheduler.finish_inflight()
            return f"finished the persist of step {step} (past shutdown_timeout: it was too far along to stop)"
        scheduler.abandon_inflight(step)
        self.given_up_on_stop = True
        persisted = scheduler.persisted
        return (f"the persist of step {step} was abandoned when shutdown_timeout ran out: its temporary "
                f"directory was removed, newest on disk: {'nothing' if persisted is None else 'step ' + str(persisted)}")

    # exit without a signal ---------------------------------------------------------------------------------
    def should_exit(self) -> bool:
        """Whether the loop ends now: every local rank finished, or none has been alive for idle_timeout."""
        if self.scheduler.busy():
            return False
        if not self.watcher.all_said_bye() and self.watcher.any_alive():
            # Before the stages are looked at: the leader would list its store every round of a running job.
            self.no_rank_since = None
            self.cluster.ranks_alive()
            return False
        if self.cluster.awaiting_stages():
            return False
        if self.watcher.all_said_bye():
            return self._all_finished()
        now = time.monotonic()
        if self.no_rank_since is None:
            self.no_rank_since = now
            self._say_kept_for_a_restart()
        idle_timeout = self.settings.idle_timeout
        empty = self._nothing_kept()
        if empty:
            idle_timeout = min(idle_timeout, EMPTY_IDLE)
        if now - self.no_rank_since < idle_timeout:
            return False
        if empty:
            logger.info("no rank alive for %.0fs and nothing of the job in memory: exiting", idle_timeout)
            self.unlink_slots()
            self.ended_cleanly = True
            return True
        newest = self.watcher.common_steps()
        persisted = self.scheduler.persisted
        if not newest or (persisted is not None and newest[0] <= persisted):
            logger.info("no rank alive for %.0fs and the newest snapshot is on disk: exiting", idle_timeout)
            self.unlink_slots()
            self.ended_cleanly = True
        else:
            logger.warning("no rank alive for %.0fs; step %d is only in memory, its slots are kept in %s",
                           idle_timeout, newest[0], self.settings.shm_dir)
        return True

    def _only_in_memory(self) -> tuple[PersistFailure, int] | None:
        """(the persist failure, the newest step in memory) while persisting fails and that step is on no disk:
        this node's persist failed, or (across nodes) another node's persist of a step the job has not committed,
        which this node's files alone do not make a checkpoint of."""
        scheduler, in_memory = self.scheduler, newest_in_memory(self.watcher)
        if in_memory is None:
            return None
        if scheduler.failure is not None and in_memory > scheduler.durable():
            return scheduler.failure, in_memory
        job = scheduler.job_failure
        if job is not None and in_memory >= job.step:
            return PersistFailure(**job.report(time.time())), in_memory
        return None

    def _say_kept_for_a_restart(self) -> None:
        """The ranks died while persisting fails: said once as the wait starts (not idle_timeout later), so that
        whoever looks finds why the agent and its memory outlive the job."""
        kept = self._only_in_memory()
        if kept is None:
            return
        (failure, in_memory), settings = kept, self.settings
        logger.warning("no rank alive, and persisting fails (%s): step %d is only in memory, so the job's slots are "
                       "kept in %s (easyckpt-%s-*) for a restart to resume from, for %.0f s (agent_idle_timeout)",
                       failure.describe(), in_memory, settings.shm_dir, settings.job_id, settings.idle_timeout)

    def _nothing_kept(self) -> bool:
        """Ranks came and went (an agent started ahead of its ranks waits for them as long as ever), none holds
        a committed step, and this agent holds no backup of another node's ranks (one node, or a job whose
        memory is empty everywhere: a multi-node job whose load refused its only iteration waited idle_timeout on
        every node)."""
        if not self.watcher.ranks or newest_in_memory(self.watcher) is not None:
            return False
        peers, holdings = self.cluster.peers, self.cluster.holdings
        if peers is None or len(peers.nodes) <= 1:
            return True
        with holdings.lock:
            return not holdings.backups

    def _all_finished(self) -> bool:
        kept = self._only_in_memory()
        if kept is not None:
            # The ranks' close() was told (PersistError); what only memory holds stays there.
            (failure, in_memory), settings = kept, self.settings
            logger.warning("every local rank finished, but persisting failed (%s): step %d is only in memory, so "
                           "the job's slots are kept in %s (easyckpt-%s-*). Fix the disk and run the job again to "
                           "resume from them; `easyckpt status %s` shows them and how to remove them",
                           failure.describe(), in_memory, settings.shm_dir, settings.job_id, settings.save_dir)
            self.protection.release()
            return True
        logger.info("every local rank finished cleanly: exiting")
        self.unlink_slots()
        self.ended_cleanly = True
        return True

    def unlink_slots(self) -> None:
        """The job's memory is no longer needed: let go of it, remove its slots and the control block."""
        self.protection.release()
        self.watcher.close()
        for path in list_slots(self.settings.shm_dir, self.settings.job_id).values():
            path.unlink(missing_ok=True)
            logger.info("unlinked %s", path)
        self.protection.control.close(unlink=True)


def is_tree_killing_launcher(cmdline: list[str]) -> bool:
    """Whether a process with this command line is a launcher of :data:`TREE_KILLING_LAUNCHERS` (``python -u -m
    deepspeed.launcher.launch --world_info=... script.py``, which DeepSpeed's ``deepspeed`` command runs per node)."""
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "-m" and cmdline[i + 1] in TREE_KILLING_LAUNCHERS:
            return True
    return False


def is_tree_kill(*, launcher_kills_trees: bool, started_by: int | None, parent: int, running: list[int]) -> bool:
    """Whether a SIGTERM/SIGINT is the rank's tree-killing launcher ending its process tree: the rank that started
    this agent (pid ``started_by``) is still this agent's ``parent``, or it died so lately that the loop still counted
    it running (its pid in ``running``). The launcher signals this agent and then the rank an instant later, so an
    agent that runs its handler late (niced on a busy node: the Python handler waits for the main thread) finds the
    rank dead and itself reparented; it handed nothing over then, and the memory stayed in /dev/shm (a run of the
    tests two at a time, 2026-12-08). A rank the loop had seen die before the signal was not the launcher's doing:
    the signal is someone stopping a lingering agent."""
    if not launcher_kills_trees or started_by is None:
        return False
    return parent == started_by or started_by in running


def launcher_kills_trees(rank_pid: int | None) -> bool:
    """Whether the rank ``rank_pid`` (the one that started this agent) was started by a tree-killing launcher."""
    if rank_pid is None:
        return False
    try:
        parent = psutil.Process(rank_pid).parent()
        return parent is not None and is_tree_killing_launcher(parent.cmdline())
    except psutil.Error:   # the rank is gone already, or its parent
        return False


def successor_command(argv: list[str]) -> list[str]:
    """The command line of the agent that takes over from one started with ``argv`` (its own arguments): the same,
    without ``--started-by``, so that no tree kill of that agent hands over again."""
    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--started-by":
            skip = True
        elif not arg.startswith("--started-by="):
            rest.append(arg)
    return [sys.executable, "-m", "easyckpt_agent", *rest]


def start_successor(argv: list[str]) -> int:
    """Start the agent that takes the job's memory over after a process-tree kill (:attr:`Lifecycle.hand_over`),
    once this one let go of the job's lock; returns its pid. Not waited for: it is in a session of its own and
    outside the tree being killed (a launcher lists the tree before it signals it), and it outlives this process.
    Its output goes where this agent's goes (the job's agent.log)."""
    env = {name: value for name, value in os.environ.items() if name != faults.ENV}   # a test's fault fired here
    proc = subprocess.Popen(successor_command(argv), stdin=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True, env=env, cwd="/")
    logger.info("agent pid %d takes over the job's memory", proc.pid)
    return proc.pid
