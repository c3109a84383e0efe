"""The public API: ``Checkpointer(save_dir, save_mem_interval, save_storage_interval, max_ckpt_num)``.

It ties the boxes together for one rank: its slots, the stager that fills them, the client of the
node agent that persists them, and recovery. It works in a single process without torch.distributed
and under torchrun or another launcher (rank and world from the process group, else from the environment; the
ranks of this node from the launcher's variables or the process group: ``easyckpt.node.topology``).
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
import time
import weakref
from collections.abc import Collection, Mapping
from typing import Any

import torch.distributed as dist

from easyckpt.config import PERSIST_ON_REQUEST, CheckpointerConfig, check_step
from easyckpt.logs import apply_env_level, notice
from easyckpt.node import topology
from easyckpt.node.client import AgentClient, check_running_agent
from easyckpt.node.lag_gate import LagGate
from easyckpt.node.persist_watch import PersistError, PersistWatch
from easyckpt.node.replicas import introduce
from easyckpt.recovery import LoadResult, load, run_before
from easyckpt.recovery.template import left_plain
from easyckpt.recovery.worlds import release_old_world
from easyckpt.snapshot.slots import RankSlots
from easyckpt.snapshot.stager import Stager, settle_torch_thread_pool
from easyckpt_wire import owner, procs, protocol
from easyckpt_wire.episode import Episode
from easyckpt_wire.health import RankHealth, rank_verdict
from easyckpt_wire.records import FlushReply, PeerTable
from easyckpt_wire.storage import location

logger = logging.getLogger(__name__)
# How often the end of a multi-node run asks whether the leader committed its final step (a few ms of the agent's
# time each): it commits a fraction of a second after the last node's files are durable.
COMMIT_POLL = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlushResult:
    """What ``Checkpointer.flush()`` achieved."""

    step: int | None          # the snapshot asked for (None: this process took none)
    durable: bool             # this node's files of ``step`` (or of a newer step) are fsynced in save_dir
    committed: bool           # ... and the iteration is published and tracked (multi-node: every node's files are)
    persisted: int | None     # the newest step this node's agent has persisted
    seconds: float
    error: str | None = None  # why not durable
    # the agent's report when persisting failed (a full or read-only disk): step, errno, text (path and
    # error), needed and free bytes when known; None when it did not fail (or gave no details)
    failure: dict[str, Any] | None = None


def _release(stager: Stager, agent: AgentClient, slots: RankSlots) -> None:
    """A Checkpointer collected without close(): finish the copy in flight and drop sockets and maps
    without a word to the agent (a later Checkpointer of this process may go on with the same rank)."""
    try:
        stager.close()
    finally:
        agent.detach()
        slots.close()


class Checkpointer:
    """Snapshots a rank's training state to shared memory; a node agent persists it to ``save_dir``."""

    def __init__(self, save_dir: str | os.PathLike[str], save_mem_interval: int, save_storage_interval: int,
                 max_ckpt_num: int, log_file_path: str | None = None, **options: Any) -> None:
        apply_env_level()
        self.config = CheckpointerConfig(save_dir=location(save_dir, "save_dir"), save_mem_interval=save_mem_interval,
                                         save_storage_interval=save_storage_interval, max_ckpt_num=max_ckpt_num,
                                         log_file_path=log_file_path, **options)
        place = topology.current()
        self.rank, self.world_size, self.local_rank, self.local_world_size = (
            place.rank, place.world_size, place.local_rank, place.local_world_size)
        settle_torch_thread_pool()   # before this process starts threads that run torch code
        hazard = topology.restart_hazard(os.environ)
        if hazard is not None and self.local_rank == 0:
            logger.warning("easyckpt rank %d: %s", self.rank, hazard)
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            logger.warning("rank %d of %d: torch.distributed is not initialised, so load() cannot make the ranks "
                           "agree on one step; call init_process_group() before creating the Checkpointer",
                           self.rank, self.world_size)
        config = self.config
        assert config.shm_dir is not None and config.job_id is not None
        # Before this process registers anywhere (an owner claim that the agent reads would count as one more
        # rank death): a running agent of this job that watches another shm_dir is refused.
        check_running_agent(protocol.runtime_dir(config.job_id), job_id=config.job_id, shm_dir=config.shm_dir,
                            rank=self.rank)
        # Before anything touches the slots or says HELLO: a second live run on this save_dir must fail
        # here, not resume out of the first one's memory and write into it (owner.SaveDirInUseError).
        owner.claim(protocol.runtime_dir(config.job_id), config.job_id, self.rank, config.save_dir)
        self.slots = RankSlots(config.shm_dir, config.job_id, self.rank, self.world_size, self.local_world_size,
                               config.slots, persist_every=config.save_storage_interval,
                               snapshot_every=config.save_mem_interval)
        self.agent = AgentClient(
            job_id=config.job_id, save_dir=config.save_dir, shm_dir=config.shm_dir, rank=self.rank,
            world_size=self.world_size, local_world_size=self.local_world_size, idle_timeout=config.agent_idle_timeout,
            spawn=config.start_agent,
            hello={"save_storage_interval": config.save_storage_interval, "max_ckpt_num": config.max_ckpt_num,
                   "log_file_path": config.log_file_path, "pid_start": procs.start_time()})
        self.agent.ensure(force=True)
        if config.start_agent:
            self.agent.wait_ready(config.agent_start_timeout)
        self.peers: PeerTable | None = None
        if self.world_size > self.local_world_size and dist.is_available() and dist.is_initialized():
            # A job across nodes: agents must know each other before any rank may need a replica.
            self.peers = introduce(self.agent.request, rank=self.rank, world_size=self.world_size,
                                   replicate_unique=config.replicate_unique, timeout=config.agent_start_timeout)
        self.stager = Stager(config, self.slots, rank=self.rank, world_size=self.world_size,
                             local_rank=self.local_rank, local_world_size=self.local_world_size,
                             request_persist=functools.partial(self.agent.flush, wait=False, timeout=0),
                             committed=self.agent.waker.wake)
        self._closed = False
        self._newest_step: int | None = None   # the newest step given since the last load()
        self._started = False   # load() called or a step given: the first step of a run that never loaded is checked
        self._step_back = Episode(logger)   # steps given below it: said once, not refused (scripts that did it ran)
        self._resumed: int | None = None   # the step load() resumed from memory
        self._old_world: int | None = None  # the step load() resharded from another world's memory
        assert config.max_backup_lag is not None
        self.lag_gate = LagGate(rank=self.rank, limit=config.max_backup_lag, read=self.slots.agent_word)
        self.watch = PersistWatch(rank=self.rank, local_rank=self.local_rank, save_dir=config.save_dir)
        # Nothing the finalizer holds refers back to self, so a dropped Checkpointer is collected, and its
        # sockets and maps are released without blocking; at interpreter exit an unclosed one says goodbye.
        self._finalizer = weakref.finalize(self, _release, self.stager, self.agent, self.slots)
        atexit.register(Checkpointer._goodbye_at_exit, weakref.ref(self))
        persist = ("the steps asked for" if config.save_storage_interval >= PERSIST_ON_REQUEST
                   else f"every {config.save_storage_interval}")
        logger.info("easyckpt rank %d/%d: job %s, save_dir %s, shm %s, snapshot every %d, persist %s, keep %d",
                    self.rank, self.world_size, config.job_id, config.save_dir, config.shm_dir,
                    config.save_mem_interval, persist, config.max_ckpt_num)

    def load(self, state_dict: Any = None, *, load_dir: str | os.PathLike[str] | None = None,
             allow_unhealthy: bool = False, reshard: bool = True, announce: bool = True) -> LoadResult:
        """Resume: the newest step every rank can get: from this node's memory, else (multi-node) from
        replicas on other nodes, else from disk.

        With ``state_dict``, its tensors of matching names are filled in place (on their devices) and
        appear in ``result.state``; a shape or dtype mismatch raises StateMismatchError and changes
        nothing. ``load_dir`` names one ``iteration_N`` directory to load instead, whatever its health.

        Health: a step whose snapshot some rank judged unhealthy (``save_if_needed(metrics=)``) is passed
        over for the newest healthy one, in every tier; when nothing healthy is left LoadError says so
        (``allow_unhealthy=True`` loads the newest anyway).

        Sharded state (DTensors) saved by another world size is resharded through ``torch.distributed.checkpoint``'s
        planning: from the saved world's memory when every one of its ranks' snapshots is still reachable (this
        node's slots, agents' replicas: ``easyckpt.recovery.reshard``), else from disk (``easyckpt.dcp``); state
        split otherwise on as many ranks is read from disk. ``reshard=False`` refuses both with
        ``LayoutChangedError`` (a StateMismatchError).

        A resume is announced in one line by each node's first rank, ``easyckpt: resumed at step S from
        memory (size, seconds)``: a log record at INFO (``easyckpt.checkpointer``), or on stderr when no
        logging is configured (``easyckpt.logs.notice``). ``announce=False`` leaves it to the caller
        (``TrainerWrapper`` says it in the Trainer's log).
        """
        self.stager.wait()
        result = load(slots=self.slots, save_dir=self.config.save_dir, rank=self.rank, world_size=self.world_size,
                      template=state_dict, load_dir=location(load_dir, "load_dir") if load_dir is not None else None,
                      timeout=self.config.load_timeout, peers=self.peers, peer_timeout=self.config.peer_timeout,
                      allow_unhealthy=allow_unhealthy, reshard=reshard,
                      checksums=functools.partial(self.agent.checksums, timeout=self.config.peer_timeout))
        # In this rank's slot (memory, or pulled from a replica): a process that ends without a snapshot of its
        # own must still make it durable. A step read from disk is durable already; one resharded from another
        # world's memory is in no slot of this world, so this world's agent has nothing of it to persist.
        own = result.step in self.slots.committed()
        self._resumed = result.step if result.source in ("memory", "replica") and own else None
        # Resharded from another world's slots: those of its ranks past this world have no successor to reuse
        # them; they are released once this world has a safe step of its own (recovery.worlds.release_old_world).
        self._old_world = result.step if result.source in ("memory", "replica") and not own else None
        if result.step is not None and announce and self.local_rank == 0:
            notice(logger, logging.INFO, "resumed at %s", result.describe())
            plain = left_plain(state_dict, result.state) if state_dict is not None else []
            if plain:
                logger.warning(
                    "easyckpt rank %d: the state passed to load() holds DTensors, but %d tensors of step %d have no "
                    "place in it (%s): they come back as this rank's local shards, plain tensors, and an optimizer "
                    "given them fails at its next step ('got mixed torch.Tensor and DTensor'). An optimizer has no "
                    "state before its first step: create it before load() (init_optimizer_state in "
                    "examples/fsdp2_train.py), or build the state with torch.distributed.checkpoint.state_dict's "
                    "get_optimizer_state_dict", self.rank, len(plain), result.step, ", ".join(plain[:3])
                    + (", ..." if len(plain) > 3 else ""))
        if result.source in ("memory", "replica") and load_dir is None and self.local_rank == 0:
            word = self.slots.agent_word()
            run_before.check_save_dir_kept(self.config.save_dir, None if word is None else word.persisted,
                                           rank=self.rank, step=result.step)
        self._start_timeline(result.step, "load()")
        return result

    def resumed_at(self, step: int) -> None:
        """Training resumed at ``step`` from a state easyckpt did not load (a Trainer's ``checkpoint-N``, a Lightning
        ``.ckpt`` file): a new timeline begins there, as after ``load()``. This rank's snapshots of ``step`` and after
        are dropped (the file's state need not be theirs) and the agent sets newer iterations aside, so that this
        run's steps are persisted again and no resume takes the abandoned run's state. Every rank calls it alike."""
        value = check_step(step, rank=self.rank)
        self.stager.wait()
        self.slots.invalidate_newer_than(value - 1)
        self._resumed = None
        self._start_timeline(value, "resumed_at()")

    def _release_old_world(self) -> None:
        """Once the agent declares a step of this world safe past the one resharded from another world's memory,
        that world's slots of ranks this world lacks are dead weight in shared memory: this node's first local
        rank unlinks them (those still locked are left to the agent's cleanup at the end of the job)."""
        word = self.slots.agent_word()
        if word is None or word.safe is None or self._old_world is None or word.safe <= self._old_world:
            return
        self._old_world = None
        if self.local_rank != 0:
            return
        config = self.config
        assert config.shm_dir is not None and config.job_id is not None
        removed = release_old_world(config.shm_dir, config.job_id, self.world_size)
        if removed:
            logger.info("rank %d: step %d is safe in this world: released %d slots of the saved world's ranks >= %d "
                        "(%s)", self.rank, word.safe, len(removed), self.world_size, ", ".join(p.name for p in removed))

    def _start_timeline(self, step: int | None, how: str) -> None:
        """A resume from ``step`` starts a new timeline (invariant 10): the agent moves newer iterations of
        save_dir aside and persists this run's steps again, whatever numbers the abandoned run reached."""
        self._newest_step, self._started = step, True
        self._step_back.end("easyckpt rank %d: %s at step %s; the steps start from there", self.rank, how, step)
        if step is None:
            return
        self.lag_gate.resume_at(step)
        # This process's snapshots before the resume belong to the abandoned timeline (or are the resumed step
        # itself): the end of the run must not wait for one of them to become durable.
        self.stager.last_commit_step = None
        stale = [[index, generation] for index, generation in sorted(self.slots.abandoned.items())]
        reply = self.agent.resume(step, stale, timeout=self.config.agent_start_timeout)
        if reply is not None and reply.error is not None:
            logger.warning("rank %d: the agent could not record the resume at step %d: %s", self.rank, step,
                           reply.error)
        elif reply is not None and reply.moved:
            logger.info("rank %d: resumed at step %d; iterations %s of the abandoned timeline were moved aside",
                        self.rank, step, reply.moved)
        self.slots.retry_abandoned()

    def _step(self, step: int) -> int:
        value, newest = check_step(step, rank=self.rank), self._newest_step
        if not self._started:
            self._started = True
            if self.rank == 0:
                run_before.check_unloaded_start(self.config.save_dir, self.slots.committed(), value)
        if newest is not None and value < newest:
            self._step_back.hit(
                "easyckpt rank %d: step %d after step %d: the steps of a run should only grow. A resume takes the "
                "newest step every rank holds, so until the steps pass %d again it may take a snapshot of an older "
                "state that has a higher step. Pass the global step (a batch index that starts again at 0 every "
                "epoch is not one); to train again from an earlier step, load() it first",
                self.rank, value, newest, newest)
            return value
        if newest is not None:
            self._step_back.end("easyckpt rank %d: steps pass step %d again at %d", self.rank, newest, value)
        self._newest_step = value
        return value

    def due(self, step: int) -> bool:
        """Whether ``save_if_needed(step, ...)`` takes a snapshot: ``step % save_mem_interval == 0``. For a loop
        or an integration that builds (or measures) the state only for the steps that are snapshotted."""
        return step % self.config.save_mem_interval == 0

    def note_step(self, step: int) -> None:
        """The loop reached ``step`` and takes no snapshot of it: what ``save_if_needed`` does on a step that is
        not ``due`` (finish the last copy, keep the agent running and watched, release what a resume left), for
        a loop that does not build its state on such steps."""
        if self._closed:
            raise RuntimeError(f"note_step(step={step}) after close(): create a new Checkpointer")
        self._reached(self._step(step))

    def _reached(self, step: int) -> None:
        self.stager.wait()
        self.agent.ensure()
        self.watch.observe(self.slots.agent_word())
        self.stager.note_step(step)
        if self._old_world is not None:
            self._release_old_world()

    def save_if_needed(self, step: int, state_dict: Any, *, metrics: Mapping[str, float] | None = None) -> bool:
        """Snapshot when ``step % save_mem_interval == 0`` (``due(step)``); returns at once (True if a copy
        started).

        ``metrics`` (say ``{"embedding_local_norm": ..., "loss": ...}``, plain numbers) give this rank's
        health verdict on the snapshot against ``health_thresholds``; without them the rank is neutral."""
        if self._closed:
            raise RuntimeError(f"save_if_needed(step={step}) after close(): create a new Checkpointer")
        step = self._step(step)
        self._reached(step)
        if not self.due(step) or self.stager.taken_already(step):
            return False
        self.lag_gate.before_snapshot(step)
        self.slots.scale_due_wait(self.lag_gate.step_seconds)
        return self.stager.snapshot(step, state_dict, health=self._verdict(metrics))

    def save(self, step: int, state_dict: Any, *, persist: bool = False,
             metrics: Mapping[str, float] | None = None) -> bool:
        """Snapshot now, whatever ``save_mem_interval`` says; returns at once (True if the copy started,
        False if it was skipped: no free slot, the agent still reads both).

        With ``persist=True`` the node agent is also asked to persist this step as soon as every local rank
        holds it, whatever ``save_storage_interval`` says: the request goes out once the copy is committed
        (at the next optimizer step, ``save_if_needed``, ``save``, ``wait()``, ``flush()`` or ``close()``)
        and nothing waits for the disk (``flush()`` does). In a multi-node job every rank must ask, or the
        iteration is never complete.
        """
        if self._closed:
            raise RuntimeError(f"save(step={step}) after close(): create a new Checkpointer")
        step = self._step(step)
        self.stager.wait()
        self.agent.ensure()
        self.watch.observe(self.slots.agent_word())
        return self.stager.snapshot(step, state_dict, persist=persist, health=self._verdict(metrics))

    def _verdict(self, metrics: Mapping[str, float] | None) -> RankHealth:
        assert self.config.health_thresholds is not None
        return rank_verdict(metrics, self.config.health_thresholds)

    def flush(self, *, timeout: float | None = None) -> FlushResult:
        """Make the newest snapshot durable now: finish its copy, ask the agent to persist it, and wait
        (at most ``timeout``, default ``flush_timeout``) until its files are fsynced. For a process that is
        about to end (SIGTERM, a fatal error); the training loop itself never needs it.

        When the agent cannot persist it (a full or read-only disk), ``durable`` is False and ``error`` and
        ``failure`` say why; a failed step is tried again by every flush(), in case the disk was fixed."""
        timeout = self.config.flush_timeout if timeout is None else timeout
        started = time.monotonic()
        self.stager.take_owed(timeout / 2)   # the newest state, if its snapshot was skipped and it did not move
        self.stager.wait()
        step = self._newest_own_step()
        if step is None:
            return FlushResult(step=None, durable=False, committed=False, persisted=None, seconds=0.0,
                               error="this process has taken no snapshot and resumed from none in its memory")
        return self._flush_step(step, timeout, started)

    def _newest_own_step(self) -> int | None:
        """The newest step in this rank's slots: its last snapshot, else the step ``load()`` resumed from memory
        or replicas (a flush or the end of a run right after a resume, before the next snapshot)."""
        step = self.stager.last_commit_step
        return self._resumed if step is None else step

    def _flush_step(self, step: int, timeout: float, started: float, what: str = "flush_timeout") -> FlushResult:
        reply = self.agent.flush(step, wait=True, timeout=max(0.0, timeout - (time.monotonic() - started)))
        seconds = time.monotonic() - started
        self.watch.observe(self.slots.agent_word())
        if reply is None:
            error = (f"the agent did not answer within {timeout:.0f}s ({what}); it goes on persisting step "
                     f"{step} after this process ends" if self.agent.alive() else "no agent runs for this job")
            return FlushResult(step=step, durable=False, committed=False, persisted=None, seconds=seconds, error=error)
        if reply.error is not None:
            return FlushResult(step=step, durable=False, committed=False, persisted=reply.persisted, seconds=seconds,
                               error=reply.error, failure=reply.failure)
        return FlushResult(step=step, durable=True, committed=reply.committed, persisted=reply.persisted,
                           seconds=seconds)

    def passed_over(self) -> frozenset[int]:
        """Due steps the node agent lately passed over (a persist was still running, or, across nodes, some node
        could not take them): they will never be persisted, so nothing should wait for them."""
        word = self.slots.agent_word()
        return word.passed if word is not None else frozenset()

    def persist_failed(self, step: int) -> bool:
        """Whether the node agent's persist of ``step``, or of a newer step, failed (a full disk, say): a failed
        persist is not retried, so ``step`` will not reach disk unless a newer step does."""
        word = self.slots.agent_word()
        return word is not None and word.failure is not None and word.failure.step >= step

    def revive_agent(self, persist: Collection[int] = ()) -> bool:
        """Replace a node agent that is gone now, for a wait on the disk that no snapshot will interrupt (the end
        of training, before ``close()``): the ranks replace a dead agent only when they next snapshot or flush.
        The new agent adopts the slots and persists the newest due step every local rank holds; ``persist``
        names the steps this rank asked the dead agent to persist (those requests died with it), asked again.
        Waits at most ``agent_start_timeout`` for the new agent to answer. True when an agent runs."""
        if self._closed:
            raise RuntimeError("revive_agent() after close(): create a new Checkpointer")
        if self.agent.alive():
            return True
        if not self.config.start_agent:
            return False
        logger.warning("rank %d: the easyckpt agent of job %s is gone; starting a new one to persist steps %s "
                       "(see %s)", self.rank, self.config.job_id, sorted(persist) or "due in memory",
                       self.agent.job_dir / "agent.log")
        self.agent.ensure(force=True)
        if not self.agent.wait_ready(self.config.agent_start_timeout):
            return False
        for step in sorted(persist):
            self.agent.flush(step, wait=False, timeout=0)
        return True

    def persist(self, step: int) -> None:
        """Ask the node agent to persist ``step``, committed in this rank's memory, as soon as every local rank
        holds it (the request ``save(step, ..., persist=True)`` sends at its commit); returns at once.

        For a step snapshotted again (a save point after the step's own snapshot): ``save`` it without
        ``persist``, ``wait()``, meet the other ranks, then ask. The agent claims each rank's copy of a
        requested step as soon as any rank asks, so a rank still writing its second copy would have its older
        one persisted."""
        if self._closed:
            raise RuntimeError(f"persist(step={step}) after close(): create a new Checkpointer")
        self.stager.request_persist(step)

    def wait(self) -> None:
        """Block until the last snapshot's copy is in shared memory.

        The copy is awaited automatically before any torch optimizer's next step; call this yourself
        if you change the saved tensors in place some other way before the next save_if_needed.
        """
        self.stager.wait()

    def stats(self) -> dict[str, Any]:
        """Snapshot counts of this rank, and the agent's word on persisting: ``persisted_step`` (the newest
        step on disk), ``persist_failure`` (the failed persist in progress: step, errno, text, needed and
        free bytes; None while persists succeed) and ``persist_failures`` (how many failed in all)."""
        if not self._closed:
            self.watch.observe(self.slots.agent_word())
        return {**self.stager.stats(), **self.watch.stats(), "backup_lag_wait_seconds": self.lag_gate.waited,
                "due_step_wait_seconds": self.slots.due_waited}

    def close(self, *, raise_errors: bool = True, failed: bool = False) -> None:
        """The end of the run: finish the last copy, make the newest snapshot durable (``final_persist``,
        bounded by ``close_timeout``), then detach.

        Raises :class:`PersistError` when the agent could not persist it (a full or read-only disk); the
        snapshot then stays in shared memory, where a rerun of the job resumes from it. A persist that is
        merely slow is not an error: past ``close_timeout`` the agent finishes it after this process ends.
        ``raise_errors=False``: that failure is logged instead (an exception is already on its way).

        ``failed=True``: the training loop failed (an exception is on its way out, as when another rank died
        inside a collective). The newest snapshot is still made durable, and close() still waits (bounded) for
        the persists in flight, but the agent is told that the run failed rather than ended: as for a process
        that dies, it keeps this node's memory, and the backups it holds of other nodes' ranks, for the
        restart, which then resumes from memory. Errors are logged, never raised.
        """
        started = self._begin_end(self.config.close_timeout)
        if started is None:
            return
        final = self._final_persist(self.config.close_timeout, started, "close_timeout")
        if self._old_world is not None:
            self._release_old_world()
        remaining = max(1.0, self.config.close_timeout - (time.monotonic() - started))
        # A goodbye from every local rank ends the job on this node: the agent removes the memory a restart
        # resumes from. A failed run still waits for the persists in flight (an exporter of the due step, such
        # as Lightning's, needs them before the launcher's SIGTERM), but says that it failed (soak seed 1130302,
        # fault 57: a rank killed on another node fails the collectives of every rank here at once).
        reply = self.agent.close(wait=True, timeout=remaining, failed=failed)
        self.watch.observe(self.slots.agent_word())
        self.slots.close()
        owner.release(self.agent.job_dir, self.rank)
        if failed:
            logger.info("easyckpt rank %d: the run failed; the agent keeps this node's snapshots for a restart "
                        "(newest: step %s, newest on disk: %s)", self.rank, self.stager.last_commit_step,
                        reply.persisted if reply else "unknown")
        else:
            logger.info("easyckpt rank %d closed: %d snapshots, %d skipped, newest on disk: %s", self.rank,
                        self.stager.committed, self.stager.skipped, reply.persisted if reply else "unknown")
        error = self._final_error(final)
        if error is not None:
            if raise_errors and not failed:
                raise error
            logger.error("%s", error)

    def _final_persist(self, timeout: float, started: float, what: str) -> FlushResult | None:
        """Make the newest snapshot durable at the end of the run (None: not wanted, or nothing to persist).
        A process that resumed from memory and took no snapshot since ends with that step (a rerun after
        close() raised PersistError, say)."""
        step = self._newest_own_step()
        if not self.config.final_persist or step is None:
            return None
        result = self._flush_step(step, timeout, started, what)
        if result.durable and not result.committed:
            if self.world_size > self.local_world_size:
                result = self._await_commit(result, timeout, started)
            else:
                # One node: the agent publishes an iteration before it counts the step as persisted, so only a
                # removal behind its back leaves the step persisted and unpublished; no wait would bring it back.
                logger.warning("easyckpt rank %d: the agent persisted step %d, but it is not the tracked, complete "
                               "iteration in %s (removed or replaced while the job ran?): the newest snapshot is "
                               "not on disk; `easyckpt ls %s` shows what is", self.rank, step,
                               self.config.save_dir, self.config.save_dir)
        if result.committed:
            logger.info("easyckpt rank %d: the final snapshot (step %d) is durable in %s", self.rank, step,
                        self.config.save_dir)
        return result

    def _await_commit(self, result: FlushResult, timeout: float, started: float) -> FlushResult:
        """Across nodes, this node's files of the final step are durable before the leader's agent publishes and
        tracks the iteration (once every node's are): the end of the run waits for that too, so that a job that
        ended names its final step in the tracker. Bounded by ``flush_timeout`` within ``timeout``: past it the
        leader's agent still commits after this process ends, and the shortfall is said."""
        assert result.step is not None
        deadline = min(started + timeout, time.monotonic() + self.config.flush_timeout)
        logger.info("easyckpt rank %d: this node's files of step %d are durable; waiting for the leader's agent to "
                    "commit the iteration (every node's files)", self.rank, result.step)
        reply: FlushReply | None = None
        while time.monotonic() < deadline:
            reply = self.agent.flush(result.step, wait=True, timeout=max(0.0, deadline - time.monotonic()))
            if reply is None or reply.error is not None or reply.committed:
                break
            time.sleep(COMMIT_POLL)   # a FLUSH of a durable step is answered at once: ask again shortly
        seconds = time.monotonic() - started
        if reply is not None and reply.error is None and reply.committed:
            logger.info("easyckpt rank %d: step %d committed by the leader's agent after %.2fs", self.rank, result.step,
                        seconds)
            return dataclasses.replace(result, committed=True, persisted=reply.persisted, seconds=seconds)
        if reply is not None and reply.error is not None:
            # Another node's persist of the step failed (the leader says so): the iteration will not be committed.
            logger.warning("easyckpt rank %d: %s", self.rank, reply.error)
            return dataclasses.replace(result, error=reply.error, failure=reply.failure, persisted=reply.persisted,
                                       seconds=seconds)
        logger.warning("easyckpt rank %d: step %d is durable on this node but not committed yet after %.1fs "
                       "(flush_timeout): the leader's agent publishes it once every node's files are durable; see "
                       "the agent.log of rank 0's node", self.rank, result.step, seconds)
        return dataclasses.replace(result, seconds=seconds)

    def _final_error(self, result: FlushResult | None) -> PersistError | None:
        """PersistError when the agent failed to persist the final snapshot (across nodes: any node's agent, so
        that the job's iteration cannot be committed); other shortfalls are logged."""
        if result is None or (result.durable and result.failure is None):
            return None
        if result.failure is None:
            # Slow (the agent goes on after we exit), no agent at all, or another rank's last snapshot is
            # older: not a disk failure, and nothing in memory is released because of it.
            # Without an agent by choice (start_agent=False, none runs: benchmarks, tests) that is expected.
            quiet = not self.config.start_agent and not self.agent.alive()
            logger.log(logging.INFO if quiet else logging.WARNING, "easyckpt rank %d: the final snapshot (step %s) "
                       "is not durable yet: %s", self.rank, result.step, result.error)
            return None
        config = self.config
        return PersistError.final(rank=self.rank, step=result.step, save_dir=config.save_dir, shm_dir=config.shm_dir,
                                  job_id=config.job_id, persisted=result.persisted, failure=result.failure)

    @property
    def closed(self) -> bool:
        """True once close() began (or the process exit said goodbye instead)."""
        return self._closed

    def _begin_end(self, timeout: float) -> float | None:
        """The first step of either end (close() or the exit without it): the monotonic time it began after
        the last copy finished, or None when the end happened already. The run's last snapshot, if it was
        skipped, is taken now (within half of ``timeout``), so that final_persist makes the end durable."""
        if self._closed:
            return None
        self._closed = True
        self._finalizer.detach()
        started = time.monotonic()
        if self.config.final_persist:
            self.stager.take_owed(timeout / 2)
        self.stager.close()
        return started

    @staticmethod
    def _goodbye_at_exit(ref: weakref.ReferenceType[Checkpointer]) -> None:
        """atexit, holding only a weak reference (a Checkpointer dropped before is collected)."""
        ckpt = ref()
        # An uncaught exception (sys.last_value is set before atexit runs) is a failure, not the end of the
        # run: no goodbye, so the agent sees a dead rank and keeps its memory (flush on failure).
        if ckpt is not None and getattr(sys, "last_value", None) is None:
            try:
                ckpt._exit_without_close()
            except Exception:   # at exit nothing is left to handle it: say what happened and go on exiting
                logger.exception("easyckpt: saying goodbye at exit failed")

    def _exit_without_close(self) -> None:
        """The interpreter exits and close() was never called (the Megatron API has none): say goodbye
        without waiting, so the agent persists what is due and exits at once instead of after
        agent_idle_timeout."""
        # The end of the run all the same (the Megatron API has no close): its newest snapshot is made durable,
        # bounded by flush_timeout as any exit path; a failure is said, there is no one left to raise it to.
        timeout = min(self.config.flush_timeout, self.config.close_timeout)
        started = self._begin_end(timeout)
        if started is None:
            return
        error = self._final_error(self._final_persist(timeout, started, "flush_timeout"))
        self.agent.close(wait=False, timeout=5.0)
        self.slots.close()
        if error is not None:
            logger.error("%s", error)
        logger.info("easyckpt rank %d: process exit without close(): said goodbye to the agent", self.rank)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        # With an exception on its way the run failed: a PersistError must not replace it (it is logged
        # instead), and the agent keeps this node's memory for the restart.
        self.close(raise_errors=kind is None, failed=kind is not None)
