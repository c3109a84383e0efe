"""``RankSlots.choose`` against a real control block and real flocks: the word the rank reads can lag the agent's
flocks by a round of the agent's loop (a persist claim is published at the end of it)."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from conftest import seeded_random
from tiers_sources import JOB, write_snapshots

from easyckpt.config import CheckpointerConfig
from easyckpt.snapshot import slots as slots_module
from easyckpt.snapshot.slots import RankSlots
from easyckpt.snapshot.stager import Stager
from easyckpt_agent.watcher import SlotHolds, SlotInfo
from easyckpt_wire.control import ControlWriter, control_path
from easyckpt_wire.health import NEUTRAL
from easyckpt_wire.shm import SlotMap, list_slots


def close_all(*closeable: Stager | RankSlots | ControlWriter | SlotMap) -> None:
    for each in closeable:
        each.close()


def test_a_slot_flocked_before_the_agent_publishes_why_is_a_quiet_skip(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Safe step 3 published, held []; the agent has flocked the slots of steps 1 and 2 too (a claim it publishes at
    the end of its round). The rank skips, keeping its own newest snapshot, but it says so at INFO, not as a WARNING
    that all slots hold steps the agent keeps (CI: "all 3 slots hold steps the agent keeps (safe step 16, held [])"
    printed by a plain loop with no logging configured)."""
    write_snapshots(tmp_path, 0, 1, {1: NEUTRAL, 2: NEUTRAL, 3: NEUTRAL})
    agent_maps = [SlotMap(path, writable=False) for path in sorted(list_slots(tmp_path, JOB).values())]
    control = ControlWriter(control_path(tmp_path, JOB))
    config = CheckpointerConfig(save_dir=tmp_path / "unused-save-dir", save_mem_interval=1, save_storage_interval=5,
                                max_ckpt_num=1, job_id=JOB, shm_dir=tmp_path, start_agent=False)
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3)
    stager = Stager(config, slots, rank=0, world_size=1, local_rank=0, local_world_size=1)
    caplog.set_level(logging.INFO, logger="easyckpt.snapshot.stager")
    try:
        for slot in agent_maps:
            assert slot.try_lock(exclusive=False)
        control.publish(3, frozenset())
        assert slots.choose() is None and slots.raced
        assert not stager.snapshot(4, {"w": torch.ones(3)})
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "skipped" in r.getMessage()]
        assert said == [(logging.INFO, "rank 0: snapshot of step 4 skipped: the agent was taking a slot for a persist "
                                       "as the rank chose one (it says which at the end of its round)")], said
        control.publish(3, frozenset({1, 2}))   # its word now: every slot kept, a real shortage
        assert slots.choose() is None and not slots.raced
        agent_maps[0].unlock()
        control.publish(3, frozenset({2}))
        assert slots.choose() == 0 and not slots.raced
    finally:
        close_all(stager, slots, control, *agent_maps)


def _ahead_of_rank_1(shm: Path) -> tuple[ControlWriter, RankSlots]:
    """Rank 0 committed steps 4, 5 and 6, rank 1 only 4 and 5; the agent keeps 5 (safe) and 4 (a persist): the one
    slot rank 0 may write holds its step 6, which rank 1 is still copying (DDP ranks reach a save a moment apart)."""
    write_snapshots(shm, 0, 2, {4: NEUTRAL, 5: NEUTRAL, 6: NEUTRAL})
    write_snapshots(shm, 1, 2, {4: NEUTRAL, 5: NEUTRAL})
    control = ControlWriter(control_path(shm, JOB))
    control.publish(5, frozenset({4}))
    return control, RankSlots(shm, JOB, 0, 2, 2, 3)


def _step_in(slots: RankSlots, index: int) -> int:
    header = slots.header(index)
    assert header is not None and header.committed
    return header.step


