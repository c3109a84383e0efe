"""The public API: ``Checkpointer(save_dir, save_mem_interval, save_storage_interval, max_ckpt_num)``.

It ties the boxes together for one rank: its slots, the stager that fills them, the client of the
node agent that persists them, and recovery. It works in a single process without torch.distributed
and under torchrun (rank and world from the process group, else from torchrun's environment).
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
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist

from easyckpt.agent_client import AgentClient
from easyckpt.config import CheckpointerConfig
from easyckpt.recovery import LoadResult, load
from easyckpt.replica import PeerSet, introduce
from easyckpt.slots import RankSlots
from easyckpt.stager import Stager

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlushResult:
    """What ``Checkpointer.flush()`` achieved."""

    step: int | None          # the snapshot asked for (None: this process took none)
    durable: bool             # this node's files of ``step`` (or of a newer step) are fsynced in save_dir
    committed: bool           # ... and the iteration is complete (multi-node: every node's files are)
    persisted: int | None     # the newest step this node's agent has persisted
    seconds: float
    error: str | None = None  # why not durable


def _release(stager: Stager, agent: AgentClient, slots: RankSlots) -> None:
    """A Checkpointer collected without close(): finish the copy in flight and drop sockets and maps
    without a word to the agent (a later Checkpointer of this process may go on with the same rank)."""
    try:
        stager.close()
    finally:
        agent.detach()
        slots.close()


def _goodbye_at_exit(ref: "weakref.ReferenceType[Checkpointer]") -> None:
    ckpt = ref()
    # An uncaught exception (sys.last_value is set before atexit runs) is a failure, not the end of the
    # run: no goodbye, so the agent sees a dead rank and keeps its memory (flush on failure).
    if ckpt is not None and getattr(sys, "last_value", None) is None:
        try:
            ckpt._exit_without_close()
        except Exception:   # at exit nothing is left to handle it: say what happened and go on exiting
            logger.exception("easyckpt: saying goodbye at exit failed")


def _topology() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


class Checkpointer:
    """Snapshots a rank's training state to shared memory; a node agent persists it to ``save_dir``."""

    def __init__(self, save_dir: str | os.PathLike[str], save_mem_interval: int, save_storage_interval: int,
                 max_ckpt_num: int, log_file_path: str | None = None, **options: Any) -> None:
        self.config = CheckpointerConfig(save_dir=Path(save_dir), save_mem_interval=save_mem_interval,
                                         save_storage_interval=save_storage_interval, max_ckpt_num=max_ckpt_num,
                                         log_file_path=log_file_path, **options)
        self.rank, self.world_size, self.local_rank, self.local_world_size = _topology()
        if self.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            logger.warning("rank %d of %d: torch.distributed is not initialised, so load() cannot make the ranks "
                           "agree on one step; call init_process_group() before creating the Checkpointer",
                           self.rank, self.world_size)
        config = self.config
        assert config.shm_dir is not None and config.job_id is not None
        self.slots = RankSlots(config.shm_dir, config.job_id, self.rank, self.world_size, self.local_world_size,
                               config.slots)
        self.agent = AgentClient(
            job_id=config.job_id, save_dir=config.save_dir, shm_dir=config.shm_dir, rank=self.rank,
            world_size=self.world_size, local_world_size=self.local_world_size, idle_timeout=config.agent_idle_timeout,
            spawn=config.start_agent,
            hello={"save_storage_interval": config.save_storage_interval, "max_ckpt_num": config.max_ckpt_num,
                   "log_file_path": config.log_file_path, "pid_start": psutil.Process().create_time()})
        self.agent.ensure(force=True)
        if config.start_agent:
            self.agent.wait_ready(config.agent_start_timeout)
        self.peers: PeerSet | None = None
        if self.world_size > self.local_world_size and dist.is_available() and dist.is_initialized():
            # A job across nodes: agents must know each other before any rank may need a replica.
            self.peers = introduce(self.agent, rank=self.rank, world_size=self.world_size,
                                   replicate_unique=config.replicate_unique, timeout=config.agent_start_timeout)
        self.stager = Stager(config, self.slots, rank=self.rank, world_size=self.world_size,
                             local_rank=self.local_rank, local_world_size=self.local_world_size,
                             request_persist=functools.partial(self.agent.flush, wait=False, timeout=0),
                             committed=self.agent.waker.wake)
        self._closed = False
        # Nothing the finalizer holds refers back to self, so a dropped Checkpointer is collected, and its
        # sockets and maps are released without blocking; at interpreter exit an unclosed one says goodbye.
        self._finalizer = weakref.finalize(self, _release, self.stager, self.agent, self.slots)
        atexit.register(_goodbye_at_exit, weakref.ref(self))
        logger.info("easyckpt rank %d/%d: job %s, save_dir %s, shm %s, snapshot every %d, persist every %d, keep %d",
                    self.rank, self.world_size, config.job_id, config.save_dir, config.shm_dir,
                    config.save_mem_interval, config.save_storage_interval, config.max_ckpt_num)

    def load(self, state_dict: Any = None, *, load_dir: str | os.PathLike[str] | None = None) -> LoadResult:
        """Resume: the newest step every rank can get: from this node's memory, else (multi-node) from
        replicas on other nodes, else from disk.

        With ``state_dict``, its tensors of matching names are filled in place (on their devices) and
        appear in ``result.state``; a shape or dtype mismatch raises StateMismatchError and changes
        nothing. ``load_dir`` names one ``iteration_N`` directory to load instead.
        """
        self.stager.wait()
        result = load(slots=self.slots, save_dir=self.config.save_dir, rank=self.rank, world_size=self.world_size,
                      template=state_dict, load_dir=Path(load_dir).resolve() if load_dir is not None else None,
                      timeout=self.config.load_timeout, peers=self.peers, peer_timeout=self.config.peer_timeout)
        if result.step is not None:
            self._start_timeline(result.step)
        return result

    def _start_timeline(self, step: int) -> None:
        """A resume from ``step`` starts a new timeline (invariant 10): the agent moves newer iterations of
        save_dir aside and persists this run's steps again, whatever numbers the abandoned run reached."""
        stale = [[index, generation] for index, generation in sorted(self.slots.abandoned.items())]
        reply = self.agent.resume(step, stale, timeout=self.config.agent_start_timeout)
        if reply is not None and not reply.get("ok"):
            logger.warning("rank %d: the agent could not record the resume at step %d: %s", self.rank, step,
                           reply.get("error"))
        elif reply is not None and reply.get("moved"):
            logger.info("rank %d: resumed at step %d; iterations %s of the abandoned timeline were moved aside",
                        self.rank, step, reply["moved"])
        self.slots.retry_abandoned()

    def save_if_needed(self, step: int, state_dict: Any) -> bool:
        """Snapshot when ``step % save_mem_interval == 0``; returns at once (True if a copy started)."""
        if self._closed:
            raise RuntimeError(f"save_if_needed(step={step}) after close(): create a new Checkpointer")
        self.stager.wait()
        self.agent.ensure()
        if step % self.config.save_mem_interval:
            return False
        return self.stager.snapshot(step, state_dict)

    def save(self, step: int, state_dict: Any, *, persist: bool = False) -> bool:
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
        self.stager.wait()
        self.agent.ensure()
        return self.stager.snapshot(step, state_dict, persist=persist)

    def flush(self, *, timeout: float | None = None) -> FlushResult:
        """Make the newest snapshot durable now: finish its copy, ask the agent to persist it, and wait
        (at most ``timeout``, default ``flush_timeout``) until its files are fsynced. For a process that is
        about to end (SIGTERM, a fatal error); the training loop itself never needs it."""
        timeout = self.config.flush_timeout if timeout is None else timeout
        started = time.monotonic()
        self.stager.wait()
        step = self.stager.last_commit_step
        if step is None:
            return FlushResult(step=None, durable=False, committed=False, persisted=None, seconds=0.0,
                               error="this process has taken no snapshot")
        reply = self.agent.flush(step, wait=True, timeout=max(0.0, timeout - (time.monotonic() - started)))
        seconds = time.monotonic() - started
        if reply is None:
            error = (f"the agent did not answer within {timeout:.0f}s (flush_timeout); it goes on persisting step "
                     f"{step} after this process ends" if self.agent.alive() else "no agent runs for this job")
            return FlushResult(step=step, durable=False, committed=False, persisted=None, seconds=seconds, error=error)
        persisted = reply.get("persisted")
        if not reply.get("ok"):
            return FlushResult(step=step, durable=False, committed=False, persisted=persisted, seconds=seconds,
                               error=str(reply.get("error")))
        return FlushResult(step=step, durable=True, committed=bool(reply.get("committed")), persisted=persisted,
                           seconds=seconds)

    def wait(self) -> None:
        """Block until the last snapshot's copy is in shared memory.

        The copy is awaited automatically before any torch optimizer's next step; call this yourself
        if you change the saved tensors in place some other way before the next save_if_needed.
        """
        self.stager.wait()

    def stats(self) -> dict[str, Any]:
        return self.stager.stats()

    def close(self) -> None:
        """Finish the last copy, wait (bounded) for the agent to persist what is due, then detach."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self.stager.close()
        reply = self.agent.close(wait=True, timeout=self.config.close_timeout)
        self.slots.close()
        logger.info("easyckpt rank %d closed: %d snapshots, %d skipped, newest on disk: %s", self.rank,
                    self.stager.committed, self.stager.skipped, reply.get("persisted") if reply else "unknown")

    def _exit_without_close(self) -> None:
        """The interpreter exits and close() was never called (the Megatron API has none): say goodbye
        without waiting, so the agent persists what is due and exits at once instead of after
        agent_idle_timeout."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self.stager.close()
        self.agent.close(wait=False, timeout=5.0)
        self.slots.close()
        logger.info("easyckpt rank %d: process exit without close(): said goodbye to the agent", self.rank)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
