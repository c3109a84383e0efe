"""Issue 11, items 5-7: SIGTERM to the node agent, one job per save_dir, and what ``easyckpt status`` and
``easyckpt clean`` say and do about what a job left behind. Real processes, real signals, real kill -9."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, Env, gone, run_cli, wait_for
from soak_job import free_port

from easyckpt_wire import layout, owner, procs, protocol, runtime

# One rank parked after its snapshots (training is over for the test's purposes, the process lives).
# 8 MiB of state: at EASYCKPT_PERSIST_MBPS=2 one persist takes about 4 s.
PARKED = """
import sys, torch, easyckpt
idle = next((float(arg[5:]) for arg in sys.argv[4:] if arg.startswith("idle=")), 120.0)
ck = easyckpt.Checkpointer(sys.argv[1], 1, int(sys.argv[2]), 3, agent_idle_timeout=idle)
result = ck.load()
print("loaded", result.step, result.source, flush=True)
for step in range(1, int(sys.argv[3]) + 1):
    ck.save_if_needed(step, {"w": torch.full((2 << 20,), float(step)), "step": step})
    ck.wait()
print("ready", flush=True)
sys.stdin.read()  # parked until the test closes stdin or kills it
if "close" in sys.argv[4:]:
    ck.close()
elif "failed" in sys.argv[4:]:   # what an integration does when the loop raised (another rank died, say)
    ck.close(failed=True)
"""


def agent_log(env: Env) -> str:
    return (env.job_dir() / "agent.log").read_text()


def start_rank(env: Env, *args: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PARKED, str(env.save_dir), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env.environ(**extra),
                            cwd=str(ROOT))


def wait_ready(proc: subprocess.Popen[str]) -> str:
    """The rank's 'loaded ...' line, once it printed 'ready' (a readline blocks: bounded by the test timeout)."""
    assert proc.stdout is not None
    loaded = proc.stdout.readline().strip()
    ready = proc.stdout.readline().strip()
    assert ready == "ready", f"{loaded!r} {ready!r} {proc.stderr.read() if proc.poll() is not None and proc.stderr else ''}"
    return loaded


def start_agent(env: Env, timeout: float, **extra: str) -> subprocess.Popen[bytes]:
    """The agent as the test's own child, so that its exit code can be read (a rank would start it detached)."""
    job_dir = env.runtime_dir / layout_job_id(env)
    job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(job_dir / "agent.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "easyckpt_agent", "--save-dir", str(env.save_dir), "--shm-dir",
                                 str(env.shm_dir), "--idle-timeout", "120", "--shutdown-timeout", str(timeout)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env.environ(**extra), cwd=str(ROOT))
    wait_for(env.agent_alive, 30, "the agent to take its lock")
    return proc


def layout_job_id(env: Env) -> str:
    return protocol.job_id_for(env.save_dir)


def tmp_dirs(env: Env) -> list[str]:
    return [p.name for p in env.save_dir.iterdir() if p.name.startswith(layout.TMP_PREFIX)] \
        if env.save_dir.is_dir() else []


def complete(env: Env) -> list[int]:
    return [step for step, _ in layout.complete_iterations(env.save_dir)]


