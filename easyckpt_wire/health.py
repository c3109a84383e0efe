"""Checkpoint health as plain data: a rank's verdict on its snapshot, the job's verdict on a step, and the
``save_dir/health_ckpts.json`` index the agent keeps (the MindSpore Transformers format).

A rank that reports metrics (``save_if_needed(..., metrics=...)``) gives a verdict: unhealthy when a metric
is not finite, or exceeds its threshold. A rank that reports nothing (a later pipeline stage, which has no
embedding) is neutral. A step is healthy when every reporting rank says so.

Everything here is pure or one read or write through a ``Storage``, torch-free, so the agent (which writes the index and
protects the newest healthy iteration from rotation) and the library (which picks the step to resume
from) decide alike.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from easyckpt_wire.storage import Storage, StorageLike, open_storage

HEALTH_FILE = "health_ckpts.json"
HEALTHY, UNHEALTHY = 0, 1          # ``is_health`` values, as MindSpore writes them (0 means healthy)


class HealthFileError(ValueError):
    """``health_ckpts.json`` cannot be read as the list of entries its format promises."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankHealth:
    """One rank's verdict on one snapshot; ``reporting=False`` is neutral (it said nothing)."""

    reporting: bool = False
    healthy: bool = True
    reasons: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any] | None:
        return {"healthy": self.healthy, "reasons": list(self.reasons)} if self.reporting else None

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> RankHealth:
        if obj is None:
            return cls()
        if not isinstance(obj, Mapping) or type(obj.get("healthy")) is not bool \
                or not isinstance(obj.get("reasons", []), list) \
                or not all(isinstance(r, str) for r in obj.get("reasons", [])):
            raise ValueError(f"{where}: health is {obj!r:.120}, expected None or "
                             "{'healthy': bool, 'reasons': [str, ...]}")
        return cls(True, obj["healthy"], tuple(obj.get("reasons", [])))


NEUTRAL = RankHealth()   # a rank that reported no metrics


def check_thresholds(thresholds: Mapping[str, float] | None, what: str = "health_thresholds") -> dict[str, float]:
    """Thresholds as a plain dict; each must be a finite positive number (a ValueError names the key)."""
    checked: dict[str, float] = {}
    for name, value in (thresholds or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what}: metric names must be non-empty strings, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{what}[{name!r}] must be a finite positive number, got {value!r}")
        checked[name] = float(value)
    return checked


def rank_verdict(metrics: Mapping[str, float] | None, thresholds: Mapping[str, float]) -> RankHealth:
    """The verdict of one rank on its snapshot from the metrics it reported (None or {}: neutral)."""
    if not metrics:
        return RankHealth()
    reasons = []
    for name, value in sorted(metrics.items()):
        value = float(value)
        if not math.isfinite(value):
            reasons.append(f"{name} is {value}")
        elif name in thresholds and value > thresholds[name]:
            reasons.append(f"{name} {value:.6g} > threshold {thresholds[name]:g}")
    return RankHealth(True, not reasons, tuple(reasons))


def combine(verdicts: Mapping[int, RankHealth]) -> RankHealth:
    """The job's verdict on a step from every rank's: healthy unless a reporting rank says otherwise; the
    reasons name their rank. No reporting rank at all: neutral."""
    reporting = {rank: v for rank, v in verdicts.items() if v.reporting}
    if not reporting:
        return RankHealth()
    reasons = tuple(f"rank {rank}: {reason}" for rank, v in sorted(reporting.items()) for reason in v.reasons)
    return RankHealth(True, all(v.healthy for v in reporting.values()), reasons)


@dataclasses.dataclass(frozen=True, slots=True)
class HealthEntry:
    """One row of ``health_ckpts.json``."""

    step: int
    ckpt_name: str
    is_health: int                  # HEALTHY (0) or UNHEALTHY (1)
    reasons: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.is_health == HEALTHY

    def to_json(self) -> dict[str, Any]:
        return {"is_health": self.is_health, "ckpt_name": self.ckpt_name, "step": self.step,
                "reasons": list(self.reasons)}


def entry_for(step: int, ckpt_name: str, verdict: RankHealth) -> HealthEntry:
    return HealthEntry(step, ckpt_name, HEALTHY if verdict.healthy else UNHEALTHY, verdict.reasons)


def read_health(store: Storage) -> list[HealthEntry] | None:
    """The entries of the save_dir's ``health_ckpts.json`` by step, or None when there is no such file."""
    where = store.where(HEALTH_FILE)
    try:
        raw = json.loads(store.read(HEALTH_FILE))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HealthFileError(f"{where}: not readable JSON ({exc}); remove it or restore it from a backup: "
                              "the agent rewrites it from the next persist on") from exc
    if not isinstance(raw, list):
        raise HealthFileError(f"{where}: expected a JSON list of entries, got {type(raw).__name__}")
    entries = []
    for i, item in enumerate(raw):
        ok = (isinstance(item, dict) and type(item.get("step")) is int and item["step"] >= 0
              and isinstance(item.get("ckpt_name"), str) and item.get("is_health") in (HEALTHY, UNHEALTHY)
              and type(item.get("is_health")) is int and isinstance(item.get("reasons", []), list)
              and all(isinstance(r, str) for r in item.get("reasons", [])))
        if not ok:
            raise HealthFileError(f"{where}: entry {i} is {item!r:.160}; expected {{'is_health': 0|1, "
                                  "'ckpt_name': str, 'step': int >= 0, 'reasons': [str, ...]}")
        entries.append(HealthEntry(item["step"], item["ckpt_name"], item["is_health"], tuple(item.get("reasons", []))))
    return sorted(entries, key=lambda e: e.step)


def write_health(store: Storage, entries: Iterable[HealthEntry]) -> None:
    """Replace the save_dir's ``health_ckpts.json`` atomically (a reader sees the old list or the new one)."""
    store.put(HEALTH_FILE, (json.dumps([e.to_json() for e in sorted(entries, key=lambda e: e.step)], indent=1)
                            + "\n").encode())


def read_health_file(save_dir: StorageLike) -> list[HealthEntry] | None:
    """``read_health`` of the save_dir at this path."""
    return read_health(open_storage(save_dir))


def write_health_file(save_dir: StorageLike, entries: Iterable[HealthEntry]) -> None:
    """``write_health`` to the save_dir at this path."""
    write_health(open_storage(save_dir), entries)


def updated(entries: Iterable[HealthEntry], new: HealthEntry | None, kept_steps: Iterable[int]) -> list[HealthEntry]:
    """The index after a persist (``new``, replacing any entry of its step) and a rotation (only the steps in
    ``kept_steps``, the iterations still on disk, stay)."""
    kept = set(kept_steps)
    by_step = {e.step: e for e in entries if e.step in kept}
    if new is not None and new.step in kept:
        by_step[new.step] = new
    return [by_step[s] for s in sorted(by_step)]


def newest_healthy(entries: Iterable[HealthEntry]) -> int | None:
    return max((e.step for e in entries if e.healthy), default=None)


def unhealthy_steps(entries: Iterable[HealthEntry]) -> dict[int, tuple[str, ...]]:
    return {e.step: e.reasons for e in entries if not e.healthy}
