"""Checkpoint health in one process: a rank's verdict, the job's verdict on a step, ``health_ckpts.json``
(round trip, corrupt, atomic), the agent's record of each persist in it, and rotation that keeps the newest
healthy iteration whatever ``max_ckpt_num`` says (invariant 13)."""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

import pytest
from conftest import marker_iteration, seeded_random

from easyckpt_agent import policy
from easyckpt_agent.persister import AuditLog, forget_health, record_health, write_tracker
from easyckpt_agent.timeline import DiskTimeline
from easyckpt_wire import health, layout
from easyckpt_wire.health import HealthEntry, RankHealth

T = {"embedding_local_norm": 270.0}


def make_iteration(save_dir: Path, step: int, verdict: RankHealth | None = None) -> Path:
    return marker_iteration(save_dir, step, health=verdict.to_wire() if verdict is not None else None)


def new_save_dir(tmp_path: Path) -> tuple[Path, AuditLog]:
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    return save_dir, AuditLog(save_dir)


# a rank's verdict and the job's ------------------------------------------------------------------------
def test_rank_verdict() -> None:
    assert health.rank_verdict(None, T) == health.NEUTRAL and health.rank_verdict({}, T) == health.NEUTRAL
    ok = health.rank_verdict({"embedding_local_norm": 269.9, "loss": 2.0}, T)
    assert ok.reporting and ok.healthy and ok.reasons == ()
    bad = health.rank_verdict({"embedding_local_norm": 300.0}, T)
    assert not bad.healthy and bad.reasons == ("embedding_local_norm 300 > threshold 270",)
    for value in (math.nan, math.inf):
        verdict = health.rank_verdict({"loss": value}, T)
        assert not verdict.healthy and "loss is" in verdict.reasons[0]   # not finite, threshold or not
    assert health.rank_verdict({"embedding_local_norm": 270.0}, T).healthy   # at the threshold: healthy


def test_combine_is_healthy_unless_a_reporting_rank_says_not() -> None:
    bad = RankHealth(True, False, ("embedding_local_norm 300 > threshold 270",))
    assert health.combine({}) == health.NEUTRAL
    assert health.combine({0: health.NEUTRAL, 1: health.NEUTRAL}) == health.NEUTRAL
    assert health.combine({0: RankHealth(True), 1: health.NEUTRAL}) == RankHealth(True, True, ())
    verdict = health.combine({0: RankHealth(True), 1: bad, 2: health.NEUTRAL})
    assert verdict.reporting and not verdict.healthy
    assert verdict.reasons == ("rank 1: embedding_local_norm 300 > threshold 270",)


def test_combine_randomized() -> None:
    rng = seeded_random()
    for _ in range(200):
        verdicts = {r: rng.choice([health.NEUTRAL, RankHealth(True), RankHealth(True, False, (f"r{r}",))])
                    for r in range(rng.randrange(0, 6))}
        got = health.combine(verdicts)
        assert got.reporting == any(v.reporting for v in verdicts.values())
        assert got.healthy == all(v.healthy for v in verdicts.values())
        assert len(got.reasons) == sum(not v.healthy for v in verdicts.values())


def test_bad_thresholds_are_refused_naming_the_key() -> None:
    for value in (0, -1.0, math.nan, math.inf, True, "270"):
        with pytest.raises(ValueError, match="embedding_local_norm"):
            health.check_thresholds({"embedding_local_norm": value})   # type: ignore[dict-item]


def test_checkpointer_refuses_bad_thresholds(tmp_path: Path) -> None:
    from easyckpt import Checkpointer
    with pytest.raises(ValueError, match="embedding_local_norm.*finite positive"):
        Checkpointer(tmp_path / "ckpt", 1, 1, 1, health_thresholds={"embedding_local_norm": 0.0})


