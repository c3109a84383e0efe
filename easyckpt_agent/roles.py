"""What a multi-node agent holds for the job (``agreement.plan_holds`` carried out) and says of it.

:class:`RoleHolds` keeps the slots of the job-safe step, the candidate and the node-safe step on every
local rank or on none: a new step is held before an old one is let go, so the node never holds less than
the plan's floor. :class:`Announcements` logs each due step the leader passed over once, with the reason,
and keeps the newest ones for the control block (a rank waiting for one stops at once).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from easyckpt_agent.agreement import PASSED_KEPT, Verdict
from easyckpt_agent.watcher import SlotHolds, SlotInfo

logger = logging.getLogger(__name__)


class RoleHolds:
    def __init__(self, holds: SlotHolds) -> None:
        self.holds = holds
        self.held: dict[int, list[SlotInfo]] = {}   # step -> every local rank's slot of it

    @property
    def steps(self) -> frozenset[int]:
        return frozenset(self.held)

    def apply(self, plan: Iterable[int], ranks: set[int], committed: dict[int, dict[int, SlotInfo]],
              *, skip: Iterable[int] = ()) -> bool:
        """Hold the plan's steps (but ``skip``: held for another reason already), then let go of the others;
        True when anything changed. A step some rank is rewriting right now is not held (the next round
        plans again)."""
        wanted = [step for step in plan if step not in set(skip)]
        changed = False
        for step in wanted:
            if step in self.held:
                continue
            taken = self.holds.hold_all(ranks, committed, step, ("role", step))
            if taken is not None:
                self.held[step] = taken
                changed = True
        for step in [s for s in self.held if s not in wanted]:
            self._let_go(step)
            changed = True
        return changed

    def release(self, which: Callable[[int], bool] = lambda step: True) -> None:
        for step in [s for s in self.held if which(s)]:
            self._let_go(step)

    def _let_go(self, step: int) -> None:
        for info in self.held.pop(step):
            self.holds.release(info, ("role", step))


class Announcements:
    """Due steps the leader passed over: logged once each, the newest kept for the ranks."""

    def __init__(self) -> None:
        self.said: set[int] = set()
        self.recent: list[int] = []

    def hear(self, verdict: Verdict, interval: int) -> list[int]:
        """Log what the verdict passes over for the first time; returns those steps."""
        fresh = []
        for step, why in verdict.passed:
            if step in self.said:
                continue
            self.said.add(step)
            fresh.append(step)
            logger.info("due step %d passed over on every node: %s (save_storage_interval=%d); the next due step is "
                        "persisted", step, why, interval)
        if fresh:
            self.recent = sorted({*self.recent, *fresh})[-PASSED_KEPT:]
            self.said = {s for s in self.said if s >= min(self.recent)}
        return fresh

    def withdraw(self, step: int) -> None:
        """A rank asked for ``step`` to be persisted after all (the HF wrapper asks for every due step it exports):
        it is claimed now, so nothing waiting for it may read it as passed over and give up (CI, 2026-11-29: the
        export of a best checkpoint-8 gave up while the agent went on to persist step 8)."""
        if step in self.recent:
            self.recent = [s for s in self.recent if s != step]
            logger.info("due step %d, announced passed over, is claimed after all: a rank asked for it", step)

    def forget_after(self, step: int) -> None:
        """A resume at ``step``: step numbers after it come again on the new timeline."""
        self.said = {s for s in self.said if s <= step}
        self.recent = [s for s in self.recent if s <= step]
