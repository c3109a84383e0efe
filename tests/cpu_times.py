"""``--cpu-times=PATH``: each test's wall time and the CPU time it used (pytest's own process and every child
process it waited for, torchrun's workers included), written to PATH as JSON, and the tests that left the cores
idle longest in the terminal summary.

Why: the suite is bound by CPU on a 2-core machine (every rank and every ``torchrun`` imports torch), so
``--durations`` alone cannot tell a test that waits (a timeout, a back-off, a throttled persist: shorten it) from
one that computes (only fewer processes help). Idle core-seconds are ``cores x wall - CPU``. Detached processes
(the agents) are not counted in the CPU time; on Linux each row also has ``busy_s``, the whole machine's busy
core-seconds from ``/proc/stat`` (agents included, and anything else running: measure on a quiet machine), and the
summary ranks by the idle time that leaves.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
from collections.abc import Generator
from pathlib import Path

import pytest

CORES = len(os.sched_getaffinity(0))   # the cores this run may use (a container may allow fewer than the host's)
SHOWN = 15


def _machine_busy() -> float | None:
    """Core-seconds the whole machine has spent busy since boot; None where /proc/stat is not."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]   # idle and iowait: a core waiting on the disk does no work either
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclasses.dataclass(frozen=True)
class Row:
    test: str
    started: float         # time.time() at its start, to line it up with other records of the run
    wall_s: float
    cpu_s: float
    busy_s: float | None   # the whole machine's busy core-seconds (Linux), detached agents included

    @property
    def idle_core_s(self) -> float:
        return CORES * self.wall_s - (self.cpu_s if self.busy_s is None else max(self.cpu_s, self.busy_s))


class CpuTimes:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[Row] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        started, wall, cpu, busy = time.time(), time.monotonic(), _cpu_seconds(), _machine_busy()
        yield
        after = _machine_busy()
        self.rows.append(Row(item.nodeid, started, time.monotonic() - wall, _cpu_seconds() - cpu,
                             None if busy is None or after is None else after - busy))

    def pytest_sessionfinish(self) -> None:
        rows = [{**dataclasses.asdict(r), "idle_core_s": r.idle_core_s} for r in self.rows]
        self.path.write_text(json.dumps(rows, indent=1))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        wall, cpu = sum(r.wall_s for r in self.rows), sum(r.cpu_s for r in self.rows)
        terminalreporter.write_sep("=", f"cpu times ({CORES} cores): {wall / 60:.1f} min of tests, {cpu / 60:.1f} "
                                        f"CPU-min, cores busy {cpu / max(wall * CORES, 1e-9):.0%}; per test in {self.path}")
        busy = [r.busy_s for r in self.rows if r.busy_s is not None]
        if busy:
            terminalreporter.write_line(f"the machine was busy {sum(busy) / 60:.1f} core-min "
                                        f"({sum(busy) / max(wall * CORES, 1e-9):.0%} of the cores), agents included")
        for row in sorted(self.rows, key=lambda r: -r.idle_core_s)[:SHOWN]:
            machine = "" if row.busy_s is None else f" {row.busy_s:7.1f}s busy"
            terminalreporter.write_line(f"{row.wall_s:7.1f}s wall {row.cpu_s:7.1f}s CPU{machine} {row.idle_core_s:7.1f} "
                                        f"idle core-s  {row.test}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-times", metavar="PATH", default=None,
                     help="write each test's wall and CPU time to PATH (JSON) and list the tests that idle longest")


def pytest_configure(config: pytest.Config) -> None:
    option = config.getoption("--cpu-times")
    if not option:
        return
    path = Path(option)
    # said before the run, not in a traceback after it: the file is written only once every test has run
    if path.is_dir() or not path.parent.is_dir():
        raise pytest.UsageError(f"--cpu-times {option}: give a file in an existing directory "
                                f"({'a directory' if path.is_dir() else 'no directory ' + str(path.parent)})")
    config.pluginmanager.register(CpuTimes(path), "easyckpt-cpu-times")
