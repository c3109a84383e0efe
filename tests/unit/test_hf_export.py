"""The HF wrapper's export thread (``easyckpt.transformers.export``): what makes it stop waiting for an iteration."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, cast

from conftest import wait_for

from easyckpt.transformers.export import Exporter
from easyckpt_wire import layout


def test_an_export_whose_persist_failed_stops_waiting_at_once(tmp_path: Path) -> None:
    """The agent's persist of step 10 failed (a full disk) and is not retried: the export gives up at once
    instead of holding the end of training for its timeout (fault soak, seed 101, fault 19: a 2-node HF job
    on a full disk waited export_timeout for each failed step)."""
    failed = {10, 15}
    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0, persist_failed=lambda step: step <= max(failed))
    try:
        started = time.monotonic()
        for step in sorted(failed):
            exporter.request(step)
        assert exporter.drain(60.0), "the exports of steps whose persist failed are still waiting"
        assert time.monotonic() - started < 30.0
        assert exporter.failed == {10: "not persisted", 15: "not persisted"} and not exporter.exported
        assert not any(layout.export_hold(tmp_path, step).exists() for step in failed), "an export hold was left"
    finally:
        exporter.stop()


def test_an_export_still_waits_while_nothing_failed(tmp_path: Path) -> None:
    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0, persist_failed=lambda step: False)
    try:
        exporter.request(10)
        assert not exporter.drain(0.5), "gave up on a step the agent may still persist"
    finally:
        exporter.cancel(10)
        assert exporter.drain(60.0)
        exporter.stop()



def test_exports_abandoned_at_the_end_of_training_stop_waiting_at_once(tmp_path: Path) -> None:
    """The node agent was killed and none could be started (fault soak, seed 101, fault 99: the agent killed at
    step 7 of a run that ended a second later; the end of training waited export_timeout for checkpoint-10, 15
    and 20): the exports give up at once, also one requested after."""
    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0)
    try:
        for step in (10, 15):
            exporter.request(step)
        assert exporter.waiting() == [10, 15] and not exporter.drain(0.2)
        started = time.monotonic()
        exporter.abandon("no easyckpt agent runs")
        exporter.request(20)
        assert exporter.drain(60.0), "the exports still wait for an agent that is gone"
        assert time.monotonic() - started < 30.0
        assert exporter.failed == {10: "not persisted", 15: "not persisted", 20: "not persisted"}
        assert exporter.waiting() == [] and not exporter.exported
    finally:
        exporter.stop()


def test_a_passed_over_save_step_that_the_end_of_training_persisted_is_exported_after_all(tmp_path: Path) -> None:
    """The agent passed due steps 15 and 20 over (a persist still ran), and the exports gave them up; then close()
    persisted the newest snapshot, step 20 (CI, 2026-11-27: the run ended with iteration 20 on disk and no
    checkpoint-20, which a plain Trainer writes). Asked again, only 20 is exported: 15 is on disk nowhere."""
    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0, passed_over=lambda: frozenset({15, 20}))
    try:
        for step in (15, 20):
            exporter.request(step)
        assert exporter.drain(60.0) and exporter.failed == {15: "not persisted", 20: "not persisted"}
        final = tmp_path / layout.iteration_dirname(20)   # what close()'s final persist leaves
        final.mkdir()
        (final / layout.METADATA).write_text(json.dumps({"format": layout.METADATA_FORMAT, "format_version": 1,
                                                         "step": 20}))
        assert exporter.ask_again_if_persisted() == [20]
        assert exporter.drain(60.0)
        assert exporter.failed[20] != "not persisted", "the export of 20 did not read the iteration"
        assert exporter.ask_again_if_persisted() == [], "asked once only"
    finally:
        exporter.stop()


def test_a_step_announced_passed_over_a_moment_before_its_request_reached_the_agent_is_still_exported(
        tmp_path: Path) -> None:
    """The wrapper asks the agent for step 8 without waiting; the agent, busy with step 4, had announced 8 passed
    over a moment before, and withdraws it when the request arrives (CI, 2026-11-29: checkpoint-8, the best one,
    was given up while the agent went on to persist step 8). A short-lived announcement is not a verdict."""
    announced_until = time.monotonic() + 0.3
    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0,
                        passed_over=lambda: frozenset({8}) if time.monotonic() < announced_until else frozenset())
    try:
        exporter.request(8)
        assert not exporter.drain(0.6), "gave up on a step the agent withdrew from its passed-over list"
        iteration = tmp_path / layout.iteration_dirname(8)   # the agent's persist of step 8 commits
        iteration.mkdir()
        (iteration / layout.METADATA).write_text(json.dumps({"format": layout.METADATA_FORMAT, "format_version": 1,
                                                             "step": 8}))
        assert exporter.drain(60.0)
        assert exporter.failed.get(8) != "not persisted", "the export of 8 did not read the iteration"
    finally:
        exporter.stop()


def test_two_requests_of_one_step_hold_its_iteration_until_the_last_is_done(tmp_path: Path) -> None:
    """The HF exporter counts its holds per step like the Lightning one: the first request's end must not let
    rotation delete the iteration the second still waits for."""
    both_asked = threading.Event()
    answers = iter([True])   # the first look says the persist failed, every later one that it may still come

    def persist_failed(step: int) -> bool:
        both_asked.wait(30)   # else the first request may end before the second is made, and prove nothing
        return next(answers, False)

    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0, persist_failed=persist_failed)
    try:
        exporter.request(10)
        exporter.request(10)
        both_asked.set()
        wait_for(lambda: exporter.outstanding == 1, 30, "the first request of step 10 to end")
        assert exporter.failed == {10: "not persisted"} and exporter.waiting() == [10]
        assert layout.export_holds(tmp_path) == {10}, "the second request of step 10 still needs its iteration"
        exporter.cancel(10)
        assert exporter.drain(60.0)
        assert layout.export_holds(tmp_path) == set()
    finally:
        exporter.stop()


def test_export_holds_write_the_file_with_the_first_hold_and_remove_it_with_the_last(tmp_path: Path) -> None:
    holds = layout.ExportHolds(tmp_path)
    holds.hold(5)
    holds.hold(5)
    holds.hold(6)
    holds.release(5)
    assert layout.export_holds(tmp_path) == {5, 6} and holds.held() == {5: 1, 6: 1}
    holds.release(5)
    assert layout.export_holds(tmp_path) == {6}
    layout.hold_export(tmp_path, 7)   # a dead run's hold: no count here, the first release removes it
    holds.release(7)
    assert layout.export_holds(tmp_path) == {6} and holds.held() == {6: 1}


def test_a_resume_from_an_older_checkpoint_sets_the_newer_folders_aside_in_one_place(tmp_path: Path) -> None:
    """``CheckpointFolders.set_aside_after(10)``: checkpoint-15 and -20 (of the timeline the resume abandons) move
    into one ``.abandoned-<time>`` folder whole, checkpoint-5 and -10 and anything not a checkpoint stay, and a
    second call finds nothing to move."""
    from easyckpt.transformers.folders import CheckpointFolders

    for name in ("checkpoint-5", "checkpoint-10", "checkpoint-15", "checkpoint-20", "checkpoint-x", "runs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(name)
    folders = CheckpointFolders(cast(Any, None), tmp_path)
    moved = folders.set_aside_after(10)
    assert [p.name for p in moved] == ["checkpoint-15", "checkpoint-20"]
    assert len({p.parent for p in moved}) == 1 and moved[0].parent.name.startswith(".abandoned-")
    assert all((p / "trainer_state.json").read_text() == p.name for p in moved)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["checkpoint-10", "checkpoint-5", "checkpoint-x", "runs"]
    assert folders.set_aside_after(10) == []


def test_the_string_true_of_a_command_line_means_true_unless_such_a_path_exists(tmp_path: Path,
                                                                                monkeypatch: Any) -> None:
    """run_clm.py's ``--resume_from_checkpoint True`` reaches ``train()`` as the string: taken as True, as a
    Python caller's True, unless a file or folder of that name exists (then it is the path it names)."""
    from easyckpt.transformers.resume import as_asked

    monkeypatch.chdir(tmp_path)
    assert as_asked("True") is True and as_asked("true") is True and as_asked(True) is True
    assert as_asked(None) is None and as_asked(False) is False and as_asked("out/checkpoint-5") == "out/checkpoint-5"
    (tmp_path / "True").mkdir()
    assert as_asked("True") == "True"


