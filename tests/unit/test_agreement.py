"""The job-wide rules across nodes (invariants 9 and 12) in one process: ``easyckpt_agent.agreement`` as pure functions,
and driven by the seeded discrete-event simulation of ``benchmarks/cluster_sim.py`` over timings drawn from a fixed
seed (``SAMPLE_SEED``: agents fast or starved, a slow node, persists of any length) and the moment of a rank kill or
a node loss. Every failure prints the drawn configuration and the call that replays it; the pure rules' properties
use ``hypothesis`` (``--hypothesis-seed`` replays them)."""
from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable
from typing import Any

import cluster_sim
import pytest
import zmq
from conftest import wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from easyckpt_agent.agreement import (
    Book,
    NodeState,
    StepFailure,
    Verdict,
    counts_on,
    decide,
    decide_due,
    due_to_hold,
    job_failure,
    job_safe_here,
    job_steps,
    persist_floor,
    plan_holds,
    state_from_wire,
    state_to_wire,
    verdict_from_wire,
    verdict_to_wire,
)
from easyckpt_agent.jobwide import Courier, JobWide
from easyckpt_wire import protocol
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import PeerNode, PeerTable

NODES = ["a", "b"]


def state(node: str, local: set[int], held: set[int] = frozenset(), backed: set[int] = frozenset(),  # type: ignore[assignment]
          busy: int | None = None, took: int = -1, lost: set[int] = frozenset()) -> NodeState:  # type: ignore[assignment]
    return NodeState(node, frozenset(local), frozenset(held), frozenset(backed), busy, took, frozenset(lost))


# the leader's word -----------------------------------------------------------------------------------------
def test_job_safe_is_the_newest_step_every_node_holds_and_node_safe_also_backed_up() -> None:
    states = {"a": state("a", {3, 4, 5}, {3, 4}, {3}), "b": state("b", {4, 5, 6}, {3, 4}, {3, 4})}
    job_safe, node_safe, candidate, common = job_steps(states, NODES)
    assert (job_safe, node_safe, candidate, common) == (4, 3, 5, 5)
    assert job_steps({"a": states["a"]}, NODES) == (None, None, None, None), "a node that said nothing holds nothing"


def test_the_candidate_stays_until_job_safe_or_some_node_lost_it() -> None:
    states = {"a": state("a", {5, 6, 7}, {4, 5}), "b": state("b", {5, 6}, {4})}
    assert job_steps(states, NODES, proposed=5)[2] == 5          # b will hold it in a moment: no chasing 6
    states["b"] = state("b", {6, 7}, {4})                        # b's ranks moved past 5 unheld
    assert job_steps(states, NODES, proposed=5)[2] == 7          # the newest common step instead
    states["b"] = state("b", {5, 6}, {4, 5})
    assert job_steps(states, NODES, proposed=5)[0] == 5          # now job-safe


def test_a_due_step_is_taken_once_every_node_holds_it_and_every_persister_is_free() -> None:
    book = Book(decided=0)
    states = {"a": state("a", {4, 5}, {4, 5}), "b": state("b", {4, 5}, {4})}
    assert decide_due(states, NODES, interval=5, book=book) == (None, book)   # b holds it in a moment
    states["b"] = state("b", {4, 5}, {4, 5})
    take, book = decide_due(states, NODES, interval=5, book=book)
    assert take == 5 and book.taken == 5 and book.decided == 5
    assert decide_due(states, NODES, interval=5, book=book)[0] is None, "decided once"


def test_a_due_step_that_comes_while_a_node_persists_is_passed_over_and_announced() -> None:
    book = Book(decided=5, taken=5)
    states = {"a": state("a", {10}, {10}, busy=5, took=5), "b": state("b", {10}, {10}, took=5)}
    take, book = decide_due(states, NODES, interval=5, book=book)
    assert take is None and book.decided == 10
    assert book.passed == ((10, "node a still persists step 5"),)
    # A node that has not yet seen the last take counts as busy with it: the nodes persist the same steps.
    book = Book(decided=5, taken=5)
    states = {"a": state("a", {10}, {10}, took=5), "b": state("b", {10}, {10}, took=0)}
    assert decide_due(states, NODES, interval=5, book=book)[1].passed[-1][0] == 10


def test_a_due_step_some_node_no_longer_holds_is_passed_over_and_an_older_one_is_decided_first() -> None:
    states = {"a": state("a", {10, 11}, {10}), "b": state("b", {11, 12}, {11})}
    take, book = decide_due(states, NODES, interval=5, book=Book(decided=5))
    assert take is None and book.passed[-1][0] == 10 and "node(s) ['b']" in book.passed[-1][1]
    # Two undecided due steps: the older is taken when every node holds it, the newer passed for it.
    states = {"a": state("a", {5, 9, 10}, {5}), "b": state("b", {5, 9, 10}, {5})}
    take, book = decide_due(states, NODES, interval=5, book=Book(decided=0))
    assert take == 5 and [s for s, _ in book.passed] == [10]