def test_a_rank_ahead_waits_for_the_others_commit_of_its_newest_step_and_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 9 while a persist holds the third slot: rank 0 reaches step 7's save before rank 1 has committed 6.
    Overwriting 6 would leave no step newer than the safe step 5 in both ranks' memory, and when rank 0 leads
    again at the next steps the safe step stands still for the whole persist (CI: killed at 29, resumed at 26).
    Rank 0 waits for rank 1's commit (the ranks' own commits only), then for the agent's word, and writes over 5."""
    control, slots = _ahead_of_rank_1(tmp_path)
    # Generous bounds: the test's other "rank" runs in a thread of this process, the agent is this test.
    monkeypatch.setattr(slots_module, "PEER_WAIT_MAX", 60.0, raising=False)
    monkeypatch.setattr(slots_module, "SAFE_WAIT", 60.0)
    slots.peer_wait = 60.0
    asked = threading.Event()
    real = slots._every_local_rank_has

    def spy(step: int) -> bool:
        held = real(step)
        if not held:
            asked.set()
        return held

    monkeypatch.setattr(slots, "_every_local_rank_has", spy)
    failures: list[BaseException] = []

    def rank_1_commits_then_the_agent_declares() -> None:
        try:
            assert asked.wait(60), "rank 0 never looked for rank 1's step 6"
            write_snapshots(tmp_path, 1, 2, {6: NEUTRAL})
            control.publish(6, frozenset({4}))
        except BaseException as exc:   # reported by the test's thread
            failures.append(exc)

    other = threading.Thread(target=rank_1_commits_then_the_agent_declares)
    other.start()
    try:
        index = slots.choose()
        other.join(120)
        assert not other.is_alive() and not failures, failures
        assert index is not None and _step_in(slots, index) == 5, "rank 0 was to keep step 6 and write over 5"
        assert asked.is_set()
    finally:
        slots.close()
        control.close()


def test_a_rank_whose_peer_does_not_commit_in_time_overwrites_its_newest_once_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The wait is bounded (``peer_wait``, from the rank's own copy time): past it the rank writes over its newest
    step as before, says so once, and does not wait again until the others are seen to keep pace by themselves."""
    control, slots = _ahead_of_rank_1(tmp_path)
    slots.peer_wait = 0.05
    calls: list[int] = []
    real = slots._every_local_rank_has

    def counting(step: int) -> bool:
        calls.append(step)
        return real(step)

    monkeypatch.setattr(slots, "_every_local_rank_has", counting)
    caplog.set_level(logging.INFO, logger="easyckpt.snapshot.slots")
    try:
        index = slots.choose()
        assert index is not None and _step_in(slots, index) == 6
        assert len(calls) > 1, "rank 0 was to wait for rank 1's commit"
        calls.clear()
        assert slots.choose() == index
        assert len(calls) == 1, "a rank that found its peers late does not wait again"
        late = [r.getMessage() for r in caplog.records if "not every local rank committed step 6" in r.getMessage()]
        assert len(late) == 1, late
        write_snapshots(tmp_path, 1, 2, {6: NEUTRAL})   # the agent has not declared it yet: the rank sees it
        assert slots.choose() is not None
        assert any("commit their snapshots in time again (2 time(s)" in r.getMessage() for r in caplog.records)
    finally:
        slots.close()
        control.close()


def test_the_agent_is_woken_only_once_the_committed_slot_is_unlocked(tmp_path: Path) -> None:
    """The wake-up after a commit is the agent's cue to hold the new step as safe. Woken while the rank's exclusive
    flock was still on the slot, it failed to hold it and moved the safe step a poll interval later, after the
    ranks had given up waiting for it (SAFE_WAIT) and overwritten their newest step: a kill cost 3 steps (CI,
    2026-11-29, test_freshness.py rank0). At every wake the agent's shared flock on the new slot must succeed."""
    config = CheckpointerConfig(save_dir=tmp_path / "unused-save-dir", save_mem_interval=1, save_storage_interval=5,
                                max_ckpt_num=1, job_id=JOB, shm_dir=tmp_path, start_agent=False)
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3)
    seen: list[tuple[int, bool]] = []

    def agent_woken() -> None:   # what the agent does on waking: hold the newest committed slot, shared
        step, (index, _) = max(slots.committed().items())
        probe = SlotMap(slots.maps[index].path, writable=False)   # type: ignore[union-attr]
        try:
            held = probe.try_lock(exclusive=False)
            seen.append((step, held))
            if held:
                probe.unlock()
        finally:
            probe.close()

    stager = Stager(config, slots, rank=0, world_size=1, local_rank=0, local_world_size=1, committed=agent_woken)
    try:
        for step in range(1, 6):
            assert stager.snapshot(step, {"w": torch.full((1000,), float(step))})
            stager.wait()
        assert seen == [(step, True) for step in range(1, 6)], seen
    finally:
        stager.close()
        slots.close()


