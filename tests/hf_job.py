"""examples/hf_trainer.py under torchrun (2 ranks, gloo, CPU) for the tests of several tiers: the job, and the
checks that a resumed run continues the plain Trainer's curve exactly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ROOT, Env
from ddp_job import TORCHRUN, Job
from soak_job import free_port  # below the ephemeral ports

SCRIPT = ROOT / "examples" / "hf_trainer.py"
STEPS = 20          # 8 optimizer steps per epoch: the runs cross two epoch boundaries
SAVE_STEPS = 5
NATIVE_FILES = {"config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "training_args.bin"}


class HFJob(Job):
    """examples/hf_trainer.py under torchrun; the loss/resume/pid files are those Job reads."""

    def __init__(self, env: Env, output_dir: Path, out: Path, *, resume: str | None = None, plain: bool = False,
                 step_seconds: float = 0.0, save_total_limit: int | None = None, save_strategy: str = "steps",
                 extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 via: Path | None = None, nproc: int = 2, launcher: str = "torchrun") -> None:
        """``via``: a script that runs the example (``accelerate_fsdp_cpu.py``); ``launcher="deepspeed"``: the
        DeepSpeed launcher instead of torchrun (LOCAL_SIZE, not LOCAL_WORLD_SIZE, and on CPU Accelerate then
        writes LOCAL_WORLD_SIZE=1 into every rank: easyckpt.node.topology)."""
        self.out = out
        self.nproc = nproc
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "torchrun.log"
        self.master_port = free_port() if launcher == "deepspeed" else None
        start = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"] if launcher == "torchrun" \
            else [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", f"--num_gpus={nproc}",
                  f"--master_port={self.master_port}"]
        command = start + ([str(via)] if via is not None else []) + [str(SCRIPT),
                              "--output-dir", str(output_dir), "--out", str(out), "--steps", str(STEPS),
                              "--save-steps", str(SAVE_STEPS), "--save-strategy", save_strategy,
                              "--step-seconds", str(step_seconds)]
        if resume is not None:
            command += ["--resume"] + ([] if resume == "newest" else [resume])
        if plain:
            command.append("--plain")
        if save_total_limit is not None:
            command += ["--save-total-limit", str(save_total_limit)]
        command += extra_args or []
        extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "HF_HUB_OFFLINE": "1", **(extra_env or {})}
        if launcher != "torchrun":   # torchrun's default: the same float sums as a torchrun reference run
            extra.setdefault("OMP_NUM_THREADS", "1")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env.environ(EASYCKPT_LOG_LEVEL="INFO", **extra), cwd=str(ROOT))


    def kill(self) -> None:
        super().kill()
        if self.master_port is not None:
            # Under its own launcher (LOCAL_SIZE set) DeepSpeed's CPU all-reduce maps a 66 MB buffer per rank in
            # /dev/shm, named by the master port, and never unlinks it: 264 MB left by each run of the suite
            for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{self.master_port}_*"):
                buffer.unlink(missing_ok=True)


def run_to_end(job: HFJob, timeout: float = 120) -> HFJob:
    try:
        assert job.wait(timeout) == 0, job.log()[-4000:]
    finally:
        job.kill()
    return job


def assert_continues_exactly(resumed: Job, reference: Job, from_step: int, steps: int = STEPS) -> None:
    for rank in range(2):
        ours, theirs = resumed.losses(rank), reference.losses(rank)
        assert sorted(ours) == list(range(from_step + 1, steps + 1)), f"rank {rank} ran steps {sorted(ours)}"
        for step, row in ours.items():
            for key in ("loss", "digest", "py_rand", "np_rand", "learning_rate", "grad_norm", "epoch"):
                assert row[key] == theirs[step][key], f"rank {rank} step {step}: {key} {row[key]!r} != {theirs[step][key]!r}"


def resumed_at(job: Job) -> list[dict[str, Any]]:
    return [job.resumes(rank)[-1] for rank in range(2)]


def killed_run(env: Env, output_dir: Path, out: Path, at_step: int, *, step_seconds: float = 0.15,
               extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None) -> HFJob:
    job = HFJob(env, output_dir, out, step_seconds=step_seconds, extra_env=extra_env, extra_args=extra_args)
    try:
        job.kill_rank(1, at_step)
        assert job.wait(90) != 0
    finally:
        job.kill()
    return job
