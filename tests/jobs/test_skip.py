"""Data skipping: DataSkipper's rules (fast), and a 2-rank torchrun loop (tests/skip_job.py) where a gradient
spike is skipped bit-exactly, two in a row abort after the newest state is made durable, and a rerun resumes
with the skipper's count."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, Env

import easyckpt
from easyckpt.health import DataSkipper, TrainingAborted, embedding_local_norm
from easyckpt_wire import layout


def skipper(threshold: float = 3.0, count: int = 2, **kw: Any) -> DataSkipper:
    return DataSkipper(global_norm_spike_threshold=threshold, global_norm_spike_count_threshold=count, **kw)


def test_normal_steps_are_not_skipped() -> None:
    s = skipper()
    assert [s.skip(i, n) for i, n in enumerate([0.5, 3.0, 2.9])] == [False, False, False]   # == threshold: fine
    assert s.state_dict() == {"consecutive": 0, "skipped_total": 0}


def test_one_spike_is_skipped_and_a_normal_step_resets_the_count(caplog: pytest.LogCaptureFixture) -> None:
    s = skipper(count=2)
    with caplog.at_level(logging.WARNING, logger="easyckpt.health"):
        assert s.skip(17, 44.31) is True
    assert "step 17: global norm 44.31 > threshold 3, 1 consecutive time(s); data skipped" in caplog.text
    assert s.skip(18, 1.0) is False
    assert s.skip(19, 10.0) is True            # not two in a row: the reset made this the first again
    assert s.state_dict() == {"consecutive": 1, "skipped_total": 2}


def test_count_threshold_aborts_after_on_abort() -> None:
    calls: list[int] = []
    s = skipper(count=3, on_abort=lambda: calls.append(s.consecutive))
    assert s.skip(5, 4.0) and s.skip(6, 5.0)
    assert calls == []
    with pytest.raises(TrainingAborted) as info:
        s.skip(7, 6.5)
    assert calls == [3]
    error = info.value
    assert isinstance(error, RuntimeError)
    assert (error.step, error.global_norm, error.threshold, error.count) == (7, 6.5, 3.0, 3)
    assert "step 7" in str(error) and "6.5" in str(error) and "threshold 3" in str(error)


def test_count_one_aborts_at_the_first_spike() -> None:
    with pytest.raises(TrainingAborted):
        skipper(count=1).skip(0, 3.5)


@pytest.mark.parametrize("norm", [math.inf, -math.inf, math.nan])
def test_a_norm_that_is_not_finite_is_a_spike(norm: float) -> None:
    s = skipper(count=2)
    assert s.skip(1, norm) is True
    with pytest.raises(TrainingAborted):
        s.skip(2, torch.tensor(norm))


def test_tensor_norm_is_read() -> None:
    s = skipper()
    assert s.skip(0, torch.tensor(2.0)) is False
    assert s.skip(1, torch.tensor(20.0, dtype=torch.bfloat16)) is True


def test_state_round_trip() -> None:
    s = skipper(count=5)
    for step, norm in enumerate([9.0, 9.0, 1.0, 9.0]):
        s.skip(step, norm)
    restored = skipper(count=5)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict() == {"consecutive": 1, "skipped_total": 3}
    restored.skip(4, 9.0)
    assert restored.consecutive == 2


@pytest.mark.parametrize("state", [{}, {"consecutive": -1, "skipped_total": 0}, {"consecutive": 1.0, "skipped_total": 0},
                                   {"consecutive": True, "skipped_total": 0}, {"consecutive": 0}])
def test_bad_state_is_refused(state: dict[str, Any]) -> None:
    s = skipper()
    with pytest.raises(ValueError, match="DataSkipper state"):
        s.load_state_dict(state)
    assert s.state_dict() == {"consecutive": 0, "skipped_total": 0}


@pytest.mark.parametrize("threshold", [0, -1.0, math.inf, math.nan, "3"])
def test_threshold_must_be_positive_and_finite(threshold: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="global_norm_spike_threshold"):
        skipper(threshold=threshold)


@pytest.mark.parametrize("count", [0, -2, 1.5, 2.0, True, "2", None])
def test_count_must_be_a_positive_int(count: Any) -> None:
    with pytest.raises(ValueError, match="global_norm_spike_count_threshold must be a positive int"):
        skipper(count=count)


def test_exported_at_top_level() -> None:
    assert easyckpt.DataSkipper is DataSkipper and easyckpt.TrainingAborted is TrainingAborted


def test_embedding_local_norm() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    assert embedding_local_norm(model) is None            # no gradient yet
    model(torch.tensor([1, 2, 2])).sum().backward()
    grad = model[0].weight.grad
    assert grad is not None
    assert embedding_local_norm(model) == pytest.approx(float(grad.norm()))
    assert embedding_local_norm(torch.nn.Linear(2, 2)) is None   # a later pipeline stage: neutral


# --- a real 2-rank loop under torchrun -------------------------------------------------------------------

JOB = ROOT / "tests" / "skip_job.py"


def run_job(env: Env, name: str, *args: str, timeout: float = 180, restarts: int = 0,
            extra_env: dict[str, str] | None = None) -> tuple[int, Path, str]:
    out = env.tmp_path / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={restarts}",
               str(JOB), "--save-dir", str(env.save_dir), "--out", str(out), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          env=env.environ(EASYCKPT_LOG_LEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                          **(extra_env or {})))
    return proc.returncode, out, proc.stdout + proc.stderr


def rows(out: Path, rank: int) -> dict[int, dict[str, Any]]:
    lines = (out / f"steps-rank{rank}.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


STEPS = 12
SPIKE = 5


@pytest.mark.slow
def test_one_spike_is_skipped_bit_exactly(env: Env, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The skipped run's state equals, bit for bit, a reference that never applied step 5's update."""
    code, skipped, log = run_job(env, "skipped", "--steps", str(STEPS), "--spike-steps", str(SPIKE))
    assert code == 0, log[-4000:]
    ref_env = Env(tmp_path_factory.mktemp("reference"))
    try:
        code, reference, log = run_job(ref_env, "reference", "--steps", str(STEPS), "--drop-steps", str(SPIKE))
        assert code == 0, log[-4000:]
    finally:
        ref_env.cleanup()
    for rank in range(2):
        ours, theirs = rows(skipped, rank), rows(reference, rank)
        assert sorted(ours) == sorted(theirs) == list(range(STEPS))
        assert [s for s in ours if ours[s]["skipped"]] == [SPIKE]
        assert ours[SPIKE]["norm"] > 1000 * max(r["norm"] for s, r in ours.items() if s != SPIKE)
        for step in range(STEPS):
            assert ours[step]["digest"] == theirs[step]["digest"], f"rank {rank}: state differs at step {step}"
        # and the skip changed something: step 5's update was a real one in a run without skipping
        assert theirs[SPIKE]["digest"] == theirs[SPIKE - 1]["digest"] != theirs[SPIKE - 2]["digest"]


