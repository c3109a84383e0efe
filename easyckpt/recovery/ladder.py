"""``load()``: the ladder over the tiers. Agree on one step for all ranks, then load it from the cheapest tier
that has it.

The tiers, cheapest first: this rank's own memory and replicas on other nodes (multi-node jobs; both in
``memory``), another world's memory (``reshard``, a job restarted on another number of ranks) and storage
(``disk``).
Every rank asks each tier what it offers, the ranks agree on the ordered candidates (``candidates``: newest
first, memory before another world's memory before replica before disk on a tie; unhealthy steps passed over),
and the ladder walks them. Each attempt is collective: if any rank fails to read (a torn slot, a corrupted file,
a replica gone) all ranks move to the next candidate together; a state that does not fit the caller's template
fails on all ranks at once with the reason (invariant 4).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from easyckpt.collectives import all_gather_ints
from easyckpt.node import replicas as replica
from easyckpt.recovery.candidates import agree
from easyckpt.recovery.disk import StorageTier
from easyckpt.recovery.memory import Checksums, OwnMemoryTier, ReplicaTier
from easyckpt.recovery.results import LayoutChangedError, LoadError, LoadResult, StateMismatchError
from easyckpt.recovery.template import Template, template_targets
from easyckpt.recovery.tier import RETRYABLE, Loaded, Offer, Tier
from easyckpt.recovery.worlds import OtherWorldTier
from easyckpt.snapshot.slots import RankSlots
from easyckpt.snapshot.state import unflatten
from easyckpt_wire.records import PeerTable
from easyckpt_wire.shm import format_bytes

logger = logging.getLogger(__name__)

_OK, _RETRY, _FATAL = 0, 1, 2


def build_tiers(*, slots: RankSlots, save_dir: Path, rank: int, world_size: int, load_dir: Path | None = None,
                timeout: float = 120.0, peers: PeerTable | None = None, peer_timeout: float = 10.0,
                reshard: bool = True, checksums: Checksums | None = None) -> list[Tier]:
    """The tiers of one load, cheapest first: only storage for an explicit ``load_dir``. ``checksums``: the node
    agent's checksums of this rank's snapshots (``AgentClient.checksums``), which verify a read from memory."""
    if load_dir is not None:
        return [StorageTier(save_dir, rank=rank, world_size=world_size, load_dir=load_dir, reshard=reshard)]
    # One survey of the agents serves both tiers that read from them.
    survey = replica.survey(peers, peer_timeout) if peers is not None else None
    silent: replica.Silent = {}   # agents that did not answer: asked no more in this load, by either tier
    tiers: list[Tier] = [OwnMemoryTier(slots, rank=rank, timeout=timeout, peers=peers, peer_timeout=peer_timeout,
                                       checksums=checksums, silent=silent)]
    if peers is not None:
        tiers.append(ReplicaTier(peers, slots, rank=rank, survey=survey, timeout=timeout, peer_timeout=peer_timeout,
                                 silent=silent))
    if reshard:
        tiers.append(OtherWorldTier(slots.directory, slots.job_id, rank=rank, world_size=world_size, peers=peers,
                                    survey=survey, timeout=timeout, peer_timeout=peer_timeout, silent=silent))
    tiers.append(StorageTier(save_dir, rank=rank, world_size=world_size, reshard=reshard))
    return tiers


def _say_offers(offers: dict[str, Offer], rank: int) -> None:
    if "replica" in offers and not offers["replica"].items and not offers["memory"].items and offers["disk"].items:
        # A fresh start has nothing to bring back: nothing to say then.
        logger.warning("rank %d: no agent holds a replica of rank %d's state and its memory is empty: only disk can "
                       "bring it back (newest complete iteration: step %d)", rank, rank, offers["disk"].steps[0])


def _tiers_for(tiers: Sequence[Tier], step: int, source: str, rank: int) -> list[Tier]:
    """The tiers this rank reads a candidate from, in order: a collective one itself; for a local one (memory,
    replica) every local tier that holds the step, cheapest first, so a rank that has it in memory reads it there
    while others pull it, and pulls it too if its own copy turns out damaged."""
    chosen = next(t for t in tiers if t.source == source)
    if chosen.collective:
        return [chosen]
    held = [t for t in tiers if not t.collective and t.holds(step)]
    if not held:
        raise replica.ReplicaError(f"rank {rank} holds no plan for step {step}")
    return held


@dataclasses.dataclass(slots=True)
class _Attempt:
    code: int = _OK
    problem: str = ""
    loaded: Loaded | None = None
    state: Any = None
    fatal: type[StateMismatchError] = StateMismatchError
    where: str = ""


def _attempt(tiers: Sequence[Tier], step: int, source: str, template: Template, *, rank: int,
             reshard: bool) -> _Attempt:
    """This rank's try at one candidate; never raises (every rank must reach the vote that follows)."""
    try:
        chain = _tiers_for(tiers, step, source, rank)
    except RETRYABLE as exc:
        attempt = _Attempt(_RETRY, f"{type(exc).__name__}: {exc}", where=source)
        logger.warning("rank %d could not load step %d from %s: %s", rank, step, source, attempt.problem)
        return attempt
    for number, tier in enumerate(chain, 1):
        attempt = _read(tier, step, source, template, rank=rank, reshard=reshard)
        if attempt.code != _RETRY or number == len(chain):
            break
        # The same step from the next tier: a damaged copy in this rank's own memory is pulled from a replica
        # (a data-parallel peer's copy, the buddy's backup) before every rank gives up the step.
        logger.warning("rank %d could not load step %d from %s: %s; trying %s", rank, step, attempt.where,
                       attempt.problem, chain[number].source)
    if attempt.code != _OK:
        logger.warning("rank %d could not load step %d from %s: %s", rank, step, attempt.where, attempt.problem)
    return attempt


