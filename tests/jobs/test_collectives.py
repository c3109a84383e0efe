"""easyckpt's collectives under a real 2-rank torchrun job (gloo): no tensor they hand the backend is freed by the
backend's own thread (they are freed on the main thread once their works are let go), which would take the GIL from a
thread without a Python thread state (on CPython before 3.11.10 a DataLoader worker forked at that moment deadlocks:
the hang once seen in the Lightning stateful loader test). The same job's plain collectives on tensors let go of at
once show that the count can see such frees."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import Env
from ddp_job import TORCHRUN

JOB = Path(__file__).resolve().parents[1] / "collectives_job.py"
pytestmark = pytest.mark.slow


def test_no_tensor_of_a_collective_is_freed_by_the_backends_thread(env: Env) -> None:
    done = subprocess.run(TORCHRUN + ["--standalone", "--nproc-per-node=2", "--max-restarts=0", str(JOB),
                                      str(env.tmp_path)], env=env.environ(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    reports = [json.loads((env.tmp_path / f"report-rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        freed = report["freed"]
        assert freed.get("easyckpt off the main thread", 0) == 0, report
        assert freed.get("easyckpt", 0) > 0, f"no work was let go within the run: {report}"
    assert any(report["freed"].get("plain off the main thread", 0) > 0 for report in reports), \
        f"the control saw no tensor freed off the main thread in {reports[0]['rounds']} plain collectives: {reports}"