# health_ckpts.json -------------------------------------------------------------------------------------
def test_health_file_round_trip(tmp_path: Path) -> None:
    assert health.read_health_file(tmp_path) is None
    entries = [HealthEntry(20, "iteration_0000020", health.UNHEALTHY, ("rank 0: x",)),
               HealthEntry(10, "iteration_0000010", health.HEALTHY)]
    health.write_health_file(tmp_path, entries)
    raw = json.loads((tmp_path / health.HEALTH_FILE).read_text())
    assert raw[0] == {"is_health": 0, "ckpt_name": "iteration_0000010", "step": 10, "reasons": []}
    back = health.read_health_file(tmp_path)
    assert back == sorted(entries, key=lambda e: e.step)
    assert health.newest_healthy(back or []) == 10 and health.unhealthy_steps(back or []) == {20: ("rank 0: x",)}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]   # no temporary file left


@pytest.mark.parametrize("text", ["{not json", '{"step": 1}', '[{"step": 1, "ckpt_name": "x", "is_health": 2}]',
                                  '[{"step": "1", "ckpt_name": "x", "is_health": 0}]', "\xff\xfe"])
def test_corrupt_health_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    (tmp_path / health.HEALTH_FILE).write_text(text, errors="surrogateescape")
    with pytest.raises(health.HealthFileError, match=str(tmp_path / health.HEALTH_FILE)):
        health.read_health_file(tmp_path)


def test_health_file_is_replaced_atomically(tmp_path: Path) -> None:
    """A reader running beside a writer always sees a whole list, the old one or the new one."""
    rng = seeded_random()
    lists = [[HealthEntry(s, layout.iteration_dirname(s), rng.choice([0, 1]), ("why " * rng.randrange(200),))
              for s in range(0, 10 * n, 10)] for n in range(1, 12)]
    health.write_health_file(tmp_path, lists[0])
    stop = threading.Event()
    seen: list[int] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(len(health.read_health_file(tmp_path) or []))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(5):
            for entries in lists:
                health.write_health_file(tmp_path, entries)
    finally:
        stop.set()
        reader.join()
    assert seen and set(seen) <= {len(e) for e in lists}


def test_updated_keeps_only_iterations_on_disk() -> None:
    old = [HealthEntry(10, "a", 0), HealthEntry(20, "b", 1)]
    new = HealthEntry(30, "c", 0)
    assert [e.step for e in health.updated(old, new, [20, 30])] == [20, 30]
    assert health.updated(old, HealthEntry(20, "b", 0), [10, 20])[1].healthy   # a step persisted again


# the agent's record of each persist ---------------------------------------------------------------------
def test_record_health_writes_only_when_someone_reports(tmp_path: Path) -> None:
    save_dir, audit = new_save_dir(tmp_path)
    make_iteration(save_dir, 10)
    record_health(save_dir, 10, health.NEUTRAL, audit)
    assert not (save_dir / health.HEALTH_FILE).exists()       # users without health see no new file
    make_iteration(save_dir, 20)
    record_health(save_dir, 20, RankHealth(True), audit)
    make_iteration(save_dir, 30)
    record_health(save_dir, 30, RankHealth(True, False, ("rank 1: loss is nan",)), audit)
    make_iteration(save_dir, 40)
    record_health(save_dir, 40, health.NEUTRAL, audit)         # the file exists now: a neutral step is healthy
    entries = health.read_health_file(save_dir) or []
    assert [(e.step, e.is_health) for e in entries] == [(20, 0), (30, 1), (40, 0)]
    assert entries[1].reasons == ("rank 1: loss is nan",) and entries[1].ckpt_name == "iteration_0000030"


def test_record_health_recovers_from_a_corrupt_file(tmp_path: Path) -> None:
    save_dir, audit = new_save_dir(tmp_path)
    (save_dir / health.HEALTH_FILE).write_text("garbage")
    make_iteration(save_dir, 10)
    record_health(save_dir, 10, RankHealth(True), audit)
    assert [e.step for e in health.read_health_file(save_dir) or []] == [10]


