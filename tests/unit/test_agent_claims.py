"""easyckpt_agent.claims: persist claims as flocks on real slot files, and the ranks' FLUSH/BYE requests and answers."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_slots import JOB, FakeRanks, decode_reply, held
from conftest import s3_endpoint_down

from easyckpt.node.persist_watch import describe_failure
from easyckpt_agent.agreement import StepFailure
from easyckpt_agent.claims import Claims, FlushRequests, never_holds
from easyckpt_agent.watcher import SlotHolds, Watcher
from easyckpt_wire import layout
from easyckpt_wire.storage import location


class Node:
    def __init__(self, shm_dir: Path) -> None:
        self.ranks = FakeRanks(shm_dir)
        self.watcher = Watcher(shm_dir, JOB)
        self.claims = Claims(SlotHolds())
        self.flushes = FlushRequests()
        self.sent: list[tuple[bytes, dict[str, Any]]] = []

    def send(self, identity: bytes, blob: bytes) -> None:
        self.sent.append((identity, decode_reply(blob)))

    def scan(self) -> tuple[set[int], dict[int, Any], frozenset[int]]:
        self.watcher.scan(relist_every=0)
        return held(self.watcher)

    def close(self) -> None:
        self.claims.release(lambda step: True)
        self.watcher.close()
        self.ranks.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    node = Node(tmp_path)
    yield node
    node.close()


def test_a_step_is_claimed_on_every_rank_or_on_none(node: Node) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 5)
    ranks_, committed, _ = node.scan()
    with ranks.writing(1, 0):   # rank 1 overwrites its slot of step 5 as the agent claims it
        assert not node.claims.claim_all(5, ranks_, committed)
    assert 5 not in node.claims and ranks.writable(0, 0)   # rank 0's claim was let go of
    ranks.commit_all(1, 6)
    ranks_, committed, _ = node.scan()
    assert node.claims.claim_all(6, ranks_, committed)
    assert set(node.claims.ranks(6)) == {0, 1} and node.claims.on_every(ranks_) == {6}
    assert not ranks.writable(0, 1) and not ranks.writable(1, 1)
    assert node.claims.claim_all(6, ranks_, committed)   # claiming again changes nothing
    node.claims.drop(6)
    assert ranks.writable(0, 1) and ranks.writable(1, 1) and not node.claims


def test_a_claim_shares_the_flock_of_another_hold_and_keeps_it(node: Node) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 5)
    ranks_, committed, _ = node.scan()
    holds = node.claims.holds
    assert holds.hold_all(ranks_, committed, 5, ("safe",)) is not None
    assert node.claims.claim_all(5, ranks_, committed)
    node.claims.release(lambda step: step == 5)
    assert not ranks.writable(0, 0)   # still the safe step
    for rank in ranks_:
        holds.release(committed[rank][5], ("safe",))
    assert ranks.writable(0, 0)


def test_claims_that_a_rank_will_never_satisfy_are_dropped_with_why(node: Node) -> None:
    ranks = node.ranks
    ranks.commit(0, 0, 5)
    ranks.commit(1, 0, 4)
    _, committed, _ = node.scan()
    assert node.claims.claim(5, 0, committed[0][5])   # rank 1 has not committed step 5 yet
    assert node.claims.drop_unreachable(node.watcher, None) == {}
    assert never_holds(node.watcher, 1, 5) == ""
    ranks.commit(1, 1, 6)   # rank 1 moved past step 5 without it
    node.scan()
    assert node.claims.drop_unreachable(node.watcher, None) == {5: "rank 1 moved on without a snapshot of step 5"}
    assert 5 not in node.claims and ranks.writable(0, 0)
    ranks.commit(0, 1, 6)
    _, committed, _ = node.scan()
    assert node.claims.claim_all(6, {0, 1}, committed)
    assert node.claims.drop_unreachable(node.watcher, 6) == {}   # on disk already: let go of, silently
    assert not node.claims and ranks.writable(0, 1)


def test_a_requested_step_is_claimed_rank_by_rank_as_each_commits_it(node: Node) -> None:
    ranks, flushes = node.ranks, node.flushes
    ranks.commit(0, 0, 7)
    node.scan()
    flushes.request(0, 7, node.watcher, node.claims, durable=-1)
    assert flushes.wanted == {7} and set(node.claims.ranks(7)) == {0}   # at once: rank 0 goes on in other slots
    flushes.waiters.append((b"rank0", 11, 7))
    flushes.answer(node.send, persisted=None, save_dir=Path("/nonexistent"), given_up=-1, failure=None)
    assert node.sent == []   # still wanted: the waiter waits
    ranks.commit(1, 0, 7)
    ranks_, committed, _ = node.scan()
    flushes.claim_committed(ranks_, committed, node.claims, durable=-1)
    assert set(node.claims.ranks(7)) == {0, 1}
    flushes.request(1, 7, node.watcher, node.claims, durable=-1)   # asked already: nothing new
    flushes.request(1, 3, node.watcher, node.claims, durable=5)    # on disk already
    assert flushes.wanted == {7}


def test_flush_waiters_hear_that_the_step_is_on_disk_or_why_not(node: Node, tmp_path: Path) -> None:
    ranks, flushes = node.ranks, node.flushes
    save_dir = tmp_path / "ckpt"
    (save_dir / layout.iteration_dirname(7)).mkdir(parents=True)
    (save_dir / layout.TRACKER).write_text("7")   # a persist publishes the iteration, then tracks it
    ranks.commit_all(0, 7)
    ranks.commit_all(1, 9)
    node.scan()
    for step in (7, 9):
        flushes.request(0, step, node.watcher, node.claims, durable=-1)
    flushes.waiters += [(b"a", 1, 7), (b"b", 2, 9)]
    flushes.give_up(9, "persist of step 9 failed: /ckpt: [Errno 28] No space left on device")
    flushes.answer(node.send, persisted=7, save_dir=save_dir, given_up=9, failure={"step": 9})
    assert [identity for identity, _ in node.sent] == [b"a", b"b"]
    ok, refused = node.sent[0][1], node.sent[1][1]
    assert ok["ok"] and ok["id"] == 1 and ok["persisted"] == 7 and ok["committed"]
    assert not refused["ok"] and "No space left" in refused["error"] and refused["failure"] == {"step": 9}
    assert flushes.waiters == [] and flushes.failed == {}   # nobody waits for step 9 any more
    flushes.bye_waiters.append((b"c", 3))
    flushes.answer_byes(node.send, persisted=7, failure=None)
    assert node.sent[-1][0] == b"c" and node.sent[-1][1]["ok"] and flushes.bye_waiters == []


def test_a_flush_answered_while_the_store_is_down_says_not_committed_instead_of_raising(
        node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The answer runs in the agent's loop: a store that went down since the persist (here an s3:// save_dir whose
    endpoint nobody listens on) must not end the loop; the waiter hears the step persisted, not yet committed."""
    pytest.importorskip("boto3")
    s3_endpoint_down(monkeypatch)
    node.flushes.waiters.append((b"a", 1, 7))
    with caplog.at_level(logging.WARNING, logger="easyckpt_agent.claims"):
        node.flushes.answer(node.send, persisted=7, save_dir=location("s3://bucket/runs/a"), given_up=-1,
                            failure=None)
    (identity, reply), = node.sent
    assert identity == b"a" and reply["ok"] and reply["persisted"] == 7 and not reply["committed"], reply
    assert "cannot tell whether s3://bucket/runs/a/iteration_0000007 is committed" in caplog.text, caplog.text


