"""The main demo: a 2-rank torchrun job on CPU snapshots every step, persists every 10th, loses a rank
to ``kill -9``, is restarted by torchrun, and resumes from shared memory.

    python examples/demo.py [--out demo-out]

It first runs the same job uninterrupted, so it can show that the resumed run continues the loss
curve bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "plain_ddp.py"


def launch(save_dir: Path, out: Path, steps: int, max_restarts: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # pytorch/pytorch#135712
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", str(SCRIPT), "--save-dir", str(save_dir), "--out", str(out),
               "--steps", str(steps), "--step-seconds", "0.05"]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "torchrun.log", "wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def losses(out: Path, rank: int) -> dict[int, dict]:
    path = out / f"losses-rank{rank}.jsonl"
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                row = json.loads(line)
                rows[row["step"]] = row
    return rows


def wait_step(out: Path, rank: int, step: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in losses(out, rank)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the job stopped before step {step}; see {out / 'torchrun.log'}")
        time.sleep(0.05)  # polling a log file for progress, bounded by the deadline above


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "demo-out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=33)
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    steps = args.steps

    print(f"1/3 reference: {steps} steps uninterrupted ...", flush=True)
    reference = launch(args.out / "reference-ckpt", args.out / "reference", steps, max_restarts=0)
    if reference.wait(timeout=600) != 0:
        raise SystemExit(f"the reference run failed; see {args.out / 'reference' / 'torchrun.log'}")

    print(f"2/3 the same job under torchrun --max-restarts=1; kill -9 rank 1 at step {args.kill_at} ...", flush=True)
    run = args.out / "run"
    job = launch(args.out / "ckpt", run, steps, max_restarts=1)
    wait_step(run, 1, args.kill_at, job, timeout=600)
    victim = int((run / "pid-rank1").read_text())
    os.kill(victim, signal.SIGKILL)
    killed_at = max(losses(run, 1))
    print(f"    killed rank 1 (pid {victim}) after step {killed_at}", flush=True)
    if job.wait(timeout=600) != 0:
        raise SystemExit(f"the job did not recover; see {run / 'torchrun.log'}")

    print("3/3 result", flush=True)
    same = True
    for rank in range(2):
        report = json.loads(max(run.glob(f"resume-rank{rank}-*.json"), key=lambda p: p.stat().st_mtime).read_text())
        print(f"    rank {rank}: resumed at step {report['step']} from {report['source']} in "
              f"{report['seconds'] * 1000:.1f} ms ({report['bytes'] / 1e6:.2f} MB)")
        ours, theirs = losses(run, rank), losses(args.out / "reference", rank)
        same &= report["digest"] == theirs[report["step"]]["digest"]
        same &= all(ours[s]["loss"] == theirs[s]["loss"] for s in range(report["step"] + 1, steps))
    print(f"    state and loss curve after resume identical to the uninterrupted run: {'yes' if same else 'NO'}")
    persisted = sorted(p.name for p in (args.out / "ckpt").glob("iteration_*"))
    print(f"    on disk ({args.out / 'ckpt'}): {', '.join(persisted)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
