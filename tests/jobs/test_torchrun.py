"""2-rank torchrun jobs (gloo, CPU) killed with SIGKILL and restarted: they resume from memory at the
newest step both ranks committed, with a state bitwise equal to an uninterrupted run's and the same
loss curve afterwards."""
from __future__ import annotations

import pytest
from conftest import Env, seeded_random, wait_for
from ddp_job import Job, newest_common_committed, slot_states

STEPS = 30
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """One uninterrupted run: the loss and state digest of every step."""
    env = Env(tmp_path_factory.mktemp("reference"))
    try:
        job = Job(env, env.save_dir, env.tmp_path / "out", steps=STEPS)
        assert job.wait() == 0, job.log()[-3000:]
        wait_for(lambda: env.agent_pid() is None, 30, "the reference job's agent to exit after a clean finish")
        return job
    finally:
        env.cleanup()


def assert_continues_exactly(resumed: Job, reference: Job, from_step: int) -> None:
    for rank in range(2):
        ours, theirs = resumed.losses(rank), reference.losses(rank)
        assert sorted(ours) == list(range(from_step + 1, STEPS)), f"rank {rank} ran steps {sorted(ours)}"
        for step in ours:
            assert ours[step]["loss"] == theirs[step]["loss"], f"rank {rank} loss differs at step {step}"
            assert ours[step]["digest"] == theirs[step]["digest"], f"rank {rank} state differs at step {step}"


def check_resume(job: Job, reference: Job, step: int, source: str) -> None:
    for rank in range(2):
        report = job.resumes(rank)[-1]
        assert (report["step"], report["source"]) == (step, source), f"rank {rank}: {report}"
        assert report["digest"] == reference.losses(rank)[step]["digest"], f"rank {rank} resumed a different state"


@pytest.mark.parametrize("victims", [[1], [0, 1]], ids=["one-rank", "whole-group"])
def test_kill9_then_restart_resumes_from_memory(env: Env, reference: Job, victims: list[int]) -> None:
    kill_at = seeded_random().randint(5, 22)
    first = Job(env, env.save_dir, env.tmp_path / "first", steps=STEPS)
    try:
        for rank in victims:
            first.kill_rank(rank, kill_at)
        assert first.wait(90) != 0
    finally:
        first.kill()
    states = slot_states(env, env.save_dir)
    newest = newest_common_committed(states)
    assert newest is not None and newest >= 1, f"killed at step {kill_at}, slots: {states}"

    second = Job(env, env.save_dir, env.tmp_path / "second", steps=STEPS)
    assert second.wait() == 0, second.log()[-3000:]
    check_resume(second, reference, newest, "memory")
    assert_continues_exactly(second, reference, newest)
    assert "resumed at step" in second.log()


def test_torchrun_restart_after_kill9_resumes_from_memory(env: Env, reference: Job) -> None:
    """torchrun's own restart (--max-restarts=1) brings the group back; it resumes from memory."""
    job = Job(env, env.save_dir, env.tmp_path / "out", steps=STEPS, max_restarts=1)
    try:
        job.kill_rank(1, seeded_random().randint(5, 22))
        assert job.wait() == 0, job.log()[-3000:]
    finally:
        job.kill()
    assert "pytorch/pytorch#135712" not in job.log()   # a store per attempt: nothing to warn of
    resumed = [job.resumes(rank)[-1] for rank in range(2)]
    assert resumed[0]["step"] == resumed[1]["step"] is not None
    step = resumed[0]["step"]
    check_resume(job, reference, step, "memory")
    for rank in range(2):
        rows = job.losses(rank)
        for later in range(step + 1, STEPS):
            assert rows[later]["loss"] == reference.losses(rank)[later]["loss"], f"rank {rank} step {later}"


def test_a_restart_that_would_hang_on_the_shared_rendezvous_store_is_warned_of_before_any_failure(env: Env) -> None:
    """torchrun as a new user runs it, with ``--max-restarts`` and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: its
    restarted DDP workers would hang in init_process_group (pytorch/pytorch#135712; measured on 2026-12-06, see
    ``topology.restart_hazard``), before easyckpt could say anything. So the first attempt says it, once per node,
    with the fix. (No kill here: the restart would hang.)"""
    job = Job(env, env.save_dir, env.tmp_path / "out", steps=3, max_restarts=2,
              extra_env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    try:
        assert job.wait() == 0, job.log()[-3000:]
    finally:
        job.kill()
    warned = [line for line in job.log().splitlines() if "pytorch/pytorch#135712" in line]
    assert len(warned) == 1, warned
    assert "easyckpt rank 0" in warned[0] and "--max-restarts=2, 0 used" in warned[0]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warned[0]


@pytest.mark.parametrize("point", ["stager.mid_copy", "stager.before_commit"])
def test_kill9_during_copy_resumes_from_previous_snapshot(env: Env, reference: Job, point: str) -> None:
    """Rank 1 dies (SIGKILL at a named fault point) half-way through copying step 7 into a slot, or with
    every byte copied but the slot not committed yet: either way step 7 is not a snapshot."""
    first = Job(env, env.save_dir, env.tmp_path / "first", steps=STEPS,
                extra_env={"EASYCKPT_FAULT": f"{point}@7#1"})
    try:
        assert first.wait(90) != 0, "the fault point never fired"
    finally:
        first.kill()
    states = slot_states(env, env.save_dir)
    torn = [s for s in states[1] if s[0] == "WRITING"]
    assert torn, f"rank 1 should have left a slot half-written: {states}"
    assert 7 not in {step for state, step, _ in states[1] if state == "COMMITTED"}
    newest = newest_common_committed(states)
    assert newest is not None and newest < 7

    second = Job(env, env.save_dir, env.tmp_path / "second", steps=STEPS)
    assert second.wait() == 0, second.log()[-3000:]
    check_resume(second, reference, newest, "memory")
    assert_continues_exactly(second, reference, newest)
