"""Drive examples/plain_ddp.py under a real torchrun: launch, watch progress, kill ranks, read results."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from conftest import ROOT, Env, gone, poll, wait_for

from easyckpt_wire.shm import SlotFormatError, SlotMap, list_slots

SCRIPT = ROOT / "examples" / "plain_ddp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class Job:
    def __init__(self, env: Env, save_dir: Path, out: Path, *, steps: int, nproc: int = 2, max_restarts: int = 0,
                 step_seconds: float = 0.02, save_storage_interval: int = 10, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, script: Path = SCRIPT) -> None:
        self.out = out
        self.nproc = nproc
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "torchrun.log"
        command = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                              str(script), "--save-dir", str(save_dir), "--out", str(out), "--steps", str(steps),
                              "--step-seconds", str(step_seconds), "--save-storage-interval", str(save_storage_interval),
                              *(extra_args or [])]
        # torch's shared rendezvous store hands restarted workers the previous attempt's gloo
        # addresses (pytorch/pytorch#135712); a store of their own per attempt avoids that.
        extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(extra_env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env.environ(EASYCKPT_LOG_LEVEL="INFO", **extra), cwd=str(ROOT))

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # What CI prints is all a post-mortem gets: where each rank hung, the job's and the agent's last lines
            native = dump_stacks(self.proc.pid)
            agents = "".join(f"\n--- {log}:\n" + log.read_text()[-3000:]
                             for log in Path(os.environ.get("EASYCKPT_RUNTIME_DIR", "/nonexistent")).glob("*/agent.log"))
            log = self.log()
            raise AssertionError(f"{self.log_path.parent.name}: the job did not end within {timeout:.0f}s\n"
                                 f"{log[-12000:]}{agents}\n--- innermost frames of every thread:\n"
                                 f"{innermost_frames(log)}\n--- native stacks of the main threads:\n{native}") from None
        finally:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def pid(self, rank: int) -> int:
        return int((self.out / f"pid-rank{rank}").read_text())

    def losses(self, rank: int) -> dict[int, dict[str, Any]]:
        path = self.out / f"losses-rank{rank}.jsonl"
        if not path.exists():
            return {}
        rows = {}
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                row = json.loads(line)
                rows[row["step"]] = row
        return rows

    def reached(self, rank: int, step: int) -> bool:
        return any(s >= step for s in self.losses(rank))

    def resumes(self, rank: int) -> list[dict[str, Any]]:
        paths = sorted(self.out.glob(f"resume-rank{rank}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return [json.loads(p.read_text()) for p in paths]

    def kill_rank(self, rank: int, at_step: int, timeout: float = 90) -> None:
        wait_for(lambda: self.reached(rank, at_step) or self.proc.poll() is not None, timeout,
                 f"rank {rank} to reach step {at_step}")
        assert self.proc.poll() is None, f"job ended before step {at_step}:\n{self.log()[-3000:]}"
        os.kill(self.pid(rank), signal.SIGKILL)


def innermost_frames(log: str, depth: int = 4) -> str:
    """The first ``depth`` frames (most recent call first) of every thread that faulthandler dumped into ``log``:
    the full dumps of ranks, threads and loader workers outgrow what CI shows of a failure (one CI run showed a
    loader worker's whole stack, and no rank's)."""
    lines, out, left = log.splitlines(), [], 0
    for line in lines:
        if line.startswith("Fatal Python error"):
            out.append("--- a process:")
            left = 0
        elif line.startswith(("Thread 0x", "Current thread 0x")):
            out.append(line)
            left = depth
        elif left and line.startswith("  File "):
            out.append(line)
            left -= 1
        else:
            left = 0
    return "\n".join(out) or "(no stack was dumped)"


def native_stack(pid: int, frames: int = 14, timeout: float = 30) -> str:
    """The C frames of ``pid``'s main thread, innermost first, by gdb when this machine has it: a CI hang left a
    loader worker inside os.fork() with no Python frame to say where (2026-12-02), which only C frames tell."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb)"
    try:
        done = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", f"thread apply 1 bt {frames}"],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"(gdb took over {timeout:.0f}s)"
    calls = re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\S+)", done.stdout, flags=re.MULTILINE)
    return " < ".join(calls) or done.stderr.strip()[-300:]


def dump_stacks(pid: int, timeout: float = 10) -> str:
    """Make every process under ``pid`` (torchrun's ranks and their data loader workers) print each thread's Python
    stack into the job's log, and die: ``Env.environ`` sets PYTHONFAULTHANDLER, so SIGABRT prints them first.
    The whole tree is frozen first and then dumped one process at a time: dumps taken together interleave in the
    shared log past reading (one CI failure's did), and a process left running would react to another's death
    (torchrun stops the other ranks, a rank raises for a dead loader worker) before its own stack is taken."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return "(the job had ended)"
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            proc.suspend()
    native, budget = [], time.monotonic() + 60   # gdb takes some 5 s a torch process: a test's timeout must not cut the dump
    for proc in tree[1:]:
        with contextlib.suppress(psutil.Error):
            stack = native_stack(proc.pid) if time.monotonic() < budget else "(not taken: 60 s of gdb spent)"
            native.append(f"pid {proc.pid} (parent {proc.ppid()}): {stack}")
            proc.suspend()   # gdb's detach may have let it run
    # The ranks last: CI shows a failure's tail, and a rank's stack tells more than its loader workers' do
    ranks = {proc.pid for proc in root.children()}
    for proc in sorted(tree[1:], key=lambda proc: proc.pid in ranks):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGABRT)   # pending while stopped: the first thing it meets when continued
            proc.resume()
        with contextlib.suppress(TimeoutError):   # its parent is frozen: it ends a zombie, which counts as gone
            poll(functools.partial(gone, proc.pid), timeout, f"pid {proc.pid} to die of SIGABRT")
    with contextlib.suppress(psutil.Error):
        root.resume()
    return "\n".join(native)


def slot_states(env: Env, save_dir: Path) -> dict[int, list[tuple[str, int, int]]]:
    """{rank: [(state, step, generation) per slot]} read straight from the slot files."""
    from easyckpt_wire.protocol import job_id_for

    found: dict[int, list[tuple[str, int, int]]] = {}
    for (rank, _slot), path in sorted(list_slots(env.shm_dir, job_id_for(save_dir)).items()):
        slot = SlotMap(path, writable=False)
        try:
            header = slot.header()
            found.setdefault(rank, []).append((header.state.name, header.step, header.generation))
        except SlotFormatError:
            found.setdefault(rank, []).append(("UNREADABLE", -1, -1))
        finally:
            slot.close()
    return found


def newest_common_committed(states: dict[int, list[tuple[str, int, int]]]) -> int | None:
    common = None
    for slots in states.values():
        steps = {step for state, step, generation in slots if state == "COMMITTED" and generation % 2 == 0}
        common = steps if common is None else common & steps
    return max(common) if common else None
