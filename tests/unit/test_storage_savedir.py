"""The save_dir's own files written over a ``Storage`` (``easyckpt_wire.savedir``), the readers of the layout over
one (``layout``, ``timeline``, ``health``, ``easyckpt.storage``, ``easyckpt.tools.checks``), and what only the POSIX
implementation does (O_DIRECT, its scratch names)."""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from conftest import marker_iteration
from storage_slots import WORLD, close, snapshots, tensors

from easyckpt import storage
from easyckpt.tools import checks
from easyckpt_agent import persister
from easyckpt_wire import health, layout, savedir, timeline
from easyckpt_wire.health import RankHealth
from easyckpt_wire.savedir import AuditLog
from easyckpt_wire.storage import PosixStorage


def make_iteration(save_dir: Path, step: int, under: str = "") -> Path:
    return marker_iteration(save_dir, step, under=under)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_clean_leftovers_removes_only_what_dead_writers_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    dead = dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        gone = [save_dir / f".tmp-iteration_0000005-{dead}", save_dir / f".trash-iteration_0000003-{dead}"]
        kept = [save_dir / f".tmp-iteration_0000006-{live.pid}", save_dir / f".tmp-notes-{dead}"]
        for path in gone + kept:
            path.mkdir()
            (path / "x").write_text("x")
        restored = make_iteration(save_dir, 7)
        restored.rename(save_dir / f".aside-iteration_0000007-{dead}")   # a replace that died half way
        make_iteration(save_dir, 8)
        make_iteration(tmp_path, 8).rename(save_dir / f".aside-iteration_0000008-{dead}")   # the new one is in
        ours = save_dir / layout.iteration_dirname(9)
        ours.mkdir()
        (ours / layout.rank_file_name("model", 0, 1)).write_bytes(b"torn")
        theirs = save_dir / layout.iteration_dirname(10)
        theirs.mkdir()
        (theirs / "notes.txt").write_text("a user's file")
        removed = savedir.clean_leftovers(save_dir, AuditLog(save_dir))
        assert sorted(Path(p).name for p in removed) == sorted(
            [p.name for p in gone] + [f".aside-iteration_0000007-{dead}", f".aside-iteration_0000008-{dead}", ours.name])
        assert all(not p.exists() for p in gone) and all(p.exists() for p in kept) and theirs.exists()
        assert [s for s, _ in layout.complete_iterations(save_dir)] == [7, 8], "the aside copy is put back"
        assert "holds files that are not ours: left alone" in caplog.text
        ops = [(line["op"], Path(line["path"]).name) for line in
               map(json.loads, (save_dir / layout.AUDIT_LOG).read_text().splitlines())]
        assert ("rename", f".aside-iteration_0000007-{dead}") in ops and ("delete", ours.name) in ops
    finally:
        live.communicate(timeout=30)


def test_tracker_written_after_and_removed_audited(tmp_path: Path) -> None:
    store = PosixStorage(tmp_path)
    audit = AuditLog(store)
    assert not savedir.remove_tracker(store, audit)
    savedir.write_tracker(store, 40, audit)
    assert layout.tracker(store) == 40 and (tmp_path / layout.TRACKER).read_text() == "40\n"
    assert savedir.remove_tracker(store, audit, resumed=5)
    assert layout.tracker(store) is None
    assert [json.loads(line)["op"] for line in (tmp_path / layout.AUDIT_LOG).read_text().splitlines()] == [
        "tracker", "tracker-remove"]


def test_health_index_over_a_storage(tmp_path: Path) -> None:
    store = PosixStorage(tmp_path)
    audit = AuditLog(store)
    for step in (10, 20):
        make_iteration(tmp_path, step)
    savedir.record_health(store, 10, RankHealth(), audit)
    assert health.read_health(store) is None, "nobody reported: no file"
    savedir.record_health(store, 20, RankHealth(True, False, ("loss is nan",)), audit)
    savedir.record_health(store, 10, RankHealth(True), audit)
    assert [(e.step, e.healthy) for e in health.read_health(store) or []] == [(10, True), (20, False)]
    (tmp_path / layout.iteration_dirname(20) / layout.METADATA).unlink()
    savedir.forget_health(store, audit)
    assert [e.step for e in health.read_health_file(tmp_path) or []] == [10]


def test_abandoned_iterations_over_a_storage(tmp_path: Path) -> None:
    make_iteration(tmp_path, 30, ".abandoned-20250101T000000.000000Z")
    make_iteration(tmp_path, 40, ".abandoned-20250101T000000.000000Z")
    make_iteration(tmp_path, 50, ".not-abandoned")
    found = timeline.abandoned(PosixStorage(tmp_path))
    assert [(step, key) for _, step, key in found] == [
        (30, ".abandoned-20250101T000000.000000Z/iteration_0000030"),
        (40, ".abandoned-20250101T000000.000000Z/iteration_0000040")]
    assert [p for _, _, p in timeline.abandoned_iterations(tmp_path)] == [tmp_path / k for _, _, k in found]