@pytest.mark.slow
def test_consecutive_spikes_abort_durably_and_the_rerun_resumes_the_count(env: Env) -> None:
    """Spikes at steps 7 and 8 with count threshold 2: step 7 is skipped, step 8 aborts after on_abort=flush
    made step 7's snapshot durable; the process exits non-zero. A rerun resumes at step 7 with the
    skipper's count (1 consecutive), so one more spike at step 8 would abort; a normal step 8 resets it."""
    code, first, log = run_job(env, "first", "--steps", str(STEPS), "--spike-steps", "7,8")
    assert code != 0, log[-4000:]
    assert "TrainingAborted" in log and "step 8: global norm" in log
    for rank in range(2):
        report = json.loads((first / f"aborted-rank{rank}.json").read_text())
        assert (report["step"], report["count"]) == (8, 2)
        assert report["flush"]["step"] == 7 and report["flush"]["durable"], report
        assert sorted(rows(first, rank)) == list(range(8))
        assert rows(first, rank)[7]["skipped"]
    assert (env.save_dir / layout.iteration_dirname(7) / layout.METADATA).is_file()
    assert not (env.save_dir / layout.iteration_dirname(8)).exists()

    code, second, log = run_job(env, "second", "--steps", str(STEPS))
    assert code == 0, log[-4000:]
    for rank in range(2):
        resume = json.loads((second / f"resume-rank{rank}.json").read_text())
        assert resume["step"] == 7, resume
        assert resume["skipper"] == {"consecutive": 1, "skipped_total": 1}
        ours = rows(second, rank)
        assert sorted(ours) == list(range(8, STEPS)) and not any(r["skipped"] for r in ours.values())
        assert ours[8]["digest"] != rows(first, rank)[7]["digest"]
