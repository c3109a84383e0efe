"""Judging a soak job against the uninterrupted reference run of its configuration, and the soak's table.

**torn**: some rank logged a step whose loss or state digest (HF: also its RNG draws, learning rate, gradient norm)
differs from the reference's, a plain rank resumed a state whose digest is not the reference's at that step, or
the ranks resumed different steps. **failed**: the job did not end as it should (a launcher's non-zero exit that is
not the failure the fault must cause, steps never logged, the tracker not naming the last step after a clean end,
`easyckpt verify` finding damage, a resume from disk or a fresh start older than the step the tracker named as the
load began while storage was intact). **hung** and **leaked** are decided by the caller (``soak.py``).
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from soak_faults import Strike
from soak_job import Cluster

from easyckpt_wire import layout

KEYS = {"plain": ("loss", "digest"), "hf": ("loss", "digest", "py_rand", "np_rand", "learning_rate", "grad_norm")}
TIERS = ("memory", "replica", "disk")        # a resume is as stale as its stalest rank's source
SOURCES = ("memory", "replica", "disk", "scratch", "none")
# The HF wrapper's other sources (easyckpt/transformers/resume.py): a complete checkpoint-N folder it found at least as
# new as anything easyckpt held ("checkpoint"), or the path resume_from_checkpoint named ("path"). Both are storage.
# Until 2026-12-03 they fell into "scratch", the fresh starts (seed 1215: four HF resumes at steps 5 and 10).
ON_STORAGE = {"checkpoint": "disk", "path": "disk"}
Reference = dict[int, dict[int, dict[str, Any]]]   # rank -> step -> logged row


def reference_rows(cluster: Cluster) -> Reference:
    rows: Reference = {}
    for rank in range(cluster.config.world):
        rows[rank] = {row["step"]: row for row in cluster.rows(rank)}
        missing = sorted(set(range(cluster.shape.first, cluster.shape.last + 1)) - set(rows[rank]))
        if missing:
            raise RuntimeError(f"the reference run of {cluster.config.name}: rank {rank} never logged steps {missing}")
    return rows


def tracker(cluster: Cluster) -> int | None:
    if cluster.store is not None:   # straight from the store (soak_store set this process's endpoint)
        return layout.read_tracker(cluster.location)  # type: ignore[arg-type]  (a URL: open_storage takes it)
    try:
        text = (cluster.save_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def judge(c: Cluster, ref: Reference, strike: Strike, codes: dict[int, int]) -> dict[str, Any]:
    """The record of one job that ended (every launcher exited)."""
    torn: list[str] = []
    failed: list[str] = []
    reports = [c.resumes(rank) for rank in range(c.config.world)]
    record: dict[str, Any] = {"restarts": max((len(r) - 1 for r in reports), default=0)}
    refused = strike.may_refuse is not None and any(codes.values()) and strike.may_refuse in c.logs()
    if refused:
        record["notes"] = [f"the load refused the damaged only iteration ('{strike.may_refuse}'), as it may"]
    if record["restarts"] == 0:
        record.update(source="none", sources=[], resumed_at=None, lost=0)
        if strike.resume and strike.fired and not refused:
            failed.append("the fault needed a resume, but no rank restarted")
    else:
        _judge_resume(c, ref, strike, reports, record, torn)
        if strike.storage_intact and c.store is None:
            _judge_storage_tier(c.save_dir / layout.AUDIT_LOG, [r[-1] for r in reports if r], record, failed)
    _judge_rows(c, ref, record, refused, torn, failed)
    _judge_end(c, strike, codes, record, refused, failed)
    record.update(torn=bool(torn), failed=bool(failed), why=torn + failed)
    return record


def _judge_resume(c: Cluster, ref: Reference, strike: Strike, reports: list[list[dict[str, Any]]],
                  record: dict[str, Any], torn: list[str]) -> None:
    """Where the ranks resumed, from which tier, and whether the state they resumed equals the reference's."""
    # A rank with fewer reports than the others never finished loading in the last restart: the job ended around it
    # (seed 11301, fault 0: the store down to the end, node 0's ranks failed at close right after their resume and
    # node 1's torchrun died with the rendezvous, rank 3 still in load()). It trained nothing after it (a rank
    # reports before its first step), and what it logged is judged row by row all the same.
    newest = max(map(len, reports), default=0)
    unfinished = [rank for rank, r in enumerate(reports) if len(r) < newest]
    if unfinished:
        record.setdefault("notes", []).append(f"rank(s) {unfinished} never finished loading in the last restart")
    last = {rank: r[-1] for rank, r in enumerate(reports) if len(r) == newest}
    steps = {report.get("step") for report in last.values()}
    if len(steps) != 1:
        torn.append(f"ranks resumed different steps: {[report.get('step') for report in last.values()]}")
    step = max((s for s in steps if s is not None), default=None)
    sources = [ON_STORAGE.get(last[rank].get("source"), last[rank].get("source")) or "scratch" if rank in last
               else "unfinished" for rank in range(len(reports))]
    record["sources"] = sources
    record["source"] = next((t for t in reversed(TIERS) if t in sources), None) or "scratch"
    record["resumed_at"] = step if step is not None else c.shape.first - 1
    # at least 0: a surviving rank may log one more step after ``at`` was read, and resume from it
    record["lost"] = None if strike.at is None else max(0, strike.at - record["resumed_at"])
    if not strike.resume:
        record.setdefault("notes", []).append("a resume the fault did not call for")
    for rank, report in last.items():
        digest, want = report.get("digest"), ref[rank].get(step) if step is not None else None
        if step is not None and want is None:
            torn.append(f"rank {rank} resumed step {step}, which the job never reached")
        elif want is not None and digest is not None and digest != want["digest"]:
            torn.append(f"rank {rank} resumed step {step} with a state unlike the reference's")


