"""The persister's pieces in one process, over a real ``PosixStorage`` and real slot files: the byte path
(``easyckpt_agent.rankfiles``), the single-node commit (``easyckpt_agent.persister``), the multi-node stage
(``easyckpt_agent.stages``), and a persist killed (SIGKILL) at each of its named points in a child process."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest
import xxhash
from conftest import ROOT
from safetensors import safe_open
from storage_slots import WORLD, close, snapshots, tensors

from easyckpt import storage
from easyckpt_agent import commit, persister, rankfiles, stages
from easyckpt_wire import faults, layout, shm
from easyckpt_wire.savedir import AuditLog
from easyckpt_wire.storage import PosixStorage, posix

HERE = Path(__file__).resolve().parent


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    path = tmp_path / "save"
    path.mkdir()
    return path


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "slots"
    path.mkdir()
    yield path


def audit_ops(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / layout.AUDIT_LOG).read_text().splitlines()]


def assert_holds(iteration: Path, step: int) -> None:
    """Every rank's tensors of ``step`` are in ``iteration``, readable by safetensors itself and by the
    library's reader (checksums verified)."""
    for rank in range(WORLD):
        want = tensors(rank, step)
        for group in ("model", "opt"):
            path = iteration / layout.rank_file_name(group, rank, WORLD)
            with open(path, "rb") as handle:
                assert (8 + int.from_bytes(handle.read(8), "little")) % shm.PAGE == 0, "data must start on a page"
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():
                    numpy.testing.assert_array_equal(handle.get_tensor(name), want[name])
        entry = storage.rank_entry(iteration, rank, WORLD)
        got = {record.name: tensor.numpy() for record, tensor in storage.read_tensors(entry)}
        assert sorted(got) == sorted(want)
        for name, array in want.items():
            numpy.testing.assert_array_equal(got[name], array)


# the byte path -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [rankfiles._CHUNK, 4096], ids=["one-part", "page-parts"])
def test_rank_files_hold_the_slot_bytes(save_dir: Path, slots: Path, monkeypatch: pytest.MonkeyPatch,
                                        chunk: int) -> None:
    """Whole ranges or many parts (each written with O_DIRECT where the file system allows it, the odd tail
    through the page cache): the same bytes, every record's checksum that of the slot's bytes."""
    monkeypatch.setattr(rankfiles, "_CHUNK", chunk)
    snaps = snapshots(slots, 5)
    store = PosixStorage(save_dir)
    pending = store.begin(layout.iteration_dirname(5))
    ranks_meta, common, nbytes = rankfiles.write_rank_files(pending, 5, snaps, threads=2)
    assert nbytes == sum(a.nbytes for rank in range(WORLD) for a in tensors(rank, 5).values())
    assert common == {str(r): {"skeleton": {"step": 5}, "skeleton_version": 1} for r in range(WORLD)}
    for rank in range(WORLD):
        info = ranks_meta[str(rank)]
        assert info["files"] == [layout.rank_file_name(g, rank, WORLD) for g in ("model", "opt")]
        for record in info["tensors"]:
            assert record[layout.CHECKSUM_ALGO] == xxhash.xxh3_128_hexdigest(tensors(rank, 5)[record["name"]].tobytes())
    commit.seal(pending, 5, WORLD, ranks_meta, common, nbytes)
    assert layout.complete(store) == [], "sealed, not yet published"
    pending.publish()
    assert_holds(save_dir / layout.iteration_dirname(5), 5)
    close(snaps)


def test_abort_stops_a_persist_between_two_parts_and_keeps_no_view_of_a_slot(save_dir: Path, slots: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rankfiles, "_CHUNK", 4096)
    snaps = snapshots(slots, 5)
    pending = PosixStorage(save_dir).begin(layout.iteration_dirname(5))
    rankfiles.ABORT.set()
    try:
        with pytest.raises(rankfiles.PersistAborted):
            rankfiles.write_rank_files(pending, 5, snaps, threads=2)
    finally:
        rankfiles.ABORT.clear()
    assert not [n for n in pending.names() if layout.RANK_FILE_RE.match(n)], "an aborted file is dropped"
    close(snaps)   # BufferError if a view of a slot outlived the abort


# single node -------------------------------------------------------------------------------------------
def test_persist_publishes_then_names_the_tracker_audited_in_order(save_dir: Path, slots: Path) -> None:
    audit = AuditLog(save_dir)
    snaps = snapshots(slots, 5)
    stats = persister.persist(save_dir, 5, snaps, audit)
    final = save_dir / layout.iteration_dirname(5)
    assert stats.path == str(final) and layout.read_tracker(save_dir) == 5
    assert_holds(final, 5)
    ops = [(line["op"], Path(line["path"]).name) for line in audit_ops(save_dir)]
    assert ops == [("write-begin", f".tmp-{final.name}-{os.getpid()}"), ("write", final.name),
                   ("tracker", layout.TRACKER)]
    # the same step again (a tracker that lagged a crash): replaced whole, audited, nothing left aside
    again = [dataclasses.replace(snap, meta=dataclasses.replace(snap.meta, step=5)) for snap in snapshots(slots, 6)]
    persister.persist(save_dir, 5, again, audit)
    assert_holds(final, 6)   # step 6's bytes, persisted as step 5
    assert [line["reason"] for line in audit_ops(save_dir) if line["op"] == "delete"] == [
        "replaced by a new persist of the same step"]
    assert sorted(p.name for p in save_dir.iterdir()) == [layout.AUDIT_LOG, final.name, layout.TRACKER]
    close(snaps + again)


