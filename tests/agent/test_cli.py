"""``easyckpt ls | verify | status`` and the console entry points, run as real subprocesses."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, Env, run_cli, save_and_persist, wait_for

import easyckpt
from easyckpt_wire import layout
from easyckpt_wire.shm import format_bytes

MODEL_FILE = "easyckpt-model-0000000-0000001.safetensors"


def make_ck(env: Env, **overrides: Any) -> easyckpt.Checkpointer:
    kwargs: dict[str, Any] = {"save_mem_interval": 2, "save_storage_interval": 2, "max_ckpt_num": 5,
                              "agent_idle_timeout": 30.0}
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


def slot_files(env: Env) -> list[Path]:
    """The job's slot files (``easyckpt-<job>-r<rank>-s<slot>``), without the agent's control block."""
    return [p for p in env.slot_files() if re.search(r"-r\d{6}-s\d$", p.name)]


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


def test_verify_says_incomplete_for_an_iteration_without_its_marker_and_damaged_for_a_broken_one(
        persisted: Env) -> None:
    """No commit marker (a persist under way, or a failed one on an object store, whose files are written in place):
    INCOMPLETE, never loaded, not damage (exit 0); a marker that does not parse is damage (exit 1)."""
    save_dir = persisted.save_dir
    no_marker = save_dir / "iteration_0000006"
    no_marker.mkdir()
    (no_marker / layout.COMMON).write_text("{}")
    proc = run_cli("verify", str(save_dir), env=persisted)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "INCOMPLETE" in row(proc.stdout, "iteration_0000006:") and "2 ok, 0 damaged, 1 incomplete" in proc.stdout
    (no_marker / layout.METADATA).write_text("{ truncated")
    proc = run_cli("verify", str(save_dir), env=persisted)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DAMAGED" in row(proc.stdout, "iteration_0000006:") and "2 ok, 1 damaged" in proc.stdout


def test_verify_of_a_missing_dir_exits_2(env: Env) -> None:
    missing = env.tmp_path / "nope"
    proc = run_cli("verify", str(missing), env=env)
    assert proc.returncode == 2 and f"{missing}: no such directory" in proc.stderr


@pytest.mark.parametrize("command", ["ls", "verify", "status", "clean"])
@pytest.mark.parametrize("where, says", [
    ("gs://bucket/run", "gs://bucket/run: the gs:// scheme has no storage implementation here"),
    ("s3:/bucket/run", "looks like the URL s3://bucket/run with its '//' lost"),   # str(Path("s3://bucket/run"))
    ("s3://bucket/run", "s3://bucket/run: no AWS credentials found"),
])
def test_a_location_that_cannot_be_read_exits_2_with_the_message_and_no_traceback(env: Env, command: str, where: str,
                                                                                   says: str) -> None:
    """Every command that takes a save_dir says why it cannot read it (the scheme, the lost '//', the credentials to
    set) in one line on stderr: a traceback buried the message (``status gs://...``, ``ls s3://...`` without
    credentials did)."""
    environ = {name: value for name, value in env.environ().items() if not name.startswith("AWS_")}
    missing = str(env.tmp_path / "no-aws-files")
    environ.update(AWS_SHARED_CREDENTIALS_FILE=missing, AWS_CONFIG_FILE=missing, AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.run([sys.executable, "-m", "easyckpt.cli", command, where], capture_output=True, text=True,
                          timeout=60, env=environ, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith(f"easyckpt {command}: "), proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("args, says", [
    (["--save-dir", "gs://bucket/run"], "argument --save-dir: gs://bucket/run: the gs:// scheme has no storage"),
    (["--save-dir", "s3:/bucket/run"], "looks like the URL s3://bucket/run with its '//' lost"),
    (["--save-dir", "{file}"], "{file} is a file, not a directory"),
    (["--max-ckpt-num", "0"], "argument --max-ckpt-num: '0' is not a positive int"),
    (["--save-storage-interval", "-5"], "argument --save-storage-interval: '-5' is not an int >= 0"),
    (["--idle-timeout", "nan"], "argument --idle-timeout: 'nan' is not a positive number of seconds"),
    (["--port", "70000"], "argument --port: '70000' is not a tcp port, 0 to 65535"),
    (["--persist-threads", "two"], "argument --persist-threads: 'two' is not a positive int"),
    # the environment variables behind defaults (a traceback, exit 1, before; a rank started such agents for ever)
    (["EASYCKPT_AGENT_PORT=abc"], "argument --port: 'abc' is not a tcp port, 0 to 65535 (0: any; or EASYCKPT_AGENT_PORT)"),
    (["EASYCKPT_AGENT_LOG_LEVEL=loud"], "EASYCKPT_AGENT_LOG_LEVEL='loud' is not a logging level: use one of DEBUG"),
    (["--save-dir", " {file}"], "begins or ends with whitespace: strip it"),
])
def test_the_standalone_agent_refuses_bad_arguments_naming_them(env: Env, args: list[str], says: str) -> None:
    """``python -m easyckpt_agent`` as a user starts it (standalone, or under torchrun): a bad argument is one usage
    line naming it and why, exit 2, before any lock, runtime directory or slot is touched. A save_dir that is a
    file was a FileExistsError traceback; a count of 0 was taken (an agent that kept no checkpoint ran)."""
    file = env.tmp_path / "a-file"
    file.write_text("")
    variables = dict(a.split("=", 1) for a in args if a.startswith("EASYCKPT_"))
    argv = [a.format(file=file) for a in args if not a.startswith("EASYCKPT_")]
    if "--save-dir" not in argv:
        argv += ["--save-dir", str(env.save_dir)]
    proc = subprocess.run([sys.executable, "-m", "easyckpt_agent", *argv], capture_output=True, text=True,
                          timeout=60, env=env.environ(**variables), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert says.format(file=file) in proc.stderr.splitlines()[-1], proc.stderr
    assert not env.runtime_dir.exists() or not any(env.runtime_dir.iterdir()), "nothing of a job was created"


# status -----------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_status_shows_rank_pid_and_slots_while_a_checkpointer_is_open(env: Env) -> None:
    ck = make_ck(env)
    try:
        save_and_persist(ck, env, 2, state_at(2))
        save_and_persist(ck, env, 4, state_at(4))
        agent_pid = env.agent_pid()
        assert agent_pid is not None

        def text_status() -> subprocess.CompletedProcess[str] | None:
            proc = run_cli("status", str(env.save_dir), env=env)
            return proc if "newest on disk: step 4" in proc.stdout else None

        proc = wait_for(text_status, 30, "`easyckpt status SAVE_DIR` to report step 4 on disk")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert f"agent pid {agent_pid}" in out
        assert f"save_dir {env.save_dir.resolve()}" in out and f"shm {env.shm_dir}" in out
        assert re.search(rf"rank 0: pid {os.getpid()} alive", out), out
        slot_lines = [line for line in out.splitlines() if re.match(r"\s+rank 0 slot \d:", line)]
        assert len(slot_lines) == len(slot_files(env)) >= 2, out
        committed = [line for line in slot_lines if "COMMITTED" in line]
        assert {re.search(r"step (\d+)", line).group(1) for line in committed} == {"2", "4"}, out
        assert "safe step (every rank keeps it): 4" in out, out

        proc = run_cli("status", str(env.save_dir), "--json", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        reports = json.loads(proc.stdout)
        assert isinstance(reports, list) and len(reports) == 1
        report = reports[0]
        assert report["pid"] == agent_pid and report["job_state"] == "live"
        assert report["persisted_step"] == 4 and report["safe_step"] == 4
        assert [(r["rank"], r["pid"], r["alive"]) for r in report["ranks"]] == [(0, os.getpid(), True)]
        slots = sorted(report["slots"], key=lambda s: s["slot"])
        assert [(s["rank"], s["path"]) for s in slots] == [(0, str(p)) for p in slot_files(env)]
        slots = [s for s in slots if s["state"] == "COMMITTED"]
        assert sorted(s["step"] for s in slots) == [2, 4]
        assert all(isinstance(s["bytes"], int) and s["bytes"] > 2 * 16 * 16 * 4 for s in slots), slots

        by_option = run_cli("status", "--json", "--save-dir", str(env.save_dir), env=env)  # the old spelling
        assert by_option.returncode == 0 and json.loads(by_option.stdout)[0]["pid"] == agent_pid
        both = run_cli("status", str(env.save_dir), "--save-dir", str(env.tmp_path / "other"), env=env)
        assert both.returncode == 2 and "differ: give one of them" in both.stderr
    finally:
        ck.close()


@pytest.mark.timeout(60)
def test_status_without_any_job_exits_0_with_one_line(env: Env) -> None:
    for runtime in (env.runtime_dir, env.tmp_path / "never-created"):  # an empty runtime base, and none at all
        proc = subprocess.run([sys.executable, "-m", "easyckpt.cli", "status"], check=False, capture_output=True,
                              text=True, timeout=60, env=env.environ(EASYCKPT_RUNTIME_DIR=str(runtime)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.splitlines() == [
            f"no easyckpt job is running (looked for agents in {runtime} and their slot files in {env.shm_dir})"]
        assert proc.stderr == ""
    as_json = run_cli("status", "--json", env=env)
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == []


@pytest.mark.timeout(120)
def test_status_lists_live_jobs_and_skips_a_finished_one(env: Env, tmp_path: Path) -> None:
    # A finished job: its agent exited after the last rank's goodbye, unlinked the slots and removed its
    # runtime directory but for the log (EASYCKPT_KEEP_AGENT_LOG=1, as every test here asks).
    finished = easyckpt.Checkpointer(tmp_path / "finished", save_mem_interval=2, save_storage_interval=2,
                                     max_ckpt_num=2, agent_idle_timeout=30.0)
    finished.close()
    env.wait_agent_gone()
    stale = env.job_dir()
    assert sorted(os.listdir(stale)) == ["agent.log"] and not slot_files(env)
    proc = run_cli("status", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("no easyckpt job is running") and len(proc.stdout.splitlines()) == 1, proc.stdout

    ck = make_ck(env)
    try:
        agent_pid = wait_for(env.agent_pid, 30, "the live job's agent pid file")
        proc = run_cli("status", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"agent pid {agent_pid}" in proc.stdout and f"save_dir {env.save_dir.resolve()}" in proc.stdout
        assert stale.name not in proc.stdout and "no agent is running" not in proc.stdout, proc.stdout
        reports = json.loads(run_cli("status", "--json", env=env).stdout)
        assert [(r["pid"], r["job_state"]) for r in reports] == [(agent_pid, "live")]
        # Named, the finished job is the normal end (issue 28): exit 0, it has ended, and what is on disk.
        named = run_cli("status", str(tmp_path / "finished"), env=env)
        assert named.returncode == 0, named.stdout + named.stderr
        assert f"job {stale.name} has ended" in named.stdout and "no agent runs" in named.stdout, named.stdout
        assert f"nothing on disk in {(tmp_path / 'finished').resolve()}" in named.stdout, named.stdout
        assert "slot file" not in named.stdout
    finally:
        ck.close()


PARKED_RANK = """
import sys, torch, easyckpt
ck = easyckpt.Checkpointer(sys.argv[1], 1, 1000, 3, agent_idle_timeout=60.0)
for step in (1, 2):
    ck.save_if_needed(step, {"w": torch.full((4096,), float(step)), "step": step})
    ck.wait()
