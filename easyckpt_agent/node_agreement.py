"""This node's side of the job-wide agreement (invariants 9 and 12): its state out, the leader's verdict in.

Every round of a multi-node job, :meth:`NodeAgreement.agree` describes the node in a ``NodeState`` (the
steps every local rank holds, the steps held on every local rank, the predecessor's steps backed up here,
the persist in flight, the newest due step it took and those it could not) and hands it to
``easyckpt_agent.jobwide`` (the leader decides over every node's state with ``agreement.decide``). It then carries
out the newest verdict: it claims the due step the leader says to take (once: :meth:`take`), logs each due
step passed over once (``Announcements``), holds what ``agreement.plan_holds`` says (``RoleHolds``, through
``easyckpt_agent.protection``), and adopts the job-safe and node-safe steps as far as this node holds them. The
rules are ``easyckpt_agent.agreement``'s; this module only feeds them and carries out what they return.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from easyckpt_agent import agreement
from easyckpt_agent.agreement import NodeState, Verdict
from easyckpt_agent.cluster import NodeReplication
from easyckpt_agent.protection import Protection
from easyckpt_agent.roles import Announcements
from easyckpt_agent.scheduler import PersistScheduler, PersistSettings
from easyckpt_agent.watcher import SlotInfo, Watcher

logger = logging.getLogger(__name__)


class NodeAgreement:
    def __init__(self, *, settings: PersistSettings, cluster: NodeReplication, protection: Protection,
                 scheduler: PersistScheduler, watcher: Watcher, announced: Announcements) -> None:
        self.settings = settings
        self.cluster = cluster
        self.protection = protection
        self.scheduler = scheduler
        self.watcher = watcher
        # The newest due step the leader said to take (acted on once) and those this node could not take, and
        # the due steps passed over job-wide.
        self.took = -1
        self.lost: set[int] = set()
        self.announced = announced
        # The persist in flight at the last round, and the last one seen to end with the newest step a local rank
        # had committed by then (NodeState.wrote and freed): the leader names that persist as the reason a due step
        # its ranks committed meanwhile is gone.
        self._writing: int | None = None
        self.wrote: int | None = None
        self.freed = -1
        self.lost_to: int | None = None   # the persist that kept this node from the newest step it could not take

    def agree(self, ranks: set[int], held: dict[int, dict[int, SlotInfo]], common: frozenset[int]) -> None:
        """Tell the leader this node's state, and carry out the newest verdict: persist the due step it takes,
        hold the steps it protects, hear the due steps it passed over."""
        assert self.cluster.peers is not None
        self.protection.join_job()
        self._note_persist_end(ranks)
        state = self._state(ranks, common)
        self._carry_out(state, ranks, held, common)
        # What the verdict made this node hold (a candidate held, a due step taken) is what the leader needs for its
        # next step: said now, not at the next round (up to a poll interval later, and in the simulation never while
        # the ranks wait in their lag gate for the very step this makes node-safe). Not with three slots: there the
        # quicker rounds doubled the rank kills that cost over two steps in 9,000 simulated faults (with four, every
        # measure improved or held: benchmarks/README.md, "The node's state at once").
        if self.watcher.slots_per_rank() >= agreement.PROMPT_STATE_SLOTS:
            again = self._state(ranks, common)
            if again != state:
                self._carry_out(again, ranks, held, common)

    def _state(self, ranks: set[int], common: frozenset[int]) -> NodeState:
        alive = not self.watcher.ranks or self.watcher.any_alive()
        return NodeState(self.settings.node_id, local=agreement.newest(common),
                         held=agreement.newest(self.held_everywhere(ranks)),
                         backed=agreement.newest(self.cluster.backed_up() or ()), busy=self.scheduler.inflight_step(),
                         took=self.took, lost=agreement.newest(self.lost), wrote=self.wrote, freed=self.freed,
                         lost_to=self.lost_to, alive=alive, failure=None if alive else self.final_failure())

    def _carry_out(self, state: NodeState, ranks: set[int], held: dict[int, dict[int, SlotInfo]],
                   common: frozenset[int]) -> None:
        """Say ``state`` (the leader: decide over it too) and carry out the newest verdict."""
        peers = self.cluster.peers
        assert peers is not None
        protection, roles, scheduler = self.protection, self.protection.roles, self.scheduler
        interval = self.settings.save_storage_interval
        verdict = self.cluster.jobwide.exchange(state, peers, interval=interval,
                                                committed=self.cluster.complete if peers.is_leader else None)
        scheduler.job_failure = verdict.failure if verdict is not None else None
        scheduler.job_committed = verdict.committed if verdict is not None else None
        persisting = set(scheduler.held_steps())
        present = set(common) | roles.steps
        decided = max(scheduler.floor(), verdict.decided if verdict is not None else -1)
        due = agreement.due_to_hold(present, interval=interval, decided=decided)
        if verdict is None:
            # Nothing heard from the leader yet (or since a resume): what is held stays held, and a due step
            # is held for the leader to decide.
            plan = sorted(roles.steps, reverse=True)
            plan += [due] if due is not None and due not in plan else []
            roles.apply(plan[:max(0, self.watcher.slots_per_rank() - 1 - len(persisting))], ranks, held,
                        skip=persisting)
            return
        self.take(verdict, ranks, held)
        persisting = set(scheduler.held_steps())   # with the claim the take just made
        self.announced.hear(verdict, interval)
        floor = agreement.persist_floor(verdict, present)
        planned = persisting | ({floor} if floor is not None else set())
        plan = agreement.plan_holds(slots=self.watcher.slots_per_rank(), persisting=planned, due=due,
                                    job_safe=verdict.job_safe, candidate=verdict.candidate,
                                    node_safe=verdict.node_safe, present=present, adopted=protection.safe)
        # A persisted step the verdict counts on gets a role while its persist still runs, so that its slots stay
        # held as the persist ends: the state this node sends next names it held.
        skip = {step for step in planned if not agreement.counts_on(verdict, step)}
        if set(plan) - skip != roles.steps:
            protection.control.begin_move()   # ranks that find no free slot meanwhile wait for the move, not skip
        if roles.apply(plan, ranks, held, skip=skip):
            logger.debug("holding %s for the job (plan %s, persisting %s; verdict %s)", sorted(roles.steps), plan,
                         sorted(persisting), verdict)
        protection.set_job_steps(verdict.job_safe, verdict.node_safe, self.held_everywhere(ranks))
        self.cluster.safe_step = protection.safe

    def final_failure(self) -> agreement.StepFailure | None:
        """This node's newest failed persist, for the leader once no local rank lives (the caller's test): a failed
        step is persisted again when a rank asks for it (its close() does), so only then can no retry come. Not
        while the agent persists it again itself (at its ranks' failure)."""
        failure, scheduler = self.scheduler.failure, self.scheduler
        if failure is None or failure.step in scheduler.held_steps():
            return None
        return agreement.StepFailure(failure.step, self.settings.node_id, failure.errno, failure.text, failure.needed,
                                     failure.free)

    def _note_persist_end(self, ranks: set[int]) -> None:
        inflight = self.scheduler.inflight_step()
        if self._writing is not None and inflight != self._writing:
            self.wrote = self._writing
            self.freed = max((s for s in map(self.watcher.newest_step, ranks) if s is not None), default=-1)
        self._writing = inflight

    def take(self, verdict: Verdict, ranks: set[int], held: dict[int, dict[int, SlotInfo]]) -> None:
        """The leader said to persist due step ``verdict.take`` on every node (acted on once)."""
        step = verdict.take
        if step is None or step <= self.took:
            return
        self.took = step
        scheduler = self.scheduler
        if step <= scheduler.floor() or step in scheduler.claims or step == scheduler.inflight_step():
            return
        busy = scheduler.inflight_step()
        if busy is not None:
            why = f"its persister is busy with step {busy}"
        else:
            why = "" if scheduler.claims.claim_all(step, ranks, held) else "a local rank no longer holds it"
        if why:
            self.lost.add(step)
            self.lost_to = busy
            logger.warning("the leader said to persist due step %d on every node, but this node cannot: %s", step, why)

    def held_everywhere(self, ranks: set[int]) -> set[int]:
        """Steps whose slots this agent holds on every local rank (for the job, a persist or a claim)."""
        inflight = self.scheduler.inflight_step()
        return (set(self.protection.roles.steps) | self.scheduler.claims.on_every(ranks)
                | ({inflight} if inflight is not None else set()))

    def decided(self) -> int:
        """Due steps at or below this are decided (on disk, persisting, claimed or passed over): ranks spare
        their newest due step above it (``easyckpt.snapshot.slot_choice``)."""
        scheduler = self.scheduler
        verdict = self.cluster.jobwide.verdict if self.cluster.peers is not None else None
        return max(scheduler.floor(), scheduler.last_passed, max(scheduler.claims, default=-1),
                   scheduler.inflight_step() or -1, verdict.decided if verdict is not None else -1)

    def rewind(self, step: int) -> None:
        """The job resumed at ``step``. Step numbers of the abandoned timeline come again on the new one: nothing
        of theirs is taken, lost or passed over, and the job-wide agreement starts again from what every node
        holds now."""
        self.took = min(self.took, step)
        self.lost = {s for s in self.lost if s <= step}
        self.lost_to = None
        if self.wrote is not None and self.wrote > step:
            self.wrote, self.freed = None, -1
        self.freed = min(self.freed, step)
        self.announced.forget_after(step)
        self.cluster.jobwide.rewind(step, decided=self.scheduler.floor())

    def status(self, newest: int | None) -> dict[str, Any]:
        """What a failure now would cost: ``newest`` (the newest step a local rank committed), and how far the
        job-safe step (a rank kill) and, across nodes, the node-safe step (a node loss) trail it."""
        multi = self.cluster.peers is not None
        verdict = self.cluster.jobwide.verdict if multi else None
        node_safe = self.protection.node_safe
        return {"newest_step": newest, "job_safe_lag": agreement.lag(newest, self.protection.safe),
                "node_safe_step": node_safe if multi else None,
                "node_safe_lag": agreement.lag(newest, node_safe) if multi else None,
                "passed_over": list(self.announced.recent), "took": self.took if multi else None,
                "verdict_age": time.monotonic() - self.cluster.jobwide.verdict_at if verdict is not None else None}
