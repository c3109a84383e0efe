"""easyckpt_agent.node_agreement: a follower node carries out the leader's verdicts on real slots (the test: the leader)."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_slots import JOB, START, Harness

from easyckpt_agent.agreement import NodeState, StepFailure, Verdict, verdict_to_wire
from easyckpt_wire.control import ControlReader, PersistFailure, control_path
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import PeerNode, PeerTable
from easyckpt_wire.shm import SlotState, list_slots

PEERS = PeerTable("t" * 16, "n1", "n0", {"n0": PeerNode("tcp://127.0.0.1:1", (0, 1)),
                                         "n1": PeerNode("tcp://127.0.0.1:2", (2, 3))}, world_size=4)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Harness]:
    node = Harness(tmp_path, world_size=4, first_rank=2, node_id="n1")   # ranks 2 and 3; rank 0's node leads
    node.agent.cluster.peers = PEERS
    yield node
    node.close()


def verdict(node: Harness, **fields: object) -> None:
    """The leader's VERDICT, as the replica server's thread stores it."""
    node.agent.cluster.jobwide.on_verdict({"node": "n0", **verdict_to_wire(Verdict(**fields))}, PEERS)  # type: ignore[arg-type]


def agree(node: Harness) -> None:
    ranks, committed, common = node.scan()
    node.agent.agreement.agree(ranks, committed, common)


def start_the_taken_persist(node: Harness, step: int, **fields: object) -> None:
    """The leader takes ``step`` (committed in slot 0 of every local rank): this node claims it and starts writing."""
    node.ranks.commit_all(0, step)
    verdict(node, take=step, decided=step, newest=step, **fields)
    agree(node)
    node.agent.scheduler.start_ready()
    agree(node)
    assert node.agent.scheduler.inflight_step() == step


def test_before_any_verdict_the_undecided_due_step_is_held_for_the_leader(node: Harness) -> None:
    ranks, agent = node.ranks, node.agent
    ranks.commit_all(0, 4)
    ranks.commit_all(1, 5)
    ranks_, committed, common = node.scan()
    assert agent.protection.advance_safe(ranks_, committed, common, agent._publish)   # a single-node round first
    assert agent.protection.safe == 5 and agent.protection.safe_holds
    agree(node)
    assert agent.protection.safe_holds == []   # the single-node hold gives way to the job's
    assert agent.protection.roles.steps == {5} and not ranks.writable(2, 1) and not ranks.writable(3, 1)
    assert ranks.writable(2, 0)


def test_a_verdict_is_carried_out_take_holds_and_both_safe_steps(node: Harness) -> None:
    ranks, agent = node.ranks, node.agent
    ranks.commit_all(0, 4)
    ranks.commit_all(1, 5)
    verdict(node, job_safe=4, node_safe=4, candidate=5, take=5, decided=5, newest=5)
    agree(node)
    assert agent.agreement.took == 5 and set(agent.scheduler.claims.ranks(5)) == {2, 3}
    # the persist's step is held by its claim, and as the candidate by a role too (it stays held as the persist ends)
    assert agent.protection.roles.steps == {4, 5}
    assert (agent.protection.safe, agent.protection.node_safe, agent.cluster.safe_step) == (4, 4, 4)
    assert agent.agreement.held_everywhere({2, 3}) == {4, 5}
    assert not any(ranks.writable(rank, slot) for rank in (2, 3) for slot in (0, 1))
    agent._publish()
    view = ControlReader(control_path(node.shm_dir, JOB)).read()
    assert view is not None and not view.changing and view.gated
    assert (view.safe, view.node_safe, view.held, view.decided) == (4, 4, frozenset({4, 5}), 5)
    agent.scheduler.claims.drop(5)
    agree(node)   # the same verdict again: its take was acted on once
    assert not agent.scheduler.claims


def test_a_take_this_node_cannot_carry_out_is_reported_lost(node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    ranks, agent = node.ranks, node.agent
    ranks.commit_all(0, 5)
    ranks_, committed, _ = node.scan()
    caplog.set_level(logging.WARNING, logger="easyckpt_agent.node_agreement")
    with ranks.writing(3, 0):   # rank 3 overwrites its slot of step 5 as the take arrives
        agent.agreement.take(Verdict(take=5), ranks_, committed)
    assert agent.agreement.lost == {5} and not agent.scheduler.claims and ranks.writable(2, 0)
    ranks.commit_all(1, 10)
    ranks_, committed, _ = node.scan()
    assert agent.scheduler.claims.claim_all(10, ranks_, committed)
    agent.scheduler.start_ready()   # this node's shards of step 10 are being written
    agent.agreement.take(Verdict(take=15), ranks_, committed)
    assert agent.agreement.lost == {5, 15} and agent.agreement.took == 15
    assert agent.agreement.lost_to == 10, "the leader names the persist that kept this node from step 15"
    assert [r.getMessage().split(": ")[-1] for r in caplog.records] == [
        "a local rank no longer holds it", "its persister is busy with step 10"]
    node.settle()


def test_passed_over_due_steps_are_heard_once_and_decide_what_ranks_spare(node: Harness,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    agent = node.agent
    node.ranks.commit_all(0, 12)
    caplog.set_level(logging.INFO, logger="easyckpt_agent.roles")
    verdict(node, job_safe=12, candidate=12, passed=((10, "node n0's persister is busy"),), decided=10)
    agree(node)
    agree(node)
    assert agent.announced.recent == [10] and len(caplog.records) == 1
    assert agent.agreement.decided() == 10
    status = agent.agreement.status(12)
    assert status["passed_over"] == [10] and status["job_safe_lag"] == 0
    assert status["node_safe_lag"] == 13   # no node-safe step yet: a node loss now would cost every step
    assert status["took"] == -1 and isinstance(status["verdict_age"], float)


def test_a_resume_forgets_the_abandoned_timelines_takes_and_verdict(node: Harness) -> None:
    agent = node.agent
    verdict(node, passed=((10, "why"),), decided=10)
    agree(node)
    agent.agreement.took, agent.agreement.lost, agent.agreement.lost_to = 10, {3, 10}, 9
    agent.agreement.rewind(5)
    assert (agent.agreement.took, agent.agreement.lost, agent.announced.recent) == (5, {3}, [])
    assert agent.agreement.lost_to is None
    assert agent.cluster.jobwide.verdict is None


def test_the_taken_step_stays_held_after_its_persist_until_a_newer_step_is_job_safe(node: Harness) -> None:
    """The floor (agreement.persist_floor) is held by a role once the persist that held it ended, while the verdict
    counts on it (here: as the candidate). It was planned but held by nobody: with three slots no step was held on
    every node from each persist's end to the next due step, so the job had no job-safe or node-safe step most of
    the time and the ranks' lag gates waited at every snapshot (a 12-step 2-node soak reference run spent 21 of its
    24 s in them)."""
    ranks, agent = node.ranks, node.agent
    start_the_taken_persist(node, 3, job_safe=3, node_safe=3)
    ranks.commit_all(1, 4)
    node.settle()
    verdict(node, job_safe=None, node_safe=None, candidate=3, take=3, committed=3, decided=3, newest=4)
    agree(node)
    assert agent.scheduler.inflight_step() is None and not agent.scheduler.claims
    assert 3 in agent.protection.roles.steps and 3 in agent.agreement.held_everywhere({2, 3})
    assert not ranks.writable(2, 0) and not ranks.writable(3, 0), "the ranks must not write over the floor"
    verdict(node, job_safe=4, node_safe=4, candidate=4, take=3, committed=3, decided=3, newest=4)
    agree(node)
    assert agent.protection.roles.steps == {4} and ranks.writable(2, 0), "a newer job-safe step frees the floor"


def test_the_floor_counted_on_stays_held_as_its_persist_ends(node: Harness) -> None:
    """A floor the verdict counts on gets its role while the persist still runs, so that no moment passes between
    the persist's end and the next round with its slots free. Held only from the next round on, the state a node
    sent right after the end named the floor held nowhere, and the leader's verdict over it named no job-safe or
    node-safe step after every persist (a real 2-node run, 40 steps at full speed: the node-safe lag reached 40,
    p99 22; ``benchmarks/multinode_freshness.py``)."""
    ranks, agent = node.ranks, node.agent
    start_the_taken_persist(node, 3, job_safe=3, node_safe=3)
    assert 3 in agent.protection.roles.steps, "held by a role as well as by its persist"
    ranks.commit_all(1, 4)
    node.settle()
    assert agent.scheduler.inflight_step() is None and not agent.scheduler.claims
    # no round has run since the persist ended
    assert 3 in agent.agreement.held_everywhere({2, 3}), "the next state must name the floor held"
    assert not ranks.writable(2, 0) and not ranks.writable(3, 0), "the ranks must not write over the floor"
    agree(node)
    assert agent.protection.roles.steps >= {3}


def test_the_state_names_the_persist_that_ended_and_how_far_the_ranks_had_got(node: Harness) -> None:
    """NodeState.wrote and freed: the leader names this persist as the reason a due step committed meanwhile is gone
    (tests/unit/test_agreement.py). A resume forgets what lies on the abandoned timeline."""
    ranks, agent = node.ranks, node.agent
    start_the_taken_persist(node, 5, job_safe=5, candidate=5)
    assert agent.agreement.wrote is None
    ranks.commit_all(1, 9)
    ranks.commit(2, 2, 11)   # rank 2 moved on: the newest step any local rank committed counts
    node.settle()
    agree(node)
    assert (agent.agreement.wrote, agent.agreement.freed) == (5, 11)
    agent.agreement.rewind(8)
    assert (agent.agreement.wrote, agent.agreement.freed) == (5, 8)
    agent.agreement.rewind(4)
    assert (agent.agreement.wrote, agent.agreement.freed) == (None, -1)


def test_a_rank_a_restart_placed_on_another_node_is_no_longer_waited_for(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Fault soak, seed 7, fault 7 (node loss in a 2x1 job): the restarted job's rendezvous put rank 0 on node1 and
    rank 1 on node0, whose agent survived. It still counted its old rank 0 (slots here, process dead) as local: no
    step after the resume was ever held by every local rank, so nothing was backed up or persisted, and the job ended
    with the tracker at 0. The new peer table says which ranks are this node's."""
    node = Harness(tmp_path, ranks=2, world_size=2, node_id="n0")
    try:
        ranks, agent = node.ranks, node.agent
        ranks.commit(0, 0, 3)   # the old incarnation's rank 0, on this node
        ranks.commit(0, 1, 6)
        node.scan()
        assert 0 in agent.watcher.ranks, "rank 0 is learnt from its slot's metadata"
        caplog.set_level(logging.INFO, logger="easyckpt_agent.watcher")
        table = PeerTable("n" * 16, "n0", "n1", {"n0": PeerNode("tcp://127.0.0.1:1", (1,)),
                                                 "n1": PeerNode("tcp://127.0.0.1:2", (0,))}, world_size=2)
        node.request(b"r1", Kind.HELLO, rank=1, pid=os.getpid(), pid_start=START, world_size=2, local_world_size=1,
                     save_storage_interval=5, max_ckpt_num=2, log_file_path="", id=1)
        node.request(b"r1", Kind.PEERS, **table.to_wire(), id=2)   # starts the replica server (127.0.0.1, any port)
        assert node.sent[-1][1]["ok"], node.sent[-1]
        assert agent.watcher.local_ranks() == {1} and 0 not in agent.watcher.ranks
        assert "rank(s) [0] now run on other nodes" in caplog.text
        # The job resumed at 3: rank 0's leftover step 6 belongs to the abandoned timeline, its step 3 does not.
        node.request(b"r1", Kind.RESUME, rank=1, step=3, stale=[], id=3)
        agent.resumer.invalidate_abandoned()
        assert ranks.maps[0, 1].header().state != SlotState.COMMITTED and ranks.maps[0, 0].header().committed
        ranks.commit(1, 0, 4)
        ranks.commit(1, 1, 5)
        ranks_, committed, common = node.scan()
        assert 0 not in agent.watcher.ranks, "not learnt again from its leftover slots"
        assert ranks_ == {1} and common == frozenset({4, 5})
        assert agent.scheduler.claims.claim_all(5, ranks_, committed), "the step is claimed without rank 0"
        agent.cluster.run_alone()
        assert agent.watcher.assigned is None
    finally:
        node.close()


