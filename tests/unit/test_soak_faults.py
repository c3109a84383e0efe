"""The soak's own fault tools (benchmarks/soak_faults.py): a harness that breaks is a failed job in the table."""
from __future__ import annotations

import importlib
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


def test_the_default_kinds_leave_out_those_that_fit_none_of_the_configurations(capsys: pytest.CaptureFixture[str]) -> None:
    """``soak.py --configs hf-1x1,hf-2x1`` with every kind by default: the object-store outage (plain jobs only) is left
    out and said so (2026-12-02: the soak refused to start, since the default kinds include it)."""
    soak = importlib.import_module("soak")
    settings = soak.settle(soak.parse(["--configs", "hf-1x1,hf-2x1", "--seed", "1", "--json", "x.json"]), {})
    assert "object_store_outage" not in settings["kinds"]
    assert set(settings["kinds"]) == set(soak.available_kinds()) - {"object_store_outage"}
    assert "left out: object_store_outage (applies to none of hf-1x1, hf-2x1)" in capsys.readouterr().out
    # every configuration: every kind
    assert soak.settle(soak.parse(["--seed", "1", "--json", "x.json"]), {})["kinds"] == soak.available_kinds()


def test_a_kind_asked_for_that_fits_none_of_the_configurations_is_refused_before_any_job() -> None:
    soak = importlib.import_module("soak")
    with pytest.raises(SystemExit, match=r"--kinds: object_store_outage applies to none of the configurations hf-1x1: "
                                         r"leave it out of --kinds, or add one of plain-1x1, .* to --configs"):
        soak.settle(soak.parse(["--configs", "hf-1x1", "--kinds", "rank_kill,object_store_outage", "--seed", "1",
                               "--json", "x.json"]), {})


def test_a_configuration_that_does_not_exist_is_refused_by_name_with_the_default_kinds_too() -> None:
    """``--configs plain-4x1`` without ``--kinds`` once ended in a KeyError: the default kinds were matched against
    the configurations before any name was checked."""
    soak = importlib.import_module("soak")
    for argv in (["--configs", "plain-4x1"], ["--configs", "plain-2x1,plain-4x1", "--kinds", "rank_kill"]):
        with pytest.raises(SystemExit, match=r"--configs: no configuration 'plain-4x1'; they are plain-1x1, .*plain-3x1"):
            soak.settle(soak.parse([*argv, "--seed", "1", "--json", "x.json"]), {})