def kill(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("time_allows", [True, False], ids=["time-allows", "timeout-runs-out"])
def test_sigterm_to_the_agent_during_a_persist(env: Env, time_allows: bool) -> None:
    """SIGTERM while step 2 is being persisted (slowly): with time, the agent finishes it and persists step 3,
    the newest snapshot; without, it abandons the persist and removes its temporary directory. Either way
    it exits 0 with one line saying so, disk holds only complete iterations, the slots stay (the rank
    lives), status lists them with their size and the clean command, and clean refuses until the rank is
    gone, then removes everything."""
    agent = start_agent(env, 30.0 if time_allows else 0.5, EASYCKPT_PERSIST_MBPS="2")
    rank = start_rank(env, "2", "3")
    try:
        assert wait_ready(rank) == "loaded None None"
        wait_for(lambda: tmp_dirs(env), 30, "the persist of step 2 to start")
        assert complete(env) == [], "the persist must still be in flight when the signal comes"
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=60)
        log = agent_log(env)
        assert code == 0, log[-3000:]
        lines = [line for line in log.splitlines() if "agent stopped by SIGTERM" in line]
        assert len(lines) == 1, log[-3000:]
        assert tmp_dirs(env) == [], "no partial iteration may be left behind"
        if time_allows:
            assert "finished the persist of step 2" in lines[0] and "finished the persist of step 3" in lines[0]
            assert complete(env) == [2, 3] and layout.read_tracker(env.save_dir) == 3
        else:
            assert "the persist of step 2 was abandoned when shutdown_timeout ran out" in lines[0], lines[0]
            assert "no time left to persist step 3 (shutdown_timeout=0.5s)" in lines[0], lines[0]
            assert complete(env) == [] and not any(p.name.startswith("iteration_") for p in env.save_dir.iterdir())
        assert "slots kept: rank(s) [0] still run" in lines[0]
        slots = env.slot_files()
        assert len(slots) == 3

        status = run_cli("status", env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        for path in slots:
            assert re.search(rf"{re.escape(str(path))}: rank 0 slot \d, step \d, \d+\.\d MiB", status.stdout), status.stdout
        assert status.stdout.splitlines()[-1].strip() == f"easyckpt clean {env.save_dir.resolve()}", status.stdout
        disk = f"newest on disk in {env.save_dir.resolve()}: "
        assert (disk + ("step 3; nothing newer in memory" if time_allows else "nothing; only in memory: step(s) ")) \
            in status.stdout, status.stdout

        refused = run_cli("clean", str(env.save_dir), env=env)
        assert refused.returncode == 1 and f"rank 0 pid {rank.pid}" in refused.stderr, refused.stdout + refused.stderr
        assert env.slot_files() == slots, "a refused clean removes nothing"
    finally:
        kill(rank)
        kill(agent)
    cleaned = run_cli("clean", "--save-dir", str(env.save_dir), env=env)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert "freed" in cleaned.stdout and env.shm_files() == [] and list(env.runtime_dir.iterdir()) == []
    assert complete(env) == ([2, 3] if time_allows else [])


@pytest.mark.timeout(180)
def test_sigterm_after_the_job_ended_leaves_nothing(env: Env) -> None:
    """The rank is gone (killed) and its newest snapshot is on disk: a SIGTERMed agent unlinks the slots and
    removes its runtime directory but for its log (a rank died without closing: worth a post-mortem)."""
    rank = start_rank(env, "1", "2", EASYCKPT_KEEP_AGENT_LOG="0")
    try:
        wait_ready(rank)
        pid = wait_for(env.agent_pid, 30, "the agent's pid file")
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
        # Step 2 is on disk either as due or by the flush on failure (when it was passed over while step 1
        # was persisted): then the newest snapshot is durable and nothing in memory is worth keeping.
        wait_for(lambda: complete(env)[-1:] == [2], 60, "step 2 on disk")
        # The job is over once its agent knows: a rank whose death it had not seen yet when the signal came was torn
        # down with the job (DeepSpeed's launcher), and its memory would be kept for the restart.
        wait_for(lambda: f"rank 0 (pid {rank.pid}) died without closing" in agent_log(env),
                 30, "the agent to see the rank die")
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: gone(pid), 60, "the agent to exit")
    finally:
        kill(rank)
    assert env.shm_files() == [] and sorted(os.listdir(env.job_dir())) == ["agent.log"]
    log = agent_log(env)
    assert "agent stopped by SIGTERM" in log and "slots unlinked (everything in them is on disk)" in log, log[-2000:]