def test_a_rank_that_finds_a_safe_step_move_failed_still_waits_before_writing_over_its_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Safe step 5; the rank's newest is 6. The agent is moving the safe step to 6 (its shared flock on 6's slot, the
    word marked changing) and has just claimed 4's slot for a persist. The rank finds both free slots flocked and
    reads the word again (``MOVE_WAIT``): the move failed, 4 is held. Its one free slot now holds its newest step,
    6. It must wait for the agent to declare 6 safe, as on a first try, not write over it at once and unannounced
    (the path left after the CI freshness failure of 2026-11-29)."""
    write_snapshots(tmp_path, 0, 1, {4: NEUTRAL, 5: NEUTRAL, 6: NEUTRAL})
    control = ControlWriter(control_path(tmp_path, JOB))
    control.publish(5, frozenset())
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3)
    index_of = {step: index for step, (index, _) in slots.committed().items()}
    agent_maps = {step: SlotMap(slots.maps[index].path, writable=False)   # type: ignore[union-attr]
                  for step, index in index_of.items()}
    monkeypatch.setattr(slots_module, "MOVE_WAIT", 60.0)
    monkeypatch.setattr(slots_module, "SAFE_WAIT", 60.0)
    reread, polled = threading.Event(), threading.Event()
    moved = threading.Event()
    real_read = slots.control.read

    def read(*, wait: float = 0.0) -> object:
        if wait > 0:
            reread.set()
        elif moved.is_set():
            polled.set()
        return real_read(wait=wait)

    monkeypatch.setattr(slots.control, "read", read)
    failures: list[BaseException] = []

    def agent() -> None:
        try:
            assert reread.wait(60), "the rank never read the word again"
            agent_maps[6].unlock()                 # the move failed; the claim on 4 is published
            moved.set()
            control.publish(5, frozenset({4}))
            if polled.wait(10):                    # the rank waits for the agent's word: the retry succeeds
                assert agent_maps[6].try_lock(exclusive=False)
                control.publish(6, frozenset({4}))
        except BaseException as exc:   # reported by the test's thread
            failures.append(exc)

    try:
        assert agent_maps[4].try_lock(exclusive=False) and agent_maps[6].try_lock(exclusive=False)
        control.begin_move()
        other = threading.Thread(target=agent)
        other.start()
        index = slots.choose()
        other.join(60)
        assert not other.is_alive() and not failures, failures
        assert index == index_of[5], f"the rank wrote over slot {index} ({ {i: s for s, i in index_of.items()}[index]})"
    finally:
        slots.close()
        control.close()
        for slot in agent_maps.values():
            slot.close()


def test_a_rank_that_finds_its_slot_flocked_after_it_read_the_word_chooses_again_on_the_agents_next_word(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24's race (CI, seed 35802263, step 6): the rank read the word (safe 3, step 1 held for a persist), then
    the agent's round claimed step 2 and let go of 1, and the rank found the slot of 2 flocked. It skipped its
    snapshot although the round was freeing another slot. The agent's flocks (``SlotHolds``) now mark the word as
    changing first, and the rank, its choice raced, reads the word again and chooses on it: it writes over step 1."""
    write_snapshots(tmp_path, 0, 1, {1: NEUTRAL, 2: NEUTRAL, 3: NEUTRAL})
    control = ControlWriter(control_path(tmp_path, JOB))
    control.publish(3, frozenset({1}))
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3)
    index_of = {step: index for step, (index, _) in slots.committed().items()}
    holds = SlotHolds(before_lock=control.begin_move)
    infos = {step: SlotInfo(rank=0, slot=index, path=slots.maps[index].path,   # type: ignore[union-attr]
                            map=SlotMap(slots.maps[index].path, writable=False),   # type: ignore[union-attr]
                            header=slots.header(index))
             for step, index in index_of.items()}
    assert holds.hold_if_current(infos[1], 1, ("persist", 1))
    control.publish(3, frozenset({1}))
    real_read = slots.control.read
    rounds: list[str] = []

    def read(*, wait: float = 0.0) -> object:
        word = real_read(wait=0.0)
        if not rounds:   # the agent's round runs between the rank's reading and its flock
            rounds.append("claimed 2, let go of 1")
            assert holds.hold_if_current(infos[2], 2, ("persist", 2))
            assert real_read() is not None and real_read().changing   # type: ignore[union-attr]
            holds.release(infos[1], ("persist", 1))
        elif wait > 0 and len(rounds) == 1:   # the rank waits for the word: the round ends
            rounds.append("published")
            control.publish(3, frozenset({2}))
            return real_read(wait=wait)
        return word

    monkeypatch.setattr(slots.control, "read", read)
    try:
        index = slots.choose()
        assert rounds == ["claimed 2, let go of 1", "published"], rounds
        assert index == index_of[1] and not slots.raced, (index, index_of)
    finally:
        slots.close()
        control.close()
        for info in infos.values():
            info.map.close()