def test_the_state_says_whether_a_local_rank_lives(node: Harness) -> None:
    """NodeState.alive: a leader gives up a stage that a node whose ranks are gone can never finish
    (tests/unit/test_agent_lifecycle.py); a node whose ranks live may still commit the step."""
    leading = PeerTable(PEERS.token, "n1", "n1", PEERS.nodes, world_size=4)
    node.agent.cluster.peers = leading
    states = node.agent.cluster.jobwide.states
    node.ranks.commit_all(0, 5)
    agree(node)
    assert states["n1"].alive and 5 in states["n1"].local
    for proc in node.agent.watcher.ranks.values():
        proc.dead = True   # as the watcher marks a rank whose process is gone
    agree(node)
    assert not states["n1"].alive and 5 in states["n1"].local, "its memory outlives its ranks"


def test_a_failed_persist_is_told_to_the_leader_once_no_rank_can_ask_for_it_again(node: Harness) -> None:
    """NodeState.failure: the leader names it in the verdict, so that no rank of another node waits for the commit
    of a step this node's files will never complete (soak seed 1323, fault 523). Only once every local rank ended
    or died: a rank's close() asks for its last step again, and the retry may work."""
    node.agent.cluster.peers = PeerTable(PEERS.token, "n1", "n1", PEERS.nodes, world_size=4)   # n1 leads: its states
    states, scheduler = node.agent.cluster.jobwide.states, node.agent.scheduler
    node.ranks.commit_all(0, 19)
    scheduler.failure = PersistFailure(19, 28, "/ckpt: no space", 235_000, 212_000, 0.0, 0.0, 1)
    agree(node)
    assert states["n1"].failure is None and scheduler.job_failure is None, "its ranks live: they may ask again"
    procs = list(node.agent.watcher.ranks.values())
    procs[0].said_bye = True
    procs[1].dead = True
    agree(node)
    assert states["n1"].failure == StepFailure(19, "n1", 28, "/ckpt: no space", 235_000, 212_000)
    assert scheduler.job_failure == states["n1"].failure, "the leader's own verdict names it, to every node"
    ranks, committed, _ = node.scan()
    assert scheduler.claims.claim_all(19, ranks, committed)   # the agent persists it again (at its ranks' failure)
    agree(node)
    assert states["n1"].failure is None and scheduler.job_failure is None