def test_a_flush_says_committed_only_once_the_iteration_is_published_and_tracked(node: Node, tmp_path: Path) -> None:
    """Across nodes the leader publishes the iteration, then writes the tracker: a rank that waits for the commit (the
    end of the run) must not end in between, or a job that ended names an older step in its tracker."""
    save_dir = tmp_path / "save"

    def committed() -> bool:
        node.flushes.waiters.append((b"a", 1, 7))
        node.flushes.answer(node.send, persisted=7, save_dir=save_dir, given_up=-1, failure=None)
        (identity, reply), = node.sent
        node.sent.clear()
        assert identity == b"a" and reply["ok"] and reply["persisted"] == 7, reply
        return bool(reply["committed"])

    save_dir.mkdir()
    (save_dir / layout.TRACKER).write_text("5")
    assert not committed()                                       # this node's shards only
    (save_dir / layout.iteration_dirname(7)).mkdir()
    assert not committed()                                       # published, the tracker not written yet
    (save_dir / layout.TRACKER).write_text("7")
    assert committed()


def test_a_flush_of_a_step_another_node_failed_to_persist_is_refused_with_that_nodes_failure(
        node: Node, tmp_path: Path) -> None:
    """Soak seed 1323, fault 523: this node's files of the run's last step were durable, the leader's persist of it
    then failed on the full disk, and this node's rank waited flush_timeout for a commit that could not come (its
    launcher killed it first, and its agent, not told, kept nothing on purpose). The leader's verdict names the
    failure; the waiter hears it with the failure report (a PersistError) and the job's newest iteration."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    (save_dir / layout.TRACKER).write_text("15")
    leader = StepFailure(19, "node0", 28, "/ckpt: [Errno 28] no space left", 235_000, 212_000)

    def answer(step: int, failure: StepFailure | None) -> dict[str, Any]:
        node.flushes.waiters.append((b"a", 1, step))
        node.flushes.answer(node.send, persisted=19, save_dir=save_dir, given_up=-1, failure=None,
                            job_failure=failure, job_committed=15)
        (_, reply), = node.sent
        node.sent.clear()
        return reply

    refused = answer(19, leader)
    assert not refused["ok"] and refused["persisted"] == 15, refused
    assert "step 19 cannot be committed: node node0's persist of it failed" in refused["error"], refused
    report = refused["failure"]
    assert report["step"] == 19 and report["errno"] == 28 and report["needed"] == 235_000, report
    assert describe_failure(report).startswith("persist of step 19 failed: on node node0: /ckpt: [Errno 28]"), report
    assert answer(19, None)["ok"]                                    # no failure heard: not committed yet, ask again
    assert answer(19, dataclasses.replace(leader, step=14))["ok"]    # an older step's failure says nothing of 19
    (save_dir / layout.iteration_dirname(19)).mkdir()
    (save_dir / layout.TRACKER).write_text("19")
    committed = answer(19, leader)                                   # committed after all (a retry): that wins
    assert committed["ok"] and committed["committed"], committed


def test_a_requested_step_some_rank_will_never_hold_is_given_up(node: Node) -> None:
    ranks, flushes = node.ranks, node.flushes
    ranks.commit(0, 0, 7)
    node.scan()
    flushes.request(0, 7, node.watcher, node.claims, durable=-1)
    flushes.drop_unreachable(node.watcher, node.claims, durable=-1)
    assert flushes.wanted == {7}   # rank 1 may still commit it
    ranks.commit(1, 0, 8)   # rank 1 moved on without step 7
    node.scan()
    flushes.drop_unreachable(node.watcher, node.claims, durable=-1)
    assert flushes.wanted == set() and flushes.failed == {7: "rank 1 moved on without a snapshot of step 7"}
    assert 7 not in node.claims and ranks.writable(0, 0)
    flushes.wanted.add(8)
    flushes.drop_unreachable(node.watcher, node.claims, durable=8)   # on disk meanwhile
    assert flushes.wanted == set()
    flushes.wanted.add(9)
    flushes.abandon("the agent exited before every local rank held it")
    assert flushes.wanted == set() and flushes.failed[9] == "the agent exited before every local rank held it"
