"""``layout.replace_dir`` in-process: a fresh name, a replaced one, and a crash between its steps; and the
persister's replicated shards, written once per replica group (``layout.link_replicas``).

The crashes are real (a SIGKILL at the fault points ``layout.replace.swapped`` and ``layout.replace.aside``)
and each one is then cleaned up the way the next agent start does it (``persister.clean_leftovers``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from easyckpt_agent import persister
from easyckpt_agent.persister import AuditLog, clean_leftovers
from easyckpt_wire import faults, layout


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
def _record(name: str, file: str, *, stored_by: int | None = None, checksum: str | None = None) -> dict[str, Any]:
    record = {"name": name, "index": 0, "kind": "torch", "dtype": "F32", "shape": [4], "nbytes": 16, "file": file,
              "placements": ["S(0)", "R"], "mesh_shape": [2, 2]}
    if stored_by is not None:
        record["stored_by"] = stored_by
    if checksum is not None:
        record[layout.CHECKSUM_ALGO] = checksum
    return record


def test_link_replicas_gives_the_writers_checksum() -> None:
    writer_file = layout.rank_file_name("model", 0, 2)
    linked = _record("model/b", writer_file, stored_by=0)
    ranks: dict[str, Any] = {"0": {"files": [writer_file], "tensors": [_record("model/b", writer_file, checksum="ab" * 16)]},
                             "1": {"files": [], "tensors": [linked]}}
    layout.link_replicas(ranks, "here")
    assert linked[layout.CHECKSUM_ALGO] == "ab" * 16
    assert linked["file"] == writer_file and linked["stored_by"] == 0


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


# the persister: a replicated shard from its writer only, single-node and multi-node ------------------------------
def _snapshot(tmp: Path, rank: int, tensors: Sequence[tuple[str, bytes, Any]]) -> persister.RankSnapshot:
    """Rank ``rank``'s committed slot (a (2, 2) mesh of 4 ranks, rank r at (r // 2, r % 2)) holding ``tensors``
    (name, bytes, ShardSpec), written as the stager lays a slot out; only what the persister reads."""
    from easyckpt_wire import shm
    from easyckpt_wire.records import SlotMeta, TensorEntry

    entries, offset, blob = [], 0, b""
    for name, data, spec in tensors:
        entries.append(TensorEntry(name, "numpy", "U8", (len(data),), offset, len(data), "model", spec))  # type: ignore[arg-type]
        blob += data
        offset += len(data)
    path = tmp / f"slot-{rank}"
    path.write_bytes(b"\0" * shm.slot_size(len(blob), 4096))
    slot = shm.SlotMap(path, writable=True)
    slot.data(0, len(blob))[:] = blob
    meta = SlotMeta(job="j", rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2, pid=None,
                    pid_start=None, skeleton_version=1, tensors=tuple(entries), step=6, skeleton=None, created=0.0)
    return persister.RankSnapshot(rank, slot, meta)


def _group_snapshots(tmp: Path, writer_has_bias: bool = True) -> list[persister.RankSnapshot]:
    from easyckpt_wire.records import ShardSpec

    snaps = []
    for rank in range(4):
        coordinate = (rank // 2, rank % 2)
        weight = ShardSpec((4, 4), (2 * coordinate[0], 2 * coordinate[1]), ("S(0)", "S(1)"), (2, 2), coordinate, rank)
        bias = ShardSpec((4,), (2 * coordinate[0],), ("S(0)", "R"), (2, 2), coordinate, 2 * coordinate[0])
        tensors = [("model/w", bytes([rank]) * 4, weight)]
        if writer_has_bias or rank % 2:
            tensors.append(("model/b", bytes([10 + coordinate[0]]) * 2, bias))   # the same bytes in a group
        snaps.append(_snapshot(tmp, rank, tensors))
    return snaps


def _held(iteration: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    held: dict[str, list[int]] = {}
    for path in sorted(iteration.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                held.setdefault(name, []).append(int(path.name.split("-")[2]))
    return held


def _check_linked(iteration: Path) -> None:
    import json

    meta = json.loads((iteration / layout.METADATA).read_text())
    assert _held(iteration) == {"model/w": [0, 1, 2, 3], "model/b": [0, 2]}
    for rank, writer in ((1, 0), (3, 2)):
        mine = {t["name"]: t for t in meta["ranks"][str(rank)]["tensors"]}
        theirs = {t["name"]: t for t in meta["ranks"][str(writer)]["tensors"]}
        assert mine["model/b"]["stored_by"] == writer and "stored_by" not in theirs["model/b"]
        assert mine["model/b"]["file"] == theirs["model/b"]["file"] == layout.rank_file_name("model", writer, 4)
        assert mine["model/b"][layout.CHECKSUM_ALGO] == theirs["model/b"][layout.CHECKSUM_ALGO]
        assert mine["model/b"]["coordinate"] == [rank // 2, 1]


def test_persist_writes_a_replicated_shard_from_its_writer_only(tmp_path: Path) -> None:
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    snaps = _group_snapshots(tmp_path)
    stats = persister.persist(save_dir, 6, snaps, AuditLog(save_dir))
    assert stats.nbytes == 4 * 4 + 2 * 2   # each bias once per replica group
    _check_linked(save_dir / layout.iteration_dirname(6))


def test_multinode_commit_waits_for_the_writers_file(tmp_path: Path) -> None:
    """Node a holds ranks 1 and 3, whose bias ranks 0 and 2 (node b) write: a's shards alone do not commit the
    step; once b's are durable the leader commits it, with a's records pointing at b's files (invariant 3)."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    audit = AuditLog(save_dir)
    snaps = _group_snapshots(tmp_path)
    persister.persist_shards(save_dir, 6, [snaps[1], snaps[3]], "a", audit)
    assert persister.commit_stage(save_dir, 6, audit) is None
    assert not (save_dir / layout.iteration_dirname(6)).exists()
    persister.persist_shards(save_dir, 6, [snaps[0], snaps[2]], "b", audit)
    assert persister.commit_stage(save_dir, 6, audit) is not None
    _check_linked(save_dir / layout.iteration_dirname(6))


