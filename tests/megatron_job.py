"""examples/megatron_gpt.py under torchrun (2 ranks, gloo, CPU) for the tests of several tiers: the job, and the
check that a resumed run logs the uninterrupted run's losses and ends with its digest."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ROOT, Env, wait_for

SCRIPT = ROOT / "examples" / "megatron_gpt.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ITERS = 24
IDLE = "0.03"


class Job:
    """One torchrun of examples/megatron_gpt.py (2 ranks unless told)."""

    def __init__(self, env: Env, out: Path, *, save_dir: Path, iters: int = ITERS, max_restarts: int = 0,
                 storage_interval: int = 5, extra: tuple[str, ...] = (), nproc: int = 2, idle: str = IDLE,
                 extra_env: dict[str, str] | None = None) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "torchrun.log"
        command = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", str(SCRIPT),
                              "--save-dir", str(save_dir), "--out", str(out), "--train-iters", str(iters),
                              "--save-storage-interval", str(storage_interval), "--step-idle", idle, *extra]
        self._log = open(self.log_path, "w")
        # A rendezvous store per attempt: restarted gloo workers otherwise get stale addresses (pytorch#135712).
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                     env=env.environ(EASYCKPT_LOG_LEVEL="INFO", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                                                     **(extra_env or {})))

    def wait(self, timeout: float = 90) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"job did not end within {timeout:.0f}s:\n{self.log()[-3000:]}") from None
        finally:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def pid(self, rank: int) -> int:
        return int((self.out / f"pid-rank{rank}").read_text())

    def losses(self, rank: int) -> dict[int, float]:
        path = self.out / f"losses-rank{rank}.jsonl"
        rows: dict[int, float] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    row = json.loads(line)
                    rows[row["iteration"]] = row["loss"]   # a re-run iteration overwrites: the curve as resumed
        return rows

    def reached(self, rank: int, iteration: int) -> bool:
        return any(i >= iteration for i in self.losses(rank))

    def wait_reached(self, rank: int, iteration: int) -> None:
        wait_for(lambda: self.reached(rank, iteration) or self.proc.poll() is not None, 60,
                 f"rank {rank} to reach iteration {iteration}")
        assert self.proc.poll() is None, f"job ended before iteration {iteration}:\n{self.log()[-3000:]}"

    def resumes(self, rank: int) -> list[dict[str, Any]]:
        paths = sorted(self.out.glob(f"resume-rank{rank}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return [json.loads(p.read_text()) for p in paths]

    def final(self, rank: int) -> dict[str, Any]:
        return json.loads((self.out / f"final-rank{rank}.json").read_text())


def assert_same_curve(job: Job, reference: dict[int, Any], *, start: int = 1) -> None:
    for rank in (0, 1):
        losses, expected = job.losses(rank), reference[rank][0]
        assert sorted(losses) == list(range(start, ITERS + 1)), f"rank {rank}: iterations {sorted(losses)}"
        diff = {i: (losses[i], expected[i]) for i in losses if losses[i] != expected[i]}
        assert not diff, f"rank {rank}: losses differ from the uninterrupted run (got, expected): {diff}"
        assert job.final(rank)["digest"] == reference[rank][1]["digest"], f"rank {rank}: final state differs"
        assert job.final(rank)["flops"] == reference[rank][1]["flops"]
