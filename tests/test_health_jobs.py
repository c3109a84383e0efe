"""Checkpoint health through a real Checkpointer and its agent process: the verdicts reach metadata.json and
health_ckpts.json, rotation keeps the newest healthy iteration, load() passes unhealthy steps over, fails
clearly when nothing healthy is left, and loads an unhealthy one only when asked (load_dir=, allow_unhealthy)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import Env, assert_same, save_and_persist, wait_for
from test_bad_input import state_at

import easyckpt
from easyckpt.recovery import LoadError
from easyckpt_wire import health, layout

pytestmark = pytest.mark.slow
THRESHOLDS = {"embedding_local_norm": 270.0}


def make_ck(env: Env, **overrides: Any) -> easyckpt.Checkpointer:
    kwargs: dict[str, Any] = dict(save_mem_interval=2, save_storage_interval=2, max_ckpt_num=2,
                                  agent_idle_timeout=30.0, health_thresholds=THRESHOLDS)
    kwargs.update(overrides)
    return easyckpt.Checkpointer(env.save_dir, **kwargs)


def save(ck: easyckpt.Checkpointer, env: Env, step: int, norm: float) -> None:
    """``save_and_persist`` with this step's reported embedding norm."""
    original = ck.save_if_needed
    ck.save_if_needed = lambda s, state: original(s, state, metrics={"embedding_local_norm": norm})  # type: ignore
    try:
        save_and_persist(ck, env, step, state_at(step))
    finally:
        del ck.save_if_needed


def on_disk(env: Env) -> list[int]:
    return [s for s, _ in layout.complete_iterations(env.save_dir)]


def test_spike_marks_iterations_rotation_keeps_the_healthy_one_and_load_resumes_from_it(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    ck = make_ck(env)
    try:
        for step, norm in ((2, 100.0), (4, 120.0), (6, 300.0), (8, 310.0)):   # the spike crosses at step 6
            save(ck, env, step, norm)
        # max_ckpt_num=2 would keep 6 and 8: 4 stays, the newest healthy (rotation follows the persist)
        wait_for(lambda: on_disk(env) == [4, 8], 30, f"rotation to [4, 8] (on disk: {on_disk(env)})")
        wait_for(lambda: [e.step for e in health.read_health_file(env.save_dir) or []] == [4, 8], 30,
                 "health_ckpts.json to drop the rotated steps")
        entries = health.read_health_file(env.save_dir) or []
        assert [(e.step, e.is_health) for e in entries] == [(4, 0), (8, 1)]
        assert "embedding_local_norm 310 > threshold 270" in entries[1].reasons[0]
        meta = json.loads((env.save_dir / layout.iteration_dirname(8) / layout.METADATA).read_text())
        assert meta["health"]["healthy"] is False
        assert json.loads((env.save_dir / layout.iteration_dirname(4) / layout.METADATA).read_text())["health"] == \
            {"healthy": True, "reasons": []}
        with caplog.at_level(logging.WARNING, logger="easyckpt.recovery"):
            result = ck.load()
        assert result.step == 4, result
        assert_same(state_at(4)["model"], result.state["model"])
        assert "passing over unhealthy snapshots newer than step 4" in caplog.text and "step 8" in caplog.text
    finally:
        ck.close()


def test_nothing_healthy_is_a_clear_error_then_allow_unhealthy_and_load_dir(env: Env) -> None:
    ck = make_ck(env, max_ckpt_num=5)
    try:
        save(ck, env, 2, 300.0)
        save(ck, env, 4, float("nan"))
    finally:
        ck.close()
    env.wait_agent_gone()
    ck = make_ck(env, max_ckpt_num=5)
    try:
        with pytest.raises(LoadError) as caught:
            ck.load()
        text = str(caught.value)
        assert "no healthy checkpoint" in text and "step 4" in text and "step 2" in text
        assert "retrain from scratch" in text and "load_dir=" in text and "allow_unhealthy=True" in text
        assert "embedding_local_norm 300 > threshold 270" in text
        result = ck.load(allow_unhealthy=True)
        assert (result.step, result.source) == (4, "disk")
        result = ck.load(load_dir=env.save_dir / layout.iteration_dirname(2))
        assert result.step == 2
        assert_same(state_at(2)["model"], result.state["model"])
    finally:
        ck.close()


def test_a_corrupt_health_file_falls_back_to_metadata(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    ck = make_ck(env, max_ckpt_num=5)
    try:
        save(ck, env, 2, 100.0)
        save(ck, env, 4, 300.0)
    finally:
        ck.close()
    env.wait_agent_gone()
    (env.save_dir / health.HEALTH_FILE).write_text("{broken")
    ck = make_ck(env, max_ckpt_num=5)
    try:
        with caplog.at_level(logging.WARNING):
            result = ck.load()
        assert result.step == 2
        assert str(Path(env.save_dir) / health.HEALTH_FILE) in caplog.text
    finally:
        ck.close()


def test_cli_ls_shows_health_and_verify_checks_the_index(env: Env) -> None:
    from conftest import run_cli
    ck = make_ck(env, max_ckpt_num=5)
    try:
        save(ck, env, 2, 100.0)
        save(ck, env, 4, 300.0)
    finally:
        ck.close()
    env.wait_agent_gone()
    out = run_cli("ls", str(env.save_dir), env=env).stdout
    line2 = next(line for line in out.splitlines() if line.startswith("iteration_0000002"))
    line4 = next(line for line in out.splitlines() if line.startswith("iteration_0000004"))
    assert "health: healthy" in line2 and "health: UNHEALTHY" in line4 and "embedding_local_norm 300" in line4
    assert run_cli("verify", str(env.save_dir), env=env).returncode == 0
    index = env.save_dir / health.HEALTH_FILE
    entries = json.loads(index.read_text())
    index.write_text(json.dumps(entries + [{"is_health": 0, "ckpt_name": "iteration_0000009", "step": 9,
                                            "reasons": []}]))
    proc = run_cli("verify", str(env.save_dir), env=env)
    assert proc.returncode == 1 and str(index) in proc.stdout and "step 9" in proc.stdout
    index.write_text("{corrupt")
    proc = run_cli("verify", str(env.save_dir), env=env)
    assert proc.returncode == 1 and str(index) in proc.stdout and "not readable JSON" in proc.stdout
    assert on_disk(env) == [2, 4] and index.read_text() == "{corrupt"   # nothing deleted nor rewritten
