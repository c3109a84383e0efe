"""Freshness (invariant 9): how far behind a kill the job resumes, and how far the safe step trails.

    python benchmarks/freshness.py --persist-steps 1,5,20 --slots 2,3 --kills 3 --out benchmarks/results/freshness-cpu.json

Each configuration runs ``examples/plain_ddp.py`` under a real 2-rank ``torchrun`` (gloo, CPU): a snapshot
every step, a persist every ``--interval`` steps, a ``--ballast-mb`` tensor in each rank's state, and a busy
loop of ``--step-seconds`` standing for the step's compute. The agent's persist bandwidth is capped
(``EASYCKPT_PERSIST_MBPS``) so that one persist takes about ``--persist-steps`` training steps, the regime
of a large model on network storage.

* **lag**: while the job runs, this process reads the agent's control block and every slot header
  (read-only, a few hundred bytes) every 2 ms and records the newest step any rank committed minus the
  published safe step: the recomputation a kill at that moment would cost beyond the copy in flight.
* **lost**: ``--kills`` runs per configuration SIGKILL rank 1 right after a seeded random step's snapshot
  starts; torchrun restarts the group and the steps lost are the kill step minus the step it resumed at
  (and the source: memory, replica or disk).

The seed is printed and stored; the same seed replays the same kill steps.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from easyckpt_wire.control import ControlReader, control_path  # noqa: E402
from easyckpt_wire.protocol import job_id_for  # noqa: E402
from easyckpt_wire.shm import SlotFormatError, SlotMap, list_slots  # noqa: E402


class Sampler(threading.Thread):
    """Reads the control block and the slot headers every 2 ms; records newest committed step - safe step."""

    def __init__(self, shm_dir: Path, job_id: str) -> None:
        super().__init__(daemon=True)
        self.shm_dir, self.job_id = shm_dir, job_id
        self.stopping = threading.Event()
        self.lags: list[int] = []
        self.unsafe_samples = 0   # samples with committed steps but no safe step published yet

    def run(self) -> None:
        control = ControlReader(control_path(self.shm_dir, self.job_id))
        maps: dict[Path, SlotMap] = {}
        while not self.stopping.wait(0.002):
            word = control.read()
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
            if newest < 0:
                continue
            if word is None or word.safe is None:
                self.unsafe_samples += 1
            else:
                self.lags.append(max(0, newest - word.safe))
        control.close()
        for slot in maps.values():
            slot.close()


def run_job(args: argparse.Namespace, work: Path, *, slots: int, mbps: float, kill_at: int | None) -> dict[str, Any]:
    save_dir, out, shm = work / "ckpt", work / "out", Path(tempfile.mkdtemp(prefix="ezbench-", dir="/dev/shm"))
    runtime = Path(tempfile.mkdtemp(prefix="ezb-", dir="/tmp"))
    env = {**os.environ, "EASYCKPT_SHM_DIR": str(shm), "EASYCKPT_RUNTIME_DIR": str(runtime),
           "EASYCKPT_SLOTS": str(slots), "EASYCKPT_PERSIST_MBPS": f"{mbps:.3f}",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(ROOT),
           "EASYCKPT_LOG_LEVEL": "INFO"}   # each rank's closing line counts its skipped snapshots
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={1 if kill_at is not None else 0}", str(ROOT / "examples" / "plain_ddp.py"),
               "--save-dir", str(save_dir), "--out", str(out), "--steps", str(args.steps),
               "--save-storage-interval", str(args.interval), "--ballast-mb", str(args.ballast_mb),
               "--step-seconds", str(args.step_seconds)]
    if kill_at is not None:
        command += ["--kill-at", str(kill_at), "--kill-rank", "1"]
    sampler = Sampler(shm, job_id_for(save_dir.resolve()))
    sampler.start()
    started = time.monotonic()
    try:
        proc = subprocess.run(command, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=args.timeout)
    finally:
        sampler.stopping.set()
        sampler.join()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    persists = [float(part.split("=")[1]) for line in (out / "persist.log").read_text().splitlines()
                for part in line.split() if part.startswith("seconds=")]
    result: dict[str, Any] = {"wall_s": time.monotonic() - started, "lags": sampler.lags,
                              "persist_s": persists, "skipped": 0}
    if kill_at is not None:
        reports = sorted(out.glob("resume-rank0-*.json"))
        resumed = json.loads(reports[-1].read_text())
        result.update(kill_at=kill_at, resumed_at=resumed["step"], source=resumed["source"],
                      lost=kill_at - (resumed["step"] if resumed["step"] is not None else -1))
    for line in (proc.stdout + proc.stderr).splitlines():
        if "closed:" in line and "skipped" in line:
            result["skipped"] += int(line.split(" skipped")[0].rsplit(", ", 1)[1])
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--persist-steps", default="1,5,20", help="target persist durations, in training steps")
    parser.add_argument("--slots", default="2,3")
    parser.add_argument("--kills", type=int, default=3, help="killed runs per configuration")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--interval", type=int, default=5, help="save_storage_interval")
    parser.add_argument("--ballast-mb", type=float, default=48.0)
    parser.add_argument("--step-seconds", type=float, default=0.1, help="busy compute per step")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--dir", default=None, help="where save_dirs go (default: a temporary directory)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    persist_bytes = 2 * args.ballast_mb * (1 << 20)
    rows = []
    base = Path(args.dir or tempfile.mkdtemp(prefix="freshness-"))
    for steps in [float(s) for s in args.persist_steps.split(",")]:
        mbps = persist_bytes / (steps * args.step_seconds) / 1e6
        for slots in [int(s) for s in args.slots.split(",")]:
            runs = []
            for number in range(args.kills):
                kill_at = rng.randint(args.interval * 2, args.steps - 10)
                work = base / f"p{steps:g}-s{slots}-{number}"
                runs.append(run_job(args, work, slots=slots, mbps=mbps, kill_at=kill_at))
                shutil.rmtree(work, ignore_errors=True)
            lags = [lag for run in runs for lag in run["lags"]]
            persist_s = [s for run in runs for s in run["persist_s"]]
            row = {"persist_steps_target": steps, "slots": slots, "persist_mbps_cap": mbps,
                   "persist_s_median": statistics.median(persist_s) if persist_s else None,
                   "persist_steps_measured": (statistics.median(persist_s) / args.step_seconds) if persist_s else None,
                   "lag_median": statistics.median(lags) if lags else None,
                   "lag_p99": sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else None,
                   "lag_max": max(lags) if lags else None, "lag_samples": len(lags),
                   "kills": [{k: run[k] for k in ("kill_at", "resumed_at", "source", "lost")} for run in runs],
                   "lost_max": max(run["lost"] for run in runs), "skipped": sum(run["skipped"] for run in runs)}
            rows.append(row)
            print(f"persist ~{steps:g} steps (measured {row['persist_steps_measured'] or 0:.1f}), {slots} slots: "
                  f"lag median {row['lag_median']} p99 {row['lag_p99']} max {row['lag_max']}; lost per kill "
                  f"{[k['lost'] for k in row['kills']]} from {sorted({k['source'] for k in row['kills']})}; "
                  f"{row['skipped']} snapshots skipped", flush=True)
    result = {"benchmark": "freshness", "seed": seed, "device": "cpu",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "dir")}, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
