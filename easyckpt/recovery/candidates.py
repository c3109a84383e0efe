"""The agreement: the steps every rank can get, in the order the ladder tries them (invariants 4 and 11).

Every rank reports what its tiers offer (the own-memory tier: every committed slot of its own; the replica
tier: the steps it can pull; storage: the complete iterations it sees) in one ``all_gather`` of a few ints
(:func:`candidates_with_health`); the candidates are the steps *every* rank can get, newest first, memory before
replica before disk on a tie. A memory/replica step is one candidate: each rank reads it from its own memory
when it holds it and pulls it from the replicas otherwise. Health comes before recency: a step some rank
judges unhealthy (its snapshot's verdict, or the iteration's) is passed over in every tier unless the caller
allows it (:func:`pass_over`). Steps resharded from another world's memory (a collective tier that agrees on
its own offer) are merged in last (``worlds.merge``).
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from easyckpt.collectives import all_gather_ints
from easyckpt.recovery.results import LoadError
from easyckpt.recovery.tier import Offer
from easyckpt.recovery.worlds import SOURCE, merge
from easyckpt_wire.shm import MAX_SLOTS

logger = logging.getLogger(__name__)

MAX_DISK_CANDIDATES = 8
NOTHING = Offer()


def candidates(mem_steps: list[int], disk_steps: list[int], world_size: int,
               replica_steps: Sequence[int] = ()) -> list[tuple[int, str]]:
    """The same ordered candidate list on every rank: (step, "memory" | "replica" | "disk")."""
    return candidates_with_health(mem_steps, disk_steps, world_size, replica_steps)[0]


def candidates_with_health(mem_steps: list[int], disk_steps: list[int], world_size: int,
                           replica_steps: Sequence[int] = (), unhealthy: Collection[int] = (),
                           unhealthy_disk: Collection[int] = ()) -> tuple[list[tuple[int, str]], dict[int, list[int]]]:
    """``candidates``, and the steps some rank holds an unhealthy snapshot of: {step: [ranks saying so]}.

    ``unhealthy``: this rank's memory/replica steps whose snapshot (its own) is unhealthy; ``unhealthy_disk``:
    disk steps whose iteration says so (every rank reads the same). A memory/replica step is unhealthy when
    any rank's snapshot is; a disk step when its iteration is. Every rank gets the same answer."""
    # Every slot's step: the safe step need not be among a rank's two newest (a persist may hold a third).
    mem = (sorted(mem_steps, reverse=True) + [-1] * MAX_SLOTS)[:MAX_SLOTS]
    rep = (sorted(set(replica_steps) - set(mem_steps), reverse=True) + [-1, -1])[:2]
    disk = (disk_steps[:MAX_DISK_CANDIDATES] + [-1] * MAX_DISK_CANDIDATES)[:MAX_DISK_CANDIDATES]
    n_local = MAX_SLOTS + 2
    flags = [int(s >= 0 and s in unhealthy) for s in mem + rep] + [int(s >= 0 and s in unhealthy_disk) for s in disk]
    both = all_gather_ints(mem + rep + disk + flags, world_size)
    width = len(mem + rep + disk)
    rows = [row[:width] for row in both]
    bad_mem: dict[int, list[int]] = {}
    bad_disk: dict[int, list[int]] = {}
    for r, row in enumerate(both):
        for i, (step, flag) in enumerate(zip(row[:width], row[width:])):
            if step >= 0 and flag:
                (bad_mem if i < n_local else bad_disk).setdefault(step, []).append(r)
    local, anywhere = MAX_SLOTS, MAX_SLOTS + 2
    common_mem = set.intersection(*({s for s in row[:local] if s >= 0} for row in rows))
    common_any = set.intersection(*({s for s in row[:anywhere] if s >= 0} for row in rows))
    common_disk = set.intersection(*({s for s in row[anywhere:] if s >= 0} for row in rows))
    ordered = ([(s, "memory" if s in common_mem else "replica") for s in common_any]
               + [(s, "disk") for s in common_disk])
    rank_of = {"memory": 0, "replica": 1, "disk": 2}
    ordered = sorted(ordered, key=lambda c: (-c[0], rank_of[c[1]]))
    bad = {step: sorted(set(bad_mem.get(step, [])) | set(bad_disk.get(step, [])))
           for step in {s for s, _ in ordered} if step in bad_mem or step in bad_disk}
    return ordered, bad


