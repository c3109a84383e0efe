"""What a user sees (issue 28): a plain loop with no logging configured says one line when it resumes and
nothing else on a clean run; a persist failure and its recovery once each; the CLI tells the truth about
finished, crashed and damaged jobs; errors name the real cause.

Real processes throughout: the loops below are subprocesses with no logging set up (as a user's script),
killed with SIGKILL at a seeded step, and the CLI runs against the checkpoint directories they leave.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, Env, run_cli, save_and_persist, seeded_random, wait_for
from safetensors.torch import load_file

import easyckpt
from easyckpt.node.client import AgentClient, AgentRefused
from easyckpt_wire import protocol
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import PeerNode, PeerTable, PingReply
from easyckpt_wire.shm import filesystem_type

# The README's plain loop, nothing else: no logging configuration. Optionally it kills itself with SIGKILL
# right after the snapshot of ``kill_at``, or (``remount`` = a tmpfs under save_dir) makes save_dir read-only
# once a step is on disk, writable again once the rank has heard of the failure, and stops once persists
# succeed again: every step a real one, no sleeping.
LOOP = """
import os, signal, subprocess, sys, time, torch, easyckpt
save_dir, total, kill_at, remount = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ckpt = easyckpt.Checkpointer(save_dir=save_dir, save_mem_interval=1, save_storage_interval=5, max_ckpt_num=3)
result = ckpt.load({"model": model.state_dict(), "optim": optimizer.state_dict()})
if result.step is not None:
    model.load_state_dict(result.state["model"]); optimizer.load_state_dict(result.state["optim"])
step, phase, deadline = (result.step + 1 if result.step is not None else 0), 0, time.monotonic() + 120
why = ""
while step < total or (remount and phase < 3):
    model(torch.randn(8, 32)).sum().backward(); optimizer.step(); optimizer.zero_grad()
    ckpt.save_if_needed(step, {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step})
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if remount:
        stats = ckpt.stats()
        if phase == 0 and stats["persisted_step"] is not None:
            # "mount point is busy" while the agent has the next persist's file open: tried again next step
            tried = subprocess.run(["mount", "-o", "remount,ro", remount], capture_output=True, text=True)
            phase, why = (1, "") if tried.returncode == 0 else (0, tried.stderr.strip())
        elif phase == 1 and stats["persist_failure"] is not None:
            subprocess.run(["mount", "-o", "remount,rw", remount], check=True); phase = 2
        elif phase == 2 and stats["persist_failure"] is None:
            phase = 3
        if time.monotonic() > deadline:
            raise SystemExit(f"loop: phase {phase} of the read-only episode not reached within 120 s {why}")
    step += 1