def test_a_due_step_whose_ranks_moved_past_it_while_their_node_persisted_is_passed_over_for_that_persist() -> None:
    """The decision can come after the persist ended (a round late): the node's last finished persist (``wrote``) and
    how far its ranks had got when it ended (``freed``) still name it. A step after ``freed`` was the agents' miss."""
    for step, freed, why in ((10, 11, "node b still persisted step 5 when its ranks committed it"),
                             (10, 9, "the ranks of node(s) ['b'] moved past it before their agent held it")):
        states = {"a": state("a", {10, 11, 12}, {10}, took=5),
                  "b": dataclasses.replace(state("b", {11, 12}, {11}, took=5), wrote=5, freed=freed)}
        take, book = decide_due(states, NODES, interval=5, book=Book(decided=5, taken=5))
        assert take is None and book.decided == 10 and book.passed[-1][0] == step
        assert book.passed[-1][1].startswith(why), book.passed
    # Two nodes without the step: the persist is the reason only when it is so for both.
    states = {"a": dataclasses.replace(state("a", {11}, {11}, took=5), wrote=5, freed=12),
              "b": state("b", {11}, {11}, took=5)}
    assert "moved past it" in decide_due(states, NODES, interval=5, book=Book(decided=5, taken=5))[1].passed[-1][1]


def test_a_newest_common_step_that_jumps_two_intervals_decides_every_due_step_between() -> None:
    """A slow node's state can move the newest common step by two intervals at once (the simulation found it:
    Config(nodes=3, interval=2, slow_node=1, slow_factor=4, ...), seed 300188). The leader used to look at the
    newest two due steps only, so due step 18, held everywhere and waiting for its decision, was left behind
    ``decided`` without a word: neither persisted nor announced."""
    states = {"a": state("a", {17, 18, 21, 22}, {18}), "b": state("b", {17, 18, 21, 22}, {18})}
    take, book = decide_due(states, NODES, interval=2, book=Book(decided=16))
    assert take == 18 and book.decided == 22
    assert [step for step, _ in book.passed] == [20, 22]
    assert all("every node persists due step 18" in why for _, why in book.passed)

def test_a_taken_step_some_node_could_not_take_is_announced() -> None:
    states = {"a": state("a", {10}, {10}, took=10), "b": state("b", {10}, {10}, took=10, lost={10})}
    _, book = decide_due(states, NODES, interval=5, book=Book(decided=10, taken=10))
    assert book.passed[-1][0] == 10 and "could not persist" in book.passed[-1][1]
    # Busy with another persist when told (the job's final flush of 14, as a 2-node test's job ended): the rule's
    # case, named so.
    states["b"] = dataclasses.replace(states["b"], lost_to=14)
    _, book = decide_due(states, NODES, interval=5, book=Book(decided=10, taken=10))
    assert book.passed[-1] == (10, "node b still persists step 14 (it could not take this one when told to)")


def test_the_verdict_repeats_the_newest_take_and_names_what_is_decided() -> None:
    states = {"a": state("a", {5}, {5}), "b": state("b", {5}, {5})}
    verdict, book = decide(states, NODES, interval=5, book=Book(decided=0), committed=0)
    assert (verdict.job_safe, verdict.take, verdict.decided, verdict.committed) == (5, 5, 5, 0)
    again, _ = decide(states, NODES, interval=5, book=book, committed=0)
    assert again.take == 5, "a late or restarted agent still learns the take"


def test_the_verdict_names_the_newest_failed_persist_of_a_step_not_committed() -> None:
    """Soak seed 1323, fault 523: the leader's persist of the run's last step failed after the other node's had
    written its files; that node's rank waited for a commit that could not come. The verdict says so."""
    full = StepFailure(19, "a", 28, "no space", 235_000, 212_000)
    states = {"a": dataclasses.replace(state("a", {19}, {19}), failure=full), "b": state("b", {19}, {19})}
    verdict, _ = decide(states, NODES, interval=5, book=Book(decided=15), committed=15)
    assert verdict.failure == full
    assert decide(states, NODES, interval=5, book=Book(decided=15), committed=19)[0].failure is None, \
        "a step committed after all (a retry succeeded) is no one's failure"
    older = StepFailure(17, "b", 5, "EIO")
    states["b"] = dataclasses.replace(states["b"], failure=older)
    assert job_failure(states, NODES, 15) == full, "the newest step's failure"
    assert job_failure(states, NODES, 18) == full and job_failure(states, NODES, None) == full
    assert job_failure({"b": states["b"]}, NODES, 15) == older, "a node not heard from says nothing"
    assert job_failure(states, ["b"], 15) == older, "a node not of the job says nothing"
    tie = dataclasses.replace(older, step=19)
    states["b"] = dataclasses.replace(states["b"], failure=tie)
    assert job_failure(states, NODES, 15) == full and job_failure(states, ["b", "a"], 15) == full, \
        "among equals, the first node by name, whatever the order given"


