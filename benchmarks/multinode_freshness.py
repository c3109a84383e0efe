"""Multi-node freshness (invariants 9 and 12) with real processes: what a node loss and a rank kill cost.

    python benchmarks/multinode_freshness.py --idle-ms 0,10,50 --faults 3 --json benchmarks/results/multinode-freshness.json

Each configuration runs ``examples/plain_ddp.py`` as 2 simulated nodes x 2 ranks (one ``torchrun`` per node,
``EASYCKPT_NODE_ID`` and ``EASYCKPT_SHM_DIR`` per node, gloo across both, the machinery of ``tests/multinode.py``)
with a snapshot every step and a persist every ``--interval``, its loop idling ``--idle-ms`` per step (0: full
speed) and nothing else:

* **uninterrupted run**: every 2 ms this process reads node 0's control block (the job-safe and node-safe
  steps) and the slot headers (the newest committed step); the lags are the newest step minus each. The
  **backup time** of a step is from the moment some rank committed it to the moment it is node-safe (it
  includes the agreement across nodes). Due steps persisted and passed over come from the audit log and the
  agents' logs (every pass is announced with its reason).
* **faults** at steps drawn from the seed before each run: node 1 lost whole (its ranks freeze at the step,
  then everything of it is SIGKILLed and its shared memory wiped; a new node 1 joins) and rank 3 SIGKILLed
  alone; the steps lost are the fault step minus the resumed step, with the sources.

With ``--s3`` the save_dir is a bucket of a real S3 server process (moto's server mode on 127.0.0.1, the
tests' ``tests/s3server.py``) instead of a directory: the nodes' persists then hold the CPU longer (HTTP, the
server in the same 2 cores), and the table shows what that does to the backups and the faults.

The seed is printed and stored.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # the simulated cluster of the tests

import s3server  # noqa: E402
from conftest import Env  # noqa: E402
from multinode import Cluster  # noqa: E402

from easyckpt_wire import layout  # noqa: E402
from easyckpt_wire.control import ControlReader, control_path  # noqa: E402
from easyckpt_wire.protocol import job_id_for  # noqa: E402
from easyckpt_wire.shm import SlotFormatError, SlotMap, list_slots  # noqa: E402
from easyckpt_wire.storage import open_storage  # noqa: E402


class Sampler(threading.Thread):
    """Node 0's control block and slot headers every 2 ms: the lags, and when each step became node-safe."""

    def __init__(self, shm_dir: Path, job_id: str) -> None:
        super().__init__(daemon=True)
        self.shm_dir, self.job_id = shm_dir, job_id
        self.stopping = threading.Event()
        self.job_lags: list[int] = []
        self.node_lags: list[int] = []
        self.committed_at: dict[int, float] = {}
        self.safe_at: dict[int, float] = {}

    def run(self) -> None:
        control = ControlReader(control_path(self.shm_dir, self.job_id))
        maps: dict[Path, SlotMap] = {}
        while not self.stopping.wait(0.002):
            now = time.monotonic()
            newest = -1
            for path in list_slots(self.shm_dir, self.job_id).values():
                try:
                    slot = maps.get(path) or maps.setdefault(path, SlotMap(path, writable=False))
                    slot.refresh()
                    header = slot.header()
                except (OSError, ValueError, SlotFormatError):
                    continue
                if header.committed:
                    newest = max(newest, header.step)
                    self.committed_at.setdefault(header.step, now)
            word = control.read()
            # Before the first agreement and after the job's end (its holds released) the block says nothing
            # about training: not a lag.
            if newest < 0 or word is None or not word.gated or word.safe is None:
                continue
            self.job_lags.append(newest - (-1 if word.safe is None else word.safe))
            self.node_lags.append(newest - (-1 if word.node_safe is None else word.node_safe))
            if word.node_safe is not None:
                for step in range(max(self.safe_at, default=-1) + 1, word.node_safe + 1):
                    self.safe_at.setdefault(step, now)
        control.close()
        for slot in maps.values():
            slot.close()

    def backup_ms(self) -> list[float]:
        return [1000 * (self.safe_at[s] - t) for s, t in self.committed_at.items() if s in self.safe_at]