def tracked_before(audit: Path, moment: float) -> tuple[int, float] | None:
    """(step, time) of the last tracker update the audit log records before ``moment``, by its clock (the load's
    ``time.time()``); None: none, the last one removed the tracker, or there is no log."""
    try:
        lines = audit.read_text().splitlines()
    except OSError:
        return None
    records = []
    for line in lines:
        try:
            record = json.loads(line)
            records.append((float(record["time"]), record["op"], record.get("step")))
        except (ValueError, TypeError, KeyError):
            continue   # a torn last line
    named: tuple[int, float] | None = None
    for when, op, step in sorted(records, key=lambda r: r[0]):   # the nodes' agents append side by side
        if when >= moment:
            break
        if op == "tracker" and type(step) is int:
            named = (step, when)
        elif op == "tracker-remove":
            named = None
    return named


def _judge_storage_tier(audit: Path, last: list[dict[str, Any]], record: dict[str, Any], failed: list[str]) -> None:
    """A resume from disk, or a fresh start, while storage was intact: the step it took is at least the one the
    tracker named when the load began. An older one passed over a complete iteration, which costs steps that no
    digest shows (the run from an older step is as bit-exact as any). Only reports that say when their load began
    (``load_began`` in the reports of ``examples/plain_ddp.py`` and ``examples/hf_trainer.py``), on a directory
    ``save_dir``."""
    if record.get("source") not in ("disk", "scratch"):
        return
    began = [report["load_began"] for report in last if isinstance(report.get("load_began"), (int, float))]
    if not began or len(began) != len(last):
        return
    named = tracked_before(audit, min(began))
    resumed = record.get("resumed_at")
    if named is not None and resumed is not None and resumed < named[0]:
        failed.append(f"resumed at step {resumed} from {record['source']} although the tracker named step {named[0]} "
                      f"({min(began) - named[1]:.2f} s before the load began), and nothing damaged storage")