def test_a_rank_keeps_its_newest_step_for_a_late_agent_while_a_kill_would_otherwise_cost_three(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The agent holds step 0 for a persist and declared 2 safe, then stops answering (CI, 2026-12-01: a kill at step
    5 resumed at 2). Step 4 may go over 3 (a kill during its copy resumes at 2: two back). Step 5 must not go over 4
    (three back): it is skipped, said at INFO only. Step 6 is written again (skipping it would leave 4 two back, and
    the next write, the agent in time or not, three)."""
    write_snapshots(tmp_path, 0, 1, {0: NEUTRAL, 2: NEUTRAL, 3: NEUTRAL})
    control = ControlWriter(control_path(tmp_path, JOB))
    config = CheckpointerConfig(save_dir=tmp_path / "unused-save-dir", save_mem_interval=1, save_storage_interval=5,
                                max_ckpt_num=1, job_id=JOB, shm_dir=tmp_path, start_agent=False)
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3, persist_every=5)
    index_of = {step: index for step, (index, _) in slots.committed().items()}
    agent_maps = [SlotMap(slots.maps[index_of[step]].path, writable=False)   # type: ignore[union-attr]
                  for step in (0, 2)]
    stager = Stager(config, slots, rank=0, world_size=1, local_rank=0, local_world_size=1)
    caplog.set_level(logging.INFO, logger="easyckpt.snapshot")
    try:
        for slot in agent_maps:
            assert slot.try_lock(exclusive=False)
        control.publish(2, frozenset({0}))
        kept = []
        for step in (4, 5):
            written = stager.snapshot(step, {"w": torch.full((8,), float(step))})
            # What a kill now, during the copy, resumes at: the newest step committed in the other slots.
            assert max(slots.committed()) >= step - 2, f"a kill during step {step}'s copy would lose three steps"
            if written:
                stager.wait()
            else:
                kept.append(step)
        assert kept == [5] and sorted(slots.committed()) == [0, 2, 4]
        # Late for a third choice: beyond what skipping can bound, freshness wins.
        assert stager.snapshot(6, {"w": torch.full((8,), 6.0)})
        stager.wait()
        assert sorted(slots.committed()) == [0, 2, 6]
        assert stager.stats()["skipped"] == 1
        said = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO and "step 4" in
                r.getMessage() and "skipped" in r.getMessage()]
        assert said == [(logging.INFO, "rank 0: snapshot of step 5 skipped to keep step 4, which the agent has not "
                                       "declared safe yet (safe step 2): writing over it would let a kill cost more "
                                       "than two snapshot intervals")], said
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "tmpfs" not in r.getMessage()]
    finally:
        close_all(stager, slots, control, *agent_maps)


def _due_in_the_one_free_slot(shm: Path) -> tuple[ControlWriter, RankSlots, dict[int, int], list[SlotMap]]:
    """A multi-node rank with four slots holds steps 3 to 6; its agent keeps 6 (job-safe), 4 (node-safe) and 3 (the
    floor of a persist), flocks included, and has not seen due step 5 yet (decided 0): the one free slot holds it."""
    config = CheckpointerConfig(save_dir=shm / "unused-save-dir", save_mem_interval=1, save_storage_interval=5,
                                max_ckpt_num=1, job_id=JOB, shm_dir=shm, start_agent=False)
    slots = RankSlots(shm, JOB, 0, 1, 1, 4, persist_every=5)
    stager = Stager(config, slots, rank=0, world_size=1, local_rank=0, local_world_size=1)
    try:
        for step in (3, 4, 5, 6):
            assert stager.snapshot(step, {"w": torch.full((8,), float(step))})
            stager.wait()
    finally:
        stager.close()
    control = ControlWriter(control_path(shm, JOB))
    control.set_job(4, [], 0)
    control.publish(6, frozenset({3, 4}), gated=True)
    index_of = {step: index for step, (index, _) in slots.committed().items()}
    agent_maps = [SlotMap(slots.maps[index_of[step]].path, writable=False)   # type: ignore[union-attr]
                  for step in (4, 6, 3)]
    for slot in agent_maps:
        assert slot.try_lock(exclusive=False)
    return control, slots, index_of, agent_maps


def test_a_rank_waits_for_a_late_agents_word_on_the_due_step_in_its_one_free_slot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 12 with a starved agent (CI, 2026-12-01: "due step 5 passed over on every node: the ranks of node(s)
    ['node0'] moved past it before their agent held it"): the rank waits for the agent's word instead of writing over
    due step 5 at once. The agent, once the rank is seen polling, lets go of 4 and holds 5: the snapshot goes over
    4 and step 5 survives for its persist."""
    control, slots, index_of, agent_maps = _due_in_the_one_free_slot(tmp_path)
    slots.due_wait = 60.0   # far beyond the agent's answer below: the test never waits it out
    polls = threading.Semaphore(0)
    read = slots.control.read

    def counted(*, wait: float = 0.0) -> object:
        polls.release()
        return read(wait=wait)

    monkeypatch.setattr(slots.control, "read", counted)

    def agent() -> None:
        for _ in range(3):   # the rank's choice read the word, then polled it twice: it is waiting
            assert polls.acquire(timeout=30), "the rank never polled the agent's word"
        # The agent's round: it flocks 5 for the persist and lets go of the node-safe 4, then publishes why.
        control.begin_move()
        five = SlotMap(slots.maps[index_of[5]].path, writable=False)   # type: ignore[union-attr]
        assert five.try_lock(exclusive=False)
        agent_maps[0].unlock()
        agent_maps[0].close()
        agent_maps[0] = five
        control.set_job(4, [], 5)
        control.publish(6, frozenset({3, 5}), gated=True)

    thread = threading.Thread(target=agent)
    try:
        thread.start()
        assert slots.choose(7) == index_of[4], index_of
        assert 0 < slots.due_waited < 30
        assert _step_in(slots, index_of[5]) == 5
    finally:
        thread.join(30)
        close_all(slots, control, *agent_maps)


def test_a_wait_for_a_silent_agent_runs_out_is_said_once_and_is_not_repeated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An agent that never answers costs one bounded wait: the snapshot then goes over the due step (said once, as a
    WARNING naming the step), and the next choices do not wait while the agent's word stays the same."""
    control, slots, index_of, agent_maps = _due_in_the_one_free_slot(tmp_path)
    slots.due_wait = 0.05
    caplog.set_level(logging.INFO, logger="easyckpt.snapshot")
    try:
        index = slots.choose(7)
        assert index == index_of[5]
        waited = slots.due_waited
        assert waited >= 0.05
        slots.maps[index].unlock()   # type: ignore[union-attr]
        assert slots.choose(8) == index_of[5] and slots.due_waited == waited
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "due step" in r.getMessage()]
        assert said == ["rank 0: the node agent has neither held nor passed over due step 5 within 0.05s (starved of "
                        "CPU?): the snapshot goes over it, the one free slot, so it never reaches disk (the agent "
                        "announces it passed over)"], said
    finally:
        close_all(slots, control, *agent_maps)


