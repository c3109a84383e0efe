"""Timelines with real 2-rank torchrun jobs (issue 11, item 2; invariant 10).

A run trains to step 40 with a persist every 10 steps. Then a rollback: the next job loads
``iteration_0000020`` (or falls back past a corrupted ``iteration_0000040`` to 30), which starts a new
timeline, and is killed with SIGKILL at step 34; torchrun restarts it. The restart must resume from
memory (33 or 34), not from the abandoned step 40 on disk; the new timeline's steps are persisted although
the abandoned run had reached the same numbers; the abandoned iterations sit under ``.abandoned-*`` with
audit lines, and the tracker names the newest iteration of the new timeline. The second job's state
carries a ballast tensor and its agent's writes are capped, so that each persist spans several steps (no
sleep stands in for compute).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from conftest import Env, save_and_persist, wait_for
from ddp_job import Job, slot_states

from easyckpt import storage
from easyckpt_wire import layout, timeline

pytestmark = pytest.mark.slow

FIRST_STEPS = 41            # steps 0..40: iterations 0, 10, 20, 30, 40 on disk
SECOND_STEPS = 46           # the new timeline persists 40 again before it ends
KILL_AT = 34
SLOW_PERSIST = {"EASYCKPT_PERSIST_MBPS": "60"}       # with --ballast-mb 8 on 2 ranks: ~0.3 s, several steps
SECOND_ARGS = ["--ballast-mb", "8", "--max-ckpt-num", "10", "--kill-at", str(KILL_AT), "--kill-rank", "1"]


def first_run(env: Env) -> Job:
    job = Job(env, env.save_dir, env.tmp_path / "first", steps=FIRST_STEPS,
              extra_args=["--ballast-mb", "8", "--max-ckpt-num", "10"])
    assert job.wait() == 0, job.log()[-3000:]
    env.wait_agent_gone()     # it ended cleanly: its memory is released, only disk is left
    assert [s for s, _ in layout.complete_iterations(env.save_dir)] == [0, 10, 20, 30, 40]
    assert layout.read_tracker(env.save_dir) == 40
    return job


def audit(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / layout.AUDIT_LOG).read_text().splitlines()]


def check_new_timeline(env: Env, job: Job, resumed_first: int, abandoned: list[int]) -> None:
    """After the killed attempt and torchrun's restart: what the ranks resumed from and what is on disk."""
    for rank in range(2):
        reports = job.resumes(rank)
        assert len(reports) == 2, f"rank {rank}: {reports}\n{job.log()[-3000:]}"
        assert (reports[0]["step"], reports[0]["source"]) == (resumed_first, "disk"), reports[0]
    second = [job.resumes(rank)[1] for rank in range(2)]
    assert second[0]["step"] == second[1]["step"], second
    assert second[0]["step"] in (KILL_AT - 1, KILL_AT) and {r["source"] for r in second} == {"memory"}, (
        f"the restart after the kill at step {KILL_AT} resumed {second}; the abandoned timeline reached 40")
    # The abandoned iterations sit under .abandoned-*, each moved with an audit line naming the resume.
    moved = timeline.abandoned_iterations(env.save_dir)
    assert sorted(step for _, step, _ in moved) == abandoned, moved
    lines = audit(env.save_dir)
    abandon_lines = [i for i, line in enumerate(lines) if line["op"] == "abandon"]
    assert [lines[i]["step"] for i in abandon_lines] == abandoned
    assert all(lines[i]["resumed"] == resumed_first for i in abandon_lines)
    assert not [line for line in lines if line["op"] == "delete" and ".abandoned-" in line["path"]]
    # The new timeline's steps above the resume were persisted again, after the move.
    written = {Path(line["path"]).name: i for i, line in enumerate(lines) if line["op"] == "write"
               and Path(line["path"]).parent == env.save_dir}
    for step in (30, 40):
        if step > resumed_first:
            name = layout.iteration_dirname(step)
            assert written.get(name, -1) > abandon_lines[-1], f"{name} of the new timeline was never persisted"
    complete = [s for s, _ in layout.complete_iterations(env.save_dir)]
    assert 40 in complete and 30 in complete, complete
    # The tracker names the newest iteration of the new timeline, which a load follows: the end of the run
    # (close() makes the last snapshot durable).
    assert layout.read_tracker(env.save_dir) == max(complete) == SECOND_STEPS - 1, complete
    assert storage.newest_first(env.save_dir)[0] == SECOND_STEPS - 1
    assert all(problem is None for _, _, problem in storage.verify(env.save_dir))


