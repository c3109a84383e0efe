"""The soak's judge (benchmarks/soak_check.py) over plain reports: what counts as torn after a resume."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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


def test_ranks_of_one_restart_that_resumed_different_steps_or_states_are_torn() -> None:
    _, torn = judge([[fresh(0), resumed(0)], [fresh(1), resumed(1, 18)]])
    assert torn and torn[0].startswith("ranks resumed different steps"), torn
    wrong = resumed(1) | {"digest": "other"}
    _, torn = judge([[fresh(0), resumed(0)], [fresh(1), wrong]])
    assert torn == ["rank 1 resumed step 19 with a state unlike the reference's"], torn