def test_an_agent_silent_while_it_persists_the_first_step_lets_no_kill_cost_more_than_two(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The start of a run: the agent's first round declares step 0 safe and claims it for a persist, then says nothing
    for ten steps (a fresh agent on a busy machine, the loop at a few ms a step). The ranks used to spare due step 5 as
    well, which left them one slot: every snapshot from 6 on went over the newest one, and a kill during the copy of
    10 resumed at 5 (CI, 2026-12-02, test_ux). A due step that arrives while a persist runs is passed over anyway
    (invariant 12), so it is not spared: a kill during any copy resumes at most two steps back."""
    control = ControlWriter(control_path(tmp_path, JOB))
    control.publish(None, frozenset())
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3, persist_every=5)
    slots.due_wait = 0.05
    agent_map: SlotMap | None = None
    caplog.set_level(logging.INFO, logger="easyckpt.snapshot")
    try:
        for step in range(11):
            write = slots.write(4096, step=step)
            if write is None:
                continue
            left = slots.committed()   # what a kill during this copy resumes at: the newest step in the other slots
            assert step == 0 or max(left, default=-9) >= step - 2, f"a kill during step {step}'s copy resumes at {left}"
            with write:
                write.commit(step, 0, b"")
            if step == 0:   # the agent's first and last round: 0 is safe and claimed for a persist
                agent_map = SlotMap(slots.path(write.index), writable=False)
                assert agent_map.try_lock(exclusive=False)
                control.publish(0, frozenset({0}))
        assert 0 in slots.committed(), "the slot the agent holds was overwritten"
    finally:
        close_all(slots, control, *([agent_map] if agent_map is not None else []))


def test_an_agent_stopped_while_it_moves_the_safe_step_lets_no_kill_cost_more_than_two(tmp_path: Path) -> None:
    """The agent holds step 0 (safe, and claimed for a persist) and begins to move the safe step to 1: it marks the
    word as changing, flocks the slot of 1, and is stopped there (a starved agent). The word still leaves the slots
    of 1 and 2 free, but only 2's can be locked: the rank's newest step, the same case as a word that leaves it
    alone. The snapshot of 3 went over 2 and that of 4 over 3, and a kill during the copy of 4 resumed at 1 (CI,
    2026-12-02, test_ux, seed 720066417); now 3 goes over 2 (a kill during its copy costs two) and 4 is skipped."""
    control = ControlWriter(control_path(tmp_path, JOB))
    control.publish(None, frozenset())
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3, persist_every=5)
    flocks: list[SlotMap] = []

    def agent_flocks(step: int) -> None:
        index, _ = slots.committed()[step]
        flocks.append(SlotMap(slots.path(index), writable=False))
        assert flocks[-1].try_lock(exclusive=False), f"the agent could not hold step {step}"

    skipped = []
    try:
        for step in range(5):
            write = slots.write(4096, step=step)
            if write is None:
                skipped.append((step, slots.kept_newest))
                continue
            left = slots.committed()   # what a kill during this copy resumes at: the newest step in the other slots
            assert step == 0 or max(left, default=-9) >= step - 2, f"a kill during step {step}'s copy resumes at {left}"
            with write:
                write.commit(step, 0, b"")
            if step == 0:
                agent_flocks(0)
                control.publish(0, frozenset({0}))
            if step == 2:   # the agent's next round begins to move the safe step to 1, and stops
                control.begin_move()
                agent_flocks(1)
        assert skipped == [(4, 3)], skipped
        assert sorted(slots.committed()) == [0, 1, 3]
    finally:
        close_all(slots, control, *flocks)


class LateAgent:
    """A one-node agent reduced to its rules, with real flocks and a real control block: a round declares the
    newest step safe, claims the newest due step when no persist runs (else passes it over) and may finish the
    persist. Between rounds it is silent, as a starved agent is."""

    def __init__(self, shm: Path, slots: RankSlots, every: int) -> None:
        self.control = ControlWriter(control_path(shm, JOB))
        self.control.publish(None, frozenset())
        self.slots, self.every = slots, every
        self.flocks: dict[int, SlotMap] = {}   # step -> the agent's shared flock on its slot
        self.safe: int | None = None
        self.persisting: int | None = None
        self.floor = self.decided = -1
        self.passed: list[int] = []

    def round(self, finish_persist: bool) -> None:
        committed = {step: index for step, (index, _) in self.slots.committed().items()}
        if finish_persist and self.persisting is not None:
            self.floor, self.persisting = self.persisting, None
        if committed:
            self.safe = max(committed)
        due = max((s for s in committed if s % self.every == 0 and s > max(self.floor, self.decided)), default=None)
        if due is not None and self.persisting is None:
            self.persisting = self.decided = due
        elif due is not None:
            self.passed.append(due)
            self.decided = due
        keep = {s for s in (self.safe, self.persisting) if s is not None}
        for step in [s for s in self.flocks if s not in keep]:
            self.flocks.pop(step).close()
        for step in keep - set(self.flocks):
            self.flocks[step] = SlotMap(self.slots.path(committed[step]), writable=False)
            assert self.flocks[step].try_lock(exclusive=False), f"the agent could not hold step {step}"
        self.control.set_job(None, self.passed, self.decided)
        self.control.publish(self.safe, frozenset() if self.persisting is None else frozenset({self.persisting}))

    def close(self) -> None:
        for flock in self.flocks.values():
            flock.close()
        self.control.close()


@pytest.mark.parametrize("every", [1, 3, 5])
def test_a_kill_costs_at_most_two_steps_while_the_agent_answers_one_choice_in_two_whatever_its_persists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int) -> None:
    """The real slot choice against an agent that, drawn from a printed seed, runs a round before a rank's choice
    or not, and ends a persist in a round or not (persists of a few rounds to tens). Whatever the draw, a kill
    during any copy resumes at most two steps back while the agent ran a round before one of the last two choices,
    or however long it is silent while it keeps only one of the rank's slots (its safe step is the step it persists,
    the start of a run); the slots the agent holds are never written (their flocks)."""
    rng = seeded_random()
    monkeypatch.setattr(slots_module, "SAFE_WAIT", 0.0005)   # the agent runs on this thread: no round comes meanwhile
    for trial in range(12):
        shm = tmp_path / f"trial{trial}"
        shm.mkdir()
        slots = RankSlots(shm, JOB, 0, 1, 1, 3, persist_every=every)
        slots.due_wait = 0.0005
        agent = LateAgent(shm, slots, every)
        on_time, finish = rng.uniform(0.2, 1.0), rng.uniform(0.02, 0.6)
        answered: list[bool] = []
        try:
            for step in range(60):
                answered.append(rng.random() < on_time)
                if answered[-1]:
                    agent.round(finish_persist=rng.random() < finish)
                write = slots.write(4096, step=step)
                if write is None:
                    continue
                left = slots.committed()
                # Either the agent was in time lately, or it keeps one slot only and the rank has two to alternate.
                if step > 0 and answered[0] and (any(answered[-2:]) or len(agent.flocks) <= 1):
                    assert max(left) >= step - 2, (f"trial {trial} step {step}: a kill during the copy resumes at "
                                                   f"{max(left)} (answers {answered[-6:]}, safe {agent.safe}, "
                                                   f"persisting {agent.persisting}, slots {sorted(left)})")
                with write:
                    write.commit(step, 0, b"")
        finally:
            agent.close()
            slots.close()
