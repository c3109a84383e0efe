"""Fast in-process tests of the policy modules that tests/unit/test_policy.py and tests/agent/test_timeline.py leave out:
``easyckpt_wire.episode`` (log a repeated condition once), ``easyckpt.node.persist_watch`` (a rank's view of the
agent's persists), and the abandoned-directory names of ``easyckpt_wire.timeline``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easyckpt.node.persist_watch import PersistError, PersistWatch, describe_failure
from easyckpt_wire import layout, timeline
from easyckpt_wire.control import ControlView, PersistFailure
from easyckpt_wire.episode import Episode

FAILURE = PersistFailure(step=20, errno=28, text="/ckpt/.tmp-iteration_0000020-1: [Errno 28] No space left on device",
                         needed=3 << 30, free=1 << 30, since=100.0, at=101.0, failures=1)


def view(persisted: int | None, failure: PersistFailure | None = None, failures: int = 0) -> ControlView:
    return ControlView(safe=persisted, held=frozenset(), generation=2, agent_pid=1, updated_at=0.0,
                       persisted=persisted, failure=failure, failures=failures)


def test_an_episode_logs_its_start_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    episode = Episode(logging.getLogger("test.episode"))
    caplog.set_level(logging.INFO, "test.episode")
    assert not episode.end("never began") and not episode.active
    assert [episode.hit("step %d passed over", n) for n in (1, 2, 3)] == [True, False, False]
    assert episode.active and episode.count == 3
    assert episode.end("steps are claimed again")
    assert not episode.active and episode.total == 3
    assert episode.hit("step %d passed over", 7)   # a new episode logs again
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == (logging.WARNING, "step 1 passed over")
    assert lines[1][0] == logging.INFO and lines[1][1].startswith("steps are claimed again (3 time(s) in ")
    assert lines[2] == (logging.WARNING, "step 7 passed over") and len(lines) == 3


def test_an_episode_keeps_what_each_occurrence_was_about_for_its_end(caplog: pytest.LogCaptureFixture) -> None:
    episode = Episode(logging.getLogger("test.episode"))
    caplog.set_level(logging.INFO, "test.episode")
    for step in (5, 10, 15):
        episode.hit("no checkpoint-%d", step, item=step)
    assert episode.items == [5, 10, 15]
    assert episode.end("exports resume; none for %s", episode.items)
    assert caplog.records[-1].getMessage().startswith("exports resume; none for [5, 10, 15] (3 time(s) in ")
    assert episode.items == [] and episode.hit("no checkpoint-%d", 30) and episode.items == []


def test_persist_watch_follows_a_failure_episode_and_says_it_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "easyckpt.node.persist_watch")
    watch = PersistWatch(rank=0, local_rank=0, save_dir=Path("/ckpt"))
    watch.observe(None)                      # no agent word yet: nothing known
    assert watch.stats() == {"persisted_step": None, "persist_failures": 0, "persist_failure": None}
    watch.observe(view(10))
    watch.observe(view(10, FAILURE, failures=1))
    watch.observe(view(10, FAILURE, failures=2))   # the same episode: not said again
    assert watch.episodes == 1 and watch.stats()["persist_failure"] == FAILURE.as_dict()
    watch.observe(view(30, failures=2))
    assert watch.stats() == {"persisted_step": 30, "persist_failures": 2, "persist_failure": None}
    said = [r for r in caplog.records if r.name == "easyckpt.node.persist_watch"]
    assert [r.levelno for r in said] == [logging.WARNING, logging.WARNING]
    assert "No space left" in said[0].getMessage() and "2 persist(s) failed" in said[1].getMessage()


def test_persist_watch_of_a_rank_other_than_the_first_on_its_node_says_it_at_info() -> None:
    assert PersistWatch(rank=9, local_rank=1, save_dir=Path("/ckpt")).level == logging.INFO


def test_describe_failure_from_a_reply_dict_or_a_newer_agents_fields() -> None:
    line = describe_failure(FAILURE.as_dict())
    assert line == describe_failure(FAILURE) and line.startswith("persist of step 20 failed: ")
    assert line.endswith("(needs 3.0 GiB; 1.0 GiB were free when it started)")
    newer = {**FAILURE.as_dict(), "field_of_a_newer_agent": 1}
    assert describe_failure(newer) == str(newer)


def test_persist_error_carries_the_errno_of_the_agents_report() -> None:
    error = PersistError("x", step=20, save_dir=Path("/ckpt"), persisted=10, failure=FAILURE.as_dict(), shm_dir=None)
    assert error.errno == 28
    assert PersistError("x", step=20, save_dir=Path("/ckpt"), persisted=10, failure=None, shm_dir=None).errno is None


def test_abandoned_dirnames_sort_by_time_and_are_found_again(tmp_path: Path) -> None:
    first, second = timeline.abandoned_dirname(1_700_000_000.0), timeline.abandoned_dirname(1_700_000_060.5)
    assert first.startswith(".abandoned-") and first < second
    (tmp_path / first / "iteration_0000120").mkdir(parents=True)
    (tmp_path / first / "not-an-iteration").mkdir()
    found = timeline.abandoned_iterations(tmp_path)
    assert [(name, step) for name, step, _ in found] == [(first, 120)]


# --- an iteration published after the tracker's last update (timeline.published_untracked) ------------------------
def _record(op: str, step: int | None, path: str) -> str:
    return json.dumps({"time": 0.0, "pid": 1, "op": op, "path": path, **({} if step is None else {"step": step})})


class _SaveDir:
    """What the agent's writes leave in a save_dir and its audit log, and what a load should then take."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.complete: set[int] = set()
        self.tracker: int | None = None    # what the tracker file says
        self.recorded: int | None = None   # what the audit log's last tracker record says
        self.died: int | None = None       # the newest iteration published by a persist that died before the tracker

    def expected(self) -> int | None:
        """A load takes ``died`` over the tracker, unless the tracker was changed by hand since its last record."""
        return self.died if self.tracker == self.recorded else None

    def _track(self, step: int | None) -> None:
        self.tracker = self.recorded = step
        self.died = None
        if step is None:
            self.lines.append(_record("tracker-remove", None, "/s/latest_checkpointed_iteration.txt"))
        else:
            self.lines.append(_record("tracker", step, "/s/latest_checkpointed_iteration.txt"))

    def persist(self, step: int, *, dies_before_tracker: bool) -> None:
        self.lines.append(_record("write", step, f"/s/{layout.iteration_dirname(step)}"))
        self.complete.add(step)
        if dies_before_tracker:
            self.died = step
        else:
            self._track(step)

    def resume(self, at: int, *, dies_before_move: bool) -> None:
        """The tracker first (written when it changes or newer iterations go aside), then those iterations aside
        (timeline.DiskTimeline._move_aside)."""
        head = max((s for s in self.complete if s <= at), default=None)
        if head != self.tracker or any(s > at for s in self.complete):
            self._track(head)
        if not dies_before_move:
            for step in sorted(s for s in self.complete if s > at):
                self.lines.append(_record("abandon", step, f"/s/{layout.iteration_dirname(step)}"))
                self.complete.discard(step)

    def set_back_by_hand(self) -> None:
        older = sorted(s for s in self.complete if self.tracker is not None and s < self.tracker)
        if older:
            self.tracker = older[-1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["persist", "persist-dies", "resume", "resume-dies", "by-hand", "torn"]),
                          st.integers(1, 4)), max_size=25))
def test_only_an_iteration_whose_persist_died_before_the_tracker_is_taken_over_the_tracker(
        events: list[tuple[str, int]]) -> None:
    """Any history of persists (some dying between the publish and the tracker), resumes (some dying between
    the tracker and the move aside), rollbacks by hand and a torn last line: the rule names exactly the iteration
    whose persist died after the tracker's last update, and nothing after a resume or a rollback."""
    save = _SaveDir()
    step = -1
    for kind, by in events:
        if kind.startswith("persist"):
            step = max(step, *save.complete) + by if save.complete else step + by
            save.persist(step, dies_before_tracker=kind == "persist-dies")
        elif kind.startswith("resume") and save.complete:
            step = max(0, step - by)
            save.resume(step, dies_before_move=kind == "resume-dies")
        elif kind == "by-hand":
            save.set_back_by_hand()
        elif kind == "torn":
            save.lines.append('{"time": 1.0, "op": "wri')
    found = timeline.published_untracked(save.lines, save.tracker, save.complete)
    assert found == save.expected(), (events, save.lines)
