"""A one-rank training job for tests/jobs/test_failures.py: a real process with a Checkpointer, driven by files.

    python tests/failure_job.py --save-dir DIR --out OUT --steps 25 --pause-at 12,15

At each ``--pause-at`` step (after that step's snapshot is committed) it writes ``OUT/paused-<step>.json``
(``stats()``, and with ``--flush-at`` that step also ``flush()``'s result) and waits for ``OUT/go-<step>``,
so a test can change the disk under a live job at a known point without sleeping. At the end it calls
``close()`` and writes ``OUT/result.json``: ``{"closed": true}`` or the ``PersistError`` it raised.
Logging goes to stderr at WARNING (what a user sees by default).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

import easyckpt
from easyckpt_wire.storage.posix import write_file_atomic

GO_TIMEOUT = 120.0   # longest a pause waits for the test's go file


def write_json(path: Path, report: dict[str, object]) -> None:
    """Whole or not at all: the test reads a pause report as soon as the file exists (CI once read an empty
    paused-20.json, written but not yet filled)."""
    write_file_atomic(path, json.dumps(report))


def wait_go(out: Path, step: int) -> None:
    go = out / f"go-{step}"
    deadline = time.monotonic() + GO_TIMEOUT
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"failure_job: no {go} within {GO_TIMEOUT:.0f}s (the test did not let step {step} go on)")
        time.sleep(0.02)   # polling for the test's file against a deadline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--save-storage-interval", type=int, default=10)
    parser.add_argument("--numel", type=int, default=100_000, help="float32 elements of each of the two tensors")
    parser.add_argument("--pause-at", default="", help="comma-separated steps")
    parser.add_argument("--flush-at", default="", help="comma-separated pause steps that also call flush()")
    parser.add_argument("--no-final-persist", action="store_true")
    parser.add_argument("--load", action="store_true", help="resume with load() first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    pauses = {int(s) for s in args.pause_at.split(",") if s}
    flushes = {int(s) for s in args.flush_at.split(",") if s}
    ckpt = easyckpt.Checkpointer(args.save_dir, 1, args.save_storage_interval, 3,
                                 final_persist=not args.no_final_persist, flush_timeout=30.0, close_timeout=60.0)
    model = {"weight": torch.zeros(args.numel)}
    optim = {"moment": torch.zeros(args.numel)}
    start = 0
    if args.load:
        result = ckpt.load({"model": model, "optim": optim})
        write_json(out / "resume.json", {"step": result.step, "source": result.source})
        start = 0 if result.step is None else result.step + 1
    for step in range(start, args.steps):
        model["weight"] += 1
        optim["moment"] += 2
        ckpt.save_if_needed(step, {"model": model, "optim": optim, "step": step})
        if step in pauses:
            ckpt.wait()
            report = {"step": step, "stats": ckpt.stats()}
            if step in flushes:
                report["flush"] = dataclasses.asdict(ckpt.flush())
                # The agent publishes a failure before it answers the flush: stats() now include it for sure.
                report["stats"] = ckpt.stats()
            write_json(out / f"paused-{step}.json", report)
            wait_go(out, step)
    outcome: dict[str, object]
    try:
        ckpt.close()
        outcome = {"closed": True}
    except easyckpt.PersistError as exc:
        outcome = {"closed": False, "error": str(exc), "step": exc.step, "errno": exc.errno,
                   "persisted": exc.persisted, "failure": exc.failure}
    write_json(out / "result.json", outcome)


if __name__ == "__main__":
    main()