def pass_over_unhealthy(ordered: list[tuple[int, str]], bad: Mapping[int, object]) -> list[tuple[int, str]]:
    """The candidates left once every unhealthy step is passed over (pure: the same on every rank)."""
    return [c for c in ordered if c[0] not in bad]


def _reasons(step: int, offers: Mapping[str, Offer], rank: int) -> tuple[str, ...]:
    """Why ``step`` is unhealthy: the iteration's verdict when it has one, else this rank's on its snapshot."""
    disk = offers.get("disk", NOTHING).unhealthy()
    if step in disk:
        return disk[step]
    for source in ("memory", "replica"):
        mine = offers.get(source, NOTHING).item(step)
        if mine is not None:
            return tuple(f"rank {rank}: {r}" for r in mine.reasons)
    return ()


def pass_over(ordered: list[tuple[int, str]], bad: Mapping[int, list[int]], why: Mapping[int, Sequence[str]], *,
              rank: int, save_dir: Path, allow_unhealthy: bool) -> list[tuple[int, str]]:
    """The candidates a load tries once unhealthy steps are passed over (said once, with the ranks and reasons);
    LoadError when nothing healthy is left. ``allow_unhealthy``: all of them, with a warning."""
    if not bad:
        return ordered

    def describe(step: int) -> str:
        return (f"step {step} (unhealthy on ranks {bad[step]}"
                + (f": {'; '.join(why[step])}" if why[step] else "") + ")")

    newer = [s for s in sorted({s for s, _ in ordered}, reverse=True) if s in bad]
    healthy = pass_over_unhealthy(ordered, bad)
    if allow_unhealthy:
        logger.warning("rank %d: allow_unhealthy=True: unhealthy snapshots may be loaded: %s", rank,
                       ", ".join(describe(s) for s in newer))
        return ordered
    if not healthy:
        raise LoadError(
            f"no healthy checkpoint to resume from in memory or in save_dir {save_dir} (this is rank {rank}): "
            f"every one is unhealthy: {', '.join(describe(s) for s in newer)}. Either retrain from scratch "
            "(remove or move save_dir), or raise the threshold in health_thresholds, or load a chosen iteration "
            "with load(load_dir=<save_dir>/iteration_N), or load the newest anyway with "
            "load(allow_unhealthy=True)")
    passed = [s for s in newer if s > healthy[0][0]]
    if passed:
        logger.warning("rank %d: passing over unhealthy snapshots newer than step %d: %s", rank, healthy[0][0],
                       ", ".join(describe(s) for s in passed))
    return healthy


def agree(offers: Mapping[str, Offer], *, rank: int, world_size: int, save_dir: Path,
          allow_unhealthy: bool = False) -> list[tuple[int, str]]:
    """Collective: the candidates every rank tries, in order, from what each tier offered this rank
    (``offers`` by tier source)."""
    memory, replica, disk = (offers.get(s, NOTHING) for s in ("memory", "replica", "disk"))
    ordered, bad = candidates_with_health(memory.steps, disk.steps, world_size, replica.steps,
                                          unhealthy=set(memory.unhealthy()) | set(replica.unhealthy()),
                                          unhealthy_disk=set(disk.unhealthy()))
    why = {step: _reasons(step, offers, rank) for step in bad}
    ordered = pass_over(ordered, bad, why, rank=rank, save_dir=save_dir, allow_unhealthy=allow_unhealthy)
    if SOURCE in offers:   # another world's memory: collective, agreed in its offer
        ordered = merge(ordered, offers[SOURCE].items, rank=rank, allow_unhealthy=allow_unhealthy)
    if memory.steps and (not ordered or ordered[0][1] == "disk"):
        logger.warning("rank %d holds steps %s in memory, but no step that every rank can get from memory or from "
                       "replicas on other nodes (a rank whose node lost its memory gets only a step another node "
                       "backed up): resuming from disk", rank, sorted(memory.steps, reverse=True))
    return ordered