@pytest.mark.timeout(180)
def test_sigterm_after_a_failed_run_keeps_the_memory_for_the_rerun(env: Env) -> None:
    """DeepSpeed's launcher ends a failed job's whole process tree, the agent with it, often once the ranks are
    gone: the rank that said its run failed was promised the node's memory for the rerun, which resumes from it
    (the agent let go of it while disk held its newest step: CI of 2026-12-06)."""
    rank = start_rank(env, "1", "3", "failed")
    try:
        assert wait_ready(rank) == "loaded None None"
        pid = wait_for(env.agent_pid, 30, "the agent's pid file")
        slots = env.slot_files()
        assert rank.stdin is not None
        rank.stdin.close()   # the loop "fails": close(failed=True), which waits for the persists in flight
        assert rank.wait(timeout=60) == 0, rank.stderr.read() if rank.stderr else ""
        assert complete(env)[-1:] == [3]   # disk holds the newest step: before, that let the slots go
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: gone(pid), 60, "the agent to exit")
    finally:
        kill(rank)
    log = agent_log(env)
    assert "rank(s) [0] failed or still ran when SIGTERM came" in log, log[-2000:]
    assert env.slot_files() == slots
    rerun = start_rank(env, "1", "0", "close")
    try:
        assert wait_ready(rerun) == "loaded 3 memory"
        assert rerun.stdin is not None
        rerun.stdin.close()
        assert rerun.wait(timeout=60) == 0, rerun.stderr.read() if rerun.stderr else ""
    finally:
        kill(rerun)


def tree_killed_with_its_rank(env: Env, idle: str, late: bool = False) -> tuple[int, list[Path]]:
    """A rank under DeepSpeed's own launcher (``deepspeed --num_gpus 1``), which starts the agent and parks after step
    3; then the launcher is stopped as its ``deepspeed`` command stops it on Ctrl-C or SIGTERM: it terminates the
    rank's process tree, children first (the agent is one), with nothing waited for first. ``late``: the agent runs
    its signal handler only after the rank is gone, as a niced agent on a busy node does (the launcher signals the
    rank an instant after it). Returns the pid of the agent that took over and the slots."""
    script = env.tmp_path / "parked.py"
    script.write_text(PARKED)
    runner = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", "--num_gpus=1",
                               f"--master_port={free_port()}", str(script), str(env.save_dir), "1", "3", f"idle={idle}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env.environ(DS_ACCELERATOR="cpu"), cwd=str(ROOT))
    try:
        assert runner.stdout is not None
        lines: list[str] = []
        while not lines or lines[-1] != "ready":   # the launchers' own lines come between (readline: the test timeout)
            line = runner.stdout.readline()
            assert line, "".join(f"{text}\n" for text in lines)[-3000:]
            lines.append(line.strip())
        assert "loaded None None" in lines, lines[-20:]
        first = wait_for(env.agent_pid, 30, "the agent's pid file")
        rank = psutil.Process(first).parent()   # the agent's parent is the rank, the rank's the launcher
        launcher = rank.parent()
        assert "deepspeed.launcher.launch" in launcher.cmdline(), launcher.cmdline()
        slots = env.slot_files()
        if late:
            os.kill(first, signal.SIGSTOP)   # the launcher's SIGTERM stays pending until SIGCONT
        launcher.terminate()
        if late:
            wait_for(lambda: gone(rank.pid), 20, "the rank to die of the launcher's SIGTERM")
            os.kill(first, signal.SIGCONT)
        assert runner.wait(timeout=60) != 0
        wait_for(lambda: gone(first), 30, "the agent to stop")
    finally:
        kill(runner)
    successor = wait_for(lambda: (pid := env.agent_pid()) not in (None, first) and pid, 30,
                         "an agent to take over the job's memory")
    log = agent_log(env)
    assert "a detached agent takes the slots over" in log and f"agent pid {successor} takes over" in log, log[-3000:]
    return successor, slots


@pytest.mark.timeout(180)
def test_a_tree_kill_hands_the_memory_to_a_detached_agent_that_frees_it_after_idle_timeout(env: Env) -> None:
    """DeepSpeed's launcher takes the agent down with the ranks of every failed or stopped job: the memory it kept for
    a restart stayed in /dev/shm for good if none came. Now an agent outside that tree takes it over and, with no rank after
    agent_idle_timeout, unlinks what disk holds, as an agent does under torchrun."""
    successor, slots = tree_killed_with_its_rank(env, "3")
    wait_for(lambda: gone(successor), 60, "the agent that took over to leave after agent_idle_timeout")
    log = agent_log(env) if env.job_dir().exists() else ""
    assert env.shm_files() == [] and slots, log[-3000:]
    assert complete(env)[-1:] == [3]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("late", [False, True], ids=["handled-at-once", "handled-after-the-rank-died"])
