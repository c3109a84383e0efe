"""Invariant 9 in the regime of real jobs: 2-rank torchrun, no sleep standing in for compute, a 48 MB tensor
in the state so that one persist takes many training steps, a snapshot every step and a persist every 5th.

A rank is SIGKILLed at a seeded random step (printed; replay with EASYCKPT_TEST_SEED), the whole group is,
or a rank is killed while the agent is persisting; torchrun restarts the group. Every resume must come from
memory, at most two steps behind the kill, and continue bit-exactly (loss and state digest) like a run that
was never interrupted. The agent's log stays small: no condition is logged once per loop turn.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal

import pytest
from conftest import Env, seeded_random, wait_for
from ddp_job import Job

STEPS = 60
INTERVAL = 5
BALLAST_MB = 48
PERSIST_MBPS = 200
pytestmark = pytest.mark.slow


def job(env: Env, name: str, *extra: str, max_restarts: int = 1) -> Job:
    # 2 x 48 MB at 200 MB/s: a persist takes about half a second, ten steps or more here, as for a large
    # model on network storage.
    return Job(env, env.save_dir, env.tmp_path / name, steps=STEPS, max_restarts=max_restarts, step_seconds=0.0,
               save_storage_interval=INTERVAL, extra_args=["--ballast-mb", str(BALLAST_MB), *extra],
               extra_env={"EASYCKPT_PERSIST_MBPS": str(PERSIST_MBPS)})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    env = Env(tmp_path_factory.mktemp("reference"))
    try:
        run = job(env, "out", max_restarts=0)
        assert run.wait(180) == 0, run.log()[-3000:]
        persists = [float(m) for m in re.findall(r"seconds=([\d.]+)", (run.out / "persist.log").read_text())]
        assert persists and min(persists) > 0.3, f"persists should take several steps: {persists}"
        return run
    finally:
        env.cleanup()


def check_fresh_exact(run: Job, reference: Job, killed_at: int) -> int:
    """The resume is from memory, at most two steps behind ``killed_at``, and the run continues exactly."""
    resumed = [run.resumes(rank)[-1] for rank in range(2)]
    step = resumed[0]["step"]
    assert all(r["step"] == step and r["source"] == "memory" for r in resumed), resumed
    assert killed_at - 2 <= step <= killed_at, f"killed at step {killed_at}, resumed at {step}"
    for rank in range(2):
        assert resumed[rank]["digest"] == reference.losses(rank)[step]["digest"], f"rank {rank} resumed other bits"
        ours, theirs = run.losses(rank), reference.losses(rank)
        for later in range(step + 1, STEPS):
            assert ours[later]["loss"] == theirs[later]["loss"], f"rank {rank} loss differs at step {later}"
            assert ours[later]["digest"] == theirs[later]["digest"], f"rank {rank} state differs at step {later}"
    return step


def check_agent_log_is_quiet(env: Env) -> None:
    """No line repeated per loop turn: the same message (numbers aside) at most a few times per run."""
    text = "".join(p.read_text() for p in env.runtime_dir.glob("*/agent.log"))
    shapes = collections.Counter(re.sub(r"\d+(\.\d+)?", "N", line.split(": ", 1)[-1]) for line in text.splitlines())
    noisy = {shape: n for shape, n in shapes.items() if n > STEPS and "persisted step" not in shape}
    assert not noisy, f"agent log repeats itself: {noisy}"


@pytest.mark.parametrize("victim", [1, 0, -1], ids=["rank1", "rank0", "whole-group"])
def test_kill_at_a_random_step_resumes_from_memory_at_most_two_steps_back(env: Env, reference: Job,
                                                                          victim: int) -> None:
    kill_at = seeded_random().randint(8, STEPS - 10)
    run = job(env, "out", "--kill-at", str(kill_at), "--kill-rank", str(victim))
    try:
        assert run.wait(240) == 0, run.log()[-3000:]
    finally:
        run.kill()
    for rank in ([victim] if victim >= 0 else [0, 1]):
        assert int((run.out / f"killed-rank{rank}").read_text()) == kill_at
    check_fresh_exact(run, reference, kill_at)
    check_agent_log_is_quiet(env)


def test_kill_during_a_persist_resumes_from_memory_at_most_two_steps_back(env: Env, reference: Job) -> None:
    """The test kills rank 1 at the moment the agent reports a persist in flight (after a seeded step)."""
    from easyckpt.node.client import AgentTimeout, query_status

    after = seeded_random().randint(8, STEPS - 20)
    run = job(env, "out")

    def persisting() -> bool:
        if not run.reached(1, after):
            return False
        try:
            return query_status(env.job_dir(), timeout=5).get("persisting") is not None
        except (AgentTimeout, AssertionError):
            return False

    try:
        wait_for(persisting, 120, f"rank 1 past step {after} with a persist in flight")
        os.kill(run.pid(1), signal.SIGKILL)
        assert run.wait(240) == 0, run.log()[-3000:]
    finally:
        run.kill()
    rows = [json.loads(line) for line in (run.out / "losses-rank1.jsonl").read_text().splitlines()]
    logged = max(row["step"] for row in rows if row["attempt"] == "0")
    # The kill may land between a step's snapshot and its loss line: that snapshot is the newest then.
    check_fresh_exact(run, reference, logged + 1)
    check_agent_log_is_quiet(env)


# One rank at full speed; a 64 MB ballast so that a persist (capped at 200 MB/s) holds a slot for many steps. It
# writes its step to ``progress`` and, once ``stopped`` exists (the test SIGSTOPped the agent), SIGKILLs itself at
# the next step, right after that step's snapshot started.
STALLED_LOOP = """
import os, signal, sys, torch, easyckpt
save_dir, total, progress, stopped = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
ballast = torch.zeros(16 << 20)
ckpt = easyckpt.Checkpointer(save_dir=save_dir, save_mem_interval=1, save_storage_interval=5, max_ckpt_num=2)
result = ckpt.load({"model": model.state_dict(), "optim": optimizer.state_dict(), "ballast": ballast})
step, seen = (result.step + 1 if result.step is not None else 0), None
while step < total:
    model(torch.randn(64, 256)).sum().backward(); optimizer.step(); optimizer.zero_grad()
    ckpt.save_if_needed(step, {"model": model.state_dict(), "optim": optimizer.state_dict(), "ballast": ballast})
    if seen is not None:
        print(step, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if stopped and os.path.exists(stopped):
        seen = step
    with open(progress, "w") as out:
        out.write(str(step))
    step += 1
ckpt.close()
"""


def test_an_agent_stopped_dead_costs_a_kill_at_most_two_steps(env: Env) -> None:
    """The agent is SIGSTOPped while a persist holds a slot, at a seeded step; the rank is killed at the next step
    after it sees that. The agent is late for two choices in a row: the first may write over the newest step (a kill
    then resumes at the safe step, two back), the second must not (three back: CI, 2026-12-01, a kill at step 5
    resumed at 2); it skips that snapshot. Measured before the fix: 10 of 12 such kills lost 3 steps."""
    import subprocess
    import sys

    after = seeded_random().randint(15, 60)
    progress, stopped = env.tmp_path / "progress", env.tmp_path / "stopped"
    environ = env.environ(EASYCKPT_PERSIST_MBPS="200")
    loop = subprocess.Popen([sys.executable, "-c", STALLED_LOOP, str(env.save_dir), "100000", str(progress),
                             str(stopped)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    agent = None
    try:
        def reached() -> bool:
            try:
                return int(progress.read_text() or -1) >= after
            except (FileNotFoundError, ValueError):
                return False

        wait_for(reached, 120, f"the loop past step {after}")
        agent = wait_for(env.agent_pid, 30, "the agent's pid")
        os.kill(agent, signal.SIGSTOP)
        stopped.touch()
        out, err = loop.communicate(timeout=120)
    finally:
        loop.kill()
        if agent is not None:
            os.kill(agent, signal.SIGCONT)
    assert loop.returncode == -signal.SIGKILL, err[-3000:]
    killed = int(out.split()[-1])
    again = subprocess.run([sys.executable, "-c", STALLED_LOOP, str(env.save_dir), str(killed + 2), str(progress), ""],
                           env=environ, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    match = re.search(r"resumed at step (\d+) from (\w+)", again.stderr)
    assert match is not None and match.group(2) == "memory", again.stderr[-3000:]
    assert killed - 2 <= int(match.group(1)) <= killed, f"killed at step {killed}, resumed at {match.group(1)}"
