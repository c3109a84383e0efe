"""easyckpt_agent.scheduler: which step goes to disk when, with real slots, real persists to a temporary save_dir."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_slots import JOB, Harness

from easyckpt_agent.scheduler import PersistScheduler
from easyckpt_wire import layout
from easyckpt_wire.control import ControlReader, control_path
from easyckpt_wire.protocol import Kind


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Harness]:
    node = Harness(tmp_path, log_file_path=str(tmp_path / "persists.log"))
    yield node
    node.close()


def round_(node: Harness, *, multi: bool = False) -> PersistScheduler:
    """The scheduler's share of one round of the agent's loop."""
    scheduler = node.agent.scheduler
    scheduler.finish_inflight()
    node.agent.watcher.scan(relist_every=0)
    for proc in node.agent.watcher.newly_dead():
        scheduler.failed_ranks.add(proc.rank)
    ranks, committed, common = node.scan()
    scheduler.schedule(ranks, committed, common, multi=multi)
    return scheduler


def on_disk(save_dir: Path) -> list[int]:
    return [step for step, _ in layout.complete_iterations(save_dir)]


def test_the_newest_due_step_every_rank_holds_is_persisted_and_its_claims_let_go(node: Harness) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 4)
    scheduler = round_(node)
    assert not scheduler.busy()   # step 4 is not due (save_storage_interval=5)
    ranks.commit(0, 1, 5)
    round_(node)
    assert not scheduler.busy()   # rank 1 does not hold step 5 yet
    ranks.commit(1, 1, 5)
    round_(node)
    assert scheduler.inflight_step() == 5 and scheduler.held_steps() == {5}
    assert not ranks.writable(0, 1) and not ranks.writable(1, 1)
    node.settle()
    assert scheduler.persisted == 5 and on_disk(node.save_dir) == [5] and layout.read_tracker(node.save_dir) == 5
    assert scheduler.last_persist is not None and scheduler.last_persist.step == 5
    assert ranks.writable(0, 1) and ranks.writable(1, 1) and not scheduler.busy()
    assert "persisted step=5 ranks=2" in Path(node.config.log_file_path or "").read_text()
    round_(node)
    assert not scheduler.busy()   # on disk: never again


def test_a_due_step_arriving_while_the_persister_is_busy_is_passed_over_once(node: Harness,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    ranks = node.ranks
    scheduler = node.agent.scheduler
    ranks.commit(0, 0, 5)
    ranks.commit_all(1, 10)
    ranks_, committed, _ = node.scan()
    assert scheduler.claims.claim(5, 0, committed[0][5])   # rank 1 has not committed step 5: nothing starts
    caplog.set_level(logging.INFO, logger="easyckpt_agent.scheduler")
    for _ in range(3):
        ranks_, committed, common = node.scan()
        scheduler.persist_due(ranks_, committed, common)
    assert scheduler.last_passed == 10 and node.agent.announced.recent == [10]
    assert [r.getMessage() for r in caplog.records].count(
        "due step 10 passed over: the persist of step None is still running (a persist takes longer than "
        "save_storage_interval=5 steps); the next due step after it is persisted") == 1
    assert scheduler.passed.active
    scheduler.claims.drop(5)
    ranks_, committed, common = node.scan()
    scheduler.persist_due(ranks_, committed, common)
    assert set(scheduler.claims.ranks(10)) == {0, 1}   # free again: the newest due step is taken


def test_a_failed_persist_is_one_episode_and_its_step_is_not_retried(node: Harness, tmp_path: Path) -> None:
    ranks = node.ranks
    scheduler = node.agent.scheduler
    ranks.commit_all(0, 5)
    ranks_, _, _ = node.scan()
    scheduler.flushes.request(0, 5, node.agent.watcher, scheduler.claims, scheduler.durable())
    scheduler.flushes.waiters.append((b"rank0", 1, 5))
    aside = tmp_path / "ckpt-aside"
    node.save_dir.rename(aside)
    node.save_dir.write_text("not a directory")   # every write under save_dir now fails with ENOTDIR
    round_(node)
    node.settle()
    assert scheduler.failure is not None and scheduler.failure.step == 5 and scheduler.failures == 1
    assert "Not a directory" in scheduler.failure.text and scheduler.given_up == 5
    assert not scheduler.busy() and ranks.writable(0, 0)   # the step stays in memory, its slots go back
    scheduler.answer(node.agent._send)
    assert node.sent and not node.sent[-1][1]["ok"] and "persist of step 5 failed" in node.sent[-1][1]["error"]
    round_(node)
    assert not scheduler.busy()   # not retried
    node.save_dir.unlink()
    aside.rename(node.save_dir)   # the disk is fixed
    ranks.commit_all(1, 10)
    round_(node)
    node.settle()
    assert scheduler.persisted == 10 and scheduler.failure is None and scheduler.failures == 1


def test_the_newest_snapshot_is_persisted_when_a_rank_dies(tmp_path: Path) -> None:
    node = Harness(tmp_path)
    try:
        node.ranks.kill(1)   # rank 1's snapshots name a process that is gone
        node.ranks.commit_all(0, 3)   # not a due step
        scheduler = round_(node)
        assert scheduler.inflight_step() == 3
        node.settle()
        assert scheduler.persisted == 3 and not scheduler.failed_ranks
    finally:
        node.close()


def test_the_tail_of_a_finished_job_is_persisted_when_its_last_due_step_never_was(node: Harness) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 7)   # due step 5 was never held by every rank
    ranks_, _, _ = node.scan()
    scheduler = round_(node)
    assert not scheduler.busy()
    for rank in ranks_:
        node.agent.watcher.ranks[rank].said_bye = True
    round_(node)
    node.settle()
    assert scheduler.persisted == 7


def test_a_job_spanning_nodes_writes_shards_only_once_it_knows_its_peers(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An agent that replaced a dead one hears of due steps (or a rank's FLUSH) before the PEERS another rank's
    socket carries (CI: the final step of test_node_dying_mid_persist failed for want of it): the step waits for
    PEERS, and only a job that never sends it gets the failure that says so."""
    node = Harness(tmp_path, world_size=4)   # ranks 0 and 1 of a 4-rank job
    caplog.set_level(logging.INFO, logger="easyckpt_agent.scheduler")
    try:
        node.ranks.commit_all(0, 5)
        scheduler = round_(node)
        round_(node)
        assert scheduler.inflight is None and scheduler.failure is None and set(scheduler.claims.ranks(5)) == {0, 1}
        waits = [r.getMessage() for r in caplog.records if "wait for it" in r.getMessage()]
        assert waits == ["steps [5] are of a job that spans nodes, and no rank told this agent the other nodes yet "
                         "(PEERS): they wait for it (at most 30s)"], waits
        scheduler.multi = lambda: True   # PEERS arrived
        round_(node)
        node.settle()
        assert scheduler.persisted == 5 and scheduler.failure is None
        assert (node.save_dir / layout.stage_dirname(5)).is_dir() and on_disk(node.save_dir) == []   # the leader commits
        assert any("other nodes are known (PEERS)" in r.getMessage() for r in caplog.records)
        scheduler.multi = lambda: False   # a job whose ranks never send PEERS (another build's): a clear failure
        monkeypatch.setattr("easyckpt_agent.scheduler.PEERS_GRACE", 0.0)
        node.ranks.commit_all(1, 10)
        round_(node)
        node.settle()
        assert scheduler.failure is not None and "PEERS" in scheduler.failure.text
        assert scheduler.given_up == 10 and on_disk(node.save_dir) == []
    finally:
        node.close()


