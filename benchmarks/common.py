"""What the benchmarks share: polling against a deadline, writing the result file, a free port, and the fast exit of
the processes that the tests and the soak start.

The benchmarks run as scripts (``python benchmarks/throughput.py``), so this directory is on ``sys.path``
and they import it as ``common``; the tests put it there too (``tests/conftest.py``).
"""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Put first on PYTHONPATH by tests/conftest.py and soak_job.py: its sitecustomize skips CPython's final garbage
# collection, about a CPU-second per process that imported torch (the file says why no outcome changes)
FAST_EXIT = Path(__file__).resolve().parent.parent / "tests" / "fast_exit"


def poll(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll ``predicate`` until truthy, against a deadline (never a fixed sleep); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)  # polling interval against a deadline, not a synchronisation sleep


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a process group's MASTER_PORT)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_result(out: Path | None, result: dict[str, Any]) -> dict[str, Any]:
    """Write ``result`` as JSON to ``out`` (when given, creating its directory); returns ``result``."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result