print("ready", flush=True)
sys.stdin.read()  # parked until the test kills it
"""


def parked_rank(env: Env) -> tuple[subprocess.Popen[bytes], int]:
    """A rank that snapshotted steps 1 and 2 and waits, and the pid of its agent."""
    child = subprocess.Popen([sys.executable, "-c", PARKED_RANK, str(env.save_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env.environ(), cwd=str(ROOT))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        return child, wait_for(env.agent_pid, 30, "the rank's agent pid file")
    except BaseException:
        child.kill()
        child.wait(timeout=30)
        raise


@pytest.mark.timeout(120)
def test_status_lists_a_recoverable_job_with_its_slot_files_and_how_to_free_them(env: Env) -> None:
    child, agent_pid = parked_rank(env)
    try:
        # Stopped first, so that it cannot react to the rank's death (flush, unlink); the rank killed
        # next cannot start a new agent. Then both are gone and only the slot files remain.
        os.kill(agent_pid, signal.SIGSTOP)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        os.kill(agent_pid, signal.SIGKILL)
        env.wait_agent_gone()
    finally:
        child.kill()
        child.wait(timeout=30)
    slots = slot_files(env)
    assert len(slots) >= 2, env.slot_files()
    job = env.job_dir().name

    proc = run_cli("status", env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    out = proc.stdout
    assert f"job {job}: no agent is running, but {len(slots)} slot file(s) of the job are left in shared memory" \
        in out, out
    lines = [row(out, f"{path}:") for path in slots]
    assert sorted(re.search(r"rank 0 slot \d, step (\d+), ", line).group(1)
                  for line in lines if "step" in line) == ["1", "2"], out
    assert "snapshots of step(s) 1, 2, not necessarily on disk" in out, out
    remove = out.splitlines()[-1].strip()
    assert remove == f"easyckpt clean {env.save_dir.resolve()}", out

    report = json.loads(run_cli("status", "--json", env=env).stdout)
    assert len(report) == 1 and report[0]["job_state"] == "recoverable" and report[0]["remove"] == remove
    files = report[0]["slot_files"]
    assert [f["path"] for f in files] == [str(p) for p in slots]
    assert all(f["bytes"] == p.stat().st_size for f, p in zip(files, slots))
    committed = [f for f in files if f["state"] == "COMMITTED"]
    assert sorted(f["step"] for f in committed) == [1, 2]
    assert all(f["memory_bytes"] > 4096 * 4 for f in committed), committed

    # A byte of step 2's header changed in memory (the top byte of its step): DAMAGED, no step named.
    (newest,) = [f["path"] for f in committed if f["step"] == 2]
    with open(newest, "r+b") as handle:
        handle.seek(23)
        byte = handle.read(1)[0]
        handle.seek(23)
        handle.write(bytes([byte ^ 0x1D]))
    damaged = json.loads(run_cli("status", "--json", env=env).stdout)[0]["slot_files"]
    assert [(f["state"], f["step"]) for f in damaged if f["path"] == newest] == [("DAMAGED", None)], damaged

    named = run_cli("status", str(env.save_dir), env=env)  # named: "no agent" is still exit 1, with the slots
    assert named.returncode == 1 and "no agent is running" in named.stdout and str(slots[0]) in named.stdout

    # The printed command, as a user would run it (through this interpreter, installed or not).
    subprocess.run([sys.executable, "-m", "easyckpt.cli", *shlex.split(remove)[1:]], check=True, timeout=30,
                   env=env.environ())
    assert env.shm_files() == [] and list(env.runtime_dir.iterdir()) == []
    after = run_cli("status", env=env)
    assert after.returncode == 0 and after.stdout.startswith("no easyckpt job is running"), after.stdout


@pytest.mark.timeout(120)
def test_status_of_a_crashed_job_whose_agent_lives_says_until_when_it_holds_the_memory(env: Env) -> None:
    """Every rank SIGKILLed, the agent alive (issue 28): which steps it keeps in memory, and until when."""
    child, agent_pid = parked_rank(env)
    child.kill()   # SIGKILL: the job crashed; its agent lives on
    child.wait(timeout=30)

    def orphaned() -> subprocess.CompletedProcess[str] | None:
        proc = run_cli("status", str(env.save_dir), env=env)
        return proc if "no rank is alive" in proc.stdout else None

    proc = wait_for(orphaned, 30, "`easyckpt status` to see that every rank of the job died")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "no rank is alive" in line)
    assert f"agent pid {agent_pid} keeps the snapshots of step(s) 1, 2 (" in line, line
    assert "of shared memory) until about " in line, line
    left = int(re.search(r"\(in (\d+)s: its idle timeout is 60s after the last rank died\)", line).group(1))
    assert 0 <= left <= 60, line
    assert "Rerun the job with the same save_dir to resume from memory" in line, line
    report = json.loads(run_cli("status", str(env.save_dir), "--json", env=env).stdout)[0]
    assert report["idle_timeout"] == 60.0 and 0 <= report["idle_exit_in"] <= 60, report
    assert not any(rank["alive"] for rank in report["ranks"]), report


@pytest.mark.timeout(120)
def test_status_with_a_stuck_or_dead_agent_names_the_job_and_which(env: Env) -> None:
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
        assert proc.stderr == "", proc.stderr
        os.kill(agent_pid, signal.SIGKILL)  # the agent this test's Checkpointer started; its socket file stays
        wait_for(lambda: not env.agent_alive(), 30, f"agent pid {agent_pid} to die")
        assert (env.job_dir() / "agent.sock").exists()
        # Unnamed, a dead agent is no failure: the job is listed only if its slots are left.
        assert run_cli("status", "--timeout", "1", env=env).returncode == 0
        proc = run_cli("status", str(env.save_dir), "--timeout", "1", env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"job {job}" in proc.stdout and "no agent is running" in proc.stdout
        assert str(env.job_dir() / "agent.log") in proc.stdout
        assert "Traceback" not in proc.stderr
        as_json = run_cli("status", "--json", "--timeout", "1", "--save-dir", str(env.save_dir), env=env)
        assert as_json.returncode == 1
        report = json.loads(as_json.stdout)[0]
        assert report["job_id"] == job and "error" in report and report["job_state"] in ("no agent", "recoverable")
    finally:
        ck.close()


# entry points -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["plain_ddp.py", "fsdp2_train.py", "megatron_gpt.py"])
def test_an_example_run_without_torchrun_says_how_to_run_it(env: Env, example: str) -> None:
    """``python examples/plain_ddp.py ...`` is what a new user types first: one usage line with the torchrun command,
    not torch.distributed's traceback about an unset RANK."""
    environ = {k: v for k, v in env.environ().items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    script = ROOT / "examples" / example
    args = ["--save-dir", str(env.save_dir), "--out", str(env.tmp_path / "out")]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                          env=environ, check=False, cwd=str(ROOT))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"run it under torchrun: torchrun --nproc-per-node=2 {script}" in proc.stderr, proc.stderr[-3000:]
    assert not env.save_dir.exists() or not any(env.save_dir.iterdir()), "nothing was written"