# rotation keeps the newest healthy iteration ----------------------------------------------------------------
def test_rotation_rule_keeps_the_newest_healthy() -> None:
    assert policy.newest_healthy([10, 20, 30], {20, 30}) == 10
    assert policy.newest_healthy([10, 20], {10, 20}) is None
    assert policy.newest_healthy([10, 20], set()) == 20
    keep = policy.rotation_keep({40}, [10, 20, 30, 40], {20, 30, 40})
    assert keep == {10, 40}
    _, gone = policy.rotation_victims([10, 20, 30, 40], [], max_ckpt_num=2, keep=keep)
    assert gone == [20, 30]


def test_rotation_rule_randomized() -> None:
    rng = seeded_random()
    for _ in range(300):
        current = sorted(rng.sample(range(0, 200, 10), rng.randrange(1, 10)))
        unhealthy = {s for s in current if rng.random() < 0.6}
        max_num = rng.randrange(1, 6)
        keep = policy.rotation_keep({current[-1]}, current, unhealthy)
        _, gone = policy.rotation_victims(current, [], max_ckpt_num=max_num, keep=keep)
        left = set(current) - set(gone)
        healthy = [s for s in current if s not in unhealthy]
        if healthy:
            assert max(healthy) in left
        assert len(left) <= max(max_num, len(keep))


def test_rotation_on_disk_keeps_the_newest_healthy_and_drops_entries_of_deleted(tmp_path: Path) -> None:
    save_dir, audit = new_save_dir(tmp_path)
    disk = DiskTimeline(save_dir, audit)
    bad = RankHealth(True, False, ("rank 0: embedding_local_norm 300 > threshold 270",))
    for step, verdict in ((10, RankHealth(True)), (20, RankHealth(True)), (30, bad), (40, bad), (50, bad)):
        make_iteration(save_dir, step, verdict)
        write_tracker(save_dir, step, audit)
        record_health(save_dir, step, verdict, audit)
        disk.rotate(2, step)
    assert [s for s, _ in layout.complete_iterations(save_dir)] == [20, 50]   # 20 kept: the newest healthy
    assert [e.step for e in health.read_health_file(save_dir) or []] == [20, 50]
    # The index unreadable: rotation reads metadata.json instead, and still keeps 20.
    (save_dir / health.HEALTH_FILE).write_text("[")
    make_iteration(save_dir, 60, bad)
    write_tracker(save_dir, 60, audit)
    disk.rotate(2, 60)
    assert [s for s, _ in layout.complete_iterations(save_dir)] == [20, 60]


def test_forget_health_leaves_a_missing_file_missing(tmp_path: Path) -> None:
    save_dir, audit = new_save_dir(tmp_path)
    forget_health(save_dir, audit)
    assert not (save_dir / health.HEALTH_FILE).exists()


def test_candidates_pass_over_unhealthy_steps_in_every_tier() -> None:
    from easyckpt.recovery import candidates_with_health, pass_over_unhealthy
    ordered, bad = candidates_with_health([30, 20], [30, 10], 1, unhealthy={30}, unhealthy_disk={30})
    assert ordered == [(30, "memory"), (30, "disk"), (20, "memory"), (10, "disk")]
    assert bad == {30: [0]}
    assert pass_over_unhealthy(ordered, bad) == [(20, "memory"), (10, "disk")]
    ordered, bad = candidates_with_health([], [30, 10], 1, unhealthy_disk={10})
    assert pass_over_unhealthy(ordered, bad) == [(30, "disk")]


def test_replica_steps_are_judged_by_the_verdict_their_manifest_carries() -> None:
    """A rank whose node lost its memory sees only replica steps; an unhealthy one (its manifest's verdict,
    passed in as ``unhealthy`` the way load() does) is passed over for the next replica step."""
    from easyckpt.recovery import candidates_with_health, pass_over_unhealthy
    ordered, bad = candidates_with_health([], [10], 1, replica_steps=[30, 25], unhealthy={30})
    assert ordered == [(30, "replica"), (25, "replica"), (10, "disk")] and bad == {30: [0]}
    assert pass_over_unhealthy(ordered, bad) == [(25, "replica"), (10, "disk")]