# one agent's holds -------------------------------------------------------------------------------------
def test_holds_leave_a_slot_to_write_and_one_for_an_unseen_due_step_or_a_trailing_node_safe_step() -> None:
    present = {4, 5, 6, 7}
    assert plan_holds(slots=4, persisting=[], job_safe=5, candidate=6, node_safe=5, present=present) == [5, 6], \
        "the spare slot stays free while the node-safe step is the job-safe one"
    assert plan_holds(slots=4, persisting=[], job_safe=5, candidate=6, node_safe=4, present=present) == [5, 6, 4], \
        "a node-safe step that trails takes the spare slot: a node loss resumes from it"
    assert plan_holds(slots=4, persisting=[], job_safe=5, candidate=None, node_safe=4, present=present) == [5, 4]
    # a due step held (or persisted): the spare slot is what it took
    assert plan_holds(slots=4, persisting=[], job_safe=5, candidate=6, node_safe=4, present=present, due=5) == [5, 6, 4]
    # a persist is the floor: the candidate comes next, then the node-safe step that trails
    assert plan_holds(slots=4, persisting=[5], job_safe=5, candidate=6, node_safe=4, present=present) == [5, 6, 4]
    assert plan_holds(slots=4, persisting=[3], job_safe=5, candidate=6, node_safe=4, present=present) == [3, 6, 4]
    assert plan_holds(slots=4, persisting=[3], job_safe=5, candidate=6, node_safe=3, present=present) == [3, 6]
    # three slots: no spare slot (the job-safe step moves only once every node holds the candidate)
    assert plan_holds(slots=3, persisting=[], job_safe=5, candidate=6, node_safe=4, present=present) == [5, 6]
    assert plan_holds(slots=2, persisting=[5], job_safe=5, candidate=6, node_safe=4, present=present) == [5]
    assert plan_holds(slots=4, persisting=[], job_safe=9, candidate=None, node_safe=None, present={8, 9, 10}) == [9]
    assert plan_holds(slots=4, persisting=[], job_safe=9, candidate=10, node_safe=None, present={6, 10}) == [6, 10], \
        "a node that missed the job-safe step keeps the newest step below it that its ranks still hold"
    assert plan_holds(slots=4, persisting=[], job_safe=5, candidate=None, node_safe=None, present={6, 7}) == [], \
        "a step the ranks no longer hold cannot be held"


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(2, 6), persisting=st.sets(st.integers(0, 20), max_size=2),
       job_safe=st.none() | st.integers(0, 20), candidate=st.none() | st.integers(0, 20),
       node_safe=st.none() | st.integers(0, 20), due=st.none() | st.integers(0, 20),
       present=st.sets(st.integers(0, 20), max_size=8))
def test_holds_never_take_the_last_slot(slots: int, persisting: set[int], job_safe: int | None, candidate: int | None,
                                        node_safe: int | None, due: int | None, present: set[int]) -> None:
    persisting = set(sorted(persisting)[:max(0, slots - 1)])
    plan = plan_holds(slots=slots, persisting=persisting, job_safe=job_safe, candidate=candidate, node_safe=node_safe,
                      present=present, due=due)
    assert len(plan) == len(set(plan)) <= slots - 1
    assert persisting <= set(plan) and set(plan) <= present | persisting


def test_a_verdict_over_states_of_different_ages_does_not_move_a_nodes_job_safe_step_back() -> None:
    """The simulation found it (Config(nodes=3, interval=6, persist_ms=426, ...), seed 622481): every node held
    27 and 28 when the leader, from one node's state a round old, named 24 job-safe. The nodes that no longer had
    24 then held the candidate only, and for a round no step was held on every node."""
    present = {26, 27, 28}
    assert job_safe_here(24, present) is None
    assert job_safe_here(24, present, adopted=27) == 27
    assert job_safe_here(None, present, adopted=27) == 27
    assert job_safe_here(28, present, adopted=27) == 28, "a newer verdict moves it on"
    assert plan_holds(slots=4, persisting=[], job_safe=24, candidate=28, node_safe=None, present=present) == [28]
    assert plan_holds(slots=4, persisting=[], job_safe=24, candidate=28, node_safe=None, present=present,
                      adopted=27) == [27, 28]


def test_due_step_and_persist_floor() -> None:
    assert due_to_hold({8, 9, 10, 11}, interval=5, decided=5) == 10
    assert due_to_hold({8, 9, 10, 11}, interval=5, decided=10) is None
    assert persist_floor(Verdict(job_safe=10, take=10), {10, 11}) == 10
    assert persist_floor(Verdict(job_safe=11, take=10, committed=10), {10, 11}) is None, \
        "committed, and a newer job-safe step is the floor"
    # Not committed yet: some node may still write it, holding it and the candidate only, and the nodes that let
    # it go would leave the job with no step in common.
    assert persist_floor(Verdict(job_safe=11, take=10, committed=5), {10, 11}) == 10
    assert persist_floor(Verdict(job_safe=11, take=10), {10, 11}) == 10
    assert persist_floor(Verdict(job_safe=10, take=10, passed=((10, "x"),)), {10}) is None


def test_a_step_the_verdict_counts_on_has_a_role_of_its_own() -> None:
    assert counts_on(Verdict(candidate=10, take=10, committed=10), 10), "the candidate: held"
    assert counts_on(Verdict(job_safe=10, take=10), 10), "the job-safe step: held, its persist running or not"
    assert counts_on(Verdict(job_safe=11, node_safe=10, take=10), 10), "the node-safe step: held"
    assert not counts_on(Verdict(job_safe=11, candidate=12, node_safe=11, take=10), 10), \
        "nothing counts on it: its slot is the ranks' spare for the next due step"
    assert not counts_on(Verdict(job_safe=10, take=10), None)


