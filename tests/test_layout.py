"""``layout.replace_dir`` in-process: a fresh name, a replaced one, and a crash between its steps.

The crashes are real (a SIGKILL at the fault points ``layout.replace.swapped`` and ``layout.replace.aside``)
and each one is then cleaned up the way the next agent start does it (``persister.clean_leftovers``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.persister import AuditLog, clean_leftovers
from easyckpt_wire import faults, layout

ROOT = Path(__file__).resolve().parent.parent


def make_dir(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "which").write_text(text)
    return path


def names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def agent_names(save_dir: Path, step: int, pid: int) -> tuple[Path, Path, Path, Path]:
    return (save_dir / f"{layout.TMP_PREFIX}{step:07d}-{pid}", save_dir / layout.iteration_dirname(step),
            save_dir / f"{layout.ASIDE_PREFIX}{step:07d}-{pid}", save_dir / f"{layout.TRASH_PREFIX}{step:07d}-{pid}")


def test_replace_dir_publishes_a_fresh_name(tmp_path: Path) -> None:
    src = make_dir(tmp_path / ".tmp", "new")
    assert layout.replace_dir(src, tmp_path / "final") is None
    assert names(tmp_path) == {"final"} and (tmp_path / "final" / "which").read_text() == "new"


@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "aside"])
def test_replace_dir_replaces_an_existing_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool) -> None:
    if not atomic:
        monkeypatch.setattr(layout, "exchange_dirs", lambda a, b: False)
    elif not layout.exchange_dirs(make_dir(tmp_path / "a", "a"), make_dir(tmp_path / "b", "b")):
        pytest.skip("no atomic exchange of directories on this system")
    else:
        assert (tmp_path / "a" / "which").read_text() == "b"
        for name in ("a", "b"):
            (tmp_path / name / "which").unlink()
            (tmp_path / name).rmdir()
    src, final = make_dir(tmp_path / ".tmp", "new"), make_dir(tmp_path / "final", "old")
    trash = layout.replace_dir(src, final, aside=tmp_path / ".aside", trash=tmp_path / ".trash")
    assert trash == tmp_path / ".trash" and (trash / "which").read_text() == "old"
    assert names(tmp_path) == {"final", ".trash"} and (final / "which").read_text() == "new"


def test_replace_dir_without_an_aside_name_refuses_an_existing_one(tmp_path: Path) -> None:
    src, final = make_dir(tmp_path / ".tmp", "new"), make_dir(tmp_path / "final", "old")
    with pytest.raises(FileExistsError):
        layout.replace_dir(src, final)
    assert (final / "which").read_text() == "old" and (src / "which").read_text() == "new"


_CRASH = """
import sys
from pathlib import Path
from easyckpt_wire import layout
if sys.argv[2] == "aside":
    layout.exchange_dirs = lambda a, b: False
tmp, final, aside, trash = (Path(p) for p in sys.argv[3:])
layout.replace_dir(tmp, final, aside=aside, trash=trash)
print("not killed", flush=True)
"""


@pytest.mark.parametrize("point,survivor", [("layout.replace.swapped", "new"), ("layout.replace.aside", "old")])
def test_a_crash_inside_replace_dir_leaves_a_whole_iteration(tmp_path: Path, point: str, survivor: str) -> None:
    """Killed between two steps, the next agent start leaves iteration_N whole: the new copy once it was
    swapped in, else the old one put back from its aside name; the temporary and aside names are gone."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])   # the names carry a dead writer's pid, as a crash leaves
    dead.wait()
    pid_names = agent_names(save_dir, 100, dead.pid)
    tmp, final, aside, trash = pid_names
    make_dir(tmp, "new")
    make_dir(final, "old")
    (save_dir / layout.TRACKER).write_text("100\n")
    out = subprocess.run([sys.executable, "-c", _CRASH, str(save_dir), "exchange" if "swapped" in point else "aside",
                          *map(str, pid_names)], env={**os.environ, faults.ENV: point, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, (out.returncode, out.stdout, out.stderr)
    if point == "layout.replace.aside":
        assert not final.exists() and (aside / "which").read_text() == "old"
    else:
        assert (final / "which").read_text() == "new" and (tmp / "which").read_text() == "old"
    clean_leftovers(save_dir, AuditLog(save_dir))
    assert (final / "which").read_text() == survivor
    assert names(save_dir) == {final.name, layout.TRACKER, layout.AUDIT_LOG}


# replicated shards written once per replica group: the records of the ranks that did not write theirs ----------
def _record(name: str, file: str, *, stored_by: int | None = None, checksum: str | None = None) -> dict:
    record = {"name": name, "index": 0, "kind": "torch", "dtype": "F32", "shape": [4], "nbytes": 16, "file": file,
              "placements": ["S(0)", "R"], "mesh_shape": [2, 2]}
    if stored_by is not None:
        record["stored_by"] = stored_by
    if checksum is not None:
        record[layout.CHECKSUM_ALGO] = checksum
    return record


def test_link_replicas_gives_the_writers_checksum() -> None:
    writer_file = layout.rank_file_name("model", 0, 2)
    ranks = {"0": {"files": [writer_file], "tensors": [_record("model/b", writer_file, checksum="ab" * 16)]},
             "1": {"files": [], "tensors": [_record("model/b", writer_file, stored_by=0)]}}
    layout.link_replicas(ranks, "here")
    assert ranks["1"]["tensors"][0][layout.CHECKSUM_ALGO] == "ab" * 16
    assert ranks["1"]["tensors"][0]["file"] == writer_file and ranks["1"]["tensors"][0]["stored_by"] == 0


@pytest.mark.parametrize("writer_tensors, problem", [
    ([], "rank 0's state lacks it"),
    ([_record("model/b", layout.rank_file_name("opt", 0, 2), checksum="ab" * 16)], "has it as F32 [4] in easyckpt-opt"),
])
def test_link_replicas_refuses_a_writer_without_the_tensor(writer_tensors: list, problem: str) -> None:
    writer_file = layout.rank_file_name("model", 0, 2)
    ranks = {"0": {"files": [writer_file], "tensors": writer_tensors},
             "1": {"files": [], "tensors": [_record("model/b", writer_file, stored_by=0)]}}
    with pytest.raises(layout.CheckpointFormatError) as caught:
        layout.link_replicas(ranks, "step 4 in /x")
    message = str(caught.value)
    assert "step 4 in /x" in message and "rank 1's tensor 'model/b'" in message and problem in message, message
    assert f"stored by rank 0 in {writer_file}" in message, message


def test_link_replicas_refuses_a_writer_that_was_not_saved() -> None:
    ranks = {"1": {"files": [], "tensors": [_record("model/b", layout.rank_file_name("model", 0, 2), stored_by=0)]}}
    with pytest.raises(layout.CheckpointFormatError, match=r"stored by rank 0, which is not among the saved ranks \['1'\]"):
        layout.link_replicas(ranks, "here")
