"""The soak's judge (benchmarks/soak_check.py) over plain reports: what counts as torn after a resume, and a
resume from disk older than the tracked step."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import soak_check
from soak_faults import Strike

REF: soak_check.Reference = {rank: {19: {"step": 19, "digest": f"d{rank}"}} for rank in range(4)}


def fresh(rank: int) -> dict[str, Any]:
    return {"rank": rank, "step": None, "source": None, "digest": None}


def resumed(rank: int, step: int = 19) -> dict[str, Any]:
    return {"rank": rank, "step": step, "source": "memory", "digest": f"d{rank}"}


def judge(reports: list[list[dict[str, Any]]]) -> tuple[dict[str, Any], list[str]]:
    record: dict[str, Any] = {}
    torn: list[str] = []
    job = SimpleNamespace(shape=SimpleNamespace(first=0))
    soak_check._judge_resume(job, REF, Strike(at=19), reports, record, torn)  # type: ignore[arg-type]
    return record, torn


def test_a_rank_the_job_ended_around_while_it_loaded_is_not_a_torn_resume() -> None:
    """Seed 11301, fault 0 (the store down to the job's end, plain 2x2): node 0's ranks resumed at 19 and failed at
    close as they must; node 1's torchrun died with the rendezvous while rank 3 was still in load(). Its last report
    was its first run's fresh start, and the judge compared it with the others' resume: "ranks resumed different
    steps: [19, 19, 19, None]"."""
    record, torn = judge([[fresh(0), resumed(0)], [fresh(1), resumed(1)], [fresh(2), resumed(2)], [fresh(3)]])
    assert torn == [], torn
    assert record["resumed_at"] == 19 and record["source"] == "memory", record
    assert record["sources"] == ["memory", "memory", "memory", "unfinished"]
    assert record["notes"] == ["rank(s) [3] never finished loading in the last restart"]


def test_an_hf_resume_from_a_checkpoint_folder_counts_as_disk_not_as_a_fresh_start() -> None:
    """Seed 1215: four HF jobs resumed at steps 5 and 10 from a complete checkpoint-N folder (the wrapper's source
    "checkpoint"), and the table counted them as fresh starts ("scratch"). A report with no step stays "scratch"."""
    record, torn = judge([[fresh(0), resumed(0) | {"source": "checkpoint"}], [fresh(1), resumed(1) | {"source": "path"}]])
    assert torn == [] and record["source"] == "disk" and record["sources"] == ["disk", "disk"], record
    record, _ = judge([[fresh(0), fresh(0)], [fresh(1), fresh(1)]])
    assert record["source"] == "scratch" and record["sources"] == ["scratch", "scratch"], record


def test_ranks_of_one_restart_that_resumed_different_steps_or_states_are_torn() -> None:
    _, torn = judge([[fresh(0), resumed(0)], [fresh(1), resumed(1, 18)]])
    assert torn and torn[0].startswith("ranks resumed different steps"), torn
    wrong = resumed(1) | {"digest": "other"}
    _, torn = judge([[fresh(0), resumed(0)], [fresh(1), wrong]])
    assert torn == ["rank 1 resumed step 19 with a state unlike the reference's"], torn


def test_a_cached_reference_comes_back_as_the_run_gave_it_and_is_run_once_per_shape(tmp_path: Path) -> None:
    """``--reference-cache``: JSON turns the ranks and steps into strings; the judge looks them up as ints."""
    import soak
    from soak_plan import Shape

    rows: soak_check.Reference = {rank: {step: {"step": step, "loss": 0.1 * step + rank, "digest": f"d{rank}.{step}"}
                                         for step in range(3)} for rank in range(2)}
    runs: list[int] = []

    def run() -> tuple[soak_check.Reference, dict[str, Any]]:
        runs.append(1)
        return rows, {"seconds": 1.5}

    shape = Shape(first=0, last=2, interval=3)
    assert soak.cached_reference(tmp_path, "plain-1x2", shape, run) == (rows, {"seconds": 1.5})
    again, info = soak.cached_reference(tmp_path, "plain-1x2", shape, run)
    assert again == rows and info["seconds"] == 1.5 and "cached" in info and len(runs) == 1
    soak.cached_reference(tmp_path, "plain-1x2", Shape(first=0, last=2, interval=2), run)
    soak.cached_reference(tmp_path, "plain-2x1", shape, run)
    assert len(runs) == 3, "another interval or configuration is another reference"


def test_a_file_given_for_the_reference_cache_is_refused_before_any_job_runs(tmp_path: Path) -> None:
    import soak

    cache = tmp_path / "refs.json"
    cache.write_text("{}")
    with pytest.raises(SystemExit, match="refs.json: a file, not a directory"):
        soak.main(["--smoke", "--json", str(tmp_path / "out.json"), "--dir", str(tmp_path / "w"),
                   "--reference-cache", str(cache)])
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "w").exists()