# on the wire -----------------------------------------------------------------------------------------------
def test_states_and_verdicts_round_trip_and_garbage_is_refused() -> None:
    original = state("a", {1, 2, 3}, {2}, {1}, busy=2, took=0, lost={0})
    assert state_from_wire(state_to_wire(original)) == original
    finished = dataclasses.replace(original, wrote=0, freed=3, lost_to=2, alive=False)
    assert state_from_wire(state_to_wire(finished)) == finished
    older = {k: v for k, v in state_to_wire(finished).items() if k not in ("wrote", "freed", "lost_to", "alive")}
    assert state_from_wire(older) == original, "a sender without wrote and freed finished no persist"
    assert state_from_wire(older).alive, "a sender that does not say alive never says its ranks are gone"
    assert protocol.decode(protocol.encode(Kind.STATE, token="t", **older))[0] == Kind.STATE
    verdict = Verdict(3, 2, 4, 0, ((0, "why"),), 0, 4, 0)
    assert verdict_from_wire({**verdict_to_wire(verdict), "node": "a"}) == verdict
    for field, bad in (("local", [-1]), ("local", list(range(100))), ("held", ["x"]), ("busy", -5), ("took", "1"),
                       ("wrote", -2), ("freed", "3"), ("lost_to", 1.5), ("alive", 1)):
        with pytest.raises(ValueError, match=field):
            state_from_wire({**state_to_wire(original), field: bad})
    with pytest.raises(ValueError, match="passed"):
        verdict_from_wire({**verdict_to_wire(verdict), "node": "a", "passed": [[1, 2, 3]]})
    failure = StepFailure(19, "a", 28, "x" * 500, None, 7)
    failed = dataclasses.replace(finished, failure=failure)
    said = dataclasses.replace(failure, text="x" * 300)   # the text is cut to 300 characters on the wire
    assert state_from_wire(state_to_wire(failed)) == dataclasses.replace(failed, failure=said)
    verdict = dataclasses.replace(verdict, failure=said)
    assert verdict_from_wire({**verdict_to_wire(verdict), "node": "a"}) == verdict
    assert protocol.decode(protocol.encode(Kind.VERDICT, token="t", node="a", **verdict_to_wire(verdict)))[0] \
        == Kind.VERDICT
    assert verdict_from_wire({k: v for k, v in verdict_to_wire(verdict).items() if k != "failure"} | {"node": "a"}) \
        == dataclasses.replace(verdict, failure=None), "an older leader says no failure"
    good: Any = state_to_wire(failed)["failure"]
    for garbage in ({"step": 1}, [19], {**good, "errno": -1}, {**good, "free": "7"}, {**good, "node": 3}, "full"):
        with pytest.raises(ValueError, match="failure"):
            state_from_wire({**state_to_wire(original), "failure": garbage})


def test_news_travel_to_a_real_replica_server_and_wrong_tokens_are_dropped() -> None:
    """A Courier's STATE over tcp reaches the leader's replica server, which stores it and wakes the loop;
    news without the job token is dropped, and none of it is ever answered."""
    from easyckpt_agent.replica import Holdings, ReplicaServer

    ctx = zmq.Context()
    woke = threading.Event()
    leader = JobWide(node="a", ctx=ctx, wake=woke.set)
    token = "t" * 32
    server = ReplicaServer(Holdings("a"), ctx, "127.0.0.1", 0, lambda m: None, lambda kind, m: (
        leader.on_state(m, peers) if kind == Kind.STATE else leader.on_verdict(m, peers)))
    peers = PeerTable(token, "a", "a", {"a": PeerNode(server.endpoint, (0,)), "b": PeerNode("tcp://x:1", (1,))}, 2)
    server.token = token
    server.start()
    courier = Courier(ctx)
    try:
        news = state("b", {1, 2}, {1})
        wait_for(lambda: courier.send(server.endpoint, Kind.STATE, "wrong" * 8, **state_to_wire(news)) and False
                 or server.refused > 0, 10, "the wrong token to be refused")
        assert "b" not in leader.states
        wait_for(lambda: courier.send(server.endpoint, Kind.STATE, token, **state_to_wire(news)) and "b" in leader.states,
                 10, "the state to arrive")
        assert leader.states["b"] == news and woke.is_set()
        assert protocol.NO_REPLY_KINDS == {Kind.STATE, Kind.VERDICT}
    finally:
        courier.close()
        server.stop()
        ctx.term()


# the rules in time: the simulation -------------------------------------------------------------------------
# The simulation properties run over configurations drawn from a fixed seed, the same in every run. They were
# derandomized hypothesis examples, but hypothesis also draws constants it finds in the modules loaded at the time,
# so a change anywhere in the code base, or which tests ran before, changed the examples: the CI rehearsal of
# 2026-11-29 (the whole suite in one process) met the counterexamples in KNOWN_MISSES, which the same test alone
# never drew. A failure prints the configuration, seed, fault and step to replay with cluster_sim.run.
SAMPLE_SEED = 20261129


def draw_config(rng: random.Random) -> cluster_sim.Config:
    return cluster_sim.Config(
        nodes=rng.randint(2, 4), ranks=rng.randint(1, 2), slots=rng.randint(3, 4), steps=30, interval=rng.randint(2, 6),
        step_ms=100.0, jitter_ms=rng.uniform(0, 20), copy_ms=rng.uniform(1, 20), agent_ms=rng.uniform(0.5, 15),
        slow_node=rng.randint(-1, 3), slow_factor=rng.uniform(1, 4), net_ms=rng.uniform(0.1, 5),
        hash_ms=rng.uniform(0.5, 20), persist_ms=rng.uniform(5, 600))


def sample(test: str, count: int, faults: bool = False) -> list[tuple[cluster_sim.Config, int, str | None, int | None]]:
    """``count`` examples of a property, from SAMPLE_SEED and the test's name: (config, seed, fault, step)."""
    rng = random.Random(f"{SAMPLE_SEED}:{test}")
    rows: list[tuple[cluster_sim.Config, int, str | None, int | None]] = []
    for _ in range(count):
        config, seed = draw_config(rng), rng.randrange(1 << 20)
        rows.append((config, seed, rng.choice(["rank", "node"]), rng.randint(8, 27)) if faults else
                    (config, seed, None, None))
    return rows


def failures(rows: list[tuple[cluster_sim.Config, int, str | None, int | None]],
             check: Callable[[cluster_sim.Config, int, str | None, int | None], None]) -> list[str]:
    found = []
    for config, seed, fault, at in rows:
        try:
            check(config, seed, fault, at)
        except AssertionError as exc:
            found.append(f"{exc}\n  replay: {check.__name__}({config!r}, {seed}, {fault!r}, {at})")
    return found