def _judge_rows(c: Cluster, ref: Reference, record: dict[str, Any], refused: bool, torn: list[str],
                failed: list[str]) -> None:
    """Every logged step against the reference run's, bit for bit; every step after the resume logged."""
    keys = KEYS[c.config.api]
    for rank in range(c.config.world):
        logged = set()
        for row in c.rows(rank):
            logged.add(row["step"])
            want = ref[rank].get(row["step"])
            bad = [k for k in keys if want is None or row.get(k) != want.get(k)]
            if bad and len(torn) < 8:
                torn.append(f"rank {rank} step {row['step']} (attempt {row.get('attempt')}): {', '.join(bad)} differ")
        # Steps up to the resumed one are in the resumed state, whose digest is checked above: a rank that computed
        # such a step but died before logging it (frozen inside its snapshot, say) has nothing left to log.
        since = record["resumed_at"] + 1 if record.get("resumed_at") is not None else c.shape.first
        missing = sorted(set(range(since, c.shape.last + 1)) - logged)
        if missing and not refused:
            failed.append(f"rank {rank} never logged steps {missing[:5]}{'...' if len(missing) > 5 else ''}")


def _judge_end(c: Cluster, strike: Strike, codes: dict[int, int], record: dict[str, Any], refused: bool,
               failed: list[str]) -> None:
    """How the launchers ended, the tracker, and ``easyckpt verify`` where the fault asks for it."""
    bad_exits = {node: code for node, code in codes.items() if code != 0}
    if bad_exits:
        if strike.expect_error and strike.expect_error in c.logs():
            record.setdefault("notes", []).append(f"ended with {strike.expect_error}, as an unwritable persist must")
        elif not refused:
            failed.append(f"launchers exited {bad_exits}: {c.tail(600)}")
    elif tracker(c) != c.shape.last:
        failed.append(f"ended cleanly but the tracker names {tracker(c)}, not the last step {c.shape.last}")
    if strike.verify:
        ok, text = c.verify()
        if not ok and strike.expect_error and tracker(c) is None and "no such directory" in text:
            # The store down from the job's first object write to its end (seed 1127, fault 493): nothing was ever
            # committed, so there is nothing to verify, and the job said why (expect_error, above).
            record.setdefault("notes", []).append("nothing was ever committed to the save_dir (verify found none)")
        elif not ok:
            failed.append(f"easyckpt verify: {text}")


def _quantile(values: list[int], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def table(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault kind, then all together: runs, torn, hung, leaked, failed, resumes per source, steps lost."""
    runs = list(runs)
    rows = []
    for kind in sorted({r["fault"] for r in runs}) + ["all"]:
        mine = [r for r in runs if kind in ("all", r["fault"])]
        lost = [r["lost"] for r in mine if r.get("lost") is not None and r.get("source") not in (None, "none")]
        rows.append({"fault": kind, "runs": len(mine), **{k: sum(bool(r.get(k)) for r in mine)
                                                          for k in ("torn", "hung", "leaked", "failed", "not_run")},
                     "not_fired": sum(not r.get("fired", True) and not r.get("not_run") for r in mine),
                     **{s: sum(r.get("source") == s for r in mine) for s in SOURCES},
                     "lost_median": statistics.median(lost) if lost else None, "lost_p99": _quantile(lost, 0.99),
                     "lost_max": max(lost) if lost else None})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["fault", "runs", "torn", "hung", "leaked", "failed", "not run", "not fired", "memory", "replica", "disk",
            "scratch", "none", "lost median", "lost p99", "lost max"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["fault"], row["runs"], row["torn"], row["hung"], row["leaked"], row["failed"], row.get("not_run", 0),
                 row["not_fired"],
                 *(row[s] for s in SOURCES), *(("-" if row[k] is None else f"{row[k]:g}")
                                               for k in ("lost_median", "lost_p99", "lost_max"))]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