def test_an_unwritable_json_or_an_unreadable_earlier_soak_is_refused_before_any_job_runs(tmp_path: Path) -> None:
    """A directory given for --json once ran a whole soak and lost its runs at the first write."""
    import soak

    def refused(argv: list[str], match: str) -> None:
        with pytest.raises(SystemExit, match=match):
            soak.main([*argv, "--dir", str(tmp_path / "w")])
        assert not (tmp_path / "w").exists(), "a job ran"

    refused(["--smoke", "--json", str(tmp_path)],
            r"--json .*: a directory, not a file; give a file's path, e.g. .*soak\.json")
    (tmp_path / "file").write_text("")
    refused(["--smoke", "--json", str(tmp_path / "file" / "out.json")], r"--json .*file/out\.json: cannot be written")
    out = str(tmp_path / "out.json")
    refused(["--json", out, "--resume-from", str(tmp_path / "missing.json")],
            r"--resume-from .*missing\.json: cannot be read \(No such file or directory\); give the --json file")
    (tmp_path / "bad.json").write_text("{not json")
    refused(["--json", out, "--resume-from", str(tmp_path / "bad.json")], r"--resume-from .*bad\.json: not a soak's JSON")
    (tmp_path / "other.json").write_text('{"model": 1}')
    with pytest.raises(SystemExit, match=r"--merge .*other\.json: not a soak's JSON \(no seed and runs\)"):
        soak.main(["--merge", str(tmp_path / "other.json"), "--json", out])
    assert not (tmp_path / "out.json").exists()


def test_a_damaged_cached_reference_is_run_again_and_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import soak
    from soak_plan import Shape

    shape = Shape(first=0, last=2, interval=3)
    damaged = tmp_path / "plain-1x1-0-2-every3.json"
    rows: soak_check.Reference = {0: {0: {"step": 0, "loss": 1.0, "digest": "d"}}}
    for content in ("{not json", '{"rows": []}', '{"info": {}}'):
        damaged.write_text(content)
        assert soak.cached_reference(tmp_path, "plain-1x1", shape, lambda: (rows, {"seconds": 2.0})) == \
            (rows, {"seconds": 2.0})
        assert str(damaged) in capsys.readouterr().out
        assert soak.cached_reference(tmp_path, "plain-1x1", shape, lambda: ({}, {}))[0] == rows, "replaced"


def test_a_resume_from_disk_or_a_fresh_start_older_than_the_tracked_step_fails(tmp_path: Path) -> None:
    """The judge reads the audit log: a resume from disk (or from scratch) with storage intact must take at least the
    step the tracker named when the load began. Such a resume is as bit-exact as any, so only this catches it."""
    audit = tmp_path / "easyckpt-audit.log"
    audit.write_text("".join(json.dumps(line) + "\n" for line in [
        {"time": 100.0, "op": "write", "path": "iteration_0000005", "step": 5},
        {"time": 100.1, "op": "tracker", "path": "latest_checkpointed_iteration.txt", "step": 5},
        {"time": 101.0, "op": "tracker", "path": "latest_checkpointed_iteration.txt", "step": 10},
        {"time": 103.0, "op": "tracker", "path": "latest_checkpointed_iteration.txt", "step": 15},
    ]) + '{"time": 104.0, "op": "trac')   # a torn last line is passed over

    def failed(source: str, resumed_at: int, began: list[float | None]) -> list[str]:
        out: list[str] = []
        reports = [{"rank": r, "load_began": b} if b is not None else {"rank": r} for r, b in enumerate(began)]
        soak_check._judge_storage_tier(audit, reports, {"source": source, "resumed_at": resumed_at}, out)
        return out

    assert soak_check.tracked_before(audit, 102.0) == (10, 101.0)
    why = failed("disk", 5, [102.0, 102.5])
    assert why == ["resumed at step 5 from disk although the tracker named step 10 (1.00 s before the load began), "
                   "and nothing damaged storage"], why
    assert failed("scratch", -1, [100.5, 102.0]) and failed("disk", 10, [102.0, 102.0]) == []
    assert failed("disk", 10, [103.5, 102.0]) == [], "the earliest load began before step 15 was tracked"
    assert failed("memory", 5, [102.0, 102.0]) == [] and failed("disk", 5, [102.0, None]) == []
    assert failed("scratch", -1, [99.0, 99.0]) == [], "nothing was tracked before the load began"
    with audit.open("a") as log:
        log.write("\n" + json.dumps({"time": 101.5, "op": "tracker-remove", "path": "t"}) + "\n")
    assert soak_check.tracked_before(audit, 102.0) is None
    assert soak_check.tracked_before(tmp_path / "missing.log", 102.0) is None
