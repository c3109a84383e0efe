"""The freshness rules (invariant 9) in one process: the rank's slot choice and the agent's decisions as
pure functions, alone and in randomized interleavings of ranks, a slow persister and a dying agent.

The interleaving model carries out the decisions exactly as the processes do (flocks as sets, the control
block as the agent's last published word) and checks after every event that the ranks share a safe step
that no one overwrote, that with three slots no snapshot is skipped, and that a kill resumes from memory.
Hypothesis prints the failing sequence of events, and ``--hypothesis-seed`` replays one.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import policy
from easyckpt.slot_choice import SlotView, write_order


# the rank's choice -------------------------------------------------------------------------------------
def views(*slots: tuple[int, int]) -> list[SlotView]:
    """(step, generation) per slot; step -1 means not committed."""
    return [SlotView(i, True, step >= 0, step, gen) for i, (step, gen) in enumerate(slots)]


def test_write_order_never_offers_a_kept_step_and_prefers_the_oldest() -> None:
    order = write_order(views((5, 10), (6, 12), (7, 14)), lambda step: step in (6,))
    assert order == [0, 2]   # 6 is kept; of the others the oldest first, the newest (7) last


def test_write_order_takes_unused_and_torn_slots_before_committed_ones() -> None:
    slots = [SlotView(0, True, True, 3, 8), SlotView(1, True, False, -1, 9), SlotView(2, False, False, -1, 0)]
    assert write_order(slots, lambda step: False) == [2, 1, 0]


def test_write_order_with_every_slot_kept_is_empty() -> None:
    assert write_order(views((4, 2), (5, 4)), lambda step: step in (4, 5)) == []


# the agent's decisions ---------------------------------------------------------------------------------
def test_common_steps_needs_every_expected_rank() -> None:
    assert policy.common_steps({0: [3, 4], 1: [4, 5]}, 2) == {4}
    assert policy.common_steps({0: [3, 4]}, 2) == frozenset()


def test_next_safe_moves_forward_and_only_back_when_the_ranks_dropped_it() -> None:
    assert policy.next_safe({3, 4, 5}, None) == 5
    assert policy.next_safe({4, 5}, 5) == 5
    assert policy.next_safe({4}, 5) == 4            # ranks resumed at 4 and dropped 5
    assert policy.next_safe(set(), 5) is None
    assert policy.next_safe({6, 7}, 5, backed_up={6}) == 6   # multi-node: only backed-up steps qualify
    assert policy.next_safe({5, 7}, 5, backed_up=set()) == 5


def test_pending_step_is_kept_until_backed_up_and_given_up_after_its_limit() -> None:
    # The newest step after the safe one is held; newer commits do not displace it (chasing them is what
    # kept the multi-node safe step from ever moving while a persist held the third slot).
    assert policy.next_pending({4, 5}, above=4, current=None, expired=False) == 5
    assert policy.next_pending({4, 5, 6}, above=4, current=5, expired=False) == 5
    # Safe now (above moved): the next newer step is held, or nothing.
    assert policy.next_pending({5, 6}, above=5, current=5, expired=False) == 6
    assert policy.next_pending({5}, above=5, current=5, expired=False) is None
    # Its backup ran past the limit: only a newer step qualifies, and none may exist yet.
    assert policy.next_pending({4, 5, 6}, above=4, current=5, expired=True) == 6
    assert policy.next_pending({4, 5}, above=4, current=5, expired=True) is None
    # The ranks dropped it (a resume rewound them): the newest qualifying step instead.
    assert policy.next_pending({3, 4}, above=2, current=5, expired=False) == 4


def test_due_step_is_claimed_only_by_a_free_persister_and_never_twice() -> None:
    assert policy.due_to_claim({9, 10, 11}, floor=5, interval=5, busy=False) == 10
    assert policy.due_to_claim({9, 10, 11}, floor=10, interval=5, busy=False) is None
    assert policy.due_to_claim({9, 10, 11}, floor=5, interval=5, busy=True) is None
    assert policy.passed_over({9, 10, 11}, floor=5, interval=5, busy=True) == 10


def test_tail_is_persisted_only_when_its_due_step_never_reached_disk() -> None:
    assert policy.tail_to_persist({12, 13}, floor=5, interval=5) == 13     # 10 was passed over
    assert policy.tail_to_persist({12, 13}, floor=10, interval=5) is None  # 10 is on disk
    assert policy.tail_to_persist({10, 11}, floor=5, interval=5) is None   # 10 is held: claimed as due


def test_never_holds_says_why() -> None:
    assert policy.never_holds(4, {4, 5}, ended=False) == ""
    assert "moved on" in policy.never_holds(4, {5, 6}, ended=False)
    assert "moved on" in policy.never_holds(4, {3, 5}, ended=False)   # three slots: an older step too
    assert "ended" in policy.never_holds(4, {3}, ended=True)
    assert policy.never_holds(4, {3}, ended=False) == ""


# interleavings ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Slot:
    step: int = -1          # committed step, -1 when empty or being written
    generation: int = 0
    writing: bool = False


@dataclasses.dataclass
class Rank:
    slots: list[Slot]
    next_step: int = 0
    writing: int | None = None       # slot index of the copy in flight
    writing_step: int = -1
    generation: int = 0

    def committed(self) -> dict[int, int]:
        found: dict[int, int] = {}
        for index, slot in enumerate(self.slots):
            if slot.step >= 0 and (slot.step not in found or self.slots[found[slot.step]].generation < slot.generation):
                found[slot.step] = index
        return found


class Model:
    """One node: ranks, their slots, and an agent that follows ``policy`` with flocks as sets."""

    def __init__(self, ranks: int, slots: int, interval: int) -> None:
        self.ranks = [Rank([Slot() for _ in range(slots)]) for _ in range(ranks)]
        self.interval = interval
        self.alive = True
        self.published: tuple[int | None, frozenset[int]] = (None, frozenset())   # the control block
        self.safe: int | None = None
        self.holds: dict[tuple[int, int], set[str]] = {}     # (rank, slot) -> reasons (shared flocks)
        self.claimed: int | None = None                      # the due step claimed or being persisted
        self.floor = -1
        self.skips = 0
        self.persisted: list[int] = []
        self.lost: list[int] = []                            # steps of recomputation per kill

    # the agent ---------------------------------------------------------------------------------------
    def _hold(self, step: int, reason: str) -> bool:
        keys = []
        for r, rank in enumerate(self.ranks):
            index = rank.committed().get(step)
            if index is None or rank.slots[index].writing:
                for key in keys:
                    self.holds[key].discard(reason)
                return False
            keys.append((r, index))
        for key in keys:
            self.holds.setdefault(key, set()).add(reason)
        return True

    def _release(self, reason: str) -> None:
        for reasons in self.holds.values():
            reasons.discard(reason)

    def common(self) -> frozenset[int]:
        return policy.common_steps({r: rank.committed() for r, rank in enumerate(self.ranks)}, len(self.ranks))

    def tick(self) -> None:
        if not self.alive:
            return
        common = self.common()
        target = policy.next_safe(common, self.safe)
        if target != self.safe or (target is not None and not any("safe" in r for r in self.holds.values())):
            previous = {k for k, v in self.holds.items() if "safe" in v}
            if target is None or self._hold(target, "safe-new"):
                for key in previous:
                    self.holds[key].discard("safe")
                for reasons in self.holds.values():
                    if "safe-new" in reasons:
                        reasons.discard("safe-new")
                        reasons.add("safe")
                self.safe = target
        due = policy.due_to_claim(common, floor=self.floor, interval=self.interval, busy=self.claimed is not None)
        if due is not None and self._hold(due, "persist"):
            self.claimed = due
        self.published = (self.safe, frozenset() if self.claimed is None else frozenset({self.claimed}))

    def persist_done(self) -> None:
        if self.alive and self.claimed is not None:
            self.persisted.append(self.claimed)
            self.floor = max(self.floor, self.claimed)
            self.claimed = None
            self._release("persist")

    def agent_dies(self) -> None:
        """The flocks go with the process; the control block stays."""
        self.alive = False
        self.holds.clear()
        self.claimed = None

    def agent_restarts(self) -> None:
        self.alive = True
        self.safe = self.published[0]   # adopted from the control block, held at the next tick

    # the ranks -----------------------------------------------------------------------------------------
    def begin(self, r: int) -> None:
        rank = self.ranks[r]
        if rank.writing is not None:
            self.commit(r)   # snapshot() first waits for the previous copy
        lockstep = min(other.next_step for other in self.ranks)
        if rank.next_step > lockstep:
            return   # the collectives of the step keep ranks within one step of each other
        safe, held = self.published
        order = write_order([SlotView(i, True, s.step >= 0, s.step, s.generation) for i, s in enumerate(rank.slots)],
                            lambda step: step == safe or step in held)
        free = [i for i in order if not self.holds.get((r, i))]
        step, rank.next_step = rank.next_step, rank.next_step + 1
        if not free:
            self.skips += 1
            return
        rank.generation += 2
        rank.slots[free[0]] = Slot(-1, rank.generation - 1, writing=True)
        rank.writing, rank.writing_step = free[0], step

    def commit(self, r: int) -> None:
        rank = self.ranks[r]
        if rank.writing is not None:
            rank.slots[rank.writing] = Slot(rank.writing_step, rank.generation)
            rank.writing = None

    def kill_all(self) -> None:
        """torchrun restarts the group; recovery takes the newest step every rank holds, drops newer ones."""
        killed_at = max(rank.next_step for rank in self.ranks) - 1
        common = self.common()
        assert common, f"no step every rank can resume from: {[r.committed() for r in self.ranks]}"
        step = max(common)
        self.lost.append(killed_at - step)
        for rank in self.ranks:
            if rank.writing is not None:
                rank.slots[rank.writing] = Slot()
                rank.writing = None
            for index, slot in enumerate(rank.slots):
                if slot.step > step:
                    rank.slots[index] = Slot(generation=slot.generation)
            rank.next_step = step + 1

    # what must hold after every event -----------------------------------------------------------------
    def check(self, slots: int) -> None:
        safe = self.published[0]
        if safe is not None:
            for r, rank in enumerate(self.ranks):
                assert safe in rank.committed(), f"rank {r} overwrote the safe step {safe}: {rank.slots}"
        if self.safe is not None:
            assert self.common(), "the ranks hold no common step"
        if slots >= 3:
            assert self.skips == 0, "a snapshot was skipped with three slots"
        assert all(step % self.interval == 0 for step in self.persisted)


EVENTS = st.lists(st.one_of(
    st.tuples(st.just("begin"), st.integers(0, 2)),
    st.tuples(st.just("commit"), st.integers(0, 2)),
    st.tuples(st.just("tick"), st.just(0)),
    st.tuples(st.just("persist_done"), st.just(0)),
    st.tuples(st.just("agent_dies"), st.just(0)),
    st.tuples(st.just("agent_restarts"), st.just(0)),
    st.tuples(st.just("kill"), st.just(0)),
), min_size=1, max_size=300)


@pytest.mark.parametrize("slots", [3, 2])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, ranks=st.integers(1, 3), interval=st.integers(1, 6))
def test_interleavings_keep_a_common_safe_step(slots: int, events: list[tuple[str, int]], ranks: int,
                                               interval: int) -> None:
    model = Model(ranks, slots, interval)
    for name, arg in events:
        if name in ("begin", "commit"):
            getattr(model, name)(arg % ranks)
        elif name == "kill":
            if model.safe is not None or model.published[0] is not None:
                model.kill_all()
        else:
            getattr(model, name)()
        model.check(slots)


@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(1, 3), interval=st.integers(1, 6), persist_ticks=st.integers(1, 40),
       kill_after=st.integers(1, 60))
def test_three_slots_lose_at_most_two_intervals_however_slow_the_persist(ranks: int, interval: int,
                                                                         persist_ticks: int, kill_after: int) -> None:
    """The regime of large models: a persist takes many steps, the agent ticks between steps, ranks
    never wait. A kill after any step costs at most two snapshots and no snapshot is skipped."""
    model = Model(ranks, 3, interval)
    busy_for = 0
    for _ in range(kill_after):
        for r in range(ranks):
            model.begin(r)
        for r in range(ranks):
            model.commit(r)
        model.tick()
        busy_for = busy_for + 1 if model.claimed is not None else 0
        if busy_for >= persist_ticks:
            model.persist_done()
            busy_for = 0
        model.check(3)
    model.kill_all()
    assert model.lost[-1] <= 2, f"resumed {model.lost[-1]} steps behind the kill"
    assert model.skips == 0


# across nodes ------------------------------------------------------------------------------------------
def peer(busy_with: int | None = None, ready: int | None = None, passed: tuple[int, ...] = ()) -> policy.PeerPersister:
    return policy.PeerPersister(busy_with, ready, frozenset(passed))


def test_cluster_verdict_takes_only_with_every_node_free_for_the_step() -> None:
    both_ready = {"a": peer(ready=10), "b": peer(busy_with=10)}   # b already took it on a's word
    assert policy.cluster_verdict(10, peers=both_ready, waited=0.0, limit=5.0) == "take"
    assert policy.cluster_verdict(10, peers={"a": peer(busy_with=5)}, waited=0.0, limit=5.0) == "wait"
    assert policy.cluster_verdict(10, peers={"a": peer(passed=(10,))}, waited=0.0, limit=5.0) == "pass"
    assert policy.cluster_verdict(10, peers={"a": peer(ready=5)}, waited=6.0, limit=5.0) == "pass"
    assert policy.cluster_verdict(10, peers={}, waited=0.0, limit=5.0) == "take"   # one node


def test_pending_step_costs_a_slot_only_when_one_is_left_for_the_ranks() -> None:
    assert policy.may_hold_pending(12, {11}, slots=3, lag=1)              # safe + pending + the rank's
    assert not policy.may_hold_pending(12, {11, 10}, slots=3, lag=1)      # a persist holds the third
    assert policy.may_hold_pending(10, {11, 10}, slots=3, lag=1)          # the persisted step: no extra slot
    assert policy.may_hold_pending(13, {11, 10}, slots=3, lag=2)          # the race was lost: hold anyway
    assert not policy.may_hold_pending(12, {11}, slots=2, lag=1)


@dataclasses.dataclass
class Node:
    persist_ticks: int
    jitter: int
    busy_with: int | None = None
    busy_until: int = 0
    consent: tuple[int, int] | None = None
    passed: set[int] = dataclasses.field(default_factory=set)
    taken: list[int] = dataclasses.field(default_factory=list)
    decided: int = -1
    peers: dict[str, policy.PeerPersister] = dataclasses.field(default_factory=dict)
    told: tuple[int | None, int | None, frozenset[int], int | None] | None = None


@settings(max_examples=300, deadline=None)
@given(nodes=st.integers(2, 4), interval=st.integers(1, 6), data=st.data())
def test_nodes_persist_the_same_steps_without_holding_one_for_a_busy_node(nodes: int, interval: int,
                                                                          data: st.DataObject) -> None:
    """The agents' exchange (``NodeReplication.tell`` and ``Agent._cluster_persist``) with persists of
    any length per node, commits a few ticks apart and news delayed up to a third of a step: every node
    persists exactly the same due steps, and a due step is held only while the persister is free."""
    step_ticks, limit = 12, 10_000   # no timeouts: the property is about the news, not about lost nodes
    names = [f"n{i}" for i in range(nodes)]
    state = {name: Node(data.draw(st.integers(1, 60), label=f"{name} persist ticks"),
                        data.draw(st.integers(0, 3), label=f"{name} commit jitter")) for name in names}
    inbox: list[tuple[int, int, str, str, policy.PeerPersister]] = []   # (arrival, seq, to, from, news)
    last_arrival: dict[tuple[str, str], int] = {}
    seq = 0
    for t in range(step_ticks * 40):
        for item in sorted(i for i in inbox if i[0] <= t):
            inbox.remove(item)
            state[item[2]].peers[item[3]] = item[4]
        for name, node in state.items():
            if node.busy_with is not None and t >= node.busy_until:
                node.busy_with = None
            committed = (t - node.jitter) // step_ticks   # the newest step this node's ranks committed
            newest = committed // interval * interval
            if committed >= 0 and newest > node.decided and newest not in node.passed:
                node.decided = newest
                if node.consent is not None:
                    node.passed.add(node.consent[0])
                    node.consent = None
                if node.busy_with is not None:
                    node.passed.add(newest)
                else:
                    node.consent = (newest, t)
            if node.consent is not None:
                step, since = node.consent
                verdict = policy.cluster_verdict(step, peers=node.peers, waited=t - since, limit=limit)
                if verdict == "take":
                    assert node.busy_with is None, "a due step was held while the persister was busy"
                    node.consent, node.busy_with, node.busy_until = None, step, t + node.persist_ticks
                    node.taken.append(step)
                elif verdict == "pass":
                    node.passed.add(step)
                    node.consent = None
            news = (node.busy_with, None if node.consent is None else node.consent[0], frozenset(node.passed),
                    node.taken[-1] if node.taken else None)
            if news != node.told:
                node.told = news
                for other in names:
                    if other != name:
                        delay = data.draw(st.integers(0, step_ticks // 3), label="delay")
                        arrival = max(t + delay, last_arrival.get((name, other), 0))   # one sender, in order
                        last_arrival[(name, other)] = arrival
                        seq += 1
                        inbox.append((arrival, seq, other, name, policy.PeerPersister(*news)))
    settled = [[s for s in node.taken if s < 35] for node in state.values()]   # the last ones may be undecided
    assert all(taken == settled[0] for taken in settled), {n: node.taken for n, node in state.items()}
    assert settled[0], "no step was ever persisted"
