"""easyckpt_wire.procs: a process's identity (pid, start since boot) that a wall-clock correction cannot move.

A CI rehearsal on 2026-12-01 failed six unit tests of the agent when the VM's clock was corrected during the run:
psutil's ``create_time`` of the live test process moved by a second, and the watcher took it for a recycled pid."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from easyckpt_wire import owner, procs

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def test_the_start_is_seconds_since_boot_and_not_the_wall_clock() -> None:
    start = procs.start_time()
    assert start == procs.start_time(os.getpid())
    assert 0 < start <= uptime()   # psutil's create_time (seconds since 1970) would be far above the uptime
    # the same instant as psutil's, up to the whole-second boot time psutil adds
    assert abs((psutil.Process().create_time() - psutil.boot_time()) - start) < 1.5


def test_a_live_process_is_alive_only_with_its_own_start() -> None:
    start = procs.start_time()
    assert procs.is_alive(os.getpid(), start) and procs.is_alive(os.getpid(), None)
    assert not procs.is_alive(os.getpid(), start + 1.0)    # the pid taken by another process since
    assert not procs.is_alive(os.getpid(), start - 0.02)   # two ticks apart is another process


def test_zombies_and_reaped_processes_are_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = procs.start_time(child.pid)
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 30, "the child to exit")
    assert not procs.is_alive(child.pid, start)   # exited, not reaped yet
    child.wait(timeout=30)
    assert not procs.is_alive(child.pid, start)
    with pytest.raises(ProcessLookupError):
        procs.start_time(child.pid)


def test_a_command_name_with_spaces_and_parentheses_is_parsed() -> None:
    code = ("import sys; open('/proc/self/comm', 'w').write('a) (b c'); print('ready', flush=True); "
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "a) (b c"
        start = procs.start_time(child.pid)
        assert 0 < start <= uptime() and procs.is_alive(child.pid, start)
        assert abs((psutil.Process(child.pid).create_time() - psutil.boot_time()) - start) < 1.5
    finally:
        child.communicate(timeout=30)


def test_the_owner_file_records_the_start_since_boot(tmp_path: Path) -> None:
    path = owner.claim(tmp_path, "procsjob", 0, tmp_path / "save")
    recorded = owner.read_owner(path, 0)
    assert recorded is not None and recorded.pid == os.getpid() and recorded.start == procs.start_time()
    assert [o.pid for o in owner.live_owners(tmp_path)] == [os.getpid()]
