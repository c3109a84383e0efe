"""The Lightning exporter's file writing (``easyckpt.lightning.export.write_checkpoint``) in one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from easyckpt.lightning import export


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