ckpt.close()
print(f"ended at step {step - 1}", flush=True)
"""

RESUME_LINE = re.compile(r"^easyckpt: resumed at step (\d+) from (memory|disk) "
                         r"\((.*, )?[\d.]+ (B|KiB|MiB), [\d.]+ (ms|s)\)$")


def loop(env: Env, save_dir: Path, total: int, *, kill_at: int = -1, remount: str = "",
         **extra: str) -> subprocess.CompletedProcess[str]:
    environ = env.environ(**extra)
    if "EASYCKPT_LOG_LEVEL" not in extra:
        environ.pop("EASYCKPT_LOG_LEVEL", None)   # what a user who never heard of it runs with
    return subprocess.run([sys.executable, "-c", LOOP, str(save_dir), str(total), str(kill_at), remount],
                          capture_output=True, text=True, timeout=180, env=environ, cwd=str(ROOT))


# a word on resume by default ----------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_plain_loop_without_logging_says_one_resume_line_and_nothing_else(env: Env) -> None:
    kill_at = seeded_random().randint(3, 12)
    first = loop(env, env.save_dir, 20, kill_at=kill_at)
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    assert first.stderr == "", "a fresh start prints nothing:\n" + first.stderr

    second = loop(env, env.save_dir, 20)   # resumes from this node's memory, runs to the end, close()
    assert second.returncode == 0 and second.stdout == "ended at step 19\n", second.stdout + second.stderr
    lines = second.stderr.splitlines()
    assert len(lines) == 1, "one line, nothing else on a clean run:\n" + second.stderr
    match = RESUME_LINE.match(lines[0])
    assert match is not None and match.group(2) == "memory", lines[0]
    # Killed right after the snapshot of kill_at was started: invariant 9 bounds a rank kill to two snapshot
    # intervals. Mostly that one, or the one before if its copy was cut; two back when the agent, persisting a due
    # step, had not yet declared the newest step safe as the next snapshot took its slot (CI, 2026-11-28: killed at
    # 12, resumed at 10; issue 24 tracks the one-step bound). Three back was an agent late for two snapshots in a
    # row (CI, 2026-12-01, seed 760437856: killed at 5, resumed at 2): the rank now skips one rather than write over
    # its newest step (slot_choice.keep_newest). And an agent starved in the middle of moving the safe step (CI,
    # 2026-12-02, seed 720066417: killed at 4, resumed at 1): its flock on the new safe step's slot left the newest
    # step's slot the one free, which the rank now treats as when the agent's word leaves it alone.
    assert kill_at - 2 <= int(match.group(1)) <= kill_at, (kill_at, lines[0])

    # The job ended cleanly (the agent freed the memory): the next run resumes from disk and names it.
    env.wait_agent_gone()
    third = loop(env, env.save_dir, 22)
    assert third.returncode == 0, third.stderr
    lines = third.stderr.splitlines()
    assert len(lines) == 1 and RESUME_LINE.match(lines[0]), third.stderr
    assert lines[0].startswith(f"easyckpt: resumed at step 19 from disk ({env.save_dir.resolve()}/iteration_0000019, ")

    # EASYCKPT_LOG_LEVEL is honoured by the library itself: easyckpt's records, formatted, on stderr.
    env.wait_agent_gone()
    fourth = loop(env, env.save_dir, 24, EASYCKPT_LOG_LEVEL="info")
    assert fourth.returncode == 0, fourth.stderr
    assert re.search(r" INFO easyckpt\.checkpointer: resumed at step 21 from disk ", fourth.stderr), fourth.stderr
    assert " INFO easyckpt.snapshot.slots: " in fourth.stderr and "easyckpt: resumed" not in fourth.stderr, fourth.stderr


def test_a_log_level_that_is_not_one_is_refused_naming_the_variable(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EASYCKPT_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match=r"^EASYCKPT_LOG_LEVEL='LOUD' is not a logging level: use DEBUG, INFO, "):
        easyckpt.Checkpointer(env.save_dir, 1, 10, 2, start_agent=False)
    cli = run_cli("ls", str(env.tmp_path), env=env)   # the CLI honours it too
    assert cli.returncode == 2 and "EASYCKPT_LOG_LEVEL='LOUD' is not a logging level" in cli.stderr, cli.stderr
    # With logging configured (here pytest's handler), the level is set and no handler of ours is added.
    monkeypatch.setenv("EASYCKPT_LOG_LEVEL", "debug")
    library = logging.getLogger("easyckpt")
    try:
        easyckpt.Checkpointer(env.save_dir, 1, 10, 2, start_agent=False).close()
        assert library.level == logging.DEBUG and library.handlers == [], library.handlers
    finally:
        library.setLevel(logging.NOTSET)
        logging.getLogger("easyckpt_wire").setLevel(logging.NOTSET)


def test_an_agent_that_refuses_its_command_line_fails_the_checkpointer_at_once(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """EASYCKPT_AGENT_LOG_LEVEL=LOUD: the agent a rank starts exits with argparse's usage error, and would every time.
    Before, the rank started a new one every second for ever (a warning each time; training went on and nothing was
    ever persisted); now the Checkpointer raises at once with the agent's own words, and leaves no slot behind."""
    monkeypatch.setenv("EASYCKPT_AGENT_LOG_LEVEL", "LOUD")
    started = time.monotonic()
    with pytest.raises(AgentRefused) as info:
        easyckpt.Checkpointer(env.save_dir, 1, 10, 2)
    assert time.monotonic() - started < 30, "the refusal took the whole agent_start_timeout"
    message = str(info.value)
    assert "the easyckpt agent refused the command line rank 0 started it with" in message, message
    assert "EASYCKPT_AGENT_LOG_LEVEL='LOUD' is not a logging level: use one of DEBUG, INFO" in message, message
    assert not list(env.shm_dir.glob("easyckpt-*")), "a slot was left behind"
    log = (env.runtime_dir / protocol.job_id_for(env.save_dir) / "agent.log").read_text()
    assert log.count("EASYCKPT_AGENT_LOG_LEVEL='LOUD' is not a logging level") == 1, "the agent was started again"