def costs_at_most(bound: int, config: cluster_sim.Config, seed: int, fault: str | None, at: int | None) -> None:
    outcome = cluster_sim.run(config, seed, fault, at)
    assert outcome["resumed"] is not None, f"nothing to resume from: {outcome}"
    assert outcome["lost"] <= bound, f"{fault} at step {outcome['step']} resumed at {outcome['resumed']}: {outcome}"


def costs_at_most_two_steps(config: cluster_sim.Config, seed: int, fault: str | None, at: int | None) -> None:
    costs_at_most(2, config, seed, fault, at)


def test_a_rank_kill_or_a_node_loss_at_any_moment_costs_at_most_two_steps() -> None:
    """Agents that answer within a fraction of a step, any persist length, any moment inside any step: every
    rank still holds a common step (a node loss: every survivor, with the lost node's backup on its buddy) at
    most two steps before the newest one begun. 60 examples; KNOWN_MISSES are the counterexamples still open."""
    found = failures(sample("costs_at_most_two_steps", 60, faults=True), costs_at_most_two_steps)
    assert not found, "\n".join(found)


def costs_at_most_one_step(config: cluster_sim.Config, seed: int, fault: str | None, at: int | None) -> None:
    costs_at_most(1, config, seed, fault, at)


@pytest.mark.parametrize("slots", [4, 5], ids=["four-slots-the-multi-node-default", "five-slots"])
def test_a_rank_kill_or_a_node_loss_costs_at_most_one_step(slots: int) -> None:
    """Issue 24's bound, the kill step or the one before, with the multi-node default of four slots per rank and with
    five (``slots=5``, EASYCKPT_SLOTS=5), under the default lag gate (``max_backup_lag``: two snapshots): 300 random
    timings each (slow agents, long persists, any moment inside any step). With four slots the agent's three holds
    (job-safe, node-safe, a due step decided or persisted) can leave a rank only its newest step's slot to write;
    since the agents name what a verdict makes them hold in the round they hear it (``node_agreement.agree``) and
    the gate keeps the node-safe step within two snapshots, the simulation has not found that to cost a second step.
    Measured on 2026-12-07 with four slots forced: 24,000 rank kills (``draw_config``, seeds 2
    and 11) and 23,000 node losses (seeds 3 and 12) lost 0 or 1 step each, none more; on 2026-12-04, before both
    (the gate then allowed save_storage_interval steps), the same 4,000 rank kills of seed 2 lost 2 or 3 in 12 and the
    3,000 node losses of seed 3 lost 2 in 10 (``four-slot-three-lost`` below, kept with a gate of five). The
    simulation's backups never starve: on real processes the gate's two snapshots are what a starved backup may add
    to a node loss (``benchmarks/README.md``, "Five slots, a second trial")."""
    rows = [(dataclasses.replace(config, slots=slots), seed, fault, at)
            for config, seed, fault, at in sample("costs_at_most_one_step", 300, faults=True)]
    found = failures(rows, costs_at_most_one_step)
    assert not found, "\n".join(found)


