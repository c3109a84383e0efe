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
# Replica steps a rank shares: every backup its buddy may keep (the newest few and those the surviving ranks
# still hold). With only the two newest, a node loss whose backups ran ahead of the surviving ranks' memory
# found no common step and fell back to disk (CI, 2026-11-29, S3 node loss).
MAX_REPLICA_CANDIDATES = 8
NOTHING = Offer()

Reach = dict[tuple[int, ...], list[int]]   # memory/replica steps a rank can get -> the ranks that can get them


def candidates(mem_steps: list[int], disk_steps: list[int], world_size: int,
               replica_steps: Sequence[int] = ()) -> list[tuple[int, str]]:
    """The same ordered candidate list on every rank: (step, "memory" | "replica" | "disk")."""
    return candidates_with_health(mem_steps, disk_steps, world_size, replica_steps)[0]


def candidates_with_health(mem_steps: list[int], disk_steps: list[int], world_size: int,
                           replica_steps: Sequence[int] = (), unhealthy: Collection[int] = (),
                           unhealthy_disk: Collection[int] = ()) -> tuple[list[tuple[int, str]], dict[int, list[int]]]:
    """Collective: ``candidates``, and the steps some rank holds an unhealthy snapshot of: {step: [ranks saying
    so]}. See :func:`gather`."""
    ordered, bad, _ = gather(mem_steps, disk_steps, world_size, replica_steps, unhealthy, unhealthy_disk)
    return ordered, bad


def gather(mem_steps: Sequence[int], disk_steps: Sequence[int], world_size: int, replica_steps: Sequence[int] = (),
           unhealthy: Collection[int] = (), unhealthy_disk: Collection[int] = (),
           ) -> tuple[list[tuple[int, str]], dict[int, list[int]], Reach]:
    """Collective: this rank's row (:func:`encode`) gathered from every rank and :func:`decide`-d."""
    return decide(all_gather_ints(encode(mem_steps, disk_steps, replica_steps, unhealthy, unhealthy_disk), world_size))


def encode(mem_steps: Sequence[int], disk_steps: Sequence[int], replica_steps: Sequence[int] = (),
           unhealthy: Collection[int] = (), unhealthy_disk: Collection[int] = ()) -> list[int]:
    """One rank's offers as the fixed-width row every rank gathers: its memory steps (every slot's: the safe
    step need not be among its two newest), the replica steps it does not hold itself, the disk steps, then a
    health flag per entry. ``unhealthy``: its memory/replica steps whose snapshot (its own) is unhealthy;
    ``unhealthy_disk``: disk steps whose iteration says so (every rank reads the same)."""
    mem = _pad(sorted(mem_steps, reverse=True), MAX_SLOTS)
    rep = _pad(sorted(set(replica_steps) - set(mem_steps), reverse=True), MAX_REPLICA_CANDIDATES)
    disk = _pad(list(disk_steps), MAX_DISK_CANDIDATES)
    flags = [int(s >= 0 and s in unhealthy) for s in mem + rep] + [int(s >= 0 and s in unhealthy_disk) for s in disk]
    return mem + rep + disk + flags


def decide(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[int, str]], dict[int, list[int]], Reach]:
    """Pure, from every rank's :func:`encode` row (rank order): the ordered candidates (steps every rank can get,
    newest first, memory before replica before disk on a tie), the unhealthy ones with the ranks saying so (a
    memory/replica step is unhealthy when any rank's snapshot is, a disk step when its iteration is), and what
    each rank can get from memory or replicas."""
    local, anywhere = MAX_SLOTS, MAX_SLOTS + MAX_REPLICA_CANDIDATES
    width = anywhere + MAX_DISK_CANDIDATES
    bad_mem: dict[int, list[int]] = {}
    bad_disk: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        for i, (step, flag) in enumerate(zip(row[:width], row[width:])):
            if step >= 0 and flag:
                (bad_mem if i < anywhere else bad_disk).setdefault(step, []).append(r)
    common_mem = set.intersection(*({s for s in row[:local] if s >= 0} for row in rows))
    common_any = set.intersection(*({s for s in row[:anywhere] if s >= 0} for row in rows))
    common_disk = set.intersection(*({s for s in row[anywhere:width] if s >= 0} for row in rows))
    reach: Reach = {}
    for r, row in enumerate(rows):
        reach.setdefault(tuple(sorted({s for s in row[:anywhere] if s >= 0}, reverse=True)), []).append(r)
    ordered = ([(s, "memory" if s in common_mem else "replica") for s in common_any]
               + [(s, "disk") for s in common_disk])
    rank_of = {"memory": 0, "replica": 1, "disk": 2}
    ordered = sorted(ordered, key=lambda c: (-c[0], rank_of[c[1]]))
    bad = {step: sorted(set(bad_mem.get(step, [])) | set(bad_disk.get(step, [])))
           for step in {s for s, _ in ordered} if step in bad_mem or step in bad_disk}
    return ordered, bad, reach


def _pad(steps: list[int], width: int) -> list[int]:
    return (steps + [-1] * width)[:width]


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
    ordered, bad, reach = gather(memory.steps, disk.steps, world_size, replica.steps,
                                 unhealthy=set(memory.unhealthy()) | set(replica.unhealthy()),
                                 unhealthy_disk=set(disk.unhealthy()))
    why = {step: _reasons(step, offers, rank) for step in bad}
    ordered = pass_over(ordered, bad, why, rank=rank, save_dir=save_dir, allow_unhealthy=allow_unhealthy)
    if SOURCE in offers:   # another world's memory: collective, agreed in its offer
        ordered = merge(ordered, offers[SOURCE].items, rank=rank, allow_unhealthy=allow_unhealthy)
    if memory.steps and (not ordered or ordered[0][1] == "disk"):
        logger.warning("rank %d holds steps %s in memory, but no step that every rank can get from memory or from "
                       "replicas on other nodes (a rank whose node lost its memory gets only a step another node "
                       "backed up): resuming from disk. What the ranks can get from memory or replicas: %s", rank,
                       sorted(memory.steps, reverse=True), describe_reach(reach))
    return ordered


def describe_reach(reach: Reach, limit: int = 6) -> str:
    """``ranks [0, 1]: steps [14, 10]; ranks [2, 3]: none``, the largest groups first (a big job has few)."""
    groups = sorted(reach.items(), key=lambda item: (-len(item[1]), item[1]))
    text = "; ".join(f"ranks {_ranks(ranks)}: {'steps ' + str(list(steps)) if steps else 'none'}"
                     for steps, ranks in groups[:limit])
    return text + (f"; and {len(groups) - limit} more groups" if len(groups) > limit else "")


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)} ranks)"