def test_a_step_another_node_failed_to_persist_keeps_this_nodes_memory_when_its_ranks_end(
        node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Soak seed 1323, fault 523: this node wrote its files of the last step, the leader's persist of it failed; the
    ranks here ended (or were killed by their launcher), and this node's memory is half of the only copy of that
    step. The agent hears the failure in the verdict, keeps its slots for the restart, and says so."""
    caplog.set_level(logging.INFO)
    scheduler = node.agent.scheduler
    node.ranks.commit_all(0, 19)
    failure = StepFailure(19, "n0", 28, "/ckpt: no space", 235_000, 212_000)
    verdict(node, committed=15, failure=failure)
    agree(node)
    assert scheduler.job_failure == failure and scheduler.job_committed == 15
    scheduler.persisted = 19   # this node's files of step 19 are durable (its own persist worked)
    for proc in node.agent.watcher.ranks.values():
        proc.said_bye = True
    assert node.agent.life.should_exit() and not node.agent.life.ended_cleanly
    assert len(list_slots(node.shm_dir, JOB)) == 6, "kept for the restart"
    assert "persist of step 19 failed: on node n0: /ckpt: no space" in caplog.text, caplog.text
    assert "so the job's slots are kept in" in caplog.text, caplog.text
    verdict(node, committed=19)   # committed after all: nothing is only in memory
    agree(node)
    assert scheduler.job_failure is None and scheduler.job_committed == 19


def test_what_a_verdict_makes_the_node_hold_is_said_in_the_same_round(tmp_path: Path) -> None:
    """The node-safe step takes two rounds of the leader (a step every node committed is named the candidate, then,
    once every node holds it, job-safe and node-safe). A node used to say what the candidate's verdict made it hold
    only at its next round (up to a poll interval later, every hop); in the simulation, whose agents act only on news,
    never while the ranks waited in their lag gate for that very step (with max_backup_lag=1 every snapshot waited
    its bound). Now the state goes out again at once when carrying out the verdict changed it: here the leader's own
    state names the candidate held after one round. Not with three slots (``agreement.PROMPT_STATE_SLOTS``)."""
    for slots in (4, 3):
        (tmp_path / str(slots)).mkdir()
        node = Harness(tmp_path / str(slots), world_size=4, first_rank=2, node_id="n1", slots=slots)
        try:
            node.agent.cluster.peers = PeerTable(PEERS.token, "n1", "n1", PEERS.nodes, world_size=4)   # n1 leads
            jobwide = node.agent.cluster.jobwide
            jobwide.states["n0"] = NodeState("n0", local=frozenset({5}), held=frozenset({5}), backed=frozenset({5}))
            node.ranks.commit_all(0, 5)
            agree(node)
            assert 5 in node.agent.protection.roles.steps, "the candidate is held"
            said = 5 in jobwide.states["n1"].held
            assert said == (slots >= 4), jobwide.states["n1"]
            assert jobwide.verdict is not None and (jobwide.verdict.job_safe == 5) == said, jobwide.verdict
        finally:
            node.close()