def test_an_agent_that_dies_before_serving_is_started_again_less_and_less_often(
        env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every agent the rank starts dies before it serves (EASYCKPT_FAULT=agent.start): each next start waits twice as
    long (1, 2, 4 s ... at most a minute) instead of a new agent and two warnings every second, and the Checkpointer
    still comes up after agent_start_timeout, training without an agent as before."""
    monkeypatch.setenv("EASYCKPT_FAULT", "agent.start")
    with caplog.at_level(logging.WARNING, logger="easyckpt"):
        ck = easyckpt.Checkpointer(env.save_dir, 1, 10, 2, agent_start_timeout=6.0)
        ck.close()
    waits = [int(m.group(2)) for r in caplog.records
             if (m := re.search(r"exited with code -9 before serving \((\d+) in a row; the next start in (\d+) s\)",
                                r.getMessage()))]
    assert len(waits) >= 2 and waits == [2 ** k for k in range(len(waits))], caplog.text


@pytest.mark.timeout(240)
def test_plain_loop_without_logging_says_a_persist_failure_and_its_recovery_once_each(env: Env, tmpfs: Any) -> None:
    disk = tmpfs("size=8m")
    run = loop(env, disk / "ckpt", 0, remount=str(disk))
    assert run.returncode == 0, run.stdout + run.stderr
    # The two notices, once each and in order. Besides them only the stager's own warning may appear: under
    # load a snapshot was once skipped while the agent handled the failed persist (a WARNING with three slots,
    # which Python's lastResort shows, as it should).
    lines = [line for line in run.stderr.splitlines() if not re.match(r"^rank 0: snapshot of step \d+ skipped", line)]
    assert len(lines) == 2, "the failure and the recovery, nothing else:\n" + run.stderr
    assert lines[0].startswith("easyckpt: rank 0: persist of step ") and "Read-only file system" in lines[0], lines[0]
    assert "Training goes on" in lines[0] and str(disk / "ckpt") in lines[0], lines[0]
    assert re.match(r"^easyckpt: rank 0: persists succeed again: step \d+ is on disk \(\d+ persist\(s\) failed", lines[1])


# the CLI against real checkpoint directories -----------------------------------------------------------
def state_at(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"_orig_mod.weight": torch.randn(64, 64, generator=gen)},   # a torch.compile'd model's
            "optim": {"state": {0: {"exp_avg": torch.randn(64, 64, generator=gen)}}}, "step": step}


def imported_modules(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]


@pytest.mark.timeout(180)
def test_ls_verify_and_status_of_a_finished_job_with_a_deleted_and_a_truncated_file(env: Env) -> None:
    ck = easyckpt.Checkpointer(env.save_dir, 2, 2, 5, agent_idle_timeout=30.0)
    try:
        for step in (2, 4, 6, 8):
            save_and_persist(ck, env, step, state_at(step))
    finally:
        ck.close()
    env.wait_agent_gone()
    save_dir = env.save_dir.resolve()

    # convert: a one-process tool, without torch.distributed's "assuming ... a single process" UserWarning
    converted = run_cli("convert", "--to", "hf", str(save_dir), str(env.tmp_path / "model.safetensors"), env=env)
    assert converted.returncode == 0 and "Warning" not in converted.stderr, converted.stderr
    assert list(load_file(env.tmp_path / "model.safetensors")) == ["weight"]   # as the unwrapped model names it
    assert "torch.compile's '_orig_mod.' taken out" in converted.stdout, converted.stdout

    model = "easyckpt-model-0000000-0000001.safetensors"
    (save_dir / "iteration_0000004" / model).unlink()
    truncated = save_dir / "iteration_0000006" / model
    os.truncate(truncated, truncated.stat().st_size // 2)
    flipped = save_dir / "iteration_0000008" / model   # same size, one byte changed: only verify can tell
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 0xFF
    flipped.write_bytes(bytes(raw))

    listed = run_cli("ls", str(save_dir), env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert rows["iteration_0000002"].endswith("  complete"), listed.stdout
    assert f"DAMAGED: {model} (step 4, rank 0) is missing" in rows["iteration_0000004"], listed.stdout
    assert f"DAMAGED: {model} (step 6, rank 0) is truncated: " in rows["iteration_0000006"], listed.stdout
    assert "complete  <- tracker" in rows["iteration_0000008"], listed.stdout
    assert "2 damaged" in listed.stderr and "easyckpt verify" in listed.stderr, listed.stderr
    one = run_cli("ls", str(save_dir / "iteration_0000006"), env=env)
    assert one.returncode == 0 and [line.split()[0] for line in one.stdout.splitlines()[1:]] == ["iteration_0000006"]
    assert "DAMAGED" in one.stdout and "(no iterations)" not in one.stdout, one.stdout
    a_file = run_cli("ls", str(truncated), env=env)
    assert a_file.returncode == 2 and f"{truncated} is a file, not a directory" in a_file.stderr, a_file.stderr

    verified = subprocess.run([sys.executable, "-X", "importtime", "-m", "easyckpt.cli", "verify", str(save_dir)],
                              capture_output=True, text=True, timeout=60, env=env.environ())
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert "iteration_0000002: OK" in verified.stdout, verified.stdout
    assert f"iteration_0000004: DAMAGED: {save_dir}/iteration_0000004/{model} (step 4, rank 0) is missing" \
        in verified.stdout, verified.stdout
    assert re.search(r"iteration_0000006: DAMAGED: .*truncated", verified.stdout), verified.stdout
    assert re.search(r"iteration_0000008: DAMAGED: .*fails its xxh3_128 checksum", verified.stdout), verified.stdout
    assert "1 ok, 3 damaged" in verified.stdout, verified.stdout
    imported = imported_modules(verified)
    assert "easyckpt.tools.checks" in imported and not [m for m in imported if m.split(".")[0] == "torch"], imported[-20:]

    # A finished job is the normal case: exit 0, it has ended, what is on disk (and which iterations are damaged).
    status = run_cli("status", str(save_dir), env=env)
    assert status.returncode == 0, status.stdout + status.stderr
    out = status.stdout
    assert re.match(rf"job \w+ has ended: no agent runs and nothing of it is left in shared memory \({env.shm_dir}\)",
                    out), out
    assert f"on disk in {save_dir}: 4 complete iteration(s), steps 2, 4, 6, 8" in out, out
    assert "the tracker names step 8" in out and "DAMAGED: steps [4, 6]" in out, out
    report = json.loads(run_cli("status", str(save_dir), "--json", env=env).stdout)
    assert report[0]["job_state"] == "ended" and report[0]["disk"]["steps"] == [2, 4, 6, 8], report
    never = run_cli("status", str(env.tmp_path / "never-used"), env=env)
    assert never.returncode == 1 and "is known on this node" in never.stdout and "no such directory" in never.stdout


def test_version_and_every_help_explain_options_and_environment(env: Env) -> None:
    version = run_cli("--version", env=env)
    assert version.returncode == 0 and version.stdout.startswith(f"easyckpt {easyckpt.__version__} "), version
    for command in ("", "ls", "verify", "status", "clean", "convert", "ranks-needed"):
        proc = run_cli(*([command] if command else []), "--help", env=env)
        assert proc.returncode == 0, proc.stderr
        assert "environment variables" in proc.stdout and "\nmore: " in proc.stdout, (command, proc.stdout)
        assert "Exit 0" in proc.stdout or not command, (command, proc.stdout)
    assert "DIR         a save_dir, or one iteration_N directory in it" in run_cli("ls", "--help", env=env).stdout
    status = run_cli("status", "--help", env=env).stdout
    assert "--timeout SECONDS" in status and "how long to wait for each agent's answer" in status, status
    assert "EASYCKPT_RUNTIME_DIR" in status and "EASYCKPT_SHM_DIR" in status, status
    agent = subprocess.run([sys.executable, "-m", "easyckpt_agent", "--help"], capture_output=True, text=True, timeout=60,
                           env=env.environ())
    assert agent.returncode == 0 and "agent.log" in agent.stdout.split("--log-level")[-1], agent.stdout
    assert "environment variables" in agent.stdout and "EASYCKPT_RUNTIME_DIR" in agent.stdout, agent.stdout


# errors that name the real cause ---------------------------------------------------------------------
def test_shm_dir_on_a_disk_file_system_is_named_once(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    shm = env.tmp_path / "not-shm" / "slots"   # missing: created on the tmp_path's file system
    kind = filesystem_type(env.tmp_path)
    if kind in (None, "tmpfs", "ramfs"):
        pytest.skip(f"{env.tmp_path} is on {kind}: this test needs a disk file system there")
    with caplog.at_level(logging.INFO, logger="easyckpt.snapshot.shm_space"):
        for _ in range(2):
            easyckpt.Checkpointer(env.save_dir, 1, 10, 2, shm_dir=shm, start_agent=False).close()
    said = [r for r in caplog.records if "not on a tmpfs" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert f"shm_dir {shm} (EASYCKPT_SHM_DIR or shm_dir=) is on {kind}, not on a tmpfs" in said[0].getMessage()
    assert "disk bandwidth" in said[0].getMessage() and "/dev/shm" in said[0].getMessage()


def test_shared_memory_too_small_for_two_slots_is_one_message(env: Env, tmpfs: Any, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    shm = tmpfs("size=1m")
    monkeypatch.setenv("EASYCKPT_SHM_DIR", str(shm))
    ck = easyckpt.Checkpointer(env.save_dir, 1, 100, 2, start_agent=False)
    try:
        with caplog.at_level(logging.INFO, logger="easyckpt"), pytest.raises(easyckpt.ShmSpaceError) as info:
            ck.save_if_needed(0, {"w": torch.zeros(150_000)})   # 586 KiB: two slots need more than 1 MiB
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [], caplog.text
        message = str(info.value)
        assert f"{shm} has " in message and "--shm-size=1g (3 slots per rank x 1 local rank(s) x " in message, message
        assert "EASYCKPT_SLOTS=2" not in message, message   # two do not fit either: not a fix
    finally:
        ck.close()


@pytest.mark.parametrize("value", ["1", "9", "three", "5x"])
def test_slot_counts_out_of_range_are_refused_as_the_message_says(env: Env, monkeypatch: pytest.MonkeyPatch,
                                                                 value: str) -> None:
    monkeypatch.setenv("EASYCKPT_SLOTS", value)
    with pytest.raises(ValueError) as info:
        easyckpt.Checkpointer(env.save_dir, 1, 10, 2, start_agent=False)
    assert str(info.value).startswith(f"EASYCKPT_SLOTS={value!r} is not a slot count: use an int from 2 to 8 "), info
    with pytest.raises(ValueError, match="slots must be an int from 2 to 8, got 9: use an int from 2 to 8 "):
        easyckpt.Checkpointer(env.save_dir, 1, 10, 2, start_agent=False, slots=9)


def test_a_slot_count_the_message_offers_is_used(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EASYCKPT_SLOTS", "5")
    ck = easyckpt.Checkpointer(env.save_dir, 1, 10, 2, start_agent=False)
    try:
        for step in range(6):
            assert ck.save_if_needed(step, {"w": torch.full((16,), float(step))})
            ck.wait()
        assert ck.slots.count == 5 and len(env.slot_files()) == 5, env.slot_files()
    finally:
        ck.close()


# log noise --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_two_ranks_starting_agents_at_once_log_one_start(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """Both ranks of a node spawn an agent before either holds the lock; the loser exits as a duplicate.
    Only the winner's start is INFO; the duplicate is DEBUG."""
    job = "dup-agents"
    clients = [AgentClient(job_id=job, save_dir=env.save_dir, shm_dir=env.shm_dir, rank=rank, world_size=2,
                           local_world_size=2, idle_timeout=30.0, spawn=True,
                           hello={"save_storage_interval": 10, "max_ckpt_num": 2, "log_file_path": None,
                                  "pid_start": 0.0}) for rank in (0, 1)]
    try:
        with caplog.at_level(logging.DEBUG, logger="easyckpt.node.client"):
            for client in clients:   # back to back: the second looks before the first agent took the lock
                client.ensure(force=True)
            for client in clients:
                assert client.wait_ready(30.0)
        started = [r for r in caplog.records if "started the easyckpt agent" in r.getMessage()]
        assert len(started) == 1 and started[0].levelno == logging.INFO, caplog.text
        serving = (env.job_dir() / "agent.pid").read_text().strip()
        assert f"(pid {serving}, " in started[0].getMessage(), (serving, caplog.text)
        duplicates = [r for r in caplog.records if "exited as a duplicate" in r.getMessage()]
        assert len(duplicates) == sum(c.spawned for c in clients) - 1, caplog.text
        assert all(r.levelno == logging.DEBUG for r in duplicates) and sum(c.spawned for c in clients) == 2, caplog.text
    finally:
        for client in clients:
            client.detach()


@pytest.mark.timeout(120)
def test_an_agent_that_takes_over_the_job_hears_the_ranks_hello_and_peers_again(env: Env) -> None:
    """CI: node 1's agent was killed 0.25 s into a 2-node job; the spare agent one of its ranks had started
    in the start-up race came up late, took the lock and served the job, but its ranks' sockets only
    reconnected: it never heard their HELLO or PEERS, so it could not persist a multi-node step and failed the
    final one after PEERS_GRACE. A rank now introduces itself again to any agent that took over."""
    job = "takeover"
    agent_cmd = [sys.executable, "-m", "easyckpt_agent", "--save-dir", str(env.save_dir), "--job-id", job,
                 "--shm-dir", str(env.shm_dir), "--idle-timeout", "30"]
    agents = [subprocess.Popen(agent_cmd, env=env.environ(), cwd=str(ROOT))]
    client = AgentClient(job_id=job, save_dir=env.save_dir, shm_dir=env.shm_dir, rank=2, world_size=4,
                         local_world_size=2, idle_timeout=30.0, spawn=False,
                         hello={"save_storage_interval": 5, "max_ckpt_num": 2, "log_file_path": None, "pid_start": 0.0})
    try:
        assert client.wait_ready(30.0)
        node = PingReply.from_wire(client.request(Kind.PING, 10.0), "PING").node
        assert node is not None
        peers = PeerTable("ab" * 16, node, "other", {node: PeerNode("tcp://127.0.0.1:1", (2, 3)),
                                                     "other": PeerNode("tcp://127.0.0.1:2", (0, 1))}, world_size=4)
        assert client.request(Kind.PEERS, 10.0, **peers.to_wire()).get("ok")

        def token() -> str | None:
            return PingReply.from_wire(client.request(Kind.PING, 10.0), "PING").token

        assert token() == peers.token
        agents[0].send_signal(signal.SIGKILL)
        agents[0].wait(30)
        wait_for(lambda: not env.agent_alive(), 30, "the killed agent's lock to be released")
        agents.append(subprocess.Popen(agent_cmd, env=env.environ(), cwd=str(ROOT)))
        wait_for(lambda: env.agent_pid() == agents[1].pid, 30, "the second agent to take the job")
        client.ensure(force=True)   # what every step's save_if_needed does, at most once a second
        wait_for(lambda: token() == peers.token, 30, "the new agent to adopt the rank's PEERS")
    finally:
        client.detach()
        for agent in agents:
            agent.kill()
            agent.wait(30)


def test_a_rerun_with_another_shm_dir_beside_the_first_runs_agent_is_refused_at_once(env: Env) -> None:
    """A run killed at step 3 leaves its agent alive (it keeps the snapshots for a restart until its idle timeout).
    Rerun with another EASYCKPT_SHM_DIR, the same save_dir means the same job and so that agent, which watches the
    first directory: it would never see the rerun's snapshots, and close() used to wait close_timeout (600 s) for
    a persist that never came. The rerun is refused before it writes anything, naming both directories and the
    fix; rerun with the first directory, it resumes from that agent's memory (step 3, or 1-2 if the kill cut copies)."""
    first = loop(env, env.save_dir, 10, kill_at=3)
    assert first.returncode == -signal.SIGKILL, first.stderr
    other = env.tmp_path / "other-shm"
    other.mkdir()
    second = loop(env, env.save_dir, 10, EASYCKPT_SHM_DIR=str(other))
    assert second.returncode == 1 and "AgentElsewhereError" in second.stderr, second.stderr
    said = second.stderr.strip().splitlines()[-1]
    assert f"watches shared memory in {env.shm_dir}" in said and f"this run's shm_dir is {other}" in said, said
    assert f"Run with shm_dir {env.shm_dir}" in said and "easyckpt clean" in said, said
    assert list(other.iterdir()) == [], "refused before any slot was written"
    third = loop(env, env.save_dir, 10)
    assert third.returncode == 0 and "ended at step 9" in third.stdout, third.stderr
    # 3 unless its copy was cut; 1 once on 2026-11-27 (neither 2 nor 3 committed when the kill came; 6 runs after
    # gave 2 or 3): the promise is that a kill costs at most two steps
    assert re.search(r"resumed at step [123] from memory", third.stderr), third.stderr


class _Observed(AgentClient):
    """An AgentClient that says when it has sent a request of one kind (all else is AgentClient's own)."""

    def __init__(self, watch: Kind, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watch = watch
        self.sent = threading.Event()

    def send(self, kind: Kind, **fields: Any) -> int:
        request_id = super().send(kind, **fields)
        if kind == self.watch and request_id:
            self.sent.set()
        return request_id


@pytest.mark.parametrize("kind", [Kind.FLUSH, Kind.BYE, Kind.RESUME], ids=["flush", "bye", "resume"])
def test_a_request_whose_agent_dies_and_is_replaced_before_it_answers_is_asked_again(
        env: Env, kind: Kind, caplog: pytest.LogCaptureFixture) -> None:
    """Soak seed 1319, fault 24 (hung): a rank's FLUSH at close() went to its node's agent, which was SIGKILLed
    before it answered; another rank started a new agent within the rank's next look, so the rank saw an agent
    alive at every look and waited close_timeout (600 s) for an answer that no agent would give: the job hung at
    torchrun's exit barrier. The request is now asked again of the agent that took over (a RESUME left unanswered
    left the abandoned timeline's newer iterations on disk until a later resume)."""
    job = "replaced"
    agent_cmd = [sys.executable, "-m", "easyckpt_agent", "--save-dir", str(env.save_dir), "--job-id", job,
                 "--shm-dir", str(env.shm_dir), "--idle-timeout", "30"]
    agents = [subprocess.Popen(agent_cmd, env=env.environ(), cwd=str(ROOT))]
    wait_for(env.agent_alive, 30, "the first agent to take the job's lock")   # else the client starts its own
    client = _Observed(kind, job_id=job, save_dir=env.save_dir, shm_dir=env.shm_dir, rank=0, world_size=1,
                       local_world_size=1, idle_timeout=30.0, spawn=True,
                       hello={"save_storage_interval": 5, "max_ckpt_num": 2, "log_file_path": None, "pid_start": 0.0})
    timeout = 40.0
    try:
        assert client.wait_ready(30.0)
        wait_for(lambda: env.agent_pid() == agents[0].pid, 30, "the first agent to serve the job")
        agents[0].send_signal(signal.SIGSTOP)   # it gets the request and never answers
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            if kind == Kind.FLUSH:
                answer = pool.submit(client.flush, 0, wait=True, timeout=timeout)
            elif kind == Kind.RESUME:   # unanswered, newer iterations of an abandoned timeline stayed on disk
                answer = pool.submit(client.resume, 0, [], timeout=timeout)
            else:
                answer = pool.submit(client.close, wait=True, timeout=timeout)
            assert client.sent.wait(30), f"{kind.name} was never sent"
            agents[0].send_signal(signal.SIGKILL)
            agents[0].wait(30)
            agents.append(subprocess.Popen(agent_cmd, env=env.environ(), cwd=str(ROOT)))
            reply = answer.result(timeout + 30)
            took = time.monotonic() - started
        spawned = client.job_dir / "agent.log"   # the agents this client started write there
        said = caplog.text + (spawned.read_text(errors="replace")[-3000:] if spawned.exists() else "")
        assert reply is not None, f"{kind.name}: no answer within {timeout:.0f}s\n{said}"
        assert took < timeout / 2, f"{kind.name} answered after {took:.1f}s\n{said}"
        assert "exited before answering" in caplog.text, said
    finally:
        client.detach()
        spare = client._proc
        for agent in agents + ([spare] if spare is not None else []):
            if agent.poll() is None:
                agent.kill()
            agent.wait(30)


SHADOWED = """
import sys, torch
from easyckpt.checkpointer import Checkpointer   # how the integrations import it
import easyckpt
print("shadowed" if getattr(easyckpt, "__file__", None) is None else "not shadowed", flush=True)
model = torch.nn.Linear(8, 8)
ckpt = Checkpointer(save_dir="easyckpt", save_mem_interval=1, save_storage_interval=2, max_ckpt_num=2)
result = ckpt.load({"model": model.state_dict()})
start = 0 if result.step is None else result.step + 1
for step in range(start, start + 3):
    ckpt.save_if_needed(step, {"model": model.state_dict(), "step": step})
ckpt.close()
print(f"ended at step {start + 2}", flush=True)
"""


def test_a_directory_named_easyckpt_where_the_job_runs_does_not_stop_the_agent_from_starting(
        env: Env, tmp_path: Path) -> None:
    """Lightning's default save_dir is ``<default_root_dir>/easyckpt``, the directory a user runs from. Under the
    README's editable install (setuptools' import finder runs after the path scan) that directory is imported as an
    empty namespace package in place of ``easyckpt`` on every later run, with no ``__file__``: the Checkpointer's
    start of the agent raised TypeError (found with LightningCLI, 2026-12-06). The second run here starts with
    that directory present and no agent running."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "train.py").write_text(SHADOWED)
    environ = env.environ(EASYCKPT_JOB_ID="shadowed")
    # as a user's shell has it: the package found through its installation, not through the tests' PYTHONPATH
    environ["PYTHONPATH"] = os.pathsep.join(p for p in environ["PYTHONPATH"].split(os.pathsep) if p != str(ROOT))
    runs = []
    for _ in range(2):
        runs.append(subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, timeout=120,
                                   env=environ, cwd=str(work)))
        assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
        wait_for(lambda: env.agent_pid() is None, 60, "the agent to exit after the run's close()")
    print(f"second run: {runs[1].stdout.splitlines()[0]} (shadowed only under an editable install)")
    assert runs[1].stdout.splitlines()[1] == "ended at step 5", runs[1].stdout + runs[1].stderr
    assert (work / "easyckpt" / "iteration_0000005").is_dir()