def test_save_steps_below_a_newer_iteration_are_said_once_not_once_each(tmp_path: Path, caplog: Any) -> None:
    """A run that started below an earlier run's steps without resuming: the agent persists none of its save steps
    while a newer iteration is complete. One warning for the first (a line per save step buried the log of a new
    user's run_clm.py rerun), the steps kept to be named when an export succeeds again."""
    import logging

    newer = tmp_path / layout.iteration_dirname(20)
    newer.mkdir()
    (newer / layout.METADATA).write_text(json.dumps({"format": layout.METADATA_FORMAT, "format_version": 1,
                                                     "step": 20}))
    exporter = Exporter(cast(Any, None), tmp_path, timeout=120.0)
    try:
        with caplog.at_level(logging.INFO, logger="easyckpt.transformers.export"):
            for step in (5, 10, 15):
                exporter.request(step)
            assert exporter.drain(60.0)
        said = [r.getMessage() for r in caplog.records if "never persisted" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("step 5 was never persisted"), said
        assert exporter.failed == {5: "not persisted", 10: "not persisted", 15: "not persisted"}
        assert exporter.unpersisted.items == [5, 10, 15]
    finally:
        exporter.stop()


def test_a_peft_checkpoint_folder_is_complete_with_its_adapter_and_torn_with_a_truncated_one(tmp_path: Path) -> None:
    """A plain Trainer's checkpoint-N of a peft model holds adapter_model.safetensors, not model.safetensors: complete
    with it, and a truncated one (killed while writing the weights) is named, as a truncated model.safetensors is."""
    import safetensors.torch
    import torch

    from easyckpt.transformers.folders import checkpoint_problem

    folder = tmp_path / "checkpoint-8"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 8}))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "adapter_config.json"):
        (folder / name).write_bytes(b"x")
    adapter = folder / "adapter_model.safetensors"
    safetensors.torch.save_file({"lora_A": torch.ones(4, 8)}, str(adapter))
    assert checkpoint_problem(folder, world_size=1) is None
    adapter.write_bytes(adapter.read_bytes()[:40])
    problem = checkpoint_problem(folder, world_size=1)
    assert problem is not None and problem.startswith(f"{adapter} is not a readable safetensors file"), problem
