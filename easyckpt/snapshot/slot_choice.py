"""Which slot a rank's next snapshot goes into: a pure rule over the slot headers and the agent's word.

Invariant 9: a rank never overwrites a slot that holds a step the node agent keeps (the published safe
step, or a step it holds for a persist). Among the others it takes an unused slot first, then a torn or
emptied one, then the oldest committed snapshot, so that its own newest snapshot survives whenever
another slot is free. The rank never holds a slot on its own judgement: with three slots there is always
one left (the agent keeps at most the safe step and the step it persists), with two a persist that is
not of the safe step leaves none and the snapshot is skipped.

Among the free slots, the rank's newest due step (a multiple of ``save_storage_interval``) that the agent has
not decided yet (persist it, or pass it over) goes last: a starved agent that holds it a few steps late still
finds it, and the disk keeps its cadence (invariant 12). That is a preference, never a hold: when it is the only
free slot (``waits_for_due``), the rank waits a few step times for the agent's word on it, then overwrites it.
Not while the node's agent holds a step for a persist: a due step that arrives then is passed over anyway
(invariant 12), and sparing it left the rank one slot for every snapshot (CI, 2026-12-02: the first persist of a
run held step 0, due step 5 was spared, and a kill at 10 resumed at 5).

When the agent is late to declare the rank's newest step safe and that step's slot is the one left (the spared
due step's apart), the rank writes over it only while a kill during that copy (which resumes at the newest step
left in the other slots) still costs at most two snapshot intervals; else it skips the snapshot while its newest
step is less than two intervals old (``keep_newest``). Later than that, freshness wins again: over the spared due
step if there is one (after the wait for the agent's word on it), else over the newest step (``past_newest``).

The caller turns the order into a choice by trying each slot's exclusive flock: the agent also holds
shared flocks on the slots it keeps, so a choice made from a stale view of the control block still never
takes a kept slot.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class SlotView:
    index: int
    allocated: bool
    committed: bool
    step: int
    generation: int


def stale(slots: Sequence[SlotView]) -> set[int]:
    """Indices of committed slots whose step a newer generation holds too (the step snapshotted again): no reader
    takes them, and the agent, which keeps steps, not slots, moves its hold to the newer copy."""
    newest: dict[int, int] = {}
    for s in slots:
        if s.committed:
            newest[s.step] = max(newest.get(s.step, s.generation), s.generation)
    return {s.index for s in slots if s.committed and s.generation < newest[s.step]}


def write_order(slots: Sequence[SlotView], keeps: Callable[[int], bool], *, spare: int | None = None,
                spare_first: bool = False) -> list[int]:
    """Indices a new snapshot may be written to, best first; ``keeps(step)`` says the agent keeps ``step``;
    the slot holding step ``spare`` (an undecided due step) is offered last, or first (``spare_first``: the rank
    keeps its newest step, ``PastNewest.SPARE``). A stale copy of a step (``stale``) is as free as an emptied
    slot, kept step or not: counted as kept, two copies of the safe step and the agent's persisted due step took
    all three slots, and every later snapshot was skipped for the rest of the run (a step saved twice, 2026-12-06).
    The agent's flock still guards a stale copy it has not let go of yet."""
    old = stale(slots)
    live = [dataclasses.replace(s, committed=False) if s.index in old else s for s in slots]
    free = [s for s in live if not (s.committed and keeps(s.step))]
    return [s.index for s in sorted(free, key=lambda s: (s.allocated, s.committed,
                                                         (s.committed and s.step == spare) != spare_first,
                                                         s.generation, s.index))]


def undecided_due(slots: Sequence[SlotView], *, every: int, decided: int, persisting: bool = False) -> int | None:
    """The newest committed step of ``slots`` that is due (``every``: save_storage_interval) and above
    ``decided`` (the agent's newest decided due step): the one to spare. None while a persist runs on this node
    (``persisting``): the agent passes a due step over then."""
    if every <= 0 or persisting:
        return None
    return max((s.step for s in slots if s.committed and s.step % every == 0 and s.step > decided), default=None)


def waits_for_due(slots: Sequence[SlotView], order: Sequence[int], spare: int | None, *, gated: bool) -> bool:
    """Whether the rank waits for the agent's word before its next write: that write would go over ``spare``, the
    undecided due step (offered last, so its slot comes first only when no other slot is free). Not across nodes
    (``gated``) with three slots: there the agent's two holds are the job-safe step and the candidate, and a due step
    held for its decision takes the candidate's, so waiting for that hold stalls the job-safe step (in the simulation,
    9,000 random kill points: a few lost 6 to 8 steps that lost at most 1 without the wait). Four slots leave one
    spare for the due step (``easyckpt_agent.agreement.plan_holds``)."""
    if spare is None or not order or (gated and len(slots) < 4):
        return False
    first = next(s for s in slots if s.index == order[0])
    return first.committed and first.step == spare


def lone_newest(slots: Sequence[SlotView], order: Sequence[int], spare: int | None) -> SlotView | None:
    """The rank's newest committed snapshot when its slot is the only one in ``order`` (the slots the rank may
    write) apart from the spared due step's: the next write goes over it unless the agent declares it safe."""
    committed = [s for s in slots if s.committed]
    if not committed:
        return None
    newest = max(committed, key=lambda s: s.generation)
    by_index = {s.index: s for s in slots}
    others = [i for i in order if i != newest.index and not (by_index[i].committed and by_index[i].step == spare)]
    return newest if newest.index in order and newest.step != spare and not others else None


def _lost_during_copy(step: int, fallback: int | None) -> int:
    """What a kill during the copy of ``step`` over the newest step costs: it resumes at ``fallback``."""
    return step - fallback if fallback is not None else step + 1


def keep_newest(step: int, *, newest: int, fallback: int | None, bound: int) -> bool:
    """Whether to skip the snapshot of ``step`` rather than write over ``newest``, this rank's newest committed step
    and its one writable slot, which the agent has not declared safe. ``fallback``: the newest step left in the
    other slots, where a kill during the copy resumes (at least the safe step). ``bound``: the most steps a kill may
    cost, two snapshot intervals (invariant 9)."""
    if step <= newest:
        return False   # the same step snapshotted again: the new copy replaces the old one
    lost_if_written = _lost_during_copy(step, fallback)
    # Skipping only while the newest step is less than the bound behind: the next write, even with the agent in time
    # (the newest step becomes the safe one), then still leaves a kill during its copy within the bound.
    return lost_if_written > bound and step - newest < bound


class PastNewest(enum.Enum):
    """What the snapshot of a step does when the agent is late to declare the rank's newest step safe."""

    WRITE = "write over the newest step"
    SKIP = "skip the snapshot, keeping the newest step"
    SPARE = "write over the spared due step, keeping the newest step"


def past_newest(step: int, *, newest: int, fallback: int | None, bound: int, spare: int | None) -> PastNewest:
    """``keep_newest``, and past it the spared due step (if any) rather than a kill beyond ``bound``: the due step
    is then lost to disk (the agent announces it passed over), which invariant 12 allows; a kill beyond the bound,
    invariant 9 does not."""
    if keep_newest(step, newest=newest, fallback=fallback, bound=bound):
        return PastNewest.SKIP
    if spare is not None and step > newest and _lost_during_copy(step, fallback) > bound:
        return PastNewest.SPARE
    return PastNewest.WRITE
