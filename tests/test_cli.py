"""``easyckpt ls | verify | status`` and the console entry points, run as real subprocesses."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import easyckpt
from easyckpt_wire import layout
from easyckpt_wire.shm import format_bytes

from conftest import Env, run_cli, save_and_persist, wait_for

MODEL_FILE = "easyckpt-model-0000000-0000001.safetensors"


def make_ck(env: Env, **overrides: Any) -> easyckpt.Checkpointer:
    kwargs: dict[str, Any] = dict(save_mem_interval=2, save_storage_interval=2, max_ckpt_num=5,
                                  agent_idle_timeout=30.0)
    kwargs.update(overrides)
    return easyckpt.Checkpointer(env.save_dir, **kwargs)


def state_at(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"model": OrderedDict(weight=torch.randn(16, 16, generator=gen)),
            "optim": {"state": {0: {"exp_avg": torch.randn(16, 16, generator=gen)}}}, "step": step}


@pytest.fixture
def persisted(env: Env) -> Env:
    """Steps 2 and 4 on disk in env.save_dir; the Checkpointer closed and its agent gone."""
    ck = make_ck(env)
    try:
        for step in (2, 4):
            save_and_persist(ck, env, step, state_at(step))
    finally:
        ck.close()
    env.wait_agent_gone()
    return env


def row(output: str, name: str) -> str:
    lines = [line for line in output.splitlines() if line.split() and line.split()[0] == name]
    assert len(lines) == 1, f"expected one row for {name} in:\n{output}"
    return lines[0]


# ls ---------------------------------------------------------------------------------------------------
def test_ls_lists_iterations_with_step_size_status_and_tracker(persisted: Env) -> None:
    save_dir = persisted.save_dir
    proc = run_cli("ls", str(save_dir), env=persisted)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["iteration", "step", "size", "status"]
    for step in (2, 4):
        name = layout.iteration_dirname(step)
        line = row(proc.stdout, name)
        fields = line.split()
        assert fields[1] == str(step)
        size = sum(p.stat().st_size for p in (save_dir / name).iterdir() if p.is_file())
        assert format_bytes(size) in line
        assert "complete" in fields and "INCOMPLETE" not in line
        assert ("<- tracker" in line) == (step == 4), line
    names = [line.split()[0] for line in proc.stdout.splitlines()[1:]]
    assert names == ["iteration_0000002", "iteration_0000004"]  # oldest first


def test_ls_marks_incomplete_and_unparsable_iterations(persisted: Env) -> None:
    save_dir = persisted.save_dir
    no_marker = save_dir / "iteration_0000006"
    no_marker.mkdir()
    (no_marker / layout.COMMON).write_text("{}")
    bad_marker = save_dir / "iteration_0000008"
    bad_marker.mkdir()
    (bad_marker / layout.METADATA).write_text("{ truncated")
    proc = run_cli("ls", str(save_dir), env=persisted)
    assert proc.returncode == 0, proc.stderr
    assert "INCOMPLETE" in row(proc.stdout, "iteration_0000006")
    assert "INCOMPLETE" in row(proc.stdout, "iteration_0000008")
    assert "<- tracker" in row(proc.stdout, "iteration_0000004")


def test_ls_of_a_missing_dir_exits_2_naming_it(env: Env) -> None:
    missing = env.tmp_path / "does-not-exist"
    proc = run_cli("ls", str(missing), env=env)
    assert proc.returncode == 2
    assert f"{missing}: no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ls_of_an_empty_dir_says_so(env: Env) -> None:
    empty = env.tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("ls", str(empty), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "(no iterations)" in proc.stdout


# verify -----------------------------------------------------------------------------------------------
def test_verify_healthy_save_dir_and_one_iteration(persisted: Env) -> None:
    proc = run_cli("verify", str(persisted.save_dir), env=persisted)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "iteration_0000002: OK" in proc.stdout and "iteration_0000004: OK" in proc.stdout
    assert "2 ok, 0 damaged" in proc.stdout
    one = run_cli("verify", str(persisted.save_dir / "iteration_0000002"), env=persisted)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "1 ok, 0 damaged" in one.stdout and "iteration_0000004" not in one.stdout


def test_verify_exits_1_on_damage_naming_iteration_and_file(persisted: Env) -> None:
    target = persisted.save_dir / "iteration_0000002" / MODEL_FILE
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF  # last byte: tensor data, never the header
    target.write_bytes(bytes(raw))
    proc = run_cli("verify", str(persisted.save_dir), env=persisted)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = row(proc.stdout, "iteration_0000002:")
    assert "DAMAGED" in line and str(target) in line and "checksum" in line
    assert "iteration_0000004: OK" in proc.stdout
    assert "1 ok, 1 damaged" in proc.stdout
    assert run_cli("verify", str(persisted.save_dir / "iteration_0000004"), env=persisted).returncode == 0
    assert run_cli("verify", str(persisted.save_dir / "iteration_0000002"), env=persisted).returncode == 1


def test_verify_of_a_missing_dir_exits_2(env: Env) -> None:
    missing = env.tmp_path / "nope"
    proc = run_cli("verify", str(missing), env=env)
    assert proc.returncode == 2 and f"{missing}: no such directory" in proc.stderr


# status -----------------------------------------------------------------------------------------------
def test_status_shows_rank_pid_and_slots_while_a_checkpointer_is_open(env: Env) -> None:
    ck = make_ck(env)
    try:
        save_and_persist(ck, env, 2, state_at(2))
        save_and_persist(ck, env, 4, state_at(4))
        agent_pid = env.agent_pid()
        assert agent_pid is not None

        def text_status() -> subprocess.CompletedProcess[str] | None:
            proc = run_cli("status", env=env)
            return proc if "newest on disk: step 4" in proc.stdout else None

        proc = wait_for(text_status, 30, "`easyckpt status` to report step 4 on disk")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert f"agent pid {agent_pid}" in out
        assert f"save_dir {env.save_dir.resolve()}" in out and f"shm {env.shm_dir}" in out
        assert re.search(rf"rank 0: pid {os.getpid()} alive", out), out
        slot_lines = [line for line in out.splitlines() if re.match(r"\s+rank 0 slot [01]:", line)]
        assert len(slot_lines) == 2, out
        assert {re.search(r"step (\d+)", line).group(1) for line in slot_lines} == {"2", "4"}, out
        assert all("COMMITTED" in line for line in slot_lines), out

        proc = run_cli("status", "--json", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        reports = json.loads(proc.stdout)
        assert isinstance(reports, list) and len(reports) == 1
        report = reports[0]
        assert report["pid"] == agent_pid
        assert report["persisted_step"] == 4
        assert [(r["rank"], r["pid"], r["alive"]) for r in report["ranks"]] == [(0, os.getpid(), True)]
        slots = sorted(report["slots"], key=lambda s: s["slot"])
        assert [(s["rank"], s["slot"]) for s in slots] == [(0, 0), (0, 1)]
        assert sorted(s["step"] for s in slots) == [2, 4]
        assert all(s["state"] == "COMMITTED" and isinstance(s["bytes"], int) and s["bytes"] > 2 * 16 * 16 * 4
                   for s in slots), slots

        by_dir = run_cli("status", "--json", "--save-dir", str(env.save_dir), env=env)
        assert by_dir.returncode == 0 and json.loads(by_dir.stdout)[0]["pid"] == agent_pid
    finally:
        ck.close()


def test_status_without_any_agent_exits_1_and_says_so(env: Env) -> None:
    proc = run_cli("status", env=env)
    assert proc.returncode == 1
    assert "no easyckpt agent found" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_with_a_stuck_or_dead_agent_exits_1_naming_the_job_and_which(env: Env) -> None:
    ck = make_ck(env)
    try:
        agent_pid = env.agent_pid()
        assert agent_pid is not None
        job = env.job_dir().name
        os.kill(agent_pid, signal.SIGSTOP)
        try:
            proc = run_cli("status", "--timeout", "1", env=env)
        finally:
            os.kill(agent_pid, signal.SIGCONT)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"job {job}" in proc.stdout and "no reply within 1s (the agent is alive but busy or stuck" in proc.stdout
        os.kill(agent_pid, signal.SIGKILL)  # the agent this test's Checkpointer started; its socket file stays
        wait_for(lambda: not env.agent_alive(), 30, f"agent pid {agent_pid} to die")
        assert (env.job_dir() / "agent.sock").exists()
        proc = run_cli("status", "--timeout", "1", env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"job {job}" in proc.stdout and "no agent is running" in proc.stdout
        assert str(env.job_dir() / "agent.log") in proc.stdout
        assert "Traceback" not in proc.stderr
        as_json = run_cli("status", "--json", "--timeout", "1", env=env)
        assert as_json.returncode == 1
        assert json.loads(as_json.stdout)[0]["job_id"] == job and "error" in json.loads(as_json.stdout)[0]
    finally:
        ck.close()


# entry points -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("module, expect", [("agent", "--save-dir"), ("easyckpt.cli", "verify")])
def test_python_m_help_exits_0(env: Env, module: str, expect: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                          env=env.environ())
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and expect in proc.stdout


@pytest.mark.parametrize("script, expect", [("easyckpt-agent", "--save-dir"), ("easyckpt", "status")])
def test_console_scripts_help_exit_0(env: Env, script: str, expect: str) -> None:
    path = Path(sys.executable).parent / script
    if not path.exists():
        pytest.skip(f"{path} not installed (run `pip install -e .` in this interpreter's environment)")
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60, env=env.environ())
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and expect in proc.stdout


def test_cli_without_a_command_exits_2_with_usage(env: Env) -> None:
    proc = run_cli(env=env)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