def test_a_writer_without_the_replicated_tensor(tmp_path: Path) -> None:
    """Ranks 0 and 2 (the writers) lack the bias that ranks 1 and 3 hold: where the writer is persisted on the same
    node, its group's other ranks write their own copy (logged); where the writer is on another node, the leader
    refuses to commit the stage and keeps its notes (the iteration never becomes visible)."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    snaps = _group_snapshots(tmp_path, writer_has_bias=False)
    persister.persist(save_dir, 6, snaps, AuditLog(save_dir))
    assert _held(save_dir / layout.iteration_dirname(6)) == {"model/w": [0, 1, 2, 3], "model/b": [1, 3]}

    other = tmp_path / "other"
    other.mkdir()
    audit = AuditLog(other)
    persister.persist_shards(other, 6, [snaps[1], snaps[3]], "a", audit)
    persister.persist_shards(other, 6, [snaps[0], snaps[2]], "b", audit)
    with pytest.raises(layout.CheckpointFormatError, match=r"rank 1's tensor 'model/b' .* stored by rank 0 .* lacks it"):
        persister.commit_stage(other, 6, audit)
    assert not (other / layout.iteration_dirname(6)).exists()
    assert len(list((other / layout.stage_dirname(6)).glob("node-*.json"))) == 2, "the stage's notes must stay"


def test_stored_by_rule() -> None:
    from easyckpt_wire.records import ShardSpec, TensorEntry

    def entry(writer: int | None, placements: tuple[str, ...] = ("S(0)", "R")) -> TensorEntry:
        return TensorEntry("b", "torch", "F32", (2,), 0, 8, "model", ShardSpec((4,), (0,), placements, (2, 2), (0, 1),
                                                                                writer))

    own: persister.Own = {0: {"b": ((2,), "F32", "model")}, 2: {}}
    assert persister.stored_by(1, entry(0), own) == 0            # the writer is here and holds it
    assert persister.stored_by(1, entry(5), own) == 5            # the writer is on another node: trusted
    assert persister.stored_by(3, entry(2), own) is None         # the writer here lacks it: its own copy
    assert persister.stored_by(0, entry(0), own) is None         # the writer itself
    assert persister.stored_by(1, entry(None), own) is None      # an older rank: every rank writes its own
    assert persister.stored_by(1, entry(0)._replace(shard=None), own) is None