def pct(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def job_env(args: argparse.Namespace, work: Path) -> Env:
    """A job's dirs; with ``--s3`` its save_dir is a new bucket of the server ``main`` started."""
    env = Env(work)
    if args.s3:
        env.save_dir = f"s3://{s3server.bucket(args.s3_url)}/fresh"   # type: ignore[assignment]
    return env


def uninterrupted(args: argparse.Namespace, work: Path, idle: float) -> dict[str, Any]:
    env = job_env(args, work)
    job = Cluster(env, work / "out", steps=args.steps, step_idle=idle, save_storage_interval=args.interval)
    sampler = Sampler(job.shm[0], job_id_for(env.save_dir))   # a local path is resolved there, a URL kept
    sampler.start()
    started = time.monotonic()
    try:
        job.start_all()
        for node in range(job.nodes):
            if job.wait(node, timeout=args.timeout) != 0:
                raise RuntimeError(job.log(node)[-3000:])
        wall = time.monotonic() - started
    finally:
        sampler.stopping.set()
        sampler.join()
        job.cleanup()
        env.cleanup()
    audit = [json.loads(line) for line in open_storage(env.save_dir).read(layout.AUDIT_LOG).decode().splitlines()]
    committed = sorted({r["step"] for r in audit if r["op"] == "write" and Path(r["path"]).name.startswith("iteration_")})
    logs = "".join(p.read_text() for p in (work / "out").glob("agent-*.log"))
    passed = dict(sorted({int(s): why for s, why in re.findall(r"due step (\d+) passed over on every node: (.*?) \(save",
                                                              logs)}.items()))
    due = list(range(0, args.steps, args.interval))
    step_ms = 1000 * wall / args.steps
    backups = sampler.backup_ms()
    # A due step still undecided when the job ended (its agents starved of CPU for the step or two after it) is
    # neither persisted nor announced: close() persists the newest step instead. Counted apart, never as persisted.
    final = max(committed, default=-1)
    superseded = [s for s in due if s not in committed and s not in passed and final - args.interval < s < final]
    return {"wall_s": wall, "step_ms": step_ms, "job_lags": sampler.job_lags, "node_lags": sampler.node_lags,
            "backup_ms": backups, "due": due, "persisted_due": [s for s in due if s in committed],
            "passed": passed, "superseded": superseded}


def faulted(args: argparse.Namespace, work: Path, idle: float, kind: str, at: int) -> dict[str, Any]:
    env = job_env(args, work)
    extra = (["--kill-at", str(at), "--kill-rank", "2,3", "--kill-signal", "STOP"] if kind == "node" else
             ["--kill-at", str(at), "--kill-rank", "3"])
    job = Cluster(env, work / "out", steps=args.steps, step_idle=idle, save_storage_interval=args.interval,
                  extra_args=extra)
    try:
        job.start_all(max_restarts=0 if kind == "node" else 1)
        if kind == "node":
            deadline = time.monotonic() + args.timeout
            while not job.frozen(job.ranks_of(1)):
                if time.monotonic() > deadline or job.procs[0].poll() is not None:
                    raise RuntimeError(f"node 1 never reached step {at}: {job.log(1)[-2000:]}")
                time.sleep(0.01)   # polling for the frozen ranks' markers against a deadline
            job.kill_node(1)
            job.start(1)
        for node in range(job.nodes):
            if job.wait(node, timeout=args.timeout) != 0:
                raise RuntimeError(job.log(node)[-3000:])
        reports = [job.resumes(rank)[-1] for rank in range(job.world)]
    finally:
        job.cleanup()
        env.cleanup()
    steps = {r["step"] for r in reports}
    step = min((s for s in steps if s is not None), default=None)
    return {"fault": kind, "at": at, "resumed": step, "lost": at - (-1 if step is None else step),
            "sources": [r["source"] for r in reports], "agreed": len(steps) == 1}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-ms", default="0,10,50", help="idle time per step, as when the CPU waits for a GPU")
    parser.add_argument("--faults", type=int, default=3, help="node losses and rank kills each, per configuration")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=5, help="save_storage_interval")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--s3", action="store_true", help="persist to a bucket of a local S3 server (moto) instead")
    args = parser.parse_args(argv)
    server = s3server.MotoServer() if args.s3 else None
    if server is not None:
        os.environ.update(s3server.env(server.url))   # the nodes' torchruns inherit them (Env.environ)
        args.s3_url = server.url
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    rows = []
    base = Path(tempfile.mkdtemp(prefix="mnfresh-"))
    try:
        for idle_ms in [float(x) for x in args.idle_ms.split(",")]:
            idle = idle_ms / 1000
            whole = uninterrupted(args, base / f"i{idle_ms:g}-whole", idle)
            faults = [faulted(args, base / f"i{idle_ms:g}-{kind}{n}", idle, kind, rng.randint(8, args.steps - 8))
                      for kind in ("node", "rank") for n in range(args.faults)]
            lost = {kind: [f["lost"] for f in faults if f["fault"] == kind] for kind in ("node", "rank")}
            row = {"idle_ms": idle_ms, "step_ms": round(whole["step_ms"], 1),
                   "node_loss_lost": lost["node"], "rank_kill_lost": lost["rank"],
                   "sources": sorted({s for f in faults for s in f["sources"] if s}),
                   "job_safe_lag": [statistics.median(whole["job_lags"]), pct(whole["job_lags"], 0.99),
                                    max(whole["job_lags"])],
                   "node_safe_lag": [statistics.median(whole["node_lags"]), pct(whole["node_lags"], 0.99),
                                     max(whole["node_lags"])],
                   "backup_ms": [round(statistics.median(whole["backup_ms"]), 1), round(pct(whole["backup_ms"], 0.99)
                                                                                      or 0, 1)],
                   "due": len(whole["due"]), "due_persisted": len(whole["persisted_due"]),
                   "passed_over": {str(step): why for step, why in whole["passed"].items()},
                   "superseded_by_the_final_persist": whole["superseded"], "faults": faults}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "faults"}), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if server is not None:
            server.stop()
    result = {"benchmark": "multinode_freshness", "seed": seed, "machine": platform.platform(),
              "config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
