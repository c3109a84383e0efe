"""Timelines (invariant 10) in one process: the rules as pure functions (which iterations a resume abandons,
what rotation removes, what a load follows), and the agent's disk side on real directories: moves aside
with a rename and an audit line, idempotent, rotation of abandoned iterations first, and a persist that
finishes after a resume abandoned its step publishes nothing.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

from conftest import marker_iteration
from hypothesis import given, settings
from hypothesis import strategies as st

from easyckpt import storage
from easyckpt_agent import policy
from easyckpt_agent.persister import AuditLog, write_tracker
from easyckpt_agent.timeline import DiskTimeline
from easyckpt_wire import layout, timeline

steps_st = st.sets(st.integers(0, 200), max_size=12)


# what a load follows ------------------------------------------------------------------------------------
def test_load_follows_the_tracker_and_falls_back_only_when_it_names_no_complete_iteration() -> None:
    assert timeline.load_order([10, 20, 30, 40], 30) == [30, 20, 10]    # 40: abandoned, or the tracker lagged
    assert timeline.load_order([10, 20, 30, 40], 35) == [40, 30, 20, 10]  # names nothing complete
    assert timeline.load_order([10, 20], None) == [20, 10]
    assert timeline.load_order([], 30) == []
    assert timeline.head([10, 20, 30, 40], 30) == 30 and timeline.head([], None) is None


@given(complete=steps_st, tracker=st.one_of(st.none(), st.integers(0, 200)))
def test_load_order_properties(complete: set[int], tracker: int | None) -> None:
    order = timeline.load_order(sorted(complete), tracker)
    assert order == sorted(order, reverse=True) and set(order) <= complete
    if tracker in complete:
        assert order[0] == tracker and set(order) == {s for s in complete if s <= tracker}
    else:
        assert set(order) == complete


# which iterations a resume abandons -----------------------------------------------------------------------
@given(on_disk=steps_st, resumed=st.integers(0, 200))
def test_a_resume_abandons_exactly_the_newer_iterations_and_is_idempotent(on_disk: set[int], resumed: int) -> None:
    gone = policy.abandoned_by_resume(on_disk, resumed)
    assert set(gone) == {s for s in on_disk if s > resumed} and gone == sorted(gone)
    left = on_disk - set(gone)
    assert policy.abandoned_by_resume(left, resumed) == []          # the second rank's RESUME moves nothing
    head = policy.tracker_after_resume(left, resumed)
    assert head == max(left, default=None)
    # A load after the move follows the new timeline, whatever the tracker said before.
    assert timeline.load_order(sorted(left), head) == sorted(left, reverse=True)


@given(complete=steps_st, resumed=st.integers(0, 200), before=st.one_of(st.none(), st.integers(0, 200)),
       given_up=st.integers(-1, 200))
def test_after_a_resume_the_new_timeline_s_steps_are_persisted_again(complete: set[int], resumed: int,
                                                                     before: int | None, given_up: int) -> None:
    persisted, failed = policy.floor_after_resume(complete, resumed, before, given_up)
    floor = max(-1 if persisted is None else persisted, failed)
    assert floor <= resumed   # every step after the resume is above the floor: due steps are claimed again
    if before is not None and before <= resumed:
        assert persisted == before      # still this timeline's: not persisted twice
    else:
        assert persisted == max((s for s in complete if s <= resumed), default=None)
    assert failed in (given_up, -1) and (failed == given_up) == (given_up <= resumed)


def test_resume_messages_are_validated() -> None:
    import pytest

    from easyckpt_wire import protocol

    blob = protocol.encode(protocol.Kind.RESUME, rank=0, step=20, stale=[[1, 84]])
    assert protocol.decode(blob)[1]["stale"] == [[1, 84]]
    for stale in ([[1]], [["a", 2]], [[-1, 2]], [[0, 0]] * 65, "x"):
        with pytest.raises(protocol.ProtocolError):
            protocol.encode(protocol.Kind.RESUME, rank=0, step=20, stale=stale)


# what rotation removes ------------------------------------------------------------------------------------
def test_rotation_removes_abandoned_iterations_first_oldest_abandonment_first() -> None:
    abandoned = [(".abandoned-20261122T100000.000000Z", 40), (".abandoned-20261122T090000.000000Z", 50),
                 (".abandoned-20261122T100000.000000Z", 30)]
    gone_abandoned, gone_current = policy.rotation_victims([10, 20, 30], abandoned, max_ckpt_num=3, keep={30})
    assert gone_abandoned == [(".abandoned-20261122T090000.000000Z", 50), (".abandoned-20261122T100000.000000Z", 30),
                              (".abandoned-20261122T100000.000000Z", 40)]
    assert gone_current == []
    assert policy.rotation_victims([10, 20, 30, 40], [], max_ckpt_num=3, keep={40}) == ([], [10])
    assert policy.rotation_victims([10, 20], abandoned, max_ckpt_num=5, keep={20}) == ([], [])


@given(current=steps_st, abandoned=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 200)),
                                            unique=True, max_size=8),
       max_ckpt_num=st.integers(1, 6), keep=st.sets(st.integers(0, 200), max_size=2))
def test_rotation_properties(current: set[int], abandoned: list[tuple[str, int]], max_ckpt_num: int,
                             keep: set[int]) -> None:
    gone_abandoned, gone_current = policy.rotation_victims(sorted(current), abandoned, max_ckpt_num=max_ckpt_num,
                                                          keep=keep)
    assert set(gone_abandoned) <= set(abandoned) and set(gone_current) <= current
    assert not set(gone_current) & keep and (not current or max(current) not in gone_current)
    if gone_current:   # current iterations go only once no abandoned one is left
        assert len(gone_abandoned) == len(abandoned)
    assert gone_abandoned == sorted(abandoned)[:len(gone_abandoned)]     # oldest abandonment first
    remaining = len(current) + len(abandoned) - len(gone_abandoned) - len(gone_current)
    if remaining > max_ckpt_num:   # only protected current iterations are left above the limit
        assert len(gone_abandoned) == len(abandoned)
        assert all(s in keep or s == max(current) for s in current - set(gone_current))
    assert remaining >= min(max_ckpt_num, len(current) + len(abandoned))  # never more than needed


# the agent's disk side -----------------------------------------------------------------------------------
def make_iteration(save_dir: Path, step: int) -> Path:
    return marker_iteration(save_dir, step)


def audit_lines(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / layout.AUDIT_LOG).read_text().splitlines()]


def test_abandon_moves_newer_iterations_aside_atomically_audited_and_idempotent(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    for step in (10, 20, 30, 40):
        make_iteration(save_dir, step)
    write_tracker(save_dir, 40, audit)
    disk = DiskTimeline(save_dir, audit)
    first = disk.abandon_after(20, commits=True)
    assert first.moved == [30, 40] and first.tracker == 20 and first.directory is not None
    assert [s for s, _ in layout.complete_iterations(save_dir)] == [10, 20]
    assert layout.read_tracker(save_dir) == 20
    assert sorted((s, p.parent) for _, s, p in timeline.abandoned_iterations(save_dir)) == [
        (30, first.directory), (40, first.directory)]
    moves = [line for line in audit_lines(save_dir) if line["op"] == "abandon"]
    assert [(m["step"], m["resumed"]) for m in moves] == [(30, 20), (40, 20)]
    assert all(Path(m["to"]).parent == first.directory for m in moves)
    # Every other rank of the job sends the same resume: nothing more moves, nothing is deleted.
    second = disk.abandon_after(20, commits=True)
    assert second.moved == [] and second.tracker == 20
    assert len(timeline.abandoned_iterations(save_dir)) == 2
    assert not any(line["op"] == "delete" for line in audit_lines(save_dir))
    # A load now follows the new timeline.
    assert storage.newest_first(save_dir) == [20, 10]


def test_a_resume_below_every_iteration_removes_the_tracker(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    make_iteration(save_dir, 40)
    write_tracker(save_dir, 40, audit)
    result = DiskTimeline(save_dir, audit).abandon_after(5, commits=True)
    assert result.moved == [40] and result.tracker is None
    assert layout.read_tracker(save_dir) is None and storage.newest_first(save_dir) == []
    assert any(line["op"] == "tracker-remove" for line in audit_lines(save_dir))


def test_an_agent_that_does_not_commit_moves_nothing(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    make_iteration(save_dir, 40)
    result = DiskTimeline(save_dir, audit).abandon_after(20, commits=False)
    assert result.moved == [] and (save_dir / layout.iteration_dirname(40)).is_dir()


def test_rotation_on_disk_removes_abandoned_first_and_never_the_tracked_one(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    for step in (10, 20, 30, 40):
        make_iteration(save_dir, step)
    disk = DiskTimeline(save_dir, audit)
    moved = disk.abandon_after(20, commits=True)
    assert moved.directory is not None
    make_iteration(save_dir, 30)             # the new timeline's step 30
    write_tracker(save_dir, 30, audit)
    gone = disk.rotate(3, 30)
    assert sorted(step for _, step in gone) == [30, 40]     # both abandoned ones (5 > 3), none of ours
    assert not moved.directory.exists()                      # emptied abandonment directory removed, audited
    assert [s for s, _ in layout.complete_iterations(save_dir)] == [10, 20, 30]
    deletes = [line for line in audit_lines(save_dir) if line["op"] == "delete"]
    assert any("abandoned timeline first" in line["reason"] for line in deletes)
    assert any(line["path"] == str(moved.directory) for line in deletes)
    make_iteration(save_dir, 40)
    write_tracker(save_dir, 40, audit)
    assert disk.rotate(3, 40) == [("", 10)]
    assert not list(save_dir.glob(".trash-*"))


def test_rotation_spares_an_iteration_whose_export_is_owed(tmp_path: Path) -> None:
    """TrainerWrapper holds iteration 5 until checkpoint-5 is exported: a crash in between (a flush then
    persists 11) must not let rotation delete it; once the hold goes, rotation catches up."""
    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    for step in (5, 10, 11):
        make_iteration(save_dir, step)
    layout.export_hold(save_dir, 5).touch()
    assert layout.export_holds(save_dir) == {5}
    disk = DiskTimeline(save_dir, audit)
    assert disk.rotate(2, 11) == [("", 10)]
    assert [s for s, _ in layout.complete_iterations(save_dir)] == [5, 11]
    layout.export_hold(save_dir, 5).unlink()
    make_iteration(save_dir, 15)
    assert disk.rotate(2, 15) == [("", 5)]


def test_a_persist_that_finishes_after_the_resume_publishes_nothing(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    disk = DiskTimeline(save_dir, audit)
    started = disk.epoch                   # a persist of step 40 starts...
    with disk.publishing(30, started) as ok:
        assert ok                           # nothing happened meanwhile
    disk.abandon_after(20, commits=True)    # ... the job resumes at 20 while it runs
    with disk.publishing(40, started) as ok:
        assert not ok
    with disk.publishing(20, started) as ok:
        assert ok                           # at or below the resumed step: still the current timeline
    with disk.publishing(40, disk.epoch) as ok:
        assert ok                           # the new timeline's own step 40


@settings(deadline=None, max_examples=25)
@given(order=st.permutations(["resume", "publish"]))
def test_publishing_and_abandonment_exclude_each_other(tmp_path_factory, order: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Whatever the order, the abandoned step is never left published."""
    save_dir = tmp_path_factory.mktemp("race") / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    disk = DiskTimeline(save_dir, audit)
    epoch = disk.epoch

    def publish() -> None:
        with disk.publishing(40, epoch) as ok:
            if ok:
                make_iteration(save_dir, 40)
                write_tracker(save_dir, 40, audit)

    def resume() -> None:
        disk.abandon_after(20, commits=True)

    threads = [threading.Thread(target={"resume": resume, "publish": publish}[name]) for name in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [s for s, _ in layout.complete_iterations(save_dir)] == []
    assert layout.read_tracker(save_dir) is None


def test_ls_lists_abandoned_iterations_apart(tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import ROOT

    save_dir = tmp_path / "ckpt"
    audit = AuditLog((save_dir.mkdir(), save_dir)[1])
    for step in (10, 20):
        make_iteration(save_dir, step)
    write_tracker(save_dir, 20, audit)
    moved = DiskTimeline(save_dir, audit).abandon_after(10, commits=True)
    assert moved.directory is not None
    out = subprocess.run([sys.executable, "-m", "easyckpt.cli", "ls", str(save_dir)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=True).stdout
    lines = out.splitlines()
    assert any(line.startswith("iteration_0000010") and "<- tracker" in line for line in lines), out
    assert any(line.startswith(f"{moved.directory.name}/iteration_0000020") and "abandoned" in line
               for line in lines), out