# Counterexamples to the two-step bound outside the defaults (three slots; four with a lag gate of five snapshots),
# still open. The first (met by the CI rehearsal of 2026-11-29, and present in every commit back to the agreement's
# first): four nodes of two ranks, three slots, a due step every 2 steps,
# persists longer than a step (so every other due step is passed over) and node 2's agent 3.75-4 times slower (37-38
# ms a reaction). Causes, traced step by step on 2026-11-29 (a tracer around cluster_sim's lead/apply/begin):
# - nothing-in-common: a rank kill at step 9 found no step every rank held ({5, 8}, {6, 8}, {5, 7}, {5, 8}). The
#   leader decides over states a round old. Every node had held due step 6 for its decision; the leader passed it over
#   (a persist ran), every node let it go and its ranks wrote step 7 over it, but the states they had sent before
#   still listed 6 as held, and the next verdict named 6 job-safe. Node 1 heard it first, adopted 6 and let 4 and 5
#   go; the others no longer had 6, and from then on each node kept a different step in its two holds.
#   Tried: never naming safe a decided due step held only for its decision (unless it is the candidate, the step
#   taken or the last verdict's). In the simulation it makes this case hold and cuts the moments with no step held on
#   every node from 65 to 26 (3,000 random runs), with as many losses over two steps (19 and 18 in 9,000 kill
#   points), but 17% more due steps missed for want of a hold with four slots; and with real processes (2 nodes x 2
#   ranks, full speed, 8 uninterrupted runs each) 3 due steps were missed that way against none before: not kept.
# - three-lost: only step 6 was common (3 lost). With three slots an agent holds two steps. While a persist runs it
#   holds the persisted step (the floor) and the undecided due step 8 before the candidate 7; the slow node's round-old
#   state kept 8 undecided until step 9 began, so every rank wrote 9 over 7 (or, on the slow node, over 8). Three slots
#   leave two holds for the floor, the job-safe step, the candidate and a due step being decided: in 9,000 random kill
#   points (``draw_config``, seeds 4242, 99, 1234) the two-step bound failed 19 times, all with three slots. Tried:
#   holding the candidate before the due step while a persist runs. It makes this case hold, but in 1,334 random
#   uninterrupted three-slot runs it tripled the due steps missed for want of a hold and nearly tripled the moments
#   with no step held on every node: not kept. Tried on 2026-12-04: the single-node rule for a late agent
#   (``slot_choice.past_newest``: skip the snapshot rather than write over the rank's newest step when a kill during
#   that copy would cost more than two intervals) across nodes too. This case still lost 3, and in 1,500 random kill
#   points the three-slot rank kills lost 5 and 6 (5 before) and four-slot runs skipped 29 snapshots: not kept.
# Three slots across nodes are below the multi-node default (four, ``slots.MULTI_NODE_SLOTS``): a job gets them only
# when shared memory has no room for four, or when asked for (``slots=3``, EASYCKPT_SLOTS=3), and the node's first
# rank then says once what they cost (``shm_space.fewer_slots_cost``). The 373 four-slot rank kills among those
# 1,500 kill points lost at most 1 step each.
# - four-slot-three-lost (found 2026-12-04 in 4,000 rank kills from ``draw_config`` with four slots forced, seed 2:
#   3,329 lost 0, 659 lost 1, 11 lost 2 and this one 3; 3,000 node losses, seed 3: 10 lost 2, none more). Node 0,
#   the leader, 3.6 times slower (45 ms a reaction), persists of 290 ms, copies of 19 ms. While step 20 was persisted,
#   nodes 0 and 2 held [20, 21, 22]: the floor, the candidate 22, and 21 as the node-safe step, which is also the
#   job-safe one that the persist's limit had left out and which the node-safe step's own cap (one slot more) held
#   again. With three holds in four slots the ranks wrote step 24 over their newest, 23. Node 1's agent had not yet
#   applied the verdict that named 22, held [20, 21] only, and its ranks wrote 24 over 22. Common: 20 and 21.
#   Tried the same day: the node-safe step takes the extra slot only while it is older than every other hold (A), or
#   older than the job-safe step (B). Rank kills lost 2 or more 4 (A) and 2 (B) times in those 4,000, node losses lost
#   2 twice in 3,000 (both), but with the job-safe step no longer held through a persist, the nodes that finished it
#   let its floor go first and the leader named no job-safe step for a round (test_persists_longer_than_the_interval:
#   a lag of 51), and two due-step tests changed outcome: not kept. (The 4,000: rng = random.Random(2), then per
#   kill ``dataclasses.replace(draw_config(rng), slots=4)``, ``rng.randrange(1 << 20)``, ``rng.randint(8, 27)``
#   into ``cluster_sim.run(config, seed, "rank", at)``; the node losses the same with Random(3) and "node".)
#   What would bound a rank kill by one step: never more than ``slots - 2`` holds with four slots (each rank then
#   keeps its newest committed step beside the one it writes), which leaves a persist one hold beside its floor, and
#   the node-safe step then stalls for the persist's length (the lag gate would make the ranks wait): a change of
#   design. Five slots leave that room with all three holds, but were not kept as the default; with the gate's default
#   of two snapshots (2026-12-04) four slots meet one step in the simulation too: test_a_rank_kill_or_a_node_loss_costs_
#   at_most_one_step.
KNOWN_MISSES = [
    pytest.param(cluster_sim.Config(nodes=4, ranks=2, slots=3, steps=30, interval=2, step_ms=100.0, jitter_ms=0.0,
                                    copy_ms=7.0, agent_ms=9.5, slow_node=2, slow_factor=4.0, net_ms=2.5, hash_ms=2.0,
                                    backup_ms=0.0, persist_ms=115.0, leader_us_per_node=20.0, max_backup_lag=5),
                 1753, "rank", 9, id="three-lost"),
    pytest.param(cluster_sim.Config(nodes=3, ranks=2, slots=4, steps=30, interval=5, step_ms=100.0,
                                    jitter_ms=13.177706036241501, copy_ms=18.871333801512996, agent_ms=12.312913050083731,
                                    slow_node=0, slow_factor=3.630088528423171, net_ms=3.120095782830371,
                                    hash_ms=15.5731891115894, backup_ms=0.0, persist_ms=290.46085785470945,
                                    leader_us_per_node=20.0, max_backup_lag=5, due_wait_ms=500.0),
                 636065, "rank", 24, id="four-slot-three-lost"),
]
# four-slot-three-lost was seed 636059 until 2026-12-06, when a node began to say what a verdict made it hold in the
# same round (easyckpt_agent.node_agreement.agree, four slots or more): that run's kill then cost one step, but of
# the 600 kill points of seeds 636059-636088 at steps 8-27 in the same configuration 13 still cost two steps and 3
# three (636065 is one), so the mechanism stands. With today's max_backup_lag (2) none of those 600 cost over one,
# nor any of 24,000 random four-slot rank kills: the entry keeps a gate of five, a looser bound a user may set.


# Held since 2026-11-30, when the simulation took the agents' rule for the floor (agreement.counts_on: once
# its persist ended, the floor is held only while the verdict counts on it; the simulation had held it always, the
# agents never). That changed this run's course; the mechanism traced above (a verdict over round-old states naming
# a step some nodes had let go) is not ruled out by it. Kept as a regression test of the two-step bound.
FORMER_MISSES = [
    pytest.param(cluster_sim.Config(nodes=4, ranks=2, slots=3, steps=30, interval=2, step_ms=100.0, jitter_ms=0.5,
                                    copy_ms=9.0, agent_ms=9.75, slow_node=2, slow_factor=3.75, net_ms=2.5, hash_ms=18.0,
                                    backup_ms=0.0, persist_ms=116.0, leader_us_per_node=20.0, max_backup_lag=5),
                 1753, "rank", 9, id="nothing-in-common"),
]