def test_an_export_hold_spares_its_iteration_from_rotation_until_released(tmp_path: Path) -> None:
    """The HF and Lightning exporters hold the iteration they export through the save_dir's Storage."""
    from easyckpt_agent.timeline import DiskTimeline

    store = PosixStorage(tmp_path)
    iterations = {step: make_iteration(tmp_path, step) for step in (1, 2, 3)}
    layout.hold_export(tmp_path, 1)
    layout.hold_export(store, 1)   # held twice: still one hold
    assert layout.holds(store) == layout.export_holds(tmp_path) == {1}
    rotation = DiskTimeline(tmp_path, AuditLog(store))
    assert rotation.rotate(max_ckpt_num=1, keep=3) == [("", 2)]
    assert [layout.present(iterations[s]) for s in (1, 2, 3)] == [True, False, True]
    layout.release_export(tmp_path, 1)
    layout.release_export(tmp_path, 1)   # released twice: no error
    assert layout.holds(store) == set()
    assert rotation.rotate(max_ckpt_num=1, keep=3) == [("", 1)]
    assert not layout.present(iterations[1]) and [s for s, _ in layout.complete(store)] == [3]


# the library's readers through the storage ---------------------------------------------------------------
@pytest.fixture
def persisted(tmp_path: Path) -> Path:
    save_dir, slots = tmp_path / "save", tmp_path / "slots"
    save_dir.mkdir()
    slots.mkdir()
    snaps = snapshots(slots, 3)
    persister.persist(save_dir, 3, snaps, AuditLog(save_dir))
    close(snaps)
    return save_dir / layout.iteration_dirname(3)


def test_a_truncated_or_flipped_file_is_named_by_every_reader(persisted: Path) -> None:
    assert checks.damage(persisted) is None and checks.verify_iteration(persisted) is None
    assert checks.dir_bytes(persisted) == sum(p.stat().st_size for p in persisted.iterdir())
    victim = persisted / layout.rank_file_name("model", 1, WORLD)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(data)
    assert "fails its xxh3_128 checksum" in (checks.verify_iteration(persisted) or "")
    with pytest.raises(storage.CheckpointCorruptError, match="fails its xxh3_128 checksum"):
        list(storage.read_tensors(storage.rank_entry(persisted, 1, WORLD)))
    os.truncate(victim, len(data) - 100)
    assert "is truncated" in (checks.damage(persisted) or "")
    with pytest.raises(storage.CheckpointCorruptError) as caught:
        list(storage.read_tensors(storage.rank_entry(persisted, 1, WORLD)))
    assert str(victim) in str(caught.value) and "(step 3)" in str(caught.value) and "truncated" in str(caught.value)
    victim.unlink()
    with pytest.raises(storage.CheckpointCorruptError, match="is missing"):
        list(storage.read_tensors(storage.rank_entry(persisted, 1, WORLD)))
    # rank 0 is untouched: its tensors still load, bit-exact
    got = {r.name: t.numpy() for r, t in storage.read_tensors(storage.rank_entry(persisted, 0, WORLD))}
    for name, array in tensors(0, 3).items():
        numpy.testing.assert_array_equal(got[name], array)


@pytest.mark.parametrize("name,before", [(layout.COMMON, b'"skeleton":{"'), (layout.METADATA, b'"name":"')])
def test_a_flipped_name_in_a_json_document_is_named_by_every_reader(persisted: Path, name: str, before: bytes) -> None:
    """A byte flipped inside a name leaves valid JSON (soak 798013051, fault 14: "block" became "bloc9" in
    common.json and a rank was handed its state under that name): the documents' checksums refuse it."""
    path = persisted / name
    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[raw.index(before) + len(before)] ^= 0x01   # rank 0's first skeleton key, or its first tensor's name
    json.loads(bytes(flipped))   # still valid JSON: only a checksum can tell
    path.write_bytes(bytes(flipped))
    assert "fails its xxh3_128 checksum" in (checks.verify_iteration(persisted) or "")
    with pytest.raises(layout.CheckpointFormatError, match=f"{name}.* fails its xxh3_128 checksum"):
        storage.rank_entry(persisted, 0, WORLD)
    path.write_bytes(raw)
    assert checks.verify_iteration(persisted) is None
    assert storage.rank_entry(persisted, 0, WORLD).step == 3


def test_documents_of_an_easyckpt_before_their_checksums_are_read_unchecked(persisted: Path) -> None:
    marker = persisted / layout.METADATA
    meta = json.loads(marker.read_bytes())
    del meta[layout.MARKER_CHECKSUM], meta[layout.COMMON_CHECKSUM]
    marker.write_text(json.dumps(meta, indent=1))   # not even the layout's own spacing
    assert checks.verify_iteration(persisted) is None
    assert storage.rank_entry(persisted, 1, WORLD).step == 3


# what only POSIX does --------------------------------------------------------------------------------------
def test_posix_writer_goes_around_the_page_cache_for_aligned_parts(tmp_path: Path) -> None:
    """A page-aligned part at a page-aligned offset goes through an O_DIRECT descriptor (where the file system
    takes one: tmp_path's here), an odd tail through the page cache; the bytes are the same."""
    pending = PosixStorage(tmp_path).begin("iteration_0000001")
    aligned = mmap.mmap(-1, 3 * 4096)          # page-aligned memory, as a slot is
    aligned[:] = os.urandom(3 * 4096)
    writer = pending.create("f")
    with memoryview(aligned) as view:
        writer.write(view)
        direct = writer._direct >= 0
        writer.write(b"tail")
        writer.write(view)                     # an unaligned offset now: through the page cache
    writer.close()
    assert (tmp_path / pending.key / "f").read_bytes() == bytes(aligned) + b"tail" + bytes(aligned)
    probe = tmp_path / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT")
    assert direct