def test_a_tree_kill_hands_the_memory_to_a_detached_agent_and_the_rerun_resumes_from_it(env: Env, late: bool) -> None:
    successor, slots = tree_killed_with_its_rank(env, "120", late)
    assert env.slot_files() == slots
    log = wait_for(lambda: "had ended before this agent adopted its slots" in (text := agent_log(env)) and text, 30,
                   "the agent that took over to say that the rank whose slots it adopted had ended")
    assert log.count("died without closing") <= 1, "only the first agent may have seen the rank die"
    rerun = start_rank(env, "1", "0", "close")
    try:
        assert wait_ready(rerun) == "loaded 3 memory"
        assert env.agent_pid() == successor
        assert rerun.stdin is not None
        rerun.stdin.close()
        assert rerun.wait(timeout=60) == 0, rerun.stderr.read() if rerun.stderr else ""
    finally:
        kill(rerun)
    wait_for(lambda: gone(successor), 60, "the agent to leave once the rerun ended")
    assert env.shm_files() == []


@pytest.mark.timeout(180)
def test_a_second_run_on_the_same_save_dir_fails_at_construction_and_a_restart_after_kill_adopts(env: Env) -> None:
    first = start_rank(env, "1000", "2")
    try:
        assert wait_ready(first) == "loaded None None"
        before = {p: p.stat().st_mtime_ns for p in env.slot_files()}
        second = subprocess.run([sys.executable, "-c", PARKED, str(env.save_dir), "1000", "2"], stdin=subprocess.DEVNULL,
                                check=False, capture_output=True, text=True, timeout=120, env=env.environ(), cwd=str(ROOT))
        assert second.returncode != 0
        assert "SaveDirInUseError" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr[-2000:]
        assert str(env.save_dir.resolve()) in second.stderr and "own save_dir" in second.stderr
        assert "loaded" not in second.stdout, "the second run must not resume out of the first one's slots"
        assert {p: p.stat().st_mtime_ns for p in env.slot_files()} == before, "the second run touched the slots"
        assert first.poll() is None
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        restarted = start_rank(env, "1000", "2")
        try:
            assert wait_ready(restarted) == "loaded 2 memory"
        finally:
            kill(restarted)
    finally:
        kill(first)


@pytest.mark.timeout(120)
def test_the_same_process_may_build_a_new_checkpointer(env: Env) -> None:
    """One job per save_dir is about other processes: a loop that builds a new Checkpointer goes on."""
    code = ("import sys, easyckpt; a = easyckpt.Checkpointer(sys.argv[1], 1, 1000, 3); "
            "b = easyckpt.Checkpointer(sys.argv[1], 1, 1000, 3); b.close(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code, str(env.save_dir)], check=False, capture_output=True, text=True,
                          timeout=120, env=env.environ(), cwd=str(ROOT))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_a_job_that_ends_cleanly_leaves_no_runtime_dir(env: Env) -> None:
    rank = start_rank(env, "1", "2", "close", EASYCKPT_KEEP_AGENT_LOG="0")
    try:
        wait_ready(rank)
        assert rank.stdin is not None
        rank.stdin.close()
        assert rank.wait(timeout=60) == 0
        wait_for(lambda: not env.agent_alive(), 60, "the agent to exit after the goodbye")
    finally:
        kill(rank)
    assert complete(env)[-1] == 2
    assert env.shm_files() == [] and list(env.runtime_dir.iterdir()) == []


def make_job_dir(base: Path, name: str, files: list[str], age: float) -> Path:
    job = base / name
    job.mkdir(mode=0o700)
    for file in files:
        (job / file).write_text("x")
    stamp = time.time() - age
    for path in [*job.iterdir(), job]:
        os.utime(path, (stamp, stamp))
    return job


