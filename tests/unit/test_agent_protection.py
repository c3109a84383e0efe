"""easyckpt_agent.protection: the safe step's flocks on real slot files, and the control block the ranks read."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_slots import JOB, FakeRanks, held

from easyckpt_agent.claims import Claims
from easyckpt_agent.protection import Protection
from easyckpt_agent.watcher import Watcher
from easyckpt_wire.control import ControlReader, ControlWriter, PersistFailure, control_path


class Node:
    def __init__(self, shm_dir: Path) -> None:
        self.ranks = FakeRanks(shm_dir)
        self.watcher = Watcher(shm_dir, JOB)
        self.protection = Protection(self.watcher, ControlWriter(control_path(shm_dir, JOB)))
        self.reader = ControlReader(control_path(shm_dir, JOB))
        self.published = 0

    def publish(self) -> None:
        self.published += 1
        self.protection.publish(persisted=None, failure=None, failures=0, passed=[], decided=-1, held=(), gated=False)

    def advance(self) -> bool:
        self.watcher.scan(relist_every=0)
        ranks, committed, common = held(self.watcher)
        return self.protection.advance_safe(ranks, committed, common, self.publish)

    def close(self) -> None:
        self.protection.release()
        self.protection.control.close()
        self.reader.close()
        self.watcher.close()
        self.ranks.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    node = Node(tmp_path)
    yield node
    node.close()


def test_the_safe_step_is_the_newest_step_every_rank_holds_and_its_slots_are_held(node: Node) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 1)
    ranks.commit(0, 1, 2)   # rank 1 has not committed step 2 yet
    assert node.advance()
    assert node.protection.safe == 1
    assert not ranks.writable(0, 0) and not ranks.writable(1, 0)   # step 1 kept on both ranks
    assert ranks.writable(0, 1)
    view = node.reader.read()
    assert view is not None and view.safe == 1 and not view.changing
    assert not node.advance()   # nothing new: it stands, no move, nothing published
    ranks.commit(1, 1, 2)
    assert node.advance()
    assert node.protection.safe == 2
    assert ranks.writable(0, 0) and ranks.writable(1, 0)   # the old safe step is let go of, after the new one is held
    assert not ranks.writable(0, 1) and not ranks.writable(1, 1)
    view = node.reader.read()
    assert view is not None and view.safe == 2


def test_a_rank_rewriting_its_slot_of_the_new_step_keeps_the_old_safe_step(node: Node) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 1)
    assert node.advance()
    ranks.commit_all(1, 2)
    node.watcher.scan(relist_every=0)
    ranks_, committed, common = held(node.watcher)
    with ranks.writing(1, 1):   # seen committed at step 2 a moment ago, being overwritten now
        published = node.published
        assert not node.protection.advance_safe(ranks_, committed, common, node.publish)
        assert node.published == published + 1   # the move is ended (even generation) though it failed
    assert node.protection.safe == 1
    assert ranks.writable(0, 1)   # rank 0's slot of step 2 was not kept: all or none
    assert not ranks.writable(0, 0) and not ranks.writable(1, 0)
    view = node.reader.read()
    assert view is not None and view.safe == 1 and not view.changing


def test_a_new_copy_of_the_safe_step_takes_over_its_hold(node: Node) -> None:
    ranks = node.ranks
    ranks.commit_all(0, 1)
    assert node.advance()
    ranks.commit(0, 1, 1)   # rank 0 saved step 1 again (a save point after the step's own snapshot)
    assert node.advance()
    assert node.protection.safe == 1
    assert ranks.writable(0, 0) and not ranks.writable(0, 1)   # the stale copy's slot is free for the rank
    assert not ranks.writable(1, 0)   # rank 1's copy did not change: it stays held
    node.protection.release()
    assert ranks.writable(1, 0) and ranks.writable(0, 1)


def test_a_resume_lets_go_of_newer_steps_and_of_abandoned_snapshots(node: Node) -> None:
    ranks, protection = node.ranks, node.protection
    ranks.commit_all(0, 1)
    ranks.commit_all(1, 2)
    assert node.advance() and protection.safe == 2
    ranks_, committed, _ = held(node.watcher)
    assert protection.roles.apply([1], ranks_, committed)
    protection.node_safe = 2
    assert protection.rewind(1)   # the safe step was newer: dropped
    assert protection.safe is None and protection.node_safe is None
    assert ranks.writable(0, 1) and ranks.writable(1, 1)
    assert protection.roles.steps == {1} and not ranks.writable(0, 0)   # a peer may be pulling step 1 right now
    header = node.watcher.slots[0, 0].header
    assert header is not None
    node.watcher.abandoned.add((0, 0, header.generation))   # rank 0 could not invalidate its copy of step 1
    assert not protection.rewind(1)
    assert protection.roles.steps == set() and ranks.writable(0, 0) and ranks.writable(1, 0)


def test_the_job_steps_are_those_held_on_every_rank_and_the_block_says_everything(node: Node) -> None:
    ranks, protection = node.ranks, node.protection
    ranks.commit_all(0, 1)
    ranks.commit_all(1, 2)
    node.watcher.scan(relist_every=0)
    ranks_, committed, _ = held(node.watcher)
    assert protection.roles.apply([2, 1], ranks_, committed)
    protection.set_job_steps(2, 1, {1, 2})
    assert (protection.safe, protection.node_safe) == (2, 1)
    protection.set_job_steps(3, 3, {1, 2})   # not held here yet: the newest held step at or below the job's;
    assert (protection.safe, protection.node_safe) == (2, 3)   # the node-safe step is the leader's word
    failure = PersistFailure(4, 28, "/ckpt: [Errno 28] No space left on device", 100, 10, 1.0, 2.0, 3)
    protection.publish(persisted=0, failure=failure, failures=3, passed=[5], decided=5, held={4}, gated=True)
    view = node.reader.read()
    assert view is not None
    assert (view.safe, view.held, view.gated, view.persisted) == (2, frozenset({1, 2, 4}), True, 0)
    assert view.failure is not None and (view.failure.step, view.failure.errno, view.failures) == (4, 28, 3)
    assert (view.node_safe, view.passed, view.decided) == (3, frozenset({5}), 5)
    protection.release()
    assert all(ranks.writable(rank, slot) for rank in (0, 1) for slot in (0, 1))


def test_joining_a_job_gives_up_the_single_node_hold_and_leaving_it_the_jobs(node: Node) -> None:
    ranks, protection = node.ranks, node.protection
    ranks.commit_all(0, 1)
    assert node.advance()
    protection.join_job()
    assert protection.safe == 1 and ranks.writable(0, 0)   # the value stands until the first verdict
    ranks_, committed, _ = held(node.watcher)
    protection.roles.apply([1], ranks_, committed)
    protection.node_safe = 1
    protection.leave_job()
    assert protection.roles.steps == set() and protection.node_safe is None and ranks.writable(0, 0)


@pytest.mark.parametrize("death", ["idle", "after_a_flock"])
def test_a_restarted_agent_adopts_its_predecessors_safe_step(tmp_path: Path, death: str) -> None:
    """Also when the predecessor died between a new flock (the word marked changing) and its round's word: the
    fields are then still its last word, whole (``MOVING``)."""
    writer = ControlWriter(control_path(tmp_path, JOB))
    writer.publish(4, frozenset({2}))
    if death == "after_a_flock":
        writer.begin_move()
    writer.close()
    node = Node(tmp_path)
    try:
        assert node.protection.safe == 4   # the ranks keep step 4 meanwhile
        view = node.reader.read()
        assert view is not None and not view.changing and view.safe == 4 and view.held == {2}
        node.ranks.commit_all(0, 4)
        assert node.advance()   # and this agent holds it once it sees it
        assert node.protection.safe == 4 and not node.ranks.writable(0, 0)
    finally:
        node.close()


def test_a_restarted_agent_does_not_adopt_a_word_its_predecessor_died_writing(tmp_path: Path) -> None:
    """Killed inside a write (generation odd, ``MOVING`` cleared by the write's first fields): the fields may be torn,
    so the new agent starts without a safe step and declares one itself."""
    path = control_path(tmp_path, JOB)
    writer = ControlWriter(path)
    writer.publish(4, frozenset())
    writer.begin_move()
    writer.close()
    with path.open("r+b") as block:   # what a write leaves when its process dies after the header's first fields
        block.seek(12)
        block.write((0).to_bytes(4, "little") + (writer.generation | 1).to_bytes(8, "little"))
    node = Node(tmp_path)
    try:
        assert node.protection.safe is None
        node.ranks.commit_all(0, 4)
        assert node.advance() and node.protection.safe == 4
    finally:
        node.close()


def test_slots_a_rank_creates_just_after_a_listing_are_watched_at_the_next_scan(tmp_path: Path) -> None:
    """A rank creates its slots one file after another at its first snapshot, and a listing between two of them
    saw only rank 0's first. The next scan, well within the ordinary 0.25 s between listings, watches the rest:
    their commits decide the safe step (CI: rank 0's second and third slots were found only after it died, 14
    steps on, so the agent could not declare its steps safe and flushed step 0 on the failure)."""
    ranks = FakeRanks(tmp_path)
    aside = tmp_path / "being-created"
    aside.mkdir()
    for slot in (1, 2):
        ranks.path(0, slot).rename(aside / ranks.path(0, slot).name)
    watcher = Watcher(tmp_path, JOB)
    try:
        watcher.scan()
        assert sorted(watcher.slots) == [(0, 0), (1, 0), (1, 1), (1, 2)]
        for slot in (1, 2):
            (aside / ranks.path(0, slot).name).rename(ranks.path(0, slot))
        ranks.commit_all(1, 5)
        watcher.scan(relist_every=60)   # no ordinary listing due: only the settle window can find the new slots
        assert sorted(watcher.slots) == [(rank, slot) for rank in (0, 1) for slot in range(3)]
        assert held(watcher)[2] == {5}, "step 5 is held by every rank, in slots the last listing did not see"
    finally:
        watcher.close()
        ranks.close()


def test_a_move_that_meets_a_rank_flock_still_on_its_new_slot_is_retried_at_once_a_few_times(node: Node) -> None:
    """A rank unlocks its slot a moment after the commit that woke the agent: the move fails, and the agent tries
    again after RETRY_POLL rather than a whole poll interval, when the ranks have stopped waiting for it (SAFE_WAIT).
    A step that stays unholdable falls back to the normal rounds after QUICK_RETRIES."""
    from easyckpt_agent import protection as protection_module

    ranks = node.ranks
    ranks.commit_all(0, 1)
    assert node.advance() and not node.protection.retry_soon()
    ranks.commit_all(1, 2)
    slot_map = ranks.maps[1, 1]
    assert slot_map.try_lock(exclusive=True)   # rank 1 committed step 2 but has not unlocked yet
    try:
        assert not node.advance() and node.protection.safe == 1 and node.protection.retry_soon()
        for _ in range(protection_module.QUICK_RETRIES):
            node.advance()
        assert not node.protection.retry_soon(), "an unholdable step keeps the agent polling fast"
    finally:
        slot_map.unlock()
    assert node.advance() and node.protection.safe == 2 and not node.protection.retry_soon()
    assert not node.advance() and not node.protection.retry_soon()


def test_every_new_flock_marks_the_word_changing_until_the_round_publishes(node: Node) -> None:
    """A persist claim flocks a slot the published word still calls free: a rank that reads the word after the flock
    must see it changing (and wait for it) until the round says why the slot is held (issue 24's race)."""
    ranks = node.ranks
    ranks.commit_all(0, 1)
    assert node.advance()
    ranks.commit_all(1, 2)
    node.watcher.scan(relist_every=0)
    _, committed, _ = held(node.watcher)
    view = node.reader.read()
    assert view is not None and not view.changing
    claims = Claims(node.protection.holds)   # as the agent's scheduler claims: through the protection's flocks
    try:
        assert claims.claim_all(2, {0, 1}, committed)
        assert not ranks.writable(0, 1)
        view = node.reader.read()
        assert view is not None and view.changing, "flocked while the word still said the slot was free"
        assert claims.claim_all(2, {0, 1}, committed)   # held already: no new flock, the move stays one move
        node.publish()
        view = node.reader.read()
        assert view is not None and not view.changing
    finally:
        claims.release(lambda step: True)