def test_a_failed_persist_is_one_line_naming_the_path_and_publishes_nothing(save_dir: Path, slots: Path) -> None:
    """A real OSError (the temporary directory's name is taken by a file): PersistFailed with the path and
    the errno, no iteration, no tracker."""
    in_the_way = save_dir / f".tmp-{layout.iteration_dirname(5)}-{os.getpid()}"
    in_the_way.write_text("not a directory")
    snaps = snapshots(slots, 5)
    with pytest.raises(persister.PersistFailed) as caught:
        persister.persist(save_dir, 5, snaps, AuditLog(save_dir))
    assert caught.value.path == str(in_the_way) and caught.value.errno == 20, caught.value.describe()
    assert layout.complete_iterations(save_dir) == [] and layout.read_tracker(save_dir) is None
    close(snaps)


def test_a_persist_checks_the_agents_checksums_and_refuses_bytes_changed_since_the_commit(save_dir: Path,
                                                                                         slots: Path) -> None:
    """With the checksums the agent took after the commit, an unchanged slot persists as before; one changed
    byte in a rank's tensor fails the persist in one line naming the slot, tensor, rank and step, and publishes
    nothing (never a file whose checksum vouches for the changed bytes)."""
    snaps = snapshots(slots, 5)
    taken = [tuple(xxhash.xxh3_128_digest(tensors(s.rank, 5)[e.name].tobytes()) for e in s.meta.tensors)
             for s in snaps]
    checked = [dataclasses.replace(s, checksums=c) for s, c in zip(snaps, taken)]
    persister.persist(save_dir, 5, checked, AuditLog(save_dir))
    assert_holds(save_dir / layout.iteration_dirname(5), 5)
    victim = checked[1].meta.tensors[-1]
    with checked[1].slot.data(victim.offset, victim.nbytes) as view:
        view[victim.nbytes // 2] ^= 0x10
    with pytest.raises(persister.PersistFailed) as caught:
        persister.persist(save_dir, 6, [dataclasses.replace(s, meta=dataclasses.replace(s.meta, step=6))
                                        for s in checked], AuditLog(save_dir))
    text = caught.value.describe()
    assert caught.value.path == str(checked[1].slot.path) and caught.value.errno == 0, text
    assert f"tensor {victim.name!r} of rank 1's step 6 no longer matches the checksum" in text, text
    assert [step for step, _ in layout.complete_iterations(save_dir)] == [5] and layout.read_tracker(save_dir) == 5
    close(snaps)


def test_a_persist_that_cannot_fit_is_refused_before_a_byte_is_written(tmpfs, slots: Path) -> None:  # type: ignore[no-untyped-def]
    save_dir = tmpfs("size=64k")
    snaps = snapshots(slots, 5)
    with pytest.raises(persister.PersistFailed) as caught:
        persister.persist(save_dir, 5, snaps, AuditLog(save_dir))
    assert caught.value.errno == 28 and caught.value.needed and caught.value.free is not None
    assert [p.name for p in save_dir.iterdir()] == []
    close(snaps)


def test_a_step_abandoned_while_persisted_is_not_published(save_dir: Path, slots: Path) -> None:
    import contextlib

    @contextlib.contextmanager
    def abandoned(step: int) -> Iterator[bool]:
        yield False

    snaps = snapshots(slots, 5)
    with pytest.raises(persister.StepAbandoned):
        persister.persist(save_dir, 5, snaps, AuditLog(save_dir), publishing=abandoned)
    assert [p.name for p in save_dir.iterdir()] == [layout.AUDIT_LOG]
    assert "abandoned this step" in audit_ops(save_dir)[-1]["reason"]
    close(snaps)


# several nodes -------------------------------------------------------------------------------------------
def test_a_stage_commits_once_every_rank_is_durable(save_dir: Path, slots: Path, caplog: pytest.LogCaptureFixture) -> None:
    audit = AuditLog(save_dir)
    snaps = snapshots(slots, 8)
    caplog.set_level("INFO", logger="easyckpt_agent")
    stages.persist_shards(save_dir, 8, [snaps[1]], "b", audit)
    persister.persist(save_dir, 7, snapshots(slots, 7), audit)
    # every persist, a node's stage or a whole iteration, announces itself as the persister (the agent log is grepped)
    persisting = [r.name for r in caplog.records if r.getMessage().startswith("persisting step")]
    assert persisting == ["easyckpt_agent.persister"] * 2
    assert stages.stage_steps(save_dir) == [8] and stages.commit_stage(save_dir, 8, audit) is None
    world, ranks = stages.stage_progress(save_dir, 8)
    assert world == WORLD and sorted(ranks) == ["1"]
    # node a wrote for a step a resume abandoned: only its own files go, b's stay
    stages.persist_shards(save_dir, 8, [snaps[0]], "a", audit)
    stages.drop_own_shards(save_dir, 8, "a", [0], audit)
    assert sorted(stages.stage_progress(save_dir, 8)[1]) == ["1"]
    stages.persist_shards(save_dir, 8, [snaps[0]], "a", audit)
    stats = stages.commit_stage(save_dir, 8, audit)
    assert stats is not None and stats.nbytes == sum(a.nbytes for r in range(WORLD) for a in tensors(r, 8).values())
    final = save_dir / layout.iteration_dirname(8)
    assert_holds(final, 8)
    assert sorted(p.name for p in final.iterdir() if not p.name.endswith(".safetensors")) == [
        layout.COMMON, layout.METADATA], "the nodes' notes are gone before the marker"
    assert stages.stage_steps(save_dir) == [] and layout.read_tracker(save_dir) == 8
    stages.persist_shards(save_dir, 9, [snaps[0]], "a", audit)
    stages.drop_stage(save_dir, 9, audit, "superseded")
    assert stages.stage_steps(save_dir) == []
    close(snaps)


def test_a_nodes_write_is_audited_before_its_note_lets_the_leader_commit(save_dir: Path, slots: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On the leader the commit runs on another thread than its own persist: the moment a note is in the stage,
    the audit log must already say that node's shards are written (CI 2026-11-30 saw a commit recorded first)."""
    audit = AuditLog(save_dir)
    snaps = snapshots(slots, 8)
    seen: list[tuple[str, list[str]]] = []
    put = posix._Pending.put

    def watched(pending: posix._Pending, name: str, data: bytes, *, atomic: bool = False) -> None:
        put(pending, name, data, atomic=atomic)
        if layout.NODE_FILE_RE.match(name):
            seen.append((name, [r["node"] for r in audit_ops(save_dir) if r["op"] == "write"]))

    monkeypatch.setattr(posix._Pending, "put", watched)
    stages.persist_shards(save_dir, 8, [snaps[1]], "b", audit)
    stages.persist_shards(save_dir, 8, [snaps[0]], "a", audit)
    assert seen == [(layout.node_file_name("b"), ["b"]), (layout.node_file_name("a"), ["b", "a"])]
    assert stages.commit_stage(save_dir, 8, audit) is not None
    close(snaps)


# killed at each named point ------------------------------------------------------------------------------
_PERSIST = """
import sys
from pathlib import Path
from easyckpt_agent import persister
from easyckpt_wire.savedir import AuditLog
from storage_slots import snapshots
save_dir, slots, step = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
persister.persist(save_dir, step, snapshots(slots, step), AuditLog(save_dir))
print("persisted", flush=True)
"""


@pytest.mark.parametrize("point", ["agent.persist.after_file", "agent.persist.before_marker",
                                   "agent.persist.before_tracker"])
def test_a_persist_killed_at_a_named_point(save_dir: Path, slots: Path, point: str) -> None:
    """kill -9 of the persisting process: before the marker nothing new is visible and the next start cleans
    the temporary directory; after the publish the iteration is whole and the tracker still names the older one:
    a load takes the published one (the audit log shows that its persist died before the tracker), unless the
    tracker was set back by hand since (a rollback: the tracker wins)."""
    persister.persist(save_dir, 3, snapshots(slots, 3), AuditLog(save_dir))
    persister.persist(save_dir, 4, snapshots(slots, 4), AuditLog(save_dir))
    proc = subprocess.run([sys.executable, "-c", _PERSIST, str(save_dir), str(slots), "5"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, faults.ENV: f"{point}@5",
                                                       "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"})
    assert proc.returncode == -signal.SIGKILL, (proc.stdout, proc.stderr)
    published = point == "agent.persist.before_tracker"
    assert [s for s, _ in layout.complete_iterations(save_dir)] == ([3, 4, 5] if published else [3, 4])
    assert layout.read_tracker(save_dir) == 4 and storage.newest_first(save_dir) == ([5, 4, 3] if published else [4, 3])
    if published:   # a tracker set back by hand after the crash is a rollback: followed, the newer ones left alone
        (save_dir / layout.TRACKER).write_text("3\n")
        assert storage.newest_first(save_dir) == [3], "a tracker changed by hand since its last record wins"
    removed = persister.clean_leftovers(save_dir, AuditLog(save_dir))
    assert [Path(p).name.startswith(".tmp-iteration_0000005-") for p in removed] == ([] if published else [True])
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".")) == []