def test_rollback_to_20_then_kill9_resumes_from_memory_of_the_new_timeline(env: Env) -> None:
    first_run(env)
    load_dir = env.save_dir / layout.iteration_dirname(20)
    job = Job(env, env.save_dir, env.tmp_path / "second", steps=SECOND_STEPS, max_restarts=1, step_seconds=0.03,
              extra_env=SLOW_PERSIST, extra_args=[*SECOND_ARGS, "--load-dir", str(load_dir)])
    try:
        assert job.wait(180) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert (job.out / "killed-rank1").read_text() == str(KILL_AT)
    check_new_timeline(env, job, 20, [30, 40])


def test_fallback_past_a_corrupt_iteration_starts_a_new_timeline(env: Env) -> None:
    first_run(env)
    seed = int(os.environ.get("EASYCKPT_TEST_SEED", random.randrange(1 << 30)))
    print(f"corruption seed {seed} (EASYCKPT_TEST_SEED={seed} replays it)")
    rng = random.Random(seed)
    victim = sorted((env.save_dir / layout.iteration_dirname(40)).glob("*.safetensors"))
    target = rng.choice(victim)
    data = bytearray(target.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    offset = rng.randrange(header, len(data) - 4)
    for i in range(offset, offset + 4):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    print(f"flipped 4 bytes of {target.name} at offset {offset}")
    job = Job(env, env.save_dir, env.tmp_path / "second", steps=SECOND_STEPS, max_restarts=1, step_seconds=0.03,
              extra_env=SLOW_PERSIST, extra_args=SECOND_ARGS)
    try:
        assert job.wait(180) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert "fails its xxh3_128 checksum" in job.log()
    check_new_timeline(env, job, 30, [40])
    corrupt = [path for _, step, path in timeline.abandoned_iterations(env.save_dir) if step == 40]
    assert storage.verify(corrupt[0].parent)[0][2] is not None    # the damaged copy is kept, not deleted
    wait_for(lambda: env.agent_pid() is None, 30, "the agent to exit after the job ended cleanly")


def test_a_rollback_in_the_same_process_drops_the_snapshots_the_agent_held(env: Env) -> None:
    """load(load_dir=iteration_20) while memory holds 38..40 and the agent holds 40 as the safe step: the
    newer snapshots are never read again (in this process or after a restart), the agent lets go of them,
    and the new timeline's 30 (with other values than the abandoned 30) is persisted and tracked; with
    max_ckpt_num=5 its persist rotates out the abandoned 30 first, not an iteration of the new timeline."""
    import torch
    from agent_client_status import safe_step_of
    from safetensors import safe_open

    import easyckpt

    ck = easyckpt.Checkpointer(env.save_dir, 1, 10, 5)
    state = {"w": torch.zeros(4096)}
    try:
        for step in range(41):
            ck.wait()   # the previous snapshot's copy reads the tensor: change it only after
            state["w"].fill_(step)
            if step % 10 == 0:
                save_and_persist(ck, env, step, state)
            else:
                wait_for(lambda step=step: ck.save_if_needed(step, state), 30, f"a free slot for step {step}")
        ck.wait()
        wait_for(lambda: safe_step_of(env) == 40, 30, "the agent to hold step 40 as the safe step")
        result = ck.load(load_dir=env.save_dir / layout.iteration_dirname(20))
        assert (result.step, result.source) == (20, "disk")
        assert max(ck.slots.committed(), default=-1) <= 20, ck.slots.committed()
        wait_for(lambda: all(step <= 20 for rows in slot_states(env, env.save_dir).values()
                             for state_name, step, _ in rows if state_name == "COMMITTED"), 30,
                 "every snapshot newer than 20 to be invalidated")
        assert [s for s, _ in layout.complete_iterations(env.save_dir)] == [0, 10, 20]
        assert layout.read_tracker(env.save_dir) == 20
        assert sorted(s for _, s, _ in timeline.abandoned_iterations(env.save_dir)) == [30, 40]
        for step in range(21, 31):
            ck.wait()
            state["w"].fill_(1000 + step)
            if step % 10 == 0:
                path = save_and_persist(ck, env, step, state)
            else:
                wait_for(lambda step=step: ck.save_if_needed(step, state), 30, f"a free slot for step {step}")
        wait_for(lambda: layout.read_tracker(env.save_dir) == 30, 30, "the tracker to name the new step 30")
        wait_for(lambda: [s for _, s, _ in timeline.abandoned_iterations(env.save_dir)] == [40], 30,
                 "rotation to remove the abandoned 30 (6 iterations, max_ckpt_num=5)")
        assert [s for s, _ in layout.complete_iterations(env.save_dir)] == [0, 10, 20, 30]
        deletes = [line for line in audit(env.save_dir) if line["op"] == "delete"]
        assert [(Path(line["path"]).name, "abandoned timeline first" in line["reason"]) for line in deletes] == [
            ("iteration_0000030", True)], deletes
        files = sorted(path.glob("*.safetensors"))
        with safe_open(str(files[0]), framework="pt") as handle:
            assert bool((handle.get_tensor(handle.keys()[0]) == 1030).all())
    finally:
        ck.close()
    wait_for(lambda: env.agent_pid() is None, 30, "the agent to exit after close")
    ck = easyckpt.Checkpointer(env.save_dir, 1, 10, 10)
    try:
        result = ck.load()
        assert (result.step, result.source) == (30, "disk") and float(result.state["w"][0]) == 1030
    finally:
        ck.close()


def test_rollback_across_two_nodes_moves_aside_once_and_commits_the_new_timeline(env: Env) -> None:
    """Simulated 2 nodes x 2 ranks on shared storage: a rollback to an older iteration is told to both agents;
    the leader's moves the newer iterations aside (once, whatever the order of the four ranks' messages), and
    the new timeline's 20 gets every node's shards, is committed by the leader and tracked; no stage is left
    behind. (The leader commits the newest complete stage first and drops an older one as superseded, so
    which older iterations exist varies from run to run: the rollback target is the newest below 20.)"""
    from multinode import Cluster

    first = Cluster(env, env.tmp_path / "first", steps=21, step_idle=0.0)
    first.args += ["--max-ckpt-num", "10"]
    try:
        first.start(0)
        first.start(1)
        assert first.wait(0) == 0, first.log(0)[-3000:]
        assert first.wait(1) == 0, first.log(1)[-3000:]
    finally:
        first.cleanup()
    wait_for(lambda: layout.read_tracker(env.save_dir) == 20, 60, "the first run's step 20 to be committed")
    env.wait_agent_gone()   # both nodes' agents exit once their ranks finished: the second run starts new ones
    complete = [s for s, _ in layout.complete_iterations(env.save_dir)]
    assert len(complete) >= 2 and complete[-1] == 20, complete
    target = complete[-2]
    newer = [s for s in complete if s > target]
    print(f"first run's iterations {complete}: rolling back to {target}")
    second = Cluster(env, env.tmp_path / "second", steps=21, step_idle=0.0)
    second.args += ["--max-ckpt-num", "10", "--load-dir", str(env.save_dir / layout.iteration_dirname(target))]
    try:
        second.start(0)
        second.start(1)
        assert second.wait(0) == 0, second.log(0)[-3000:]
        assert second.wait(1) == 0, second.log(1)[-3000:]
    finally:
        second.cleanup()
    for rank in range(4):
        report = json.loads((env.tmp_path / "second" / f"resume-rank{rank}-0.json").read_text())
        assert (report["step"], report["source"]) == (target, "disk"), report
    wait_for(lambda: layout.read_tracker(env.save_dir) == 20 and not list(env.save_dir.glob(".stage-*")), 120,
             "the new timeline's step 20 to be committed by the leader and tracked")
    lines = audit(env.save_dir)
    abandon_lines = [i for i, line in enumerate(lines) if line["op"] == "abandon"]
    assert [lines[i]["step"] for i in abandon_lines] == newer, "moved exactly once, by the leader"
    assert {lines[i]["pid"] for i in abandon_lines} == {lines[abandon_lines[0]]["pid"]}
    assert sorted(s for _, s, _ in timeline.abandoned_iterations(env.save_dir)) == newer
    commits = {Path(line["path"]).name: i for i, line in enumerate(lines)
               if line["op"] == "write" and line.get("nodes") == "all"}
    for step in [s for s, _ in layout.complete_iterations(env.save_dir) if s > target]:
        assert commits.get(layout.iteration_dirname(step), -1) > abandon_lines[-1], f"{step} is not the new one"
    assert commits.get(layout.iteration_dirname(20), -1) > abandon_lines[-1], "the new 20 was never committed"
    assert all(problem is None for _, _, problem in storage.verify(env.save_dir))


def test_a_persist_in_flight_when_the_rollback_arrives_publishes_nothing(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent is still writing step 40 (held at a fault point after its first file) when
    load(load_dir=iteration_20) arrives: the finished copy is removed with an audit line instead of becoming
    iteration_40 or the tracked step. (A persist throttled to last 1 s was once the stand-in: a test process
    stalled that long would have sent the load after the persist had ended.)"""
    import torch
    from agent_client_status import agent_status

    import easyckpt
    from easyckpt_wire import faults

    arm = env.tmp_path / "hold-the-persist-of-40"
    arm.touch()
    monkeypatch.setenv(faults.ENV, "agent.persist.after_file@40:hold")
    monkeypatch.setenv(faults.ARM_ENV, str(arm))
    ck = easyckpt.Checkpointer(env.save_dir, 1, 10, 10)
    state = {"w": torch.zeros(2 << 20)}
    try:
        for step in range(41):
            ck.wait()
            state["w"].fill_(step)
            if step % 10 == 0 and step < 40:
                save_and_persist(ck, env, step, state)
            else:
                wait_for(lambda step=step: ck.save_if_needed(step, state), 30, f"a free slot for step {step}")
        ck.wait()
        wait_for(lambda: (agent_status(env) or {}).get("persisting") == 40, 30, "the persist of step 40 to start")
        result = ck.load(load_dir=env.save_dir / layout.iteration_dirname(20))
        assert (result.step, result.source) == (20, "disk")
        assert (agent_status(env) or {}).get("persisting") == 40, "the persist of step 40 ended before the load"
        arm.unlink()   # the persist of step 40 goes on to its publish, which the resume has abandoned
        wait_for(lambda: (agent_status(env) or {}).get("persisting") is None, 60, "the persist of step 40 to end")
        status = agent_status(env)
        assert status is not None and status["persisted_step"] == 20, status
    finally:
        arm.unlink(missing_ok=True)   # a failed assertion must not leave close() waiting on the hold
        ck.close()
    assert [s for s, _ in layout.complete_iterations(env.save_dir)] == [0, 10, 20]
    assert layout.read_tracker(env.save_dir) == 20
    assert [s for _, s, _ in timeline.abandoned_iterations(env.save_dir)] == [30]
    lines = audit(env.save_dir)
    assert any(line["op"] == "delete" and line["step"] == 40 and "abandoned this step" in line["reason"]
               for line in lines), lines[-5:]
    assert not [line for line in lines if line["op"] == "write" and line["step"] == 40]
    assert not list(env.save_dir.glob(".tmp-*"))
