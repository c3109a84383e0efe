"""examples/lightning_trainer.py under torchrun (2 ranks, gloo, CPU) for the tests of several tiers: the job, and
the check that a resumed run continues the plain Lightning run's curve exactly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ROOT, Env
from ddp_job import TORCHRUN, Job

SCRIPT = ROOT / "examples" / "lightning_trainer.py"
STEPS = 20           # BATCHES_PER_EPOCH batches per epoch and rank: the runs cross two epoch boundaries
BATCHES_PER_EPOCH = 8   # examples/lightning_trainer.py: 64 samples, batches of 4, 2 ranks
SAVE_STEPS = 8       # ModelCheckpoint(every_n_train_steps=8, save_top_k=2, save_last=True)


class LightningJob(Job):
    """examples/lightning_trainer.py under torchrun (or Lightning's own launcher); the loss/resume/pid files are those
    Job reads."""

    def __init__(self, env: Env, root: Path, out: Path, *, steps: int = STEPS, args: list[str] | None = None,
                 extra_env: dict[str, str] | None = None, strategy: str = "ddp", launcher: str = "torchrun") -> None:
        self.out = out
        self.nproc = 2
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "torchrun.log"
        # "lightning": no torchrun, Lightning's own launcher starts rank 1 from rank 0 (the usual way on one machine)
        start = TORCHRUN + ["--standalone", "--nproc-per-node=2", "--max-restarts=0"] if launcher == "torchrun" else \
            [sys.executable]
        command = start + [str(SCRIPT), "--root", str(root), "--out", str(out), "--steps", str(steps),
                           "--save-steps", str(SAVE_STEPS), "--strategy", strategy, *(args or [])] + \
            (["--devices", "2"] if launcher == "lightning" else [])
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                     env=env.environ(EASYCKPT_LOG_LEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                                     **(extra_env or {})))

    def report(self, rank: int) -> dict[str, Any]:
        return self.resumes(rank)[-1]


def run_to_end(job: LightningJob, timeout: float = 120) -> LightningJob:
    try:
        assert job.wait(timeout) == 0, job.log()[-4000:]
    finally:
        job.kill()
    return job


def assert_continues_exactly(resumed: Job, reference: Job, from_step: int, steps: int) -> None:
    for rank in range(2):
        ours, theirs = resumed.losses(rank), reference.losses(rank)
        assert sorted(ours) == list(range(from_step + 1, steps + 1)), f"rank {rank} ran steps {sorted(ours)}"
        for step, row in ours.items():
            for key in ("loss", "ids", "digest", "lr", "epoch"):
                assert row[key] == theirs[step][key], f"rank {rank} step {step}: {key} {row[key]!r} != {theirs[step][key]!r}"
