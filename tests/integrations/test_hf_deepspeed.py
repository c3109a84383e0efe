"""TrainerWrapper with DeepSpeed ZeRO 1, 2 and 3 under a real torchrun (2 ranks, gloo, DS_ACCELERATOR=cpu), the
tiny GPT-2 of examples/hf_trainer.py; and the launches it refuses before anything is written.

The reference is the same wrapped job run uninterrupted: a resumed run must log the same losses, grad norms
and learning rates (exact float equality), draw the same random numbers and hold the same bits (digest of
the module and of this rank's ZeRO optimizer state: its partition of the Adam moments and fp32 master
weights) at every step after the one it resumed at.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the HF integration needs transformers: pip install -e '.[hf]'")
pytest.importorskip("deepspeed", reason="needs DeepSpeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from conftest import DEEPSPEED_BUILD_TIMEOUT, Env, seeded_random, wait_for, wipe_memory  # noqa: E402
from ddp_job import newest_common_committed, slot_states  # noqa: E402
from hf_job import HFJob, assert_continues_exactly, resumed_at, run_to_end  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from easyckpt import cli  # noqa: E402
from easyckpt import dcp as edcp  # noqa: E402
from easyckpt.transformers.export import read_rank_state  # noqa: E402
from easyckpt.transformers.snapshot import FROZEN_KEY  # noqa: E402
from easyckpt_wire import layout  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 12          # 8 optimizer steps per epoch on 2 ranks: the runs cross an epoch boundary
SAVE_STEPS = 5
DS_ENV = {"DS_ACCELERATOR": "cpu"}


def ds_config(tmp: Path, stage: int, **zero: Any) -> Path:
    path = tmp / f"ds-zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, **zero}, "train_batch_size": "auto",
                                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "gradient_clipping": "auto"}))
    return path


def ds_job(env: Env, output_dir: Path, out: Path, config: Path, *, step_seconds: float = 0.0,
           resume: str | None = None, plain: bool = False, extra_args: list[str] | None = None,
           launcher: str = "torchrun", nproc: int = 2) -> HFJob:
    return HFJob(env, output_dir, out, resume=resume, plain=plain, step_seconds=step_seconds, extra_env=DS_ENV,
                 extra_args=["--steps", str(STEPS), "--deepspeed", str(config), *(extra_args or [])],
                 launcher=launcher, nproc=nproc)


References = dict[tuple[int, bool], tuple[HFJob, Path]]


@pytest.fixture(scope="module")
def references() -> References:
    """Per ZeRO stage and LoRA or not, the wrapped job run uninterrupted and its output_dir (run on first use)."""
    return {}


def reference(references: References, tmp_path_factory: pytest.TempPathFactory, stage: int,
              lora: bool = False) -> tuple[HFJob, Path]:
    if (stage, lora) not in references:
        env = Env(tmp_path_factory.mktemp(f"zero{stage}{'-lora' if lora else ''}-reference"))
        try:
            job = run_to_end(ds_job(env, env.tmp_path / "hf", env.tmp_path / "out", ds_config(env.tmp_path, stage),
                                    extra_args=["--lora"] if lora else None))
            references[(stage, lora)] = job, env.tmp_path / "hf"
        finally:
            env.cleanup()
    return references[(stage, lora)]


@pytest.mark.timeout(180 + DEEPSPEED_BUILD_TIMEOUT)   # the first one builds the op (deepspeed_cpu_ops)
@pytest.mark.usefixtures("deepspeed_cpu_ops")
# ZeRO-1 (about 100 s with its reference run) is extended: it partitions the optimizer state as ZeRO-2 does
@pytest.mark.parametrize("stage,tier,lora", [pytest.param(1, "memory", False, marks=pytest.mark.extended),
                                             (2, "memory", False), (2, "disk", False), (3, "memory", False),
                                             (3, "disk", False), (3, "memory", True), (2, "memory", True)],
                         ids=["1-memory", "2-memory", "2-disk", "3-memory", "3-disk", "3-memory-lora", "2-memory-lora"])
def test_zero_kill9_resumes_with_equal_losses(env: Env, stage: int, tier: str, lora: bool, references: References,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """kill -9 one rank mid-training; the rerun resumes (each rank's ZeRO partition back into its engine)
    and continues exactly: from memory, or, with the node's memory wiped, from the newest complete
    iteration on disk. ZeRO-2 from memory runs under the DeepSpeed launcher (``deepspeed --num_gpus 2``), the others
    under torchrun. ``lora``: a peft LoRA adapter on a frozen base, which the snapshots leave out, as DeepSpeed's own
    checkpoint of a peft model does (until 2026-12-07 every snapshot under DeepSpeed held the whole base); the base
    is the one the rerun builds, and the run continues exactly all the same."""
    ref, _ = reference(references, tmp_path_factory, stage, lora)
    config = ds_config(env.tmp_path, stage)
    output_dir = env.tmp_path / "hf"
    save_dir = output_dir / "easyckpt"
    launcher = "deepspeed" if (stage, tier, lora) == (2, "memory", False) else "torchrun"
    lora_args = ["--lora"] if lora else []
    first = ds_job(env, output_dir, env.tmp_path / "first", config, step_seconds=0.15, launcher=launcher,
                   extra_args=lora_args)
    try:
        if tier == "disk":
            wait_for(lambda: SAVE_STEPS in dict(layout.complete_iterations(save_dir)) or first.proc.poll() is not None,
                     90, f"iteration {SAVE_STEPS} to be persisted")
        first.kill_rank(1, seeded_random().randint(6, 9) if tier == "disk" else seeded_random().randint(3, 9))
        assert first.wait(90) != 0
    finally:
        first.kill()
    killed_at = max(first.losses(1))
    if tier == "memory":
        newest = newest_common_committed(slot_states(env, save_dir))
        assert newest is not None and killed_at - 1 <= newest <= killed_at + 1, \
            (newest, killed_at, slot_states(env, save_dir), first.log()[-6000:])
    else:
        wipe_memory(env)
        # The agent makes the newest snapshot durable when a rank dies: disk holds about the killed step.
        newest = max(step for step, _ in layout.complete_iterations(save_dir))
        assert SAVE_STEPS <= newest <= killed_at + 1, (newest, killed_at)

    second = run_to_end(ds_job(env, output_dir, env.tmp_path / "second", config, resume="newest", launcher=launcher,
                               extra_args=lora_args))
    if launcher == "deepspeed":   # Accelerate's LOCAL_WORLD_SIZE=1 beside the launcher's LOCAL_SIZE=2, caught
        assert "rank 1 was told local rank 1 of a node of 1" in second.log(), second.log()[-3000:]
        # until 2026-12-06 each rank took itself for a node of one: "1 nodes" of "1 local ranks" and 4 slots each
        assert "2 of the 2 ranks are on this node" in second.log(), second.log()[-3000:]
        assert "for 2 local ranks" in first.log(), first.log()[-3000:]
    for report in resumed_at(second):
        assert (report["step"], report["source"], report["global_step"]) == (newest, tier, newest), report
    assert_continues_exactly(second, ref, newest, STEPS)
    size = r"[\d.]+ [KM]iB"
    where = "memory" if tier == "memory" else f"disk \\({re.escape(str(save_dir))}/iteration_\\d+, "
    assert re.search(rf"easyckpt: resumed at step {newest} from {where}", second.log()), \
        "the resume is in the Trainer's own log: " + second.log()[-3000:]
    assert re.search(rf"{size}, [\d.]+ s\)", second.log())
    if lora:
        newest_iteration = max(layout.complete_iterations(save_dir))[1]
        for rank in range(2):
            saved = read_rank_state(newest_iteration, rank, 2)
            assert saved["model"] and all("lora_" in name for name in saved["model"]), sorted(saved["model"])
            base = saved[FROZEN_KEY]   # the base's weights (the tied lm_head too), fingerprinted unless partitioned
            assert "base_model.model.lm_head.weight" in base and not set(base) & set(saved["model"]), sorted(base)
            assert all((sums is None) == (stage == 3) for sums in base.values()), base
            assert saved["deepspeed"]["frozen_param_shapes"] is None   # as DeepSpeed's exclude_frozen_parameters
        assert (output_dir / "checkpoint-10" / "adapter_model.safetensors").is_file()
        assert "frozen base" not in second.log(), "the rerun built the same base: " + second.log()[-3000:]


@pytest.mark.timeout(180 + DEEPSPEED_BUILD_TIMEOUT)   # the first one builds the op (deepspeed_cpu_ops)
@pytest.mark.usefixtures("deepspeed_cpu_ops")
@pytest.mark.parametrize("stage", [2, 3])
def test_plain_deepspeed_trainer_resumes_from_a_wrapper_checkpoint_and_zero_to_fp32_reads_it(
        env: Env, stage: int, references: References, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The wrapper's checkpoint-N is DeepSpeed's own layout (``latest``, ``global_stepN/``, one optimizer file
    per rank; under ZeRO-3 one model state file per rank too): a plain Trainer + DeepSpeed resumes from it
    exactly, and zero_to_fp32 consolidates its fp32 partitions to the model's weights (under ZeRO-3 the
    wrapper's model.safetensors is consolidated from the snapshotted parameter partitions: equal as well), and so does
    ``easyckpt convert --to hf`` of the persisted iteration; ``convert --to dcp`` and ``ranks-needed``, which have no
    way to join ZeRO partitions, refuse it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    ref, ref_dir = reference(references, tmp_path_factory, stage)
    checkpoint = env.tmp_path / "checkpoint-10"
    shutil.copytree(ref_dir / "checkpoint-10", checkpoint)
    assert (checkpoint / "latest").read_text() == "global_step10"
    optim_files = {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    model_files = {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"} \
        if stage == 3 else {"mp_rank_00_model_states.pt"}
    assert {p.name for p in (checkpoint / "global_step10").iterdir()} == optim_files | model_files

    weights = load_file(str(checkpoint / "model.safetensors"))
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    assert set(weights) <= set(consolidated) and len(weights) >= len(consolidated) - 1   # lm_head tied to wte
    for name, tensor in weights.items():
        assert torch.equal(consolidated[name], tensor), f"zero_to_fp32's {name} differs from model.safetensors"
    # easyckpt convert --to hf of the persisted iteration: the same whole weights (under ZeRO-3 joined from every
    # rank's partitions; until 2026-12-07 it wrote rank 0's flat slices and said they were the full weights)
    converted = env.tmp_path / "converted.safetensors"
    assert cli.main(["convert", "--to", "hf", str(ref_dir / "easyckpt" / layout.iteration_dirname(10)),
                     str(converted)]) == 0
    ours = load_file(str(converted))
    assert set(weights) <= set(ours) and len(ours) == len(consolidated), (sorted(ours), sorted(weights))
    for name, tensor in weights.items():
        assert torch.equal(ours[name], tensor), f"convert --to hf's {name} differs from model.safetensors"
    # the tools that would take a name's rank-0 slice for the whole tensor refuse, naming the way out
    iteration = str(ref_dir / "easyckpt" / layout.iteration_dirname(10))
    capsys.readouterr()
    assert cli.main(["convert", "--to", "dcp", iteration, str(env.tmp_path / "dcp")]) == 1
    assert cli.main(["ranks-needed", iteration, "--world-size", "4"]) == 1
    said = capsys.readouterr().err
    assert said.count(f"is a DeepSpeed ZeRO-{stage} snapshot of TrainerWrapper") == 2 and "convert --to hf" in said, said
    assert not (env.tmp_path / "dcp").exists()
    # and so does easyckpt.dcp.StorageReader for a partitioned name (until 2026-12-07 it served rank 0's slice),
    # while the model's whole weights under ZeRO-2 load through it (what convert --to hf reads)
    index = edcp.checkpoint_index(Path(iteration))
    partitioned = edcp.deepspeed_partitions(index.tensors, index.values)
    assert any(key.startswith("model.") for key in partitioned) == (stage == 3), partitioned
    for key in [partitioned[0], *(["model.transformer.wte.weight"] if stage == 2 else [])]:
        into = {key: torch.empty(index.tensors[key].global_shape, dtype=torch.float32)}
        if key in partitioned:
            with pytest.raises(CheckpointException, match=f"ZeRO-{stage} snapshot of TrainerWrapper"):
                dcp.load(into, storage_reader=edcp.StorageReader(iteration), no_dist=True)
        else:
            dcp.load(into, storage_reader=edcp.StorageReader(iteration), no_dist=True)
            assert torch.equal(into[key], weights["transformer.wte.weight"])

    config = ds_config(env.tmp_path, stage)
    plain = run_to_end(ds_job(env, env.tmp_path / "hf", env.tmp_path / "plain", config, plain=True,
                              resume=str(checkpoint)))
    assert all(r["global_step"] == 10 for r in resumed_at(plain))
    assert_continues_exactly(plain, ref, 10, STEPS)


@pytest.mark.timeout(180 + DEEPSPEED_BUILD_TIMEOUT)
@pytest.mark.usefixtures("deepspeed_cpu_ops")
def test_a_rerun_on_another_number_of_ranks_is_refused_naming_both(env: Env, references: References,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSpeed loads ZeRO partitions only onto as many ranks as saved them. Until 2026-12-07 a one-rank rerun of a
    two-rank ZeRO-2 run logged "resumed at step 12 from disk" (rank 0's partition, through the reshard tier) and then
    died in DeepSpeed's load; now the wrapper refuses first, naming both counts and the ways on."""
    _, ref_dir = reference(references, tmp_path_factory, 2)
    output_dir = env.tmp_path / "hf"
    shutil.copytree(ref_dir, output_dir)   # another path: another job, whose memory is empty, so disk
    rerun = ds_job(env, output_dir, env.tmp_path / "rerun", ds_config(env.tmp_path, 2), resume="newest", nproc=1)
    try:
        assert rerun.wait(120) != 0
    finally:
        rerun.kill()
    log = rerun.log()
    assert "holds the ZeRO-2 partitions of 2 DeepSpeed ranks, and this run has 1" in log, log[-3000:]
    assert "Run with 2 ranks" in log and "resumed at step" not in log, log[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["no-use-cpu", "offload", "skip-data"])
def test_misconfigured_launch_is_refused_before_anything_is_written(env: Env, case: str) -> None:
    """torchrun on a CPU-only machine without use_cpu=True (transformers then runs each process as its own
    single-process job), ZeRO offload and data skipping under DeepSpeed: the wrapper refuses at construction,
    naming the setting and the fix; no checkpoint, no easyckpt iteration, no temporary folder is written."""
    output_dir = env.tmp_path / "hf"
    if case == "no-use-cpu":
        job = HFJob(env, output_dir, env.tmp_path / "out", extra_args=["--steps", "4", "--no-use-cpu"])
        expected = r"args\.world_size is 1 .* of a job of 2 processes.*TrainingArguments\(use_cpu=True\) \(--use_cpu"
    elif case == "offload":
        config = ds_config(env.tmp_path, 2, offload_optimizer={"device": "cpu"})
        job = ds_job(env, output_dir, env.tmp_path / "out", config)
        expected = r"zero_optimization\.offload_optimizer\.device='cpu'"
    else:   # the grad-norm hook sees DeepSpeed's norm only after engine.step() ran inside backward()
        job = ds_job(env, output_dir, env.tmp_path / "out", ds_config(env.tmp_path, 2),
                     extra_args=["--global-norm-spike-threshold", "1.0"])
        expected = r"use_skip_data_by_global_norm=True .* does not work with DeepSpeed.*after the step changed"
    try:
        assert job.wait(90) != 0
    finally:
        job.kill()
    log = job.log()
    assert re.search(expected, log), log[-4000:]
    written = sorted(str(p.relative_to(output_dir)) for p in output_dir.rglob("*")) if output_dir.exists() else []
    assert written == [], f"written before the refusal: {written}"
    assert not env.slot_files()