def test_bye_waiters_wait_for_the_persister(node: Harness) -> None:
    scheduler = node.agent.scheduler
    node.ranks.commit_all(0, 5)
    round_(node)
    scheduler.flushes.bye_waiters.append((b"rank1", 9))
    scheduler.answer(node.agent._send)
    assert node.sent == []   # the persist of step 5 runs
    node.settle()
    scheduler.answer(node.agent._send)
    assert node.sent == [(b"rank1", node.sent[0][1])] and node.sent[0][1]["persisted"] == 5


def test_a_resume_forgets_the_newer_steps_of_the_abandoned_timeline(node: Harness) -> None:
    scheduler = node.agent.scheduler
    scheduler.persisted, scheduler.given_up, scheduler.last_passed = 10, 12, 15
    assert scheduler.rewind(8, [5, 10]) == (10, 12)
    assert (scheduler.persisted, scheduler.given_up, scheduler.last_passed, scheduler.floor()) == (5, -1, -1, 5)


def test_a_step_asked_for_goes_to_disk_before_the_failure_flush_of_a_newer_one(node: Harness) -> None:
    """Step 10 asked for (a Trainer's save step) while step 5 is written, then rank 1 dies and the failure flush
    claims step 11: 10 is written first, then 11 (newest first would make 10 obsolete: it was given up)."""
    ranks, scheduler = node.ranks, node.agent.scheduler
    ranks.commit_all(0, 5)
    round_(node)
    assert scheduler.inflight_step() == 5
    ranks.commit_all(1, 10)
    for rank in ranks.ranks:
        scheduler.flushes.request(rank, 10, node.agent.watcher, scheduler.claims, scheduler.durable())
    ranks.commit_all(2, 11)
    node.agent.watcher.ranks[1].dead = True   # its process is gone (what alive() concludes of a recycled pid)
    round_(node)
    assert scheduler.inflight_step() == 5 and scheduler.failed_ranks == set() and 11 in scheduler.claims
    node.settle()
    round_(node)
    assert scheduler.inflight_step() == 10
    node.settle()
    round_(node)
    assert scheduler.inflight_step() == 11
    node.settle()
    assert on_disk(node.save_dir) == [5, 10, 11]


