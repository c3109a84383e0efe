"""Which slot a rank's next snapshot goes into: a pure rule over the slot headers and the agent's word.

Invariant 9: a rank never overwrites a slot that holds a step the node agent keeps (the published safe
step, or a step it holds for a persist). Among the others it takes an unused slot first, then a torn or
emptied one, then the oldest committed snapshot, so that its own newest snapshot survives whenever
another slot is free. The rank never holds a slot on its own judgement: with three slots there is always
one left (the agent keeps at most the safe step and the step it persists), with two a persist that is
not of the safe step leaves none and the snapshot is skipped.

The caller turns the order into a choice by trying each slot's exclusive flock: the agent also holds
shared flocks on the slots it keeps, so a choice made from a stale view of the control block still never
takes a kept slot.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class SlotView:
    index: int
    allocated: bool
    committed: bool
    step: int
    generation: int


def write_order(slots: Sequence[SlotView], keeps: Callable[[int], bool]) -> list[int]:
    """Indices a new snapshot may be written to, best first; ``keeps(step)`` says the agent keeps ``step``."""
    free = [s for s in slots if not (s.committed and keeps(s.step))]
    return [s.index for s in sorted(free, key=lambda s: (s.allocated, s.committed, s.generation, s.index))]
