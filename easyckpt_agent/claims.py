"""Persist claims, and the ranks' requests to persist a step now (FLUSH) or to wait for the last one (BYE).

A *claim* is a shared flock on one rank's slot of a step the agent is about to persist (``SlotHolds``, the
same flocks as the safe step's): a rank cannot overwrite a claimed slot, and never waits for one either. A
step is claimed on every local rank or on none (:meth:`Claims.claim_all`), except a step a rank asked for
(:class:`FlushRequests`), which is claimed rank by rank as each commits it, so that the asking rank goes on
snapshotting into its other slots. A claim or a request that some rank will never satisfy (it moved past
the step, or ended without it: ``policy.never_holds``) is dropped and, for a request, answered with why.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from easyckpt_agent import policy
from easyckpt_agent.agreement import StepFailure
from easyckpt_agent.watcher import SlotHolds, SlotInfo, Watcher
from easyckpt_wire import layout, protocol
from easyckpt_wire.records import ByeReply, FlushReply
from easyckpt_wire.storage import is_url, open_storage

logger = logging.getLogger(__name__)

Send = Callable[[bytes, bytes], None]   # (a rank's identity, an encoded reply)


@dataclasses.dataclass(slots=True)
class Claim:
    info: SlotInfo
    generation: int


def never_holds(watcher: Watcher, rank: int, step: int) -> str:
    """Why ``rank`` will never hold ``step`` committed (it moved past it, or ended without it); "" if it may."""
    proc = watcher.ranks.get(rank)
    return policy.never_holds(step, set(watcher.committed(rank)),
                              ended=proc is not None and (proc.said_bye or proc.failed or proc.dead))


class Claims:
    """step -> rank -> the slot held for its persist."""

    def __init__(self, holds: SlotHolds) -> None:
        self.holds = holds
        self.by_step: dict[int, dict[int, Claim]] = {}

    def __contains__(self, step: object) -> bool:
        return step in self.by_step

    def __bool__(self) -> bool:
        return bool(self.by_step)

    def __iter__(self) -> Iterator[int]:
        return iter(self.by_step)

    def ranks(self, step: int) -> dict[int, Claim]:
        """The claims of ``step`` by rank (empty when it is not claimed)."""
        return self.by_step.get(step, {})

    def claim(self, step: int, rank: int, info: SlotInfo) -> bool:
        held = self.by_step.setdefault(step, {})
        if rank in held:
            return True
        if not self.holds.hold_if_current(info, step, ("persist", step)):
            if not held:
                del self.by_step[step]
            return False
        assert info.header is not None
        held[rank] = Claim(info, info.header.generation)
        return True

    def claim_all(self, step: int, ranks: set[int], held: dict[int, dict[int, SlotInfo]]) -> bool:
        """Claim ``step`` on every local rank, or on none."""
        fresh = step not in self.by_step
        if all(self.claim(step, rank, held[rank][step]) for rank in sorted(ranks)):
            return True
        if fresh:
            self.drop(step)
        return False

    def release(self, which: Callable[[int], bool]) -> None:
        for step in [s for s in self.by_step if which(s)]:
            self.drop(step)

    def drop(self, step: int) -> None:
        """Release every claim of ``step``."""
        for claim in self.by_step.pop(step, {}).values():
            self.holds.release(claim.info, ("persist", step))

    def on_every(self, ranks: set[int]) -> set[int]:
        """Steps claimed on every one of ``ranks``."""
        return {step for step, by in self.by_step.items() if ranks and set(by) >= ranks}

    def drop_unreachable(self, watcher: Watcher, persisted: int | None) -> dict[int, str]:
        """Release claims of steps on disk already, or that some rank will never commit (it moved past it
        without it); returns the latter with why."""
        dropped = {}
        for step in list(self.by_step):
            if persisted is not None and step <= persisted:
                self.drop(step)
                continue
            for rank in watcher.local_ranks():
                if rank not in self.by_step[step] and (why := never_holds(watcher, rank, step)):
                    logger.warning("step %d cannot be persisted: rank %d %s", step, rank, why)
                    self.drop(step)
                    dropped[step] = f"rank {rank} {why}"
                    break
        return dropped


class FlushRequests:
    """Steps ranks asked to persist now (FLUSH: ``flush()``, ``close()``), and the ranks waiting for an answer."""

    def __init__(self) -> None:
        self.wanted: set[int] = set()                        # steps a rank asked to persist now
        self.failed: dict[int, str] = {}                     # requested step -> why it cannot be persisted
        self.waiters: list[tuple[bytes, Any, int]] = []      # (identity, request id, step) of FLUSH(wait=True)
        self.bye_waiters: list[tuple[bytes, Any]] = []       # (identity, request id) of BYE(wait=True)

    def request(self, rank: int, step: int, watcher: Watcher, claims: Claims, durable: int) -> None:
        if step in self.wanted or step <= durable:   # asked already, or on disk
            return
        # The rank asks once its copy is committed: see that copy (in a slot file perhaps created just now),
        # not an older one.
        watcher.scan(relist_every=0)
        logger.info("rank %d asks for step %d to be persisted now: persisting it once every local rank holds it",
                    rank, step)
        self.wanted.add(step)
        self.failed.pop(step, None)
        info = watcher.committed(rank).get(step)
        if info is not None:
            claims.claim(step, rank, info)   # at once: the rank goes on snapshotting into its other slots

    def claim_committed(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], claims: Claims,
                        durable: int) -> None:
        """Claim the requested steps rank by rank, as each commits them."""
        for step in self.wanted:
            if step > durable:
                for rank in ranks:
                    if step in held[rank]:
                        claims.claim(step, rank, held[rank][step])

    def give_up(self, step: int, why: str) -> None:
        """``step`` will not be persisted: a rank waiting for it hears ``why``."""
        self.wanted.discard(step)
        self.failed[step] = why

    def drop_unreachable(self, watcher: Watcher, claims: Claims, durable: int) -> None:
        """Forget requested steps that are on disk, or that some local rank will never hold."""
        for step in sorted(self.wanted):
            if step <= durable:
                self.wanted.discard(step)
                continue
            if any(never_holds(watcher, rank, step) for rank in watcher.local_ranks()):
                watcher.scan(relist_every=0)   # not on the word of a listing up to 0.25 s old
            for rank in watcher.local_ranks():
                if why := never_holds(watcher, rank, step):
                    why = f"rank {rank} {why}"
                    logger.warning("requested persist of step %d given up: %s", step, why)
                    self.give_up(step, why)
                    claims.drop(step)
                    break

    def answer(self, send: Send, *, persisted: int | None, save_dir: Path, given_up: int,
               failure: dict[str, Any] | None, job_failure: StepFailure | None = None,
               job_committed: int | None = None) -> None:
        """Answer each FLUSH waiter whose step is on disk (this node's part of it, multi-node) or given up.
        ``job_failure``: a node's failed persist of a step the job has not committed, and ``job_committed`` the
        newest iteration it has (the leader's verdict): a waiter for that step hears that it will not be committed,
        with the job's newest iteration as the step on disk (this node's newer files are in a stage that no node
        will finish)."""
        if not self.waiters:
            return
        waiting = []
        for identity, request_id, step in self.waiters:
            if persisted is not None and persisted >= step:
                # In a multi-node job ``persisted`` is this node's durable shards; the leader renames the
                # iteration into place once every node's are.
                committed = _committed(save_dir, persisted)
                if not committed and job_failure is not None and job_failure.step >= step:
                    error, report = _not_committable(job_failure)
                    send(identity, protocol.reply(False, id=request_id, **FlushReply(
                        job_committed, error=error, failure=report).to_wire()))
                    continue
                send(identity, protocol.reply(True, id=request_id, **FlushReply(persisted, committed).to_wire()))
            elif step not in self.wanted:
                error = self.failed.get(step, f"persisting step {given_up} failed (see the agent log)")
                send(identity, protocol.reply(False, id=request_id, **FlushReply(
                    persisted, error=error, failure=failure).to_wire()))
            else:
                waiting.append((identity, request_id, step))
        self.waiters = waiting
        still = {step for _, _, step in waiting} | self.wanted
        self.failed = {s: why for s, why in self.failed.items() if s in still}

    def answer_byes(self, send: Send, *, persisted: int | None, failure: dict[str, Any] | None) -> None:
        """Answer every BYE waiter (the caller knows that nothing is being persisted or claimed)."""
        for identity, request_id in self.bye_waiters:
            send(identity, protocol.reply(True, id=request_id, **ByeReply(persisted, failure).to_wire()))
        self.bye_waiters.clear()

    def abandon(self, why: str) -> None:
        """The agent exits: every request still open is answered with ``why`` (unless it failed already)."""
        for step in self.wanted:
            self.failed.setdefault(step, why)
        self.wanted.clear()


def _not_committable(failure: StepFailure) -> tuple[str, dict[str, Any]]:
    """The answer to a rank waiting for the job to commit a step that another node failed to persist: why, and the
    failure report a rank turns into ``PersistError`` (the fields of ``PersistFailure``)."""
    return (f"step {failure.step} cannot be committed: node {failure.node}'s persist of it failed ({failure.text}); "
            "this node's files of it are durable, every node's are needed"), failure.report(time.time())


def _committed(save_dir: Path, step: int) -> bool:
    """Whether ``iteration_<step>`` is published and tracked. Published: its directory on POSIX (renamed into place
    whole); its commit object on an object store, where the files are under the final prefix before it is written.
    Tracked: the tracker, written just after, names it (or a newer step), so that a rank that waits for the commit
    (the end of a multi-node run) ends only once a new job would resume from it."""
    store, key = open_storage(save_dir), layout.iteration_dirname(step)
    try:
        if not (layout.committed(store, key) if is_url(save_dir) else store.is_dir(key)):
            return False
        tracked = layout.tracker(store)
        return tracked is not None and tracked >= step
    except OSError as exc:   # the store gone since the persist (asked from the agent's loop: it must not end it)
        logger.warning("cannot tell whether %s is committed: %s; the flush is answered 'not yet'", store.where(key), exc)
        return False
