"""The soak's own fault tools (benchmarks/soak_faults.py): a harness that breaks is a failed job in the table."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import soak_faults


def test_filling_a_disk_that_fills_up_under_it_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Soak seed 300322676, fault 18 (disk_full, crash): a persist took the space between ``fill``'s look at the free
    space and its write, a few KiB stayed in the file's buffer, and closing the file raised ENOSPC: the job was
    counted failed for the harness's error. /dev/full refuses every write with ENOSPC, as a full disk does."""
    free = 3 << 10   # less than a write buffer: the bytes that stayed behind
    monkeypatch.setattr(soak_faults.os, "statvfs", lambda path: os.statvfs_result((0, 1, 0, 0, free, 0, 0, 0, 0, 255)))
    (tmp_path / "filler").symlink_to("/dev/full")
    assert soak_faults.fill(tmp_path, 0) == 0