@pytest.mark.parametrize("config,seed,fault,at", FORMER_MISSES)
def test_the_former_counterexamples_of_the_two_step_bound_hold(config: cluster_sim.Config, seed: int, fault: str,
                                                              at: int) -> None:
    costs_at_most_two_steps(config, seed, fault, at)


@pytest.mark.xfail(strict=True, reason="open counterexamples of the two-step bound outside the defaults (see KNOWN_MISSES)")
@pytest.mark.parametrize("config,seed,fault,at", KNOWN_MISSES)
def test_the_known_counterexamples_of_the_two_step_bound(config: cluster_sim.Config, seed: int, fault: str,
                                                          at: int) -> None:
    """Strict: once a change to the rules makes one of them hold, this fails and the entry goes."""
    costs_at_most_two_steps(config, seed, fault, at)


# A random run on 2026-11-26 found counterexamples to the strict
# claim for agents of any speed, e.g. Config(nodes=2, ranks=1, slots=4, interval=2, slow_node=1, slow_factor=3.0,
# agent_ms=12.1, persist_ms=284, ...), seed=481938: node 1's agent slept 267 ms (2.7 steps) while it held the older
# undecided due step 14, a persist and the candidate, so due step 16 had only the slot the ranks write and was
# overwritten ("the ranks of node(s) ['n0001'] moved past it before their agent held it"). In 12,000 random
# configurations every such miss had an agent reaction longer than interval - 1 steps; hypothesis found one at
# 0.77 of that (a slow leader: two slow reactions in one round trip). Half of it is the documented bound.
def prompt(config: cluster_sim.Config, outcome: dict[str, Any]) -> bool:
    """The bound under which no due step is lost for want of a hold: every agent (the leader included) reacted
    within half of ``save_storage_interval - 1`` steps, so that a due step's round trip (its agent holds it and
    says so, the leader decides, every agent learns it) ends before the next due step is written."""
    return bool(outcome["slowest_reaction_ms"] < (config.interval - 1) * config.step_ms / 2)


def test_every_due_step_is_persisted_unless_a_persist_runs_and_no_snapshot_is_skipped() -> None:
    """With four slots (the multi-node default) a due step waits for its decision in the slot the agent leaves
    spare, as long as every agent reacts within half of ``save_storage_interval - 1`` steps. A slower agent may still
    hold an older undecided due step (its holds all taken) when the next one is written, and miss it; with three
    slots an agent a whole step late may. Either way every due step is decided, and every one passed over is
    announced with its reason: none is ever silently lost. 40 examples."""
    found = failures(sample("every_due_step", 40), every_due_step_is_decided)
    assert not found, "\n".join(found)


def every_due_step_is_decided(config: cluster_sim.Config, seed: int, fault: str | None, at: int | None) -> None:
    outcome = cluster_sim.run(config, seed)
    assert outcome["skipped"] == 0, "a snapshot was skipped"
    for step in outcome["due"]:
        why = outcome["passed"].get(step)
        assert step in outcome["persisted"] or why is not None, f"due step {step} neither persisted nor passed over"
        if config.slots >= 4 and prompt(config, outcome):
            assert step in outcome["persisted"] or "still persist" in why or "every node persists" in why, \
                f"due step {step}: {why} (slowest agent reaction {outcome['slowest_reaction_ms']:.0f} ms)"


def test_with_prompt_agents_and_four_slots_no_due_step_is_lost_for_want_of_a_hold() -> None:
    """The strict half of the property above on every example: agents that react within a fraction of a step
    (the slow node 3 times slower at most), intervals of 3 steps or more, four slots. 40 examples."""
    found = failures(sample("prompt_agents", 40), no_due_step_lost_for_want_of_a_hold)
    assert not found, "\n".join(found)


def no_due_step_lost_for_want_of_a_hold(config: cluster_sim.Config, seed: int, fault: str | None,
                                        at: int | None) -> None:
    prompt_config = dataclasses.replace(config, slots=4, interval=max(3, config.interval),
                                        agent_ms=min(config.agent_ms, 8.0), slow_factor=min(config.slow_factor, 3.0))
    outcome = cluster_sim.run(prompt_config, seed)
    assert outcome["skipped"] == 0, "a snapshot was skipped"
    if not prompt(prompt_config, outcome):
        return   # the exponential tail drew a reaction past the bound: the property above covers it
    for step in outcome["due"]:
        why = outcome["passed"].get(step)
        assert step in outcome["persisted"] or "still persist" in why or "every node persists" in why, \
            f"due step {step}: {why}"


# A counterexample to the property above until 2026-11-30 (the first fixed sample of 2026-11-29 drew it): three nodes of
# two ranks, four slots, a due step every 6 steps, persists of 597 ms, node 1's agent 2.9 times slower: node 1's
# persist of step 12 (597 ms against a 600 ms interval) still ran when its ranks committed 18, and its agent held three
# steps, the persisted 12 (the floor), the candidate 17 and 16 (job-safe and node-safe at once, in the slot kept spare
# for a due step, so that a node loss finds it). The ranks wrote 19 over 18. The rule lets a due step that comes
# while a persist runs be passed over; but the leader decided 18 after the persist had ended and named the reason it
# saw ("moved past it"). Each node now tells the leader which persist it last saw end and how far its ranks had got by
# then (``NodeState.wrote``, ``freed``), and the leader names the persist. The same miss had shown in
# tests/jobs/test_multinode.py's uninterrupted run on a loaded machine (due step 10 during the persist of 5).
PROMPT_MISSES = [
    pytest.param(cluster_sim.Config(nodes=3, ranks=2, slots=4, steps=30, interval=6, step_ms=100.0,
                                    jitter_ms=18.545662603531397, copy_ms=10.635135328519528,
                                    agent_ms=12.175048623146798, slow_node=1, slow_factor=2.8789959282882682,
                                    net_ms=1.4819621477088043, hash_ms=12.128298898392925, backup_ms=0.0,
                                    persist_ms=596.9525946193248, leader_us_per_node=20.0, max_backup_lag=5),
                 365341, id="due-step-12"),
]
# Seed 365335 drew it (due step 18, during the persist of 12) until 2026-12-06, when a node began to say what a verdict
# made it hold in the same round (easyckpt_agent.node_agreement.agree): that run no longer passes 18 over; 365341 is
# the first seed after it that still meets the same case (due step 12, during the persist of 6).