@pytest.mark.timeout(120)
def test_status_without_args_lists_recoverable_jobs_and_prunes_stale_runtime_dirs(env: Env) -> None:
    base = env.runtime_dir
    stale = make_job_dir(base, "aaaa000000000001", ["agent.sock", "agent.pid", "agent.lock", "agent.log"], 300)
    fresh = make_job_dir(base, "aaaa000000000002", ["agent.sock", "agent.lock"], 0)
    kept_log = make_job_dir(base, "aaaa000000000003", ["agent.log"], 3600)
    old_log = make_job_dir(base, "aaaa000000000004", ["agent.log"], runtime.LOG_RETENTION + 60)
    foreign = make_job_dir(base, "aaaa000000000005", ["agent.sock", "notes.txt"], 300)
    dead_owner = make_job_dir(base, "aaaa000000000006", ["agent.lock"], 300)
    (dead_owner / "rank-000000.owner").write_text(json.dumps({"v": owner.OWNER_VERSION, "pid": 4_000_000, "start": 1.0,
                                                              "save_dir": "/nowhere", "rank": 0}))
    os.utime(dead_owner / "rank-000000.owner", (time.time() - 300,) * 2)
    os.utime(dead_owner, (time.time() - 300,) * 2)
    live_owner = make_job_dir(base, "aaaa000000000007", [], 300)
    owner.claim(live_owner, "aaaa000000000007", 0, Path("/somewhere"))   # this test process: alive
    os.utime(live_owner / "rank-000000.owner", (time.time() - 300,) * 2)
    os.utime(live_owner, (time.time() - 300,) * 2)
    recoverable = make_job_dir(base, "aaaa000000000008", ["agent.sock", "agent.lock"], 300)
    slot = env.shm_dir / "easyckpt-aaaa000000000008-r000000-s0"
    slot.write_bytes(b"\0" * 8192)

    proc = run_cli("status", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "aaaa000000000008: no agent is running, but 1 slot file(s)" in proc.stdout, proc.stdout
    assert "easyckpt clean --job-id aaaa000000000008" in proc.stdout
    for name in ("0001", "0002", "0003", "0004", "0005", "0006", "0007"):
        assert f"aaaa00000000{name}" not in proc.stdout, proc.stdout
    remaining = sorted(p.name for p in base.iterdir())
    assert remaining == sorted(p.name for p in (fresh, kept_log, foreign, live_owner, recoverable)), remaining
    assert not stale.exists() and not old_log.exists() and not dead_owner.exists()


def test_prunable_decision() -> None:
    files = ["agent.sock", "agent.lock", "agent.pid", "rank-000003.owner"]
    assert runtime.prunable(files, age=61, agent_running=False, slots=0, live_ranks=0)
    assert not runtime.prunable(files, age=59, agent_running=False, slots=0, live_ranks=0)
    assert not runtime.prunable(files, age=1e9, agent_running=True, slots=0, live_ranks=0)
    assert not runtime.prunable(files, age=1e9, agent_running=False, slots=1, live_ranks=0)
    assert not runtime.prunable(files, age=1e9, agent_running=False, slots=0, live_ranks=1)
    assert not runtime.prunable([*files, "mine.txt"], age=1e9, agent_running=False, slots=0, live_ranks=0)
    assert not runtime.prunable(["agent.log"], age=3600, agent_running=False, slots=0, live_ranks=0)
    assert runtime.prunable(["agent.log"], age=runtime.LOG_RETENTION, agent_running=False, slots=0, live_ranks=0)
    assert runtime.prunable([], age=61, agent_running=False, slots=0, live_ranks=0)


def test_owner_conflict_decision() -> None:
    other = owner.Owner(pid=10, start=1.0, save_dir="/x", rank=0)
    assert owner.conflict(other, pid=11, alive=True)
    assert not owner.conflict(other, pid=11, alive=False)   # a crash: the old pid is dead, the slots are adopted
    assert not owner.conflict(other, pid=10, alive=True)    # the same process builds a new Checkpointer
    assert not owner.conflict(None, pid=11, alive=False)
    assert owner.parse("garbage", 0) is None and owner.parse('{"v": 2, "pid": 1}', 0) is None
    assert not procs.is_alive(os.getpid(), 0.0)         # a recycled pid: another start time
    assert procs.is_alive(os.getpid(), None)
