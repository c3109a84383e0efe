"""Timelines on disk (invariant 10): which iteration an automatic load follows, and where abandoned ones go.

A resume from step s starts a new timeline; iterations newer than s belong to the abandoned one. The
node agent moves them into ``save_dir/.abandoned-<UTC time>/iteration_N`` (one rename each) and points
the tracker at the newest iteration of the current timeline. Both sides read the same rules from here:
the library to choose what ``load()`` reads, the agent to know the newest step of the current timeline
(below which nothing is persisted again) when it starts.

The tracker is the authority: an iteration newer than the one it names is either of an abandoned
timeline that was not moved aside yet, or was published by a persist that died before it replaced the
tracker (or the tracker was set back by hand, a rollback). An automatic load takes it only in the second
case, and only when the audit log shows it (:func:`published_untracked`): the iteration was published after
the tracker's last recorded update, and nothing touched the tracker since. Only when the tracker is missing,
or names an iteration that is not complete, does a load fall back to the newest complete one.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from easyckpt_wire import layout
from easyckpt_wire.storage import Storage, as_path, open_storage

ABANDONED_PREFIX = ".abandoned-"
ABANDONED_RE = re.compile(r"^\.abandoned-(\d{8}T\d{6}\.\d{6}Z)(?:-(\d+))?$")


def load_order(complete: Sequence[int], tracker: int | None) -> list[int]:
    """Complete steps an automatic load tries, newest first: the tracked one and those before it when the
    tracker names a complete iteration, else every complete one."""
    steps = sorted(set(complete), reverse=True)
    if tracker is None or tracker not in steps:
        return steps
    return [step for step in steps if step <= tracker]


def published_untracked(audit_lines: Iterable[str], tracker: int | None, complete: Collection[int]) -> int | None:
    """The newest complete iteration newer than ``tracker`` that a persist published and then died before it
    pointed the tracker at it, read from the audit log's lines (None: there is none, or the log cannot vouch).

    The log records an iteration's publication (``write`` of ``iteration_N``) before the tracker's update
    (``tracker``), and a resume's new tracker (or ``tracker-remove``) before it moves newer iterations aside
    (``abandon``). So an iteration published after the last tracker record, with no tracker, removal or
    abandonment recorded since, is the current timeline's newest: its persist died in between. The log vouches
    only while the tracker still says what its last record says: a tracker changed by hand (a rollback to an
    older iteration) wins, and so does one whose update was cut off before its record. Lines that are not
    records (a torn last line) are passed over."""
    recorded: int | None = None
    published: set[int] = set()
    for line in audit_lines:
        try:
            record = json.loads(line)
            op, step, name = record["op"], record.get("step"), Path(str(record["path"])).name
        except (ValueError, TypeError, KeyError):
            continue
        if op in ("tracker", "tracker-remove", "abandon"):
            published.clear()
            if op != "abandon":
                recorded = step if op == "tracker" and type(step) is int else None
        elif op == "write" and type(step) is int and name == layout.iteration_dirname(step):
            published.add(step)
    if recorded != tracker:
        return None
    return max((s for s in published if s in complete and (tracker is None or s > tracker)), default=None)


def head(complete: Sequence[int], tracker: int | None) -> int | None:
    """The newest step of the current timeline on disk (what an automatic load would try first)."""
    order = load_order(complete, tracker)
    return order[0] if order else None


def abandoned_dirname(now: float | None = None) -> str:
    """A new ``.abandoned-<time>`` name; the names sort in the order they were made."""
    now = time.time() if now is None else now
    micros = int(round(now * 1e6)) % 1_000_000
    return f"{ABANDONED_PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime(int(now)))}.{micros:06d}Z"


def abandoned(store: Storage) -> list[tuple[str, int, str]]:
    """Every ``.abandoned-*/iteration_N`` as (abandoned dir name, step, key), oldest abandonment first."""
    found = []
    for entry in store.entries():
        if entry.is_dir and ABANDONED_RE.match(entry.name):
            found += [(entry.name, step, key) for step, key, _complete in layout.iterations(store, entry.name)]
    return sorted(found)


def abandoned_iterations(save_dir: Path) -> list[tuple[str, int, Path]]:
    """``abandoned`` of the save_dir at this path, with paths."""
    return [(name, step, as_path(save_dir) / key) for name, step, key in abandoned(open_storage(save_dir))]
