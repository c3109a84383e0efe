"""What the agent keeps from being overwritten, and what it tells the ranks of it (invariants 2 and 9).

:class:`Protection` owns the agent's flocks on slots (``SlotHolds``) for the single-node safe step and, across
nodes, for the job's steps (``RoleHolds``: job-safe, candidate, node-safe), and the control block the ranks
read before they choose a slot. A move of the safe step takes the new step's flocks on every local rank or on
none, publishes it, then lets go of the old one; the control block's odd generation meanwhile tells a rank
that finds no free slot to wait for the move instead of skipping. Persist claims hold slots through the same
``SlotHolds`` (``easyckpt_agent.claims``), so one flock serves every reason a slot is kept, and every new flock
marks the block as changing until the round publishes why (a rank that finds such a slot flocked waits for that
word instead of skipping its snapshot).

Holds of snapshots of an abandoned timeline are let go by a resume (``easyckpt_agent.resume`` invalidates them once
nothing holds them).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from easyckpt_agent import agreement, policy
from easyckpt_agent.roles import RoleHolds
from easyckpt_agent.watcher import SlotHolds, SlotInfo, Watcher
from easyckpt_wire.control import ControlWriter, PersistFailure

logger = logging.getLogger(__name__)

SAFE = ("safe",)   # the reason the single-node safe step's slots are held
# A move of the safe step that failed because a rank's flock was still on its new slot (unlocked a moment after the
# commit) is tried again after RETRY_POLL, not a whole poll interval later: the ranks wait only SAFE_WAIT for it.
RETRY_POLL = 0.002
QUICK_RETRIES = 8   # per target step: a step that stays unholdable is left to the normal rounds


class Protection:
    def __init__(self, watcher: Watcher, control: ControlWriter) -> None:
        self.watcher = watcher
        self.control = control
        adopted = control.adopted
        # The predecessor's word stands until this agent holds the step itself: ranks keep it meanwhile.
        self.safe: int | None = adopted.safe if adopted is not None else None
        self.safe_holds: list[SlotInfo] = []
        self.failed_target: int | None = None   # the step the last move to failed, and how often in a row
        self.failed_moves = 0
        self.holds = SlotHolds(before_lock=control.begin_move)   # every flock is followed by this round's word
        # Multi-node (agent.agreement): the steps held for the job (job-safe, candidate, node-safe) and the
        # newest verdict's node-safe step.
        self.roles = RoleHolds(self.holds)
        self.node_safe: int | None = None

    # the single-node safe step ----------------------------------------------------------------------------
    def advance_safe(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: Collection[int],
                     publish: Callable[[], None]) -> bool:
        """Move the safe step to what ``policy.next_safe`` says: hold every local rank's slot of the new step
        first (all or none: a rank already rewriting one makes the step unsafe), ``publish`` it, then let go
        of the old one. True when the safe step was (re)declared, False when it stands as it was."""
        target = policy.next_safe(common, self.safe)
        if target == self.safe and (target is None or self.safe_holds and not self._safe_superseded(ranks, held)):
            self.failed_target = None
            return False
        self.control.begin_move()
        taken = [] if target is None else self.holds.hold_all(ranks, held, target, SAFE)
        if taken is None:
            self.failed_moves = self.failed_moves + 1 if self.failed_target == target else 1
            self.failed_target = target
            publish()   # the move failed: the old safe step stands
            return False
        # A slot in both (a rank whose copy of the step did not change while another's did) keeps its flock:
        # one reason holds it, and letting go of the old hold would unlock what the new one just took.
        self._let_go_safe(keep={id(info.map) for info in taken})
        if target != self.safe:
            logger.debug("safe step %s -> %s", self.safe, target)
        self.safe, self.safe_holds = target, taken
        self.failed_target, self.failed_moves = None, 0
        publish()
        return True

    def retry_soon(self) -> bool:
        """Whether the last move failed and may succeed in a moment (see RETRY_POLL)."""
        return self.failed_target is not None and self.failed_moves <= QUICK_RETRIES

    def _safe_superseded(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]]) -> bool:
        """A rank snapshotted the safe step again (a save point after the step's own snapshot): the hold
        moves to the newer copy, so that the rank can drop the stale one and reuse its slot."""
        assert self.safe is not None
        newest = {(held[rank][self.safe].path, held[rank][self.safe].header.generation)   # type: ignore[union-attr]
                  for rank in ranks if self.safe in held[rank]}
        holding = {(info.path, info.header.generation) for info in self.safe_holds   # type: ignore[union-attr]
                   if info.header is not None}
        return bool(newest) and newest != holding

    def _let_go_safe(self, keep: Collection[int] = ()) -> None:
        """Release the safe step's holds, but those of the slot maps whose id is in ``keep``."""
        for info in self.safe_holds:
            if id(info.map) not in keep:
                self.holds.release(info, SAFE)
        self.safe_holds = []

    # the job's steps (multi-node) -----------------------------------------------------------------------
    def join_job(self) -> None:
        """The job became multi-node: the single-node safe step gives way to the job's (its value stays until
        the first verdict names the job-safe step)."""
        self.failed_target = None
        self._let_go_safe()

    def leave_job(self) -> None:
        """The job shrank to this node: its safe step is this node's again."""
        if self.roles.steps:
            self.roles.release()
            self.node_safe = None

    def set_job_steps(self, job_safe: int | None, node_safe: int | None, everywhere: Iterable[int]) -> None:
        """The verdict's steps: the job-safe one as far as this node holds it on every local rank (``everywhere``)."""
        self.safe = agreement.job_safe_here(job_safe, everywhere, self.safe)
        # The leader's word, held here or not: it says how far the backups have come job-wide, which is what the
        # ranks' max_backup_lag measures (a node-safe step this node let go of for a newer job-safe step is
        # still backed up, and the next one follows within a backup's time).
        self.node_safe = node_safe

    # timelines ----------------------------------------------------------------------------------------
    def rewind(self, step: int) -> bool:
        """The job resumed at ``step``: let go of newer steps and of snapshots of the abandoned timeline.
        Steps at or below it stay held: other nodes' ranks may be pulling the resumed step from these very
        slots right now (multi-node recovery). True when the safe step was dropped (the next round declares
        a step of the new timeline safe)."""
        self.roles.release(lambda s: s > step or self.holds_abandoned(self.roles.held[s]))
        if self.node_safe is not None and self.node_safe > step:
            self.node_safe = None
        if self.safe is not None and (self.safe > step or self.holds_abandoned(self.safe_holds)):
            self._let_go_safe()
            self.safe = None
            return True
        return False

    def holds_abandoned(self, holds: list[SlotInfo]) -> bool:
        return any(info.header is not None and (info.rank, info.slot, info.header.generation) in self.watcher.abandoned
                   for info in holds)

    # the control block ----------------------------------------------------------------------------------
    def publish(self, *, persisted: int | None, failure: PersistFailure | None, failures: int, passed: list[int],
                decided: int, held: Iterable[int], gated: bool) -> None:
        """Write what the ranks read: the safe steps, the held steps (``held``, persists and claims, plus the
        job's), how persisting goes, the due steps passed over and decided."""
        self.control.set_persist(persisted, failure, failures)
        self.control.set_job(self.node_safe, passed, decided)
        self.control.publish(self.safe, frozenset(held) | self.roles.steps, gated=gated)

    def release(self) -> None:
        """Let go of every safe and job hold (the agent stops keeping the job's memory)."""
        self._let_go_safe()
        self.roles.release()