def test_a_due_step_a_rank_asks_for_is_never_left_announced_as_passed_over(node: Harness) -> None:
    """The HF wrapper asks for every due step it exports, without waiting for an answer. Step 10 arrived while a
    persist was busy: announced passed over, then asked for, then persisted. The announcement must go (CI,
    2026-11-29: the export of checkpoint-8, the best one, gave up while the agent went on to persist step 8), and a
    step asked for before the agent's round is never announced."""
    ranks = node.ranks
    scheduler = node.agent.scheduler
    ranks.commit(0, 0, 5)
    ranks.commit_all(1, 10)
    ranks_, committed, common = node.scan()
    assert scheduler.claims.claim(5, 0, committed[0][5])   # busy: rank 1 has not committed step 5
    scheduler.persist_due(ranks_, committed, common)
    assert node.agent.announced.recent == [10]
    node.request(b"rank0", Kind.FLUSH, rank=0, step=10, wait=False)
    assert node.agent.announced.recent == [] and 10 in scheduler.held_steps()
    node.agent._publish()
    word = ControlReader(control_path(node.shm_dir, JOB)).read()   # what the ranks read
    assert word is not None and 10 not in word.passed and 10 in word.held

    ranks.commit_all(2, 15)
    node.request(b"rank1", Kind.FLUSH, rank=1, step=15, wait=False)
    scheduler.claims.drop(15)   # not claimed yet on this round (as when the request comes first)
    ranks_, committed, common = node.scan()
    scheduler.persist_due(ranks_, committed, common)
    assert 15 not in node.agent.announced.recent


def test_a_step_held_for_a_persist_is_never_published_as_passed_over(node: Harness) -> None:
    """Whatever was announced, a step the agent claims for a persist (here at a rank's death, without any request)
    is not passed over in the word the ranks' waiters read."""
    scheduler = node.agent.scheduler
    node.ranks.commit_all(0, 10)
    node.agent.announced.recent = [10]   # announced while an older persist ran
    ranks_, committed, _ = node.scan()
    assert scheduler.claims.claim_all(10, ranks_, committed)
    node.agent._publish()
    word = ControlReader(control_path(node.shm_dir, JOB)).read()
    assert word is not None and 10 in word.held and 10 not in word.passed
    assert node.agent.announced.recent == [10]   # the announcement stays for `easyckpt status`