def _read(tier: Tier, step: int, source: str, template: Template, *, rank: int, reshard: bool) -> _Attempt:
    attempt = _Attempt(where=tier.source)
    try:
        attempt.loaded = tier.read(step, template)
        attempt.state = unflatten(attempt.loaded.skeleton, attempt.loaded.values)
    except LayoutChangedError as exc:   # memory holds only this rank's own split: disk can reshard
        attempt.code, attempt.problem = (_RETRY if reshard and source != "disk" else _FATAL), str(exc)
        attempt.fatal = LayoutChangedError
    except StateMismatchError as exc:
        attempt.code, attempt.problem = _FATAL, str(exc)
    except RETRYABLE as exc:
        attempt.code, attempt.problem = _RETRY, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # unexpected, but raising here alone would leave the other ranks waiting
        logger.exception("rank %d: unexpected error loading step %d from %s", rank, step, attempt.where)
        attempt.code, attempt.problem = _RETRY, f"{type(exc).__name__}: {exc}"
    return attempt


def _walk(tiers: Sequence[Tier], ordered: list[tuple[int, str]], template: Template, *, rank: int, world_size: int,
          reshard: bool, tried: list[str]) -> tuple[int, Loaded, Any] | None:
    """Try the candidates in order, all ranks together: (step, what was read, the state) of the first that every
    rank loaded, else None with what failed in ``tried``. Raises the template's misfit as soon as one rank reports
    it."""
    for step, source in ordered:
        attempt = _attempt(tiers, step, source, template, rank=rank, reshard=reshard)
        codes = [row[0] for row in all_gather_ints([attempt.code], world_size)]
        if max(codes) == _FATAL:
            raise attempt.fatal(attempt.problem or f"rank(s) {[r for r, c in enumerate(codes) if c == _FATAL]} "
                                                   f"could not fit step {step} into their state; see their logs")
        if max(codes) == _OK and attempt.loaded is not None:
            return step, attempt.loaded, attempt.state
        failed = [r for r, c in enumerate(codes) if c]
        tried.append(f"step {step} from {attempt.where}: "
                     + (attempt.problem if attempt.code else f"failed on ranks {failed}, see their logs"))
    return None


def load(*, slots: RankSlots, save_dir: Path, rank: int, world_size: int, template: Any = None,
         load_dir: Path | None = None, timeout: float = 120.0, peers: PeerTable | None = None,
         peer_timeout: float = 10.0, allow_unhealthy: bool = False, reshard: bool = True,
         checksums: Checksums | None = None) -> LoadResult:
    """Collective: the newest step every rank can get, from the cheapest tier that has it (see the module)."""
    started = time.perf_counter()
    tiers = build_tiers(slots=slots, save_dir=save_dir, rank=rank, world_size=world_size, load_dir=load_dir,
                        timeout=timeout, peers=peers, peer_timeout=peer_timeout, reshard=reshard, checksums=checksums)
    offers = {tier.source: tier.offer() for tier in tiers}
    _say_offers(offers, rank)
    ordered = agree(offers, rank=rank, world_size=world_size, save_dir=save_dir, allow_unhealthy=allow_unhealthy)
    tried: list[str] = []
    outcome = _walk(tiers, ordered, template_targets(template), rank=rank, world_size=world_size, reshard=reshard,
                    tried=tried)
    if outcome is not None:
        step, loaded, state = outcome
        seconds = time.perf_counter() - started
        slots.invalidate_newer_than(step)
        # DEBUG: each node's first rank announces the resume (Checkpointer.load); this is every rank's detail.
        logger.debug("rank %d resumed at step %d from %s (%s) in %.3fs (%s, %.2f GB/s)", rank, step, loaded.source,
                     loaded.path, seconds, format_bytes(loaded.nbytes), loaded.nbytes / seconds / 1e9 if seconds else 0.0)
        return LoadResult(step, loaded.source, state, loaded.path, seconds, loaded.nbytes)
    if tried:
        where = f"load_dir {load_dir}" if load_dir is not None else f"save_dir {save_dir}"
        raise LoadError(f"no checkpoint in {where} could be loaded by every rank (this is rank {rank}); tried "
                        + "; ".join(tried) + ". Repair or remove the damaged files (easyckpt verify shows them)")
    if load_dir is not None:
        unreadable = next((t.unreadable for t in tiers if isinstance(t, StorageTier)), "")
        raise LoadError(f"load_dir {load_dir} cannot be loaded by every rank: "
                        f"{unreadable or 'another rank cannot read it, see its log'}")
    unlisted = next((t.unreadable for t in tiers if isinstance(t, StorageTier) and t.unreadable), "")
    if unlisted:
        # Starting from scratch now would train over checkpoints that are there but cannot be seen.
        raise LoadError(f"rank {rank}: nothing to resume from in memory or replicas, and {unlisted}. Not starting "
                        "from scratch while the checkpoints there cannot be seen: bring the storage back (or fix "
                        "its settings) and start the job again")
    # No "fresh start" here: a caller may resume from elsewhere (TrainerWrapper: a checkpoint-N folder).
    logger.info("rank %d: nothing to resume from in memory or in %s (load() returns step None)", rank, save_dir)
    return LoadResult(None, None, None)
