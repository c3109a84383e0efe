"""``--cpu-times=PATH``: each test's wall time and the CPU time it used (pytest's own process and every child
process it waited for, torchrun's workers included), written to PATH as JSON, and the tests that left the cores
idle longest in the terminal summary.

Why: the suite is bound by CPU on a 2-core machine (every rank and every ``torchrun`` imports torch), so
``--durations`` alone cannot tell a test that waits (a timeout, a back-off, a throttled persist: shorten it) from
one that computes (only fewer processes help). Idle core-seconds are ``cores x wall - CPU``. Detached processes
(the agents) are not counted: a multi-node test's idle figure is an upper bound.
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


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclasses.dataclass(frozen=True)
class Row:
    test: str
    wall_s: float
    cpu_s: float

    @property
    def idle_core_s(self) -> float:
        return CORES * self.wall_s - self.cpu_s


class CpuTimes:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[Row] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        wall, cpu = time.monotonic(), _cpu_seconds()
        yield
        self.rows.append(Row(item.nodeid, time.monotonic() - wall, _cpu_seconds() - cpu))

    def pytest_sessionfinish(self) -> None:
        rows = [{**dataclasses.asdict(r), "idle_core_s": r.idle_core_s} for r in self.rows]
        self.path.write_text(json.dumps(rows, indent=1))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        wall, cpu = sum(r.wall_s for r in self.rows), sum(r.cpu_s for r in self.rows)
        terminalreporter.write_sep("=", f"cpu times ({CORES} cores): {wall / 60:.1f} min of tests, {cpu / 60:.1f} "
                                        f"CPU-min, cores busy {cpu / max(wall * CORES, 1e-9):.0%}; per test in {self.path}")
        for row in sorted(self.rows, key=lambda r: -r.idle_core_s)[:SHOWN]:
            terminalreporter.write_line(f"{row.wall_s:7.1f}s wall {row.cpu_s:7.1f}s CPU {row.idle_core_s:7.1f} idle "
                                        f"core-s  {row.test}")


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
