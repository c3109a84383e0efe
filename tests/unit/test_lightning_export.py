"""The Lightning exporter in one process: its file writing (``easyckpt.lightning.export.write_checkpoint``), its
holds on the iterations it exports, and its thread's survival of a failed export."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import marker_iteration, wait_for
from torch.distributed.checkpoint.api import CheckpointException

from easyckpt.lightning import export
from easyckpt_wire import layout


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_temporary_file_left_by_a_killed_writer_is_removed_and_a_live_writers_is_kept(tmp_path: Path) -> None:
    """CI found it: rank 1 killed by the test while rank 0 wrote ``epoch=0-step=8.ckpt`` left
    ``.epoch=0-step=8.ckpt.easyckpt-tmp`` in the ModelCheckpoint directory for good (the kill test then saw four
    files). The next export into that directory removes what dead writers left, and nothing of a live one."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    legacy = directory / ".epoch=0-step=8.ckpt.easyckpt-tmp"            # the name before the pid was in it
    dead = directory / f".epoch=1-step=16.ckpt.{dead_pid()}.easyckpt-tmp"
    live = directory / f".epoch=1-step=16.ckpt.{os.getppid()}.easyckpt-tmp"   # a writer that still runs
    unrelated = directory / ".hidden-by-the-user"
    for path in (legacy, dead, live, unrelated):
        path.write_bytes(b"partial")
    export.write_checkpoint({"global_step": 24, "w": torch.ones(2)}, str(directory / "last.ckpt"))
    assert sorted(p.name for p in directory.iterdir()) == sorted([live.name, unrelated.name, "last.ckpt"])
    assert torch.load(directory / "last.ckpt", weights_only=False)["global_step"] == 24
    # The temporary name carries the writer's pid, so that the next job can tell a dead writer's file.
    assert export.TMP_RE.match(f".last.ckpt.{os.getpid()}.easyckpt-tmp").group("pid") == str(os.getpid())


def test_two_exports_of_one_step_hold_its_iteration_until_the_last_is_done(tmp_path: Path) -> None:
    """Two files of one step (two ModelCheckpoints, or ``save_last``): the iteration stays held from rotation
    until both are done. The first export's release used to free it, and rotation deleted it under the second
    (CI rehearsal 2026-11-30: the second export then failed, and its thread died)."""
    exporter = export.Exporter(tmp_path, timeout=60)
    first, second = str(tmp_path / "epoch=0-step=8.ckpt"), str(tmp_path / "last.ckpt")
    try:
        exporter.request(8, first, {})
        exporter.request(8, second, {})
        assert layout.export_holds(tmp_path) == {8}
        assert exporter.forget(first)   # ModelCheckpoint removed it while pending: the export gives it up
        wait_for(lambda: exporter.outstanding == 1, 30, "the first export to be given up")
        assert layout.export_holds(tmp_path) == {8}, "the second export of step 8 still needs its iteration"
        assert exporter.forget(second)
        assert exporter.drain(30)
        assert layout.export_holds(tmp_path) == set()
    finally:
        exporter.stop()


def test_an_export_that_fails_inside_torch_distributed_checkpoint_does_not_stop_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed.checkpoint reports a failed read as a CheckpointException, a BaseException: it killed
    the export thread, and the drain at the end of training waited for requests nobody would serve (CI rehearsal
    2026-11-30). The failure is the request's alone; the next one is written, and the drain returns."""
    for step in (8, 16):
        marker_iteration(tmp_path, step)

    def full_state(iteration: Path) -> dict[str, object]:
        if iteration.name == layout.iteration_dirname(8):
            raise CheckpointException("read", {0: (FileNotFoundError(f"{iteration}/a rank file"), None)})
        return {"state_dict": {"w": torch.ones(2)}}

    monkeypatch.setattr(export, "full_state", full_state)
    exporter = export.Exporter(tmp_path, timeout=60)
    try:
        exporter.request(8, str(tmp_path / "ckpt" / "step=8.ckpt"), {"global_step": 8})
        exporter.request(16, str(tmp_path / "ckpt" / "step=16.ckpt"), {"global_step": 16})
        assert exporter.drain(30), "the export thread must survive the failed read"
        assert exporter.thread.is_alive()
        assert "CheckpointException" in exporter.failed[str(tmp_path / "ckpt" / "step=8.ckpt")]
        assert exporter.exported == [(16, str(tmp_path / "ckpt" / "step=16.ckpt"))]
        assert torch.load(tmp_path / "ckpt" / "step=16.ckpt", weights_only=False)["global_step"] == 16
        assert layout.export_holds(tmp_path) == set()
    finally:
        exporter.stop()
