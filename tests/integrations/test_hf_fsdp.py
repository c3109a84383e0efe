"""TrainerWrapper with FSDP2 through Accelerate (``fsdp="full_shard"``, ``fsdp_config={"version": 2}``)
under a real torchrun (2 ranks, gloo, CPU), the tiny GPT-2 of examples/hf_trainer.py.

Accelerate enables FSDP on accelerator devices only; ``accelerate_fsdp_cpu.py`` lifts that one check and
runs the example unchanged, so that FSDP2 itself (``fully_shard``, DTensor parameters and AdamW state,
the Trainer's and Accelerate's FSDP save and load code) runs here on CPU. The reference is a plain
Trainer with FSDP2, uninterrupted, without saves (on CPU the plain Trainer's own FSDP save of the tied
GPT-2 fails in ``save_pretrained``, a transformers matter): every resumed run must log the same losses,
RNG draws and model/optimizer digests (DTensor local shards) at every step after the resumed one. A run
on another number of ranks is checked against the saved state itself (whole tensors, bitwise).
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the HF integration needs transformers: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install -e '.[hf]'")

import torch  # noqa: E402
from conftest import ROOT, Env, seeded_random, wait_for, wipe_memory  # noqa: E402
from hf_job import STEPS, HFJob, assert_continues_exactly, resumed_at, run_to_end  # noqa: E402

from easyckpt_wire import faults, layout  # noqa: E402

pytestmark = pytest.mark.slow

VIA = ROOT / "tests" / "accelerate_fsdp_cpu.py"
FSDP = ["--fsdp"]
SHARDED = FSDP + ["--fsdp-state-dict-type", "SHARDED_STATE_DICT"]
COMMON = {"scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "training_args.bin",
          "config.json", "generation_config.json"}


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> HFJob:
    env = Env(tmp_path_factory.mktemp("fsdp-reference"))
    try:
        return run_to_end(HFJob(env, env.tmp_path / "hf", env.tmp_path / "out", plain=True, save_strategy="no",
                                extra_args=FSDP, via=VIA))
    finally:
        env.cleanup()


def killed_at(env: Env, output_dir: Path, out: Path, step: int, args: list[str]) -> None:
    job = HFJob(env, output_dir, out, extra_args=args + ["--kill-at", str(step)], via=VIA)
    try:
        assert job.wait(120) != 0, "rank 1 was to kill itself"
    finally:
        job.kill()


def killed_resumes_from_memory_exactly(env: Env, output_dir: Path, step: int, args: list[str],
                                       reference: HFJob) -> None:
    """Rank 1 SIGKILLs itself after ``step``; the rerun resumes there from memory on both ranks and goes on exactly
    as ``reference``."""
    killed_at(env, output_dir, env.tmp_path / "killed", step, args)
    job = run_to_end(HFJob(env, output_dir, env.tmp_path / "resumed", resume="newest", extra_args=args, via=VIA))
    assert [(r["step"], r["source"]) for r in resumed_at(job)] == [(step, "memory")] * 2, resumed_at(job)
    assert_continues_exactly(job, reference, step)


def test_fsdp2_trainer_killed_resumes_from_memory_exactly(env: Env, fsdp_reference: HFJob) -> None:
    """The Trainer's default FULL_STATE_DICT: rank 1 SIGKILLs itself after a seeded random step; the rerun
    resumes at that very step from memory (each rank's DTensor shards staged as the Trainer's sharded FSDP
    layout, read by the Trainer's own resume) and goes on bit-exactly. checkpoint-N is Accelerate's
    FULL_STATE_DICT layout: whole model and optimizer states that an unsharded GPT-2 loads strictly."""
    output_dir = env.tmp_path / "hf"
    killed_resumes_from_memory_exactly(env, output_dir, seeded_random().randint(6, 14), FSDP, fsdp_reference)
    assert not list(env.shm_dir.glob("easyckpt-hf-resume-*")), "the staged resume directory is removed"

    folder = output_dir / f"checkpoint-{STEPS}"
    assert {p.name for p in folder.iterdir()} == COMMON | {"pytorch_model_fsdp.bin", "optimizer.bin"}
    from transformers import GPT2Config, GPT2LMHeadModel

    weights = torch.load(folder / "pytorch_model_fsdp.bin", weights_only=True)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(str(folder)))
    model.load_state_dict(weights, strict=True)
    optim = torch.load(folder / "optimizer.bin", weights_only=True)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {name: tuple(s["exp_avg"].shape) for name, s in optim["state"].items()} == shapes


def test_fsdp2_sharded_resume_from_disk_and_a_plain_trainer_resumes_our_checkpoint(env: Env,
                                                                                    fsdp_reference: HFJob) -> None:
    """SHARDED_STATE_DICT: killed after a seeded random step in 11-14, whose snapshot the agent persists when
    rank 1 dies (flush on failure); then the node's memory is wiped (agent and slots gone): the rerun resumes
    from disk at that step and goes on exactly; its checkpoint-15 is two DCP directories
    (pytorch_model_fsdp_0/, optimizer_0/) holding whole tensors, from which a plain FSDP2 Trainer resumes
    and goes on exactly (DCP's load planning takes each rank's shard)."""
    step = seeded_random().randint(11, 14)
    output_dir = env.tmp_path / "hf"
    killed_at(env, output_dir, env.tmp_path / "killed", step, SHARDED)
    wipe_memory(env)
    job = run_to_end(HFJob(env, output_dir, env.tmp_path / "resumed", resume="newest", extra_args=SHARDED, via=VIA))
    assert [(r["step"], r["source"]) for r in resumed_at(job)] == [(step, "disk")] * 2, resumed_at(job)
    assert_continues_exactly(job, fsdp_reference, step)
    assert (output_dir / "easyckpt" / layout.iteration_dirname(15) / layout.METADATA).is_file()

    folder = output_dir / "checkpoint-15"
    assert {p.name for p in folder.iterdir()} == COMMON | {"pytorch_model_fsdp_0", "optimizer_0"}
    plain = run_to_end(HFJob(env, env.tmp_path / "plain-hf", env.tmp_path / "plain", plain=True, save_strategy="no",
                             resume=str(folder), extra_args=SHARDED, via=VIA))
    assert all(r["global_step"] == 15 for r in resumed_at(plain))
    assert_continues_exactly(plain, fsdp_reference, 15)


def test_fsdp2_trainer_resumes_on_another_number_of_ranks(env: Env) -> None:
    """Saved by 2 FSDP2 ranks (SHARDED_STATE_DICT), resumed with resume_from_checkpoint=True by 3: the newest
    state (step 20, resharded by ``Checkpointer.load`` from the old world's memory or from disk, staged whole
    by rank 0) is what the Trainer's FSDP resume loads: the whole model and AdamW state the 3-rank run starts
    from, gathered from its shards, equals iteration 20 read whole from disk, bitwise; training goes on to
    step 24."""
    from easyckpt.tools.convert import full_state

    output_dir = env.tmp_path / "hf"
    run_to_end(HFJob(env, output_dir, env.tmp_path / "two", extra_args=SHARDED, via=VIA))
    three = run_to_end(HFJob(env, output_dir, env.tmp_path / "three", resume="newest", nproc=3, via=VIA,
                             extra_args=SHARDED + ["--steps", "24", "--save-full-at", "begin"]), timeout=180)
    resumes = [three.resumes(rank)[-1] for rank in range(3)]
    assert {(r["step"], r["source"] in ("memory", "disk")) for r in resumes} == {(STEPS, True)}, resumes
    assert sorted(three.losses(0)) == list(range(STEPS + 1, 25))

    saved = full_state(output_dir / "easyckpt" / layout.iteration_dirname(STEPS))
    began = torch.load(three.out / f"begin-full-0-{STEPS}.pt", weights_only=True)
    assert began["model"].keys() == saved["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(began["model"][name], tensor), f"model {name} differs from the saved step {STEPS}"
    assert began["optim"]["state"].keys() == saved["optim"]["state"].keys()
    for name, entry in saved["optim"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(began["optim"]["state"][name][key], tensor), f"optimizer {name}.{key} differs"


def test_fsdp2_trainer_skips_a_spike_on_both_ranks(env: Env) -> None:
    """Data skipping under FSDP2: the spike at step 3 (every rank's loss scaled) is seen in the global norm
    the Trainer clips by (whole, from every rank's DTensor shards) and skipped on both ranks alike: each
    rank's shard after step 3 is its shard after step 2, and training goes on from there."""
    skip = ["--global-norm-spike-threshold", "50", "--global-norm-spike-count-threshold", "2"]
    job = run_to_end(HFJob(env, env.tmp_path / "hf", env.tmp_path / "out", save_strategy="no", via=VIA,
                           extra_args=FSDP + skip + ["--spike-steps", "3"]))
    for rank in range(2):
        rows = job.losses(rank)
        assert sorted(rows) == list(range(1, STEPS + 1))
        assert rows[3]["grad_norm"] > 50 > max(r["grad_norm"] for s, r in rows.items() if s != 3)
        assert rows[3]["digest"] == rows[2]["digest"] != rows[1]["digest"], f"rank {rank} applied step 3"
        assert rows[4]["digest"] != rows[3]["digest"]
    assert job.losses(0)[3]["grad_norm"] == job.losses(1)[3]["grad_norm"], "both ranks must judge the same norm"
    assert job.log().count("step 3: global norm") == 2, job.log()[-3000:]


def test_fsdp2_synchronous_save_writes_the_live_state(env: Env) -> None:
    """The fallback when no slot is free (two slots, the persist of step 3 held in flight, pin_timeout 1 s): the
    final save (step 7, which save_steps=3 does not cover) is written synchronously from the live DTensors
    in the Trainer's FULL_STATE_DICT layout: its model and optimizer files equal the state the run ended
    with, gathered from every rank's shards, bitwise. The agent's persist of step 3 is held at a fault point until
    that write is done (it was throttled to take 3.6 s, and in a rehearsal on 2026-12-03, its agent and ranks stalled for
    5 s, found a slot free at step 7: no synchronous write)."""
    output_dir = env.tmp_path / "hf"
    arm = env.tmp_path / "hold-the-persist-of-3"
    arm.touch()
    job = HFJob(env, output_dir, env.tmp_path / "out", via=VIA,
                extra_env={"EASYCKPT_SLOTS": "2", faults.ENV: "agent.persist.after_file@3:hold",
                           faults.ARM_ENV: str(arm)},
                extra_args=FSDP + ["--steps", "7", "--save-steps", "3", "--pin-timeout", "1", "--save-full-at", "end"])
    try:
        wait_for(lambda: "writing checkpoint-7 synchronously" in job.log() or job.proc.poll() is not None, 180,
                 "the synchronous write of checkpoint-7")
    except AssertionError:
        job.kill()
        raise
    finally:
        arm.unlink()   # the persist of step 3 goes on, and the run can end
    run_to_end(job, timeout=180)
    assert "writing checkpoint-7 synchronously" in job.log(), job.log()[-4000:]
    folder = output_dir / "checkpoint-7"
    assert {p.name for p in folder.iterdir()} >= {"pytorch_model_fsdp.bin", "optimizer.bin", "trainer_state.json",
                                                 "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt"}
    ended = torch.load(job.out / "end-full-0-7.pt", weights_only=True)
    weights = torch.load(folder / "pytorch_model_fsdp.bin", weights_only=True)
    assert weights.keys() == ended["model"].keys()
    for name, tensor in ended["model"].items():
        assert torch.equal(weights[name], tensor), f"model {name} differs from the live state"
    optim = torch.load(folder / "optimizer.bin", weights_only=True)
    assert optim["state"].keys() == ended["optim"]["state"].keys()
    for name, entry in ended["optim"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(optim["state"][name][key], tensor), f"optimizer {name}.{key} differs"


def test_fsdp2_lora_snapshots_the_adapter_resumes_exactly_and_a_plain_trainer_resumes_our_checkpoint(env: Env) -> None:
    """A peft LoRA model under FSDP2 (SHARDED_STATE_DICT): the snapshots hold what trains, not the frozen base (it
    was snapshotted whole before 2026-12-07), and the Trainer's FSDP layout, for the resume and in checkpoint-N,
    holds the adapter only in peft's names, as the Trainer's own save_fsdp_model(adapter_only=True) writes and its
    load reads: until then every resume failed in the Trainer's load ("Missing key in checkpoint state_dict:
    ...lora_A.weight"), and a plain Trainer could not resume from the wrapper's checkpoint-N either. Rank 1 SIGKILLs
    itself after a seeded step; the rerun resumes there from memory and goes on exactly as an uninterrupted plain
    Trainer; a plain Trainer resumes from checkpoint-15 and goes on exactly too."""
    from easyckpt.transformers.export import read_rank_state
    from easyckpt.transformers.snapshot import FROZEN_KEY

    lora = SHARDED + ["--lora"]
    reference = run_to_end(HFJob(env, env.tmp_path / "reference-hf", env.tmp_path / "reference", plain=True,
                                 save_strategy="no", extra_args=lora, via=VIA))
    output_dir = env.tmp_path / "hf"
    killed_resumes_from_memory_exactly(env, output_dir, seeded_random().randint(6, 11), lora, reference)

    newest = max(layout.complete_iterations(output_dir / "easyckpt"))[1]
    for rank in range(2):
        saved = read_rank_state(newest, rank, 2)
        assert saved["model"] and all("lora_" in name for name in saved["model"]), sorted(saved["model"])
        # the base's fingerprints are left out: each rank holds shards, whose sums would be collectives
        assert "base_model.model.lm_head.weight" in saved[FROZEN_KEY] and set(saved[FROZEN_KEY].values()) == {None}
    from torch.distributed.checkpoint import FileSystemReader

    folder = output_dir / "checkpoint-15"
    keys = FileSystemReader(str(folder / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    assert keys and all("lora_" in key and ".default." not in key for key in keys), sorted(keys)
    plain = run_to_end(HFJob(env, env.tmp_path / "plain-hf", env.tmp_path / "plain", plain=True, save_strategy="no",
                             resume=str(folder), extra_args=lora, via=VIA))
    assert all(r["global_step"] == 15 for r in resumed_at(plain))
    assert_continues_exactly(plain, reference, 15)