@pytest.mark.parametrize("module, expect", [("easyckpt_agent", "--save-dir"), ("easyckpt.cli", "verify")])
def test_python_m_help_exits_0(env: Env, module: str, expect: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], check=False, capture_output=True, text=True,
                          timeout=60, env=env.environ())
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and expect in proc.stdout


@pytest.mark.parametrize("script, expect", [("easyckpt-agent", "--save-dir"), ("easyckpt", "status")])
def test_console_scripts_help_exit_0(env: Env, script: str, expect: str) -> None:
    path = Path(sys.executable).parent / script
    if not path.exists():
        pytest.skip(f"{path} not installed (run `pip install -e .` in this interpreter's environment)")
    proc = subprocess.run([str(path), "--help"], check=False, capture_output=True, text=True, timeout=60,
                          env=env.environ())
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and expect in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--help"], ["ls", "EMPTY"], ["status"], ["status", "EMPTY"], ["clean", "EMPTY"]])
def test_cli_commands_without_torch_do_not_import_it(env: Env, args: list[str]) -> None:
    """--help, ls and status must not pay torch's import (seconds): checked with -X importtime, not a clock."""
    empty = env.tmp_path / "empty"
    empty.mkdir()
    argv = [str(empty) if arg == "EMPTY" else arg for arg in args]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "easyckpt.cli", *argv], check=False,
                          capture_output=True, text=True, timeout=60, env=env.environ())
    assert proc.returncode == (1 if argv[:1] == ["status"] and len(argv) == 2 else 0), proc.stdout + proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "easyckpt_wire.layout" in imported, proc.stderr[-2000:]  # importtime output is there at all
    assert not [name for name in imported if name.split(".")[0] in ("torch", "safetensors", "numpy")], \
        [name for name in imported if name.split(".")[0] in ("torch", "safetensors", "numpy")][:10]


@pytest.mark.timeout(120)
def test_package_names_still_import_lazily(env: Env) -> None:
    code = ("import sys, easyckpt; assert 'torch' not in sys.modules, 'import easyckpt pulled torch in'; "
            "from easyckpt import Checkpointer, CheckpointFormatError; assert 'torch' in sys.modules; "
            "assert easyckpt.LoadError.__module__ == 'easyckpt.recovery'; assert callable(easyckpt.snapshot.state.flatten); "
            "assert callable(easyckpt.health.embedding_local_norm); assert easyckpt.DataSkipper.__module__ == "
            "'easyckpt.health'; assert not hasattr(easyckpt, 'no_such_name'); "
            "ns = {}; exec('from easyckpt import *', ns); assert set(easyckpt.__all__) <= set(ns), ns.keys()")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env=env.environ())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_without_a_command_exits_2_with_usage(env: Env) -> None:
    proc = run_cli(env=env)
    assert proc.returncode == 2
    assert "usage:" in proc.stderr
