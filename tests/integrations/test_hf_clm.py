"""examples/clm_trainer.py (the Trainer driven as transformers' run_clm.py drives it: HfArgumentParser, a
datasets pipeline from a local text file, a tokenizer trained locally) under a real torchrun, 2 ranks, CPU:
kill -9 a rank mid-training and run the same command again; the rerun resumes and logs the losses, grad
norms and learning rates of the uninterrupted wrapped run (exact float equality). DDP and DeepSpeed ZeRO-2.
"""
from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the HF integration needs transformers: pip install -e '.[hf]'")
pytest.importorskip("datasets", reason="examples/clm_trainer.py reads its text file with datasets: pip install -e '.[hf]'")

from conftest import ROOT, Env, seeded_random  # noqa: E402
from ddp_job import TORCHRUN, Job  # noqa: E402
from test_hf_deepspeed import ds_config  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "clm_trainer.py"
STEPS = 12          # 223 blocks of 32 tokens, 8 per optimizer step on 2 ranks: within the first epoch
SAVE_STEPS = 5


def corpus(path: Path) -> Path:
    rng = random.Random(0)   # the data is fixed: the runs compared must read the same text
    words = [f"w{i}" for i in range(150)]
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(400))
    path.write_text("\n".join(lines) + "\n")
    return path


class ClmJob(Job):
    """examples/clm_trainer.py under torchrun, with run_clm.py-style arguments."""

    def __init__(self, env: Env, output_dir: Path, out: Path, *, deepspeed: Path | None = None,
                 step_seconds: float = 0.0) -> None:
        self.out = out
        self.nproc = 2
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "torchrun.log"
        command = TORCHRUN + [
            "--standalone", "--nproc-per-node=2", "--max-restarts=0", str(SCRIPT),
            "--train_file", str(corpus(env.tmp_path / "corpus.txt")), "--output_dir", str(output_dir),
            "--cache_dir", str(env.tmp_path / "datasets-cache"), "--use_cpu", "--max_steps", str(STEPS),
            "--save_steps", str(SAVE_STEPS), "--logging_steps", "1", "--report_to", "none",
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--seed", "0", "--disable_tqdm", "true",
            "--log_dir", str(out), "--step_seconds", str(step_seconds), "--resume_newest"]
        if deepspeed is not None:
            command += ["--deepspeed", str(deepspeed)]
        env_vars = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env.environ(EASYCKPT_LOG_LEVEL="INFO", **env_vars), cwd=str(ROOT))


def run_to_end(job: ClmJob, timeout: float = 150) -> ClmJob:
    try:
        assert job.wait(timeout) == 0, job.log()[-4000:]
    finally:
        job.kill()
    return job


@pytest.mark.timeout(300)
# zero2 (126 s in CI) is extended: ZeRO-2 under the wrapper is test_hf_deepspeed's; ddp runs the script in CI
@pytest.mark.parametrize("backend", ["ddp", pytest.param("zero2", marks=pytest.mark.extended)])
def test_run_clm_style_script_kill9_and_rerun_gives_equal_losses(env: Env, backend: str,
                                                                 request: pytest.FixtureRequest) -> None:
    if backend == "zero2":
        request.getfixturevalue("deepspeed_cpu_ops")
    config = ds_config(env.tmp_path, 2) if backend == "zero2" else None
    reference = run_to_end(ClmJob(env, env.tmp_path / "ref", env.tmp_path / "ref-out", deepspeed=config))
    assert sorted(reference.losses(0)) == list(range(1, STEPS + 1))

    output_dir = env.tmp_path / "hf"
    first = ClmJob(env, output_dir, env.tmp_path / "first", deepspeed=config, step_seconds=0.15)
    try:
        first.kill_rank(1, seeded_random().randint(3, 9))
        assert first.wait(90) != 0
    finally:
        first.kill()
    killed_at = max(first.losses(0) or {0: None})

    second = run_to_end(ClmJob(env, output_dir, env.tmp_path / "second", deepspeed=config))
    match = re.search(r"easyckpt: resumed at step (\d+) from memory", second.log())
    assert match, "the resume is in the Trainer's own log: " + second.log()[-3000:]
    resumed = int(match.group(1))
    assert killed_at - 1 <= resumed <= killed_at + 1, (resumed, killed_at)
    for rank in range(2):
        ours, theirs = second.losses(rank), reference.losses(rank)
        assert sorted(ours) == list(range(resumed + 1, STEPS + 1)), f"rank {rank} ran steps {sorted(ours)}"
        for step, row in ours.items():
            for key in ("loss", "grad_norm", "learning_rate", "epoch"):
                assert row[key] == theirs[step][key], f"rank {rank} step {step}: {key} {row[key]!r} != {theirs[step][key]!r}"
    assert (output_dir / f"checkpoint-{STEPS}" / "tokenizer.json").is_file(), "checkpoint-N has the tokenizer"