@pytest.mark.parametrize("config,seed", PROMPT_MISSES)
def test_a_due_step_overwritten_during_a_persist_is_passed_over_for_that_persist(config: cluster_sim.Config,
                                                                                 seed: int) -> None:
    no_due_step_lost_for_want_of_a_hold(config, seed, None, None)
    prompt_config = dataclasses.replace(config, agent_ms=8.0)
    # Ranks that do not wait for their agent's word on a due step (three slots across nodes never do): 12 is passed
    # over, for the persist. Ranks that wait (four slots, easyckpt.snapshot.slots.DUE_WAIT) keep it until the persist
    # of 6 ends, and it reaches disk.
    passed = cluster_sim.run(dataclasses.replace(prompt_config, due_wait_ms=0), seed)["passed"]
    assert passed.get(12, "").startswith("node n0001 still persisted step 6 when its ranks committed it"), passed
    assert 12 in cluster_sim.run(prompt_config, seed)["persisted"]


def test_persists_longer_than_the_interval_never_leave_the_nodes_without_a_common_step() -> None:
    """benchmarks/README's table row (8 nodes, persists of 600 ms against a 500 ms interval, one agent 10 times
    slower): the nodes that finished a persist let its step go once the job-safe step passed it, while the slow
    node, still writing, held it and the candidate only. The leader then named no job-safe step for a round
    (a lag of 32 steps). Now the persisted step is kept until its iteration is committed."""
    config = cluster_sim.Config(nodes=8, slow_node=7, steps=60, slots=4, persist_ms=600, slow_factor=10.0)
    outcome = cluster_sim.run(config, 73723708)
    assert outcome["uncovered"] == 0, "a moment with no step held on every node"
    assert max(outcome["job_lags"]) <= config.interval + 2, outcome["job_lags"]
    assert len(outcome["persisted"]) + len(outcome["passed"]) == len(outcome["due"])


def test_an_agent_asleep_past_the_interval_misses_a_due_step_and_says_so() -> None:
    """The bound's other side, replayed (one like the counterexample above): node 1's agent, 3 times slower, once
    takes 272 ms, and node 1's ranks overwrite a due step (6; 12 since the floor's rule of 2026-11-30) before their
    agent held it. It is announced with its reason, and the next due step is persisted. (Seed 342044 missed due
    step 12 the same way until a trailing node-safe step took the spare slot; with that hold its due steps are all
    persisted.) Seed 342051 drew it until 2026-12-06, when a node began to say what a verdict made it hold in the same
    round (``easyckpt_agent.node_agreement.agree``); 342104, the first seed after it that meets the same case, has the
    agent take 140 ms once and node 1's ranks overwrite due step 18."""
    config = cluster_sim.Config(nodes=2, ranks=1, slots=4, steps=30, interval=2, step_ms=100.0, jitter_ms=11.7,
                                copy_ms=18.2, agent_ms=10.4, slow_node=1, slow_factor=3.0, net_ms=1.0, hash_ms=18.6,
                                persist_ms=515, max_backup_lag=5)
    # max_backup_lag=5: the gate's default when this was found. At today's two, the ranks wait for the slow agent
    # and no due step is missed (the gate's cost: training time instead).
    outcome = cluster_sim.run(dataclasses.replace(config, due_wait_ms=0), 342104)
    assert outcome["slowest_reaction_ms"] > config.step_ms * (config.interval - 1) / 2
    missed = {step: why for step, why in outcome["passed"].items()
              if "still persist" not in why and "every node persists" not in why}
    assert len(missed) == 1, outcome
    [(step, why)] = missed.items()
    assert why == "the ranks of node(s) ['n0001'] moved past it before their agent held it", outcome
    assert step + config.interval in outcome["persisted"], "the next due step is persisted"
    # The ranks as they are: they wait for the agent's word on a due step in their one free slot (at most 500 ms or
    # four steps), so the same sleep costs training time instead of the due step.
    waiting = cluster_sim.run(config, 342104)
    assert step in waiting["persisted"] and waiting["due_waited_ms"] > 0, waiting


def test_starved_agents_cost_more_steps_but_always_leave_a_step() -> None:
    """An agent ten times slower than a step: the lag grows, the job never loses every step in memory. 20 examples."""
    found = failures(sample("starved_agents", 20, faults=True), starved_agents_leave_a_step)
    assert not found, "\n".join(found)


def starved_agents_leave_a_step(config: cluster_sim.Config, seed: int, fault: str | None, at: int | None) -> None:
    starved = dataclasses.replace(config, agent_ms=config.step_ms * 2, slow_factor=5.0)
    outcome = cluster_sim.run(starved, seed, fault, at)
    assert outcome["resumed"] is not None, f"nothing to resume from: {outcome}"
