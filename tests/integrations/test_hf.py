"""HuggingFace Trainer + TrainerWrapper under a real torchrun (2 ranks, gloo, CPU), a tiny GPT-2 built
from a config: kill -9 and resume from memory, from disk with memory wiped, a plain Trainer resuming
from a wrapper-written checkpoint-N, and torn checkpoint-N folders that are never chosen.

The reference is a plain Trainer (no easyckpt) run uninterrupted: every resumed run must log the same
losses (exact float equality), draw the same Python and numpy random numbers, and hold the same model
and optimizer bits (digest) at every step after the resumed one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the HF integration needs transformers: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install -e '.[hf]'")

import torch  # noqa: E402
from conftest import Env, persisted_states, seeded_random, wait_for, wipe_memory  # noqa: E402
from ddp_job import newest_common_committed, slot_states  # noqa: E402
from hf_job import (  # noqa: E402
    NATIVE_FILES,
    SAVE_STEPS,
    SCRIPT,
    STEPS,
    HFJob,
    assert_continues_exactly,
    killed_run,
    resumed_at,
    run_to_end,
)

from easyckpt_wire import faults, health, layout  # noqa: E402

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFJob, Path]:
    """A plain Trainer, no easyckpt, uninterrupted: the losses of every step and its native checkpoints."""
    env = Env(tmp_path_factory.mktemp("plain-reference"))
    try:
        job = run_to_end(HFJob(env, env.tmp_path / "hf", env.tmp_path / "out", plain=True, save_total_limit=2))
        return job, env.tmp_path / "hf"
    finally:
        env.cleanup()


def test_wrapped_run_matches_plain_trainer_and_writes_native_checkpoints(env: Env, reference: tuple[HFJob, Path]) -> None:
    """The wrapper changes nothing in the run, and its checkpoint-N folders are the Trainer's own:
    same files, the same model bytes, equal optimizer/scheduler/RNG states; save_total_limit applies."""
    plain, plain_dir = reference
    output_dir = env.tmp_path / "hf"
    job = run_to_end(HFJob(env, output_dir, env.tmp_path / "out", save_total_limit=2))
    assert resumed_at(job)[0]["source"] is None
    assert_continues_exactly(job, plain, 0)
    assert sorted(p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-15", "checkpoint-20"], "save_total_limit=2 keeps the two newest, as the Trainer does"
    assert not [p for p in output_dir.iterdir() if p.name.startswith(".easyckpt-")]
    for step in (15, 20):
        ours, theirs = output_dir / f"checkpoint-{step}", plain_dir / f"checkpoint-{step}"
        assert {p.name for p in ours.iterdir()} == {p.name for p in theirs.iterdir()} == NATIVE_FILES
        assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
        for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
            a, b = (torch.load(d / name, weights_only=False) for d in (ours, theirs))
            assert repr(a) == repr(b), f"checkpoint-{step}/{name} differs from the Trainer's own"
        a, b = (json.loads((d / "trainer_state.json").read_text()) for d in (ours, theirs))
        for record in (a, b):  # the Trainer records its control flags in the middle of its save
            record["stateful_callbacks"]["TrainerControl"]["args"].pop("should_save")
        assert a == b


def test_epoch_saves_are_persisted_by_the_agent_and_exported(env: Env, reference: tuple[HFJob, Path]) -> None:
    """save_strategy="epoch": the Trainer saves at the epoch ends (steps 8 and 16) and at the last step
    (20, mid-epoch), none on the persist interval. Each is snapshotted with a persist request, persisted
    by the agent as iteration_N and exported by the export thread, not written by the ranks; the run is
    unchanged, checkpoint-20 holds the reference's step-20 state, and a plain Trainer resumes from
    checkpoint-16 exactly."""
    plain_run, plain_dir = reference
    output_dir = env.tmp_path / "hf"
    save_dir = output_dir / "easyckpt"
    job = run_to_end(HFJob(env, output_dir, env.tmp_path / "out", save_strategy="epoch"))
    assert_continues_exactly(job, plain_run, 0)
    log = job.log()
    for step in (8, 16, 20):
        assert f"exported {save_dir / layout.iteration_dirname(step)} to checkpoint-{step} in" in log, log[-4000:]
        assert {p.name for p in (output_dir / f"checkpoint-{step}").iterdir()} == NATIVE_FILES
    assert "synchronously" not in log
    assert sorted(p.name for p in output_dir.iterdir() if p.name.startswith(("checkpoint-", ".easyckpt-"))) == \
        ["checkpoint-16", "checkpoint-20", "checkpoint-8"]
    assert 20 in [step for step, _ in layout.complete_iterations(save_dir)]
    # The epoch-end save snapshots a step in memory already, with the Trainer's control flags changed: every rank
    # commits that copy before any asks for the step, or the agent could persist a rank's older copy.
    for step, iteration in layout.complete_iterations(save_dir):
        states = [json.loads(state["trainer_state"]) for state in persisted_states(iteration)]
        for state in states:
            del state["is_local_process_zero"], state["is_world_process_zero"]
        assert all(state == states[0] for state in states), f"the ranks' trainer states of step {step} differ"
    ours, theirs = output_dir / "checkpoint-20", plain_dir / "checkpoint-20"
    assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        a, b = (torch.load(d / name, weights_only=False) for d in (ours, theirs))
        assert repr(a) == repr(b), f"checkpoint-20/{name} differs from the Trainer's own"

    plain = run_to_end(HFJob(env, output_dir, env.tmp_path / "plain", plain=True,
                             resume=str(output_dir / "checkpoint-16")))
    assert all(r["global_step"] == 16 for r in resumed_at(plain))
    assert_continues_exactly(plain, plain_run, 16)


def test_kill9_then_resume_from_memory_continues_the_loss_curve(env: Env, reference: tuple[HFJob, Path]) -> None:
    """No compute padding, persists capped to take a few steps (fewer than save_steps), a seeded kill step:
    the rerun resumes from memory at most two steps behind the kill (invariant 9)."""
    rng = seeded_random()
    output_dir = env.tmp_path / "hf"
    first = killed_run(env, output_dir, env.tmp_path / "first", rng.randint(6, 13), step_seconds=0.0,
                       extra_env={"EASYCKPT_PERSIST_MBPS": "20"})
    killed_at = max(first.losses(1))
    persists = re.findall(r"seconds=([\d.]+)", (first.out / "persist.log").read_text())
    print(f"persists took {persists} s")
    newest = newest_common_committed(slot_states(env, output_dir / "easyckpt"))
    assert newest is not None and killed_at - 1 <= newest <= killed_at + 1, (newest, killed_at)

    second = run_to_end(HFJob(env, output_dir, env.tmp_path / "second", resume="newest"))
    for report in resumed_at(second):
        assert (report["step"], report["source"], report["global_step"]) == (newest, "memory", newest), report
    assert_continues_exactly(second, reference[0], newest)
    assert "resumed at step" in second.log()
    assert not list(env.shm_dir.glob("easyckpt-hf-resume-*")), "the staging directory is removed after resume"
    # every checkpoint-N, even one whose export the kill interrupted (its iteration was held from rotation)
    complete = {p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")}
    assert complete == {f"checkpoint-{s}" for s in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS)}
    assert not layout.export_holds(output_dir / "easyckpt"), "every export hold is released"


def test_memory_wiped_resumes_from_newest_complete_on_disk(env: Env, reference: tuple[HFJob, Path]) -> None:
    output_dir = env.tmp_path / "hf"
    killed_run(env, output_dir, env.tmp_path / "first", seeded_random().randint(11, 14))
    wipe_memory(env)
    iterations = [step for step, _ in layout.complete_iterations(output_dir / "easyckpt")]
    checkpoints = [int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*")]
    assert iterations, f"nothing persisted: {sorted(os.listdir(output_dir / 'easyckpt'))}"
    newest = max(iterations)
    assert newest >= max(checkpoints, default=0), "a checkpoint-N is exported from a persisted iteration"

    second = run_to_end(HFJob(env, output_dir, env.tmp_path / "second", resume="newest"))
    for report in resumed_at(second):
        assert (report["step"], report["source"]) == (newest, "disk"), report
        assert isinstance(report.get("load_began"), float), "the soak's judge reads when the load began"
    assert_continues_exactly(second, reference[0], newest)


def test_plain_trainer_resumes_from_a_wrapper_checkpoint(env: Env, reference: tuple[HFJob, Path]) -> None:
    """Kill the wrapped job, then resume it with a plain Trainer from the checkpoint-N the wrapper wrote."""
    output_dir = env.tmp_path / "hf"
    checkpoint = output_dir / "checkpoint-10"
    first = HFJob(env, output_dir, env.tmp_path / "first", step_seconds=0.15)
    try:
        wait_for(lambda: checkpoint.is_dir() or first.proc.poll() is not None, 90, f"{checkpoint} to be exported")
        first.kill_rank(1, seeded_random().randint(11, 14))
        assert first.wait(90) != 0
    finally:
        first.kill()
    assert {p.name for p in checkpoint.iterdir()} == NATIVE_FILES

    plain = run_to_end(HFJob(env, output_dir, env.tmp_path / "plain", plain=True, resume=str(checkpoint)))
    assert all(r["global_step"] == 10 for r in resumed_at(plain))
    assert_continues_exactly(plain, reference[0], 10)


def test_a_resume_from_an_older_checkpoint_folder_begins_a_new_timeline(env: Env,
                                                                         reference: tuple[HFJob, Path]) -> None:
    """``resume_from_checkpoint=<output_dir>/checkpoint-10`` after a run that reached step 20 (a rollback, or
    run_clm.py's way to resume): the run goes another way from there (a spike at step 11), and is killed at 13.
    The wrapper's newer states of the first run must not come back: its iterations 15 and 20 are set aside and
    its snapshots past 10 dropped, so the next resume takes the second run's step 12-14 from memory and
    checkpoint-15 and -20 are the third run's (the first run's are set aside in output_dir). Before, the second
    run's due steps were never persisted ("a newer iteration is complete"), the old checkpoint-15/20 stayed,
    and the third run resumed the first run's step 20 and trained nothing."""
    rng = seeded_random()
    output_dir, save_dir = env.tmp_path / "hf", env.tmp_path / "hf" / "easyckpt"
    first = run_to_end(HFJob(env, output_dir, env.tmp_path / "first"))
    assert {15, 20} <= {step for step, _ in layout.complete_iterations(save_dir)}
    spike = ["--spike-steps", "11"]   # without data skipping: the weights take another course from step 11
    second = HFJob(env, output_dir, env.tmp_path / "second", resume=str(output_dir / "checkpoint-10"),
                   step_seconds=0.15, extra_args=spike)
    killed_at = rng.randint(12, 14)
    try:
        second.kill_rank(1, killed_at)
        assert second.wait(90) != 0
    finally:
        second.kill()
    assert all((r["step"], r["source"]) == (10, "path") for r in resumed_at(second)), resumed_at(second)
    assert "without load()" not in second.log(), second.log()[-3000:]
    # Set aside (rotation may since have removed 15, the older: the agent persisted the newest snapshot when
    # rank 1 died, and abandoned iterations count against max_ckpt_num first)
    aside = {p.name for d in save_dir.glob(".abandoned-*") for p in d.iterdir()}
    assert layout.iteration_dirname(20) in aside <= {layout.iteration_dirname(15), layout.iteration_dirname(20)}, aside
    assert all(10 <= step <= killed_at for step, _ in layout.complete_iterations(save_dir)), \
        layout.complete_iterations(save_dir)
    folders = {p.name for d in output_dir.glob(".abandoned-*") for p in d.iterdir()}
    assert folders == {"checkpoint-15", "checkpoint-20"}, f"the first run's newer folders are set aside: {folders}"

    third = run_to_end(HFJob(env, output_dir, env.tmp_path / "third", resume="newest", extra_args=spike))
    for report in resumed_at(third):
        assert report["source"] == "memory" and killed_at - 2 <= report["step"] <= killed_at, (killed_at, report)
    assert "never persisted" not in third.log(), third.log()[-3000:]
    for step in (15, 20):
        state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
        logged = {row["step"]: row["loss"] for row in state["log_history"] if "loss" in row}
        assert logged[step] == third.losses(0)[step]["loss"] != first.losses(0)[step]["loss"], \
            f"checkpoint-{step} is not the third run's"


def test_a_run_resumed_at_max_steps_trains_no_further_step(env: Env) -> None:
    """A finished run started again (torchrun restarting ranks whose close() failed, say) resumes at its last
    step and trains nothing. The Trainer checks max_steps only after a step: with 8 steps per epoch, step 20
    lies inside the third epoch, which it fast-forwarded into and trained step 21 of (as a plain Trainer
    resumed from checkpoint-20 does: fault soak, seed 101, fault 19 trained steps 21 and 22 of max_steps=20)."""
    output_dir = env.tmp_path / "hf"
    first = run_to_end(HFJob(env, output_dir, env.tmp_path / "first"))
    assert all(sorted(first.losses(rank)) == list(range(1, STEPS + 1)) for rank in range(2))
    exported = sorted(p.name for p in output_dir.glob("checkpoint-*"))

    again = run_to_end(HFJob(env, output_dir, env.tmp_path / "again", resume="newest"))
    for report in resumed_at(again):
        assert (report["step"], report["global_step"]) == (STEPS, STEPS), report
    assert again.losses(0) == again.losses(1) == {}, "a step past max_steps was trained"
    assert f"done at step {STEPS}" in again.log()
    assert f"resumed at step {STEPS}, and max_steps is {STEPS}: nothing left to train" in again.log()
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == exported


def test_the_agent_killed_at_the_end_of_training_is_replaced_and_the_export_written(env: Env) -> None:
    """The node agent dies persisting the last step (20), while rank 0 drains the exports and rank 1 waits for
    it in the Trainer's end-of-training collective: no snapshot comes to replace the agent, so the drain does,
    and checkpoint-20 is written at once. It waited export_timeout (600 s) for it before (fault soak, seed 101,
    fault 99: the agent killed at step 7 of a run that ended within the second after)."""
    output_dir = env.tmp_path / "hf"
    fired = env.tmp_path / "fault-fired"
    job = run_to_end(HFJob(env, output_dir, env.tmp_path / "out", extra_env={
        "EASYCKPT_FAULT": f"agent.persist.after_file@{STEPS}", "EASYCKPT_FAULT_ONCE": str(fired)}))
    assert fired.exists(), "the agent was not killed while persisting the last step"
    assert f"is gone; starting a new one to persist steps [{STEPS}]" in job.log(), job.log()[-4000:]
    complete = {p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")}
    assert complete == {f"checkpoint-{s}" for s in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS)}
    assert not layout.export_holds(output_dir / "easyckpt"), "every export hold is released"


@pytest.mark.parametrize("point", ["hf.export.before_rename", "hf.export.mid_write"])
def test_torn_checkpoints_are_never_chosen(env: Env, reference: tuple[HFJob, Path], point: str) -> None:
    """Rank 0 dies (SIGKILL at a named fault point) while writing or publishing checkpoint-10; two more
    folders look like a plain Trainer killed mid-save. With memory and easyckpt's iterations gone, the
    newest complete checkpoint-N is 5, which is where the job resumes; the Trainer's own pick would be a
    torn one."""
    from transformers.trainer_utils import get_last_checkpoint

    output_dir = env.tmp_path / "hf"
    first = HFJob(env, output_dir, env.tmp_path / "first", step_seconds=0.1,
                  extra_env={"EASYCKPT_FAULT": f"{point}@10#0"})
    try:
        assert first.wait(90) != 0, "the fault point never fired"
    finally:
        first.kill()
    assert f"fault point {point} reached" in first.log()
    assert (output_dir / ".easyckpt-tmp-checkpoint-10").is_dir() and not (output_dir / "checkpoint-10").exists()
    complete = output_dir / "checkpoint-5"
    torn_no_optimizer = output_dir / "checkpoint-14"      # killed before optimizer.pt: the state file came early
    shutil.copytree(complete, torn_no_optimizer)
    (torn_no_optimizer / "optimizer.pt").unlink()
    state = json.loads((torn_no_optimizer / "trainer_state.json").read_text())
    (torn_no_optimizer / "trainer_state.json").write_text(json.dumps({**state, "global_step": 14}))
    torn_truncated = output_dir / "checkpoint-15"         # killed while writing the weights
    torn_truncated.mkdir()
    shutil.copy(complete / "config.json", torn_truncated)
    weights = (complete / "model.safetensors").read_bytes()
    (torn_truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert get_last_checkpoint(str(output_dir)) == str(torn_truncated)

    wipe_memory(env)
    for _step, path in layout.complete_iterations(output_dir / "easyckpt"):
        shutil.rmtree(path)

    second = run_to_end(HFJob(env, output_dir, env.tmp_path / "second", resume="newest"))
    for report in resumed_at(second):
        assert (report["step"], report["source"], report["path"]) == (5, "checkpoint", str(complete)), report
    assert_continues_exactly(second, reference[0], 5)
    for torn in (torn_no_optimizer, torn_truncated):
        assert f"skipping {torn}: incomplete" in second.log()
    assert not (output_dir / ".easyckpt-tmp-checkpoint-10").exists(), "the dead writer's temp folder is cleaned up"


def test_an_explicit_torn_checkpoint_is_refused(env: Env, reference: tuple[HFJob, Path]) -> None:
    """resume_from_checkpoint=<a torn checkpoint-N> fails on every rank, naming the folder, what is missing
    and the fix, instead of training on from a half-written state."""
    output_dir = env.tmp_path / "hf"
    torn = output_dir / "checkpoint-15"
    shutil.copytree(reference[1] / "checkpoint-15", torn)
    (torn / "optimizer.pt").unlink()
    refused = HFJob(env, output_dir, env.tmp_path / "out", resume=str(torn))
    try:
        assert refused.wait(90) != 0
    finally:
        refused.kill()
    log = refused.log()
    assert f"resume_from_checkpoint='{torn}' is incomplete: {torn}/optimizer.pt is missing" in log, log[-3000:]
    assert "pass True to resume from the newest complete state" in log
    assert not refused.losses(0) and not refused.losses(1)


def _example_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_trainer_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Two single-process setups, each saving on steps the persist interval does not cover:
# "steps": eval and save every 4 steps, a scripted metric whose best is step 8, the final step 14 (not on
#   the save_steps grid), save_total_limit=2: checkpoint-8 (best) and checkpoint-14 (newest) stay.
# "epoch": eval and save at each epoch end (8 and 16) and at the last step (20, mid-epoch), best at 16,
#   save_total_limit=1: the Trainer keeps the best besides the newest, and at the end only the best.
IN_PROCESS = {
    "steps": ({"max_steps": 14, "eval_strategy": "steps", "eval_steps": 4, "save_strategy": "steps", "save_steps": 4,
               "save_total_limit": 2}, [1.0, 3.0, 2.0, 1.0], ["checkpoint-14", "checkpoint-8"], [14]),
    "epoch": ({"max_steps": 20, "eval_strategy": "epoch", "save_strategy": "epoch", "save_total_limit": 1},
              [1.0, 3.0, 2.0], ["checkpoint-16"], [8, 16, 20]),
}


def _in_process_run(output_dir: Path, wrapped: bool, setup: str, *, overrides: dict[str, Any] | None = None,
                    scores: list[float] | None = None, resume: bool = False, lora: bool = False,
                    callbacks: list[Any] | None = None, model_seed: int = 0) -> Any:
    """One process, no torchrun, the best model loaded at the end (see IN_PROCESS); ``lora``: a peft LoRA adapter
    on the attention projections is what trains; ``model_seed``: the seed of the model's initialisation."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from easyckpt.transformers import TrainerWrapper

    example = _example_module()
    setup_overrides, score_list, _, _ = IN_PROCESS[setup]
    scores_left = iter(score_list if scores is None else scores)
    args = TrainingArguments(**{
        "output_dir": str(output_dir), "per_device_train_batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 2,
        "logging_steps": 1, "metric_for_best_model": "score", "greater_is_better": True,
        "load_best_model_at_end": True, "seed": 0, "data_seed": 1234, "report_to": "none", "use_cpu": True,
        "disable_tqdm": True, "dataloader_num_workers": 0, **setup_overrides, **(overrides or {})})
    torch.manual_seed(model_seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=example.VOCAB, n_positions=32))
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))
    trainer = Trainer(model=model, args=args, train_dataset=example.SyntheticTokens(32),
                      eval_dataset=example.SyntheticTokens(8, seed=1),
                      compute_metrics=lambda _: {"score": next(scores_left)}, callbacks=callbacks)
    runner = TrainerWrapper(trainer, save_mem_interval=2) if wrapped else trainer
    runner.train(resume_from_checkpoint=True if wrapped or resume else None)
    return trainer


@pytest.mark.parametrize("setup", sorted(IN_PROCESS))
def test_single_process_best_checkpoint_final_save_and_limit_as_the_trainer(
        env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture, setup: str) -> None:
    """save_total_limit keeps the best checkpoint besides the newest, saves off the persist interval
    (the final step, epoch ends) are persisted by the agent and exported like due ones, even when the
    best folder appears after training went on, and load_best_model_at_end finds it: the same folders,
    files and states as a plain Trainer's, in one process (rng_state.pth)."""
    _, _, expected, exported = IN_PROCESS[setup]
    plain = _in_process_run(tmp_path / "plain", wrapped=False, setup=setup)
    caplog.set_level(logging.INFO, logger="easyckpt")
    wrapped = _in_process_run(tmp_path / "wrapped", wrapped=True, setup=setup)
    _assert_as_the_trainer(plain, wrapped, tmp_path, expected, exported, caplog.text)


def _assert_as_the_trainer(plain: Any, wrapped: Any, tmp_path: Path, expected: list[str], exported: list[int],
                           log: str) -> None:
    """The wrapped run's folders (under tmp_path/wrapped) are the plain run's (tmp_path/plain): the same names and
    files, the same weight file bytes, equal states; the same losses, best checkpoint and final model."""
    for step in exported:
        iteration = tmp_path / "wrapped" / "easyckpt" / layout.iteration_dirname(step)
        assert f"exported {iteration} to checkpoint-{step} in" in log
    assert "synchronously" not in log
    for trainer in (plain, wrapped):
        kept = sorted(p.name for p in Path(trainer.args.output_dir).iterdir() if p.name.startswith("checkpoint-"))
        assert kept == expected, kept
        assert Path(trainer.state.best_model_checkpoint).name == expected[-1]
    assert [r.get("loss") for r in plain.state.log_history] == [r.get("loss") for r in wrapped.state.log_history]
    for name in expected:
        ours, theirs = tmp_path / "wrapped" / name, tmp_path / "plain" / name
        assert {p.name for p in ours.iterdir()} == {p.name for p in theirs.iterdir()}
        assert "rng_state.pth" in {p.name for p in ours.iterdir()}
        weights_and_configs = [p.name for p in theirs.iterdir() if p.suffix in (".safetensors", ".json")]
        for file in (file for file in weights_and_configs if file != "trainer_state.json"):
            assert (ours / file).read_bytes() == (theirs / file).read_bytes(), f"{name}/{file}"
        for file in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            a, b = (torch.load(d / file, weights_only=False) for d in (ours, theirs))
            assert repr(a) == repr(b), f"{name}/{file}"
        a, b = (json.loads((d / "trainer_state.json").read_text()) for d in (ours, theirs))
        assert (a["global_step"], a["best_global_step"], a["best_metric"]) == \
            (b["global_step"], b["best_global_step"], b["best_metric"])
        assert Path(a["best_model_checkpoint"]).name == Path(b["best_model_checkpoint"]).name
        # the state of the save point, after that step's evaluation (not the snapshot taken before it)
        assert [r.get("eval_score") for r in a["log_history"]] == [r.get("eval_score") for r in b["log_history"]]
    # the model in memory at the end is the best one, loaded back from its checkpoint
    for (key, a), (_, b) in zip(plain.model.state_dict().items(), wrapped.model.state_dict().items()):
        assert torch.equal(a, b), key


def test_a_lora_run_exports_the_adapter_as_the_trainer(env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A peft LoRA fine-tune (the "steps" setup, the adapter on the attention projections): each checkpoint-N holds
    what the Trainer writes for a peft model, adapter_config.json and adapter_model.safetensors, never the whole
    model. Before, the export wrote every weight to model.safetensors without adapter_config.json: peft's
    from_pretrained refused the folder ("Can't find 'adapter_config.json'") and load_best_model_at_end, finding
    no adapter, kept the last model. PeftModel.from_pretrained reads the exported best adapter back."""
    pytest.importorskip("peft", reason="the LoRA export is tested with peft: pip install -e '.[test]'")
    from peft import PeftModel
    from transformers import GPT2Config, GPT2LMHeadModel

    _, _, expected, exported = IN_PROCESS["steps"]
    plain = _in_process_run(tmp_path / "plain", wrapped=False, setup="steps", lora=True)
    caplog.set_level(logging.INFO, logger="easyckpt")
    wrapped = _in_process_run(tmp_path / "wrapped", wrapped=True, setup="steps", lora=True)
    _assert_as_the_trainer(plain, wrapped, tmp_path, expected, exported, caplog.text)
    for name in expected:
        files = {p.name for p in (tmp_path / "wrapped" / name).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=_example_module().VOCAB,
                                      n_positions=32))
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "wrapped" / expected[-1]))
    trained = {k: v for k, v in wrapped.model.state_dict().items() if "lora_" in k}
    assert trained and all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())


def test_a_lora_run_snapshots_what_trains_and_resumes_exactly(env: Env, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A peft LoRA fine-tune snapshots what trains (the adapter, the optimizer, the base's buffers), not the frozen
    base weights, which the script builds again at every start, as for the Trainer's own checkpoints of a peft model;
    before, every snapshot copied the whole base (14 GB a slot for a LoRA of a 7B model). A run that fails after step 9
    and is started again (a new model and Trainer, as a rerun of the script builds them) resumes from memory, trains
    only the steps left, and ends with the uninterrupted run's losses and weights; the checkpoint-N folders it exports
    are the plain Trainer's, byte for byte (``test_a_lora_run_exports_the_adapter_as_the_trainer``). A rerun that
    builds another base (initialised with another seed) is told so, naming the step and the parameters.
    ``easyckpt convert --to hf`` of such an iteration writes what it holds and says so (it said "the full model
    weights" until 2026-12-07)."""
    pytest.importorskip("peft", reason="the LoRA snapshot is tested with peft: pip install -e '.[test]'")
    from transformers import TrainerCallback

    from easyckpt.transformers.export import read_rank_state

    class Steps(TrainerCallback):
        def __init__(self, fail_at: int | None = None) -> None:
            self.fail_at, self.trained = fail_at, []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.trained.append(state.global_step)
            if state.global_step == self.fail_at:
                raise RuntimeError(f"failed after step {state.global_step}")

    plain_args: dict[str, Any] = {"eval_strategy": "no", "load_best_model_at_end": False, "save_strategy": "no"}
    reference = _in_process_run(tmp_path / "reference", wrapped=True, setup="steps", lora=True, overrides=plain_args)
    model = reference.model
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    final = tmp_path / "reference" / "easyckpt" / layout.iteration_dirname(14)
    snapshot = read_rank_state(final, 0, 1)["model"]
    assert frozen and any("lora_" in name for name in snapshot), sorted(snapshot)
    assert set(snapshot) == set(model.state_dict()) - frozen, set(snapshot) ^ (set(model.state_dict()) - frozen)
    for name, tensor in snapshot.items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    from safetensors.torch import load_file

    from easyckpt import cli
    assert cli.main(["convert", "--to", "hf", str(final), str(tmp_path / "trained.safetensors")]) == 0
    said = capsys.readouterr().out
    assert f"its {len(frozen)} frozen base parameters are not in" in said and "full model" not in said, said
    written = load_file(str(tmp_path / "trained.safetensors"))
    assert set(written) == set(snapshot) and not model.load_state_dict(written, strict=False).unexpected_keys

    failing = Steps(fail_at=9)
    with pytest.raises(RuntimeError, match="failed after step 9"):
        _in_process_run(tmp_path / "run", wrapped=True, setup="steps", lora=True, overrides=plain_args,
                        callbacks=[failing])
    again = Steps()
    resumed = _in_process_run(tmp_path / "run", wrapped=True, setup="steps", lora=True, overrides=plain_args,
                              callbacks=[again])
    assert failing.trained == list(range(1, 10)) and again.trained[0] in (9, 10) and again.trained[-1] == 14, \
        (failing.trained, again.trained)
    assert [r.get("loss") for r in resumed.state.log_history] == [r.get("loss") for r in reference.state.log_history]
    for (name, a), (_, b) in zip(reference.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert "frozen base" not in caplog.text

    with pytest.raises(RuntimeError, match="failed after step 9"):
        _in_process_run(tmp_path / "other", wrapped=True, setup="steps", lora=True, overrides=plain_args,
                        callbacks=[Steps(fail_at=9)])
    _in_process_run(tmp_path / "other", wrapped=True, setup="steps", lora=True, overrides=plain_args, model_seed=1)
    warned = [r.getMessage() for r in caplog.records if "frozen base of this peft model" in r.getMessage()]
    assert len(warned) == 1 and f"of its {len(frozen)} frozen parameters differ" in warned[0], warned
    assert re.search(r"saved step (8|9) trained with", warned[0]), warned[0]


def test_a_resumed_run_keeps_the_best_checkpoint_of_the_run_before_as_the_trainer(
        env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The "steps" setup (best at 8, kept: checkpoint-8 and checkpoint-14), then a second run to step 22 resumed from
    it, with no better score: the best folder of the first run stays, as with a plain Trainer. Before, the second
    run's start exported iteration 12 again (save_total_limit had deleted its checkpoint-12), and that export's
    rotation, before the Trainer had loaded the state that names the best checkpoint, deleted checkpoint-8."""
    later = {"max_steps": 22}
    runs = {}
    for wrapped, name in ((False, "plain"), (True, "wrapped")):
        _in_process_run(tmp_path / name, wrapped=wrapped, setup="steps")
        if wrapped:
            caplog.set_level(logging.INFO, logger="easyckpt")
        runs[name] = _in_process_run(tmp_path / name, wrapped=wrapped, setup="steps", overrides=later,
                                     scores=[1.0, 1.0, 1.0], resume=True)
    assert "exporting iteration 12" not in caplog.text, "a checkpoint that save_total_limit deleted came back"
    for name, trainer in runs.items():
        kept = sorted(p.name for p in (tmp_path / name).iterdir() if p.name.startswith("checkpoint-"))
        assert kept == ["checkpoint-22", "checkpoint-8"], f"{name}: {kept}"
        assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-8", name
    plain, wrapped_trainer = runs["plain"], runs["wrapped"]
    assert [r.get("loss") for r in plain.state.log_history] == [r.get("loss") for r in wrapped_trainer.state.log_history]
    # load_best_model_at_end loaded the first run's best in both
    for (key, a), (_, b) in zip(plain.model.state_dict().items(), wrapped_trainer.model.state_dict().items()):
        assert torch.equal(a, b), key


def test_configuration_errors_name_the_fix(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from easyckpt.transformers import TrainerWrapper

    def trainer(**overrides: Any) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to="none", use_cpu=True,
                                 **{"save_steps": 5, **overrides})
        return Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)),
                       args=args)

    with pytest.raises(ValueError, match=r"save_steps=5 is not a multiple of save_mem_interval=2.*save_mem_interval=1"):
        TrainerWrapper(trainer(), save_mem_interval=2)
    with pytest.raises(ValueError, match=r"save_steps=0.5 is a fraction.*save_steps=<int>"):
        TrainerWrapper(trainer(save_steps=0.5))
    with pytest.raises(ValueError, match=r"derives save_storage_interval.*save_steps"):
        TrainerWrapper(trainer(), save_storage_interval=10)
    with pytest.raises(NotImplementedError, match="save_on_each_node=False"):
        TrainerWrapper(trainer(save_on_each_node=True))
    # read from a config file as strings: refused by name when the wrapper is made, not once train() starts
    with pytest.raises(ValueError, match=r"TrainerWrapper: max_ckpt_num must be a positive int, got '3'"):
        TrainerWrapper(trainer(), max_ckpt_num="3")
    with pytest.raises(TypeError, match=r"TrainerWrapper: export_timeout must be a number of seconds .* got str '60'"):
        TrainerWrapper(trainer(), export_timeout="60")
    with pytest.raises(ValueError, match=r"save_mem_interval must be a positive int, got '1'"):
        TrainerWrapper(trainer(), save_mem_interval="1")
    with pytest.raises(TypeError, match="wraps a transformers.Trainer"):
        TrainerWrapper(object())  # type: ignore[arg-type]
    wrapper = TrainerWrapper(trainer(save_strategy="no"))
    assert wrapper.args.max_steps == 4 and wrapper.save_steps is None  # other attributes are the Trainer's


def test_fsdp1_trainer_is_refused_with_what_is_supported(tmp_path: Path) -> None:
    """A Trainer that Accelerate runs with FSDP1 (FlatParameters) is refused, naming FSDP2 as the fix, before
    anything is written. The FSDP state the Trainer reads from Accelerate is set by hand here (Accelerate
    enables FSDP on accelerators only); FSDP2 itself runs in test_hf_fsdp.py."""
    import types

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from easyckpt.transformers import TrainerWrapper

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to="none", use_cpu=True, save_steps=2)
    sharded = Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)),
                      args=args)
    sharded.is_fsdp_enabled = True
    state = sharded.accelerator.state
    kept = state.__dict__.get("fsdp_plugin")
    state.fsdp_plugin = types.SimpleNamespace(fsdp_version=1, state_dict_type="FULL_STATE_DICT")
    try:
        with pytest.raises(NotImplementedError, match=r"uses FSDP1.*fsdp_config=\{'version': 2\}"):
            TrainerWrapper(sharded)
    finally:
        state.fsdp_plugin = kept
    assert not (tmp_path / "easyckpt").exists(), "a refused Trainer must not get a save_dir"


def test_fsdp_asked_on_cpu_runs_unsharded_and_the_wrapper_says_so(env: Env, reference: tuple[HFJob, Path]) -> None:
    """TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2}, use_cpu=True) under torchrun: Accelerate
    1.15 keeps its FSDP plugin only on accelerator devices, so the Trainer trains as DDP. The wrapper accepts
    it, logs that FSDP was not enabled, and the run equals the plain (DDP) reference step by step."""
    job = run_to_end(HFJob(env, env.tmp_path / "hf", env.tmp_path / "out", extra_args=["--fsdp"]))
    log = job.log()
    assert "Accelerate did not enable it" in log and "never with use_cpu=True" in log, log[-4000:]
    assert_continues_exactly(job, reference[0], 0)


# --- data skipping and checkpoint health (issue 13) -----------------------------------------------------

SKIP_STEPS = 8


def _skip_run(output_dir: Path, *, spikes: set[int], wrapper_kwargs: dict[str, Any] | None,
              restore_at: int | None = None, resume: bool = False) -> tuple[Any, Any]:
    """One process, the tiny GPT-2, the loss scaled by 1e4 at the steps in ``spikes``. ``restore_at``: the
    reference, which lets step ``restore_at`` update and then puts model, optimizer and scheduler back as
    they were before it (a callback, by construction: no easyckpt). Returns the Trainer and the
    wrapper (None for the plain run), or raises what train() raises."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from easyckpt.transformers import TrainerWrapper

    example = _example_module()

    class Spiky(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * 1e4 if self.state.global_step + 1 in spikes else loss

    class Undo(TrainerCallback):
        saved: Any = None

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step + 1 == restore_at:
                self.saved = copy.deepcopy((kw["model"].state_dict(), kw["optimizer"].state_dict(),
                                            kw["lr_scheduler"].state_dict()))

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.saved is not None:
                model, optim, sched = self.saved
                kw["model"].load_state_dict(model)
                kw["optimizer"].load_state_dict(optim)
                kw["lr_scheduler"].load_state_dict(sched)
                self.saved = None

    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=4, learning_rate=3e-3, warmup_steps=2,
        max_steps=SKIP_STEPS, logging_steps=1, save_strategy="no", max_grad_norm=1.0, seed=0, data_seed=1234,
        report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=example.VOCAB, n_positions=32))
    trainer = Spiky(model=model, args=args, train_dataset=example.SyntheticTokens(64),
                    callbacks=[Undo()] if restore_at is not None else None)
    if wrapper_kwargs is None:
        trainer.train()
        return trainer, None
    wrapper = TrainerWrapper(trainer, save_mem_interval=1, **wrapper_kwargs)
    wrapper.train(resume_from_checkpoint=resume)
    return trainer, wrapper


SKIPPING = {"use_skip_data_by_global_norm": True, "global_norm_spike_threshold": 50.0,
            "global_norm_spike_count_threshold": 2}


def test_hf_spike_is_skipped_exactly_and_health_metrics_ride_with_snapshots(
        env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spike at step 3: the wrapped run's model and optimizer equal, bit for bit, a plain Trainer's that
    undid step 3's update; the Trainer still counted and logged step 3. Each snapshot carried the
    embedding's gradient norm and the step's loss, but the skipped step's only its loss."""
    from easyckpt.checkpointer import Checkpointer

    seen: list[tuple[int, Any]] = []
    original = Checkpointer.save_if_needed

    def spy(self: Checkpointer, step: int, state: Any, *, metrics: Any = None) -> bool:
        seen.append((step, metrics))
        return original(self, step, state, metrics=metrics)

    monkeypatch.setattr(Checkpointer, "save_if_needed", spy)
    ours, _ = _skip_run(tmp_path / "ours", spikes={3}, wrapper_kwargs={
        **SKIPPING, "use_checkpoint_health_monitor": True, "embedding_local_norm_threshold": 270.0})
    reference, _ = _skip_run(tmp_path / "reference", spikes={3}, wrapper_kwargs=None, restore_at=3)
    assert ours.state.global_step == reference.state.global_step == SKIP_STEPS
    norms = {r["step"]: r["grad_norm"] for r in ours.state.log_history if "grad_norm" in r}
    assert sorted(norms) == list(range(1, SKIP_STEPS + 1))
    assert norms[3] > 50.0 > max(n for s, n in norms.items() if s != 3)
    for (key, a), (_, b) in zip(ours.model.state_dict().items(), reference.model.state_dict().items()):
        assert torch.equal(a, b), key
    assert_optimizers_equal(ours.optimizer.state_dict(), reference.optimizer.state_dict())
    assert ours.lr_scheduler.state_dict() == reference.lr_scheduler.state_dict()
    assert [r.get("loss") for r in ours.state.log_history] == [r.get("loss") for r in reference.state.log_history]
    assert [s for s, _ in seen] == list(range(1, SKIP_STEPS + 1))
    for step, metrics in seen:   # the skipped step's gradients were discarded: it is not judged by them
        assert set(metrics) == ({"loss"} if step == 3 else {"embedding_local_norm", "loss"}), (step, metrics)
        assert step == 3 or metrics["embedding_local_norm"] > 0
    assert seen[2][1]["loss"] > 1000 * seen[1][1]["loss"]   # step 3's loss, spiked


def assert_optimizers_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"])
    for index in a["state"]:
        for key, value in a["state"][index].items():
            assert torch.equal(value, b["state"][index][key]), (index, key)


def test_hf_consecutive_spikes_abort_and_the_count_resumes(env: Env, tmp_path: Path) -> None:
    """Spikes at steps 3 and 4 with count threshold 2: TrainingAborted after step 3's snapshot was made
    durable. A rerun resumes at step 3 with one spike counted: one more spike at step 4 aborts at once
    (a fresh count would have skipped it); a rerun without it finishes with one step skipped in all."""
    import easyckpt

    with pytest.raises(easyckpt.TrainingAborted, match="step 4: global norm"):
        _skip_run(tmp_path / "out", spikes={3, 4}, wrapper_kwargs=SKIPPING)
    iteration = tmp_path / "out" / "easyckpt" / layout.iteration_dirname(3)
    assert (iteration / layout.METADATA).is_file(), sorted(p.name for p in iteration.parent.iterdir())
    with pytest.raises(easyckpt.TrainingAborted, match="step 4: global norm"):
        _skip_run(tmp_path / "out", spikes={4}, wrapper_kwargs=SKIPPING, resume=True)
    done, wrapper = _skip_run(tmp_path / "out", spikes=set(), wrapper_kwargs=SKIPPING, resume=True)
    assert wrapper.resumed.step == 3 and done.state.global_step == SKIP_STEPS
    assert wrapper.skipper.state_dict() == {"consecutive": 0, "skipped_total": 1}


def test_hf_skipping_keywords_are_checked(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from easyckpt.transformers import TrainerWrapper

    def trainer() -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to="none", use_cpu=True)
        return Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)),
                       args=args)

    with pytest.raises(ValueError, match="global_norm_spike_threshold=3.0 has no effect without "
                                         "use_skip_data_by_global_norm=True"):
        TrainerWrapper(trainer(), global_norm_spike_threshold=3.0)
    with pytest.raises(ValueError, match="embedding_local_norm_threshold=2.0 has no effect without "
                                         "use_checkpoint_health_monitor=True"):
        TrainerWrapper(trainer(), embedding_local_norm_threshold=2.0)
    with pytest.raises(ValueError, match="global_norm_spike_count_threshold must be a positive int"):
        TrainerWrapper(trainer(), use_skip_data_by_global_norm=True, global_norm_spike_count_threshold=0)
    with pytest.raises(ValueError, match="global_norm_spike_threshold"):
        TrainerWrapper(trainer(), use_skip_data_by_global_norm=True, global_norm_spike_threshold=-1.0)
    with pytest.raises(ValueError, match="embedding_local_norm"):
        TrainerWrapper(trainer(), use_checkpoint_health_monitor=True, embedding_local_norm_threshold=float("nan"))
    with pytest.raises(TypeError, match="use_skip_data_by_global_norm must be True or False"):
        TrainerWrapper(trainer(), use_skip_data_by_global_norm="yes")  # type: ignore[arg-type]
    wrapper = TrainerWrapper(trainer(), use_skip_data_by_global_norm=True, use_checkpoint_health_monitor=True,
                             health_thresholds={"loss": 10.0})
    assert wrapper.skipper is not None
    assert (wrapper.skipper.global_norm_spike_threshold, wrapper.skipper.global_norm_spike_count_threshold) == (1.0, 10)
    assert wrapper.options["health_thresholds"] == {"loss": 10.0, "embedding_local_norm": 1.0}


def test_hf_ddp_skips_a_spike_on_both_ranks_and_aborts_at_two(env: Env, tmp_path: Path) -> None:
    """examples/hf_trainer.py on 2 ranks: the spike at step 3 (every rank's loss scaled) is skipped on both
    ranks alike (DDP's all-reduced norm): the state after step 3 is the state after step 2, the Trainer still
    logs step 3, and the ranks stay equal; spikes at 3 and 4 abort the job with step 3 durable."""
    skip = ["--global-norm-spike-threshold", "50", "--global-norm-spike-count-threshold", "2",
            "--embedding-local-norm-threshold", "270"]
    job = run_to_end(HFJob(env, tmp_path / "hf", tmp_path / "out", save_strategy="no",
                           extra_args=skip + ["--spike-steps", "3"]))
    rows = [job.losses(rank) for rank in range(2)]
    for rank in range(2):
        assert sorted(rows[rank]) == list(range(1, STEPS + 1))
        assert rows[rank][3]["grad_norm"] > 50 > max(r["grad_norm"] for s, r in rows[rank].items() if s != 3)
        assert rows[rank][3]["digest"] == rows[rank][2]["digest"] != rows[rank][1]["digest"]
        assert rows[rank][4]["digest"] != rows[rank][3]["digest"]
    assert [r["digest"] for r in rows[0].values()] == [r["digest"] for r in rows[1].values()]
    assert job.log().count("step 3: global norm") == 2, job.log()[-3000:]

    aborted = HFJob(env, tmp_path / "hf2", tmp_path / "out2", save_strategy="no",
                    extra_args=skip + ["--spike-steps", "3,4"])
    try:
        assert aborted.wait(120) != 0
    finally:
        aborted.kill()
    assert "TrainingAborted" in aborted.log() and "step 4: global norm" in aborted.log()
    assert (tmp_path / "hf2" / "easyckpt" / layout.iteration_dirname(3) / layout.METADATA).is_file()


# Health: the loss scaled by 1e4 puts the embedding's gradient norm far above HEALTH_THRESHOLD (it is
# below 1 otherwise); data skipping stays off, so every step is applied.
HEALTH_THRESHOLD = 100.0
HEALTH_ARGS = ["--embedding-local-norm-threshold", str(HEALTH_THRESHOLD)]


def test_hf_kill_after_an_unhealthy_step_resumes_the_newest_healthy_one_from_memory(env: Env) -> None:
    """Step 14 alone is spiked (its snapshot unhealthy); rank 1 dies once its snapshot of 14 is in memory.
    The rerun passes 14 over and resumes at the newest healthy step in memory, and continues from there: 13, or
    an older one where the ranks skipped 13 (a CI run on a loaded machine skipped 12 and 13 while the agent still
    held 5 and 10 for their persists)."""
    output_dir = env.tmp_path / "hf"
    first = HFJob(env, output_dir, env.tmp_path / "first", extra_args=HEALTH_ARGS + ["--spike-steps", "14",
                                                                                     "--kill-at", "14"])
    try:
        assert first.wait(90) != 0, first.log()[-3000:]
    finally:
        first.kill()
    assert max(first.losses(1)) == 14
    skipped: dict[str, set[int]] = {}   # per rank; the stager logs a run of skips where it starts and where it ends
    for line in first.log().splitlines():
        if began := re.search(r"rank (\d): snapshot of step (\d+) skipped", line):
            skipped.setdefault(began.group(1), set()).update(range(int(began.group(2)), 15))
        elif ended := re.search(r"rank (\d): snapshots resume at step (\d+) after skips", line):
            skipped.setdefault(ended.group(1), set()).difference_update(range(int(ended.group(2)), 15))
    healthy = max(set(range(1, 14)).difference(*skipped.values()))
    assert healthy >= 10, f"the ranks skipped {skipped}"
    second = run_to_end(HFJob(env, output_dir, env.tmp_path / "second", resume="newest", extra_args=HEALTH_ARGS))
    for report in resumed_at(second):
        assert (report["step"], report["source"], report["global_step"]) == (healthy, "memory", healthy), report
    assert sorted(second.losses(0)) == list(range(healthy + 1, STEPS + 1))
    log = second.log()
    assert f"passing over unhealthy snapshots newer than step {healthy}: step 14 (unhealthy on ranks [0, 1]: " \
           "rank 0: embedding_local_norm" in log, log[-4000:]
    entries = {e.step: e.is_health for e in health.read_health_file(output_dir / "easyckpt") or []}
    assert entries and set(entries.values()) == {health.HEALTHY}, entries   # 14 was never persisted


def test_hf_diverged_run_keeps_and_resumes_the_newest_healthy_iteration_from_disk(env: Env) -> None:
    """Every step from 12 on is spiked; persists (and checkpoint-N) every 5 steps, max_ckpt_num=2: rotation
    keeps iteration 10, the newest healthy, besides 20; health_ckpts.json marks exactly those two. With
    memory wiped the rerun resumes from iteration 10 on disk, passing over the unhealthy checkpoint-15 and
    checkpoint-20 the Trainer's own pick would be."""
    output_dir = env.tmp_path / "hf"
    spiked = ",".join(str(step) for step in range(12, STEPS + 1))
    run_to_end(HFJob(env, output_dir, env.tmp_path / "first",
                     extra_args=HEALTH_ARGS + ["--spike-steps", spiked, "--max-ckpt-num", "2"]))
    save_dir = output_dir / "easyckpt"
    kept = [step for step, _ in layout.complete_iterations(save_dir)]
    assert kept == [10, 20], kept
    entries = {e.step: e.is_health for e in health.read_health_file(save_dir) or []}
    assert entries == {10: health.HEALTHY, 20: health.UNHEALTHY}, entries
    assert sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*")) == [5, 10, 15, 20]
    for step in (5, 10, 15, 20):   # the folders the Trainer wrote, and the unhealthy ones say so
        files = {p.name for p in (output_dir / f"checkpoint-{step}").iterdir()}
        assert files == (NATIVE_FILES | {"easyckpt_health.json"} if step > 10 else NATIVE_FILES), (step, files)
    wipe_memory(env)
    second = run_to_end(HFJob(env, output_dir, env.tmp_path / "second", resume="newest", extra_args=HEALTH_ARGS))
    for report in resumed_at(second):
        assert (report["step"], report["source"]) == (10, "disk"), report
    assert sorted(second.losses(0)) == list(range(11, STEPS + 1))
    log = second.log()
    assert f"passing over {output_dir / 'checkpoint-20'}: unhealthy (rank 0: embedding_local_norm" in log, log[-4000:]
    assert "passing over unhealthy snapshots newer than step 10: step 20" in log, log[-4000:]


class _UnlinkOnLine(logging.Handler):
    """Removes ``arm`` (a held fault point goes on) once a log record says ``text``: the test's event, in the very
    process that logs it, with no polling."""

    def __init__(self, text: str, arm: Path) -> None:
        super().__init__(logging.INFO)
        self.text, self.arm = text, arm

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.arm.unlink(missing_ok=True)


def test_hf_synchronous_save_carries_the_health_verdict(env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Two slots and the first persist held at a fault point until the synchronous save is logged: the agent
    holds both slots (the persisted step and the safe one), so the final save (step 5) finds no free slot within
    pin_timeout and is written synchronously from the live state. Its checkpoint-5 records the job's verdict like an
    exported one (every step is unhealthy under this threshold), so a resume passes it over. (Before, the export of the
    due step 4, which was never snapshotted, held the end of training for export_timeout.)"""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from easyckpt.transformers import TrainerWrapper
    from easyckpt.transformers.folders import HEALTH_NAME

    monkeypatch.setenv("EASYCKPT_SLOTS", "2")
    # A held persist, not a throttled one: a throttle lasts only as long as the machine's speed lets it (a rehearsal
    # on 2026-12-03: a 5 s stall let the FSDP2 twin of this test find a free slot). The line releases it.
    arm = tmp_path / "hold-the-first-persist"
    arm.touch()
    monkeypatch.setenv(faults.ENV, "agent.persist.after_file:hold")
    monkeypatch.setenv(faults.ARM_ENV, str(arm))
    release = _UnlinkOnLine("writing checkpoint-5 synchronously", arm)
    example = _example_module()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=5, save_strategy="steps",
        save_steps=2, logging_steps=1, seed=0, report_to="none", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=example.VOCAB, n_positions=32))
    trainer = Trainer(model=model, args=args, train_dataset=example.SyntheticTokens(64))
    caplog.set_level(logging.INFO, logger="easyckpt")
    logging.getLogger("easyckpt").addHandler(release)
    try:
        # final_persist=False: checkpoint-5 is the synchronous save's; the end-of-run persist adds nothing to read
        TrainerWrapper(trainer, save_mem_interval=1, pin_timeout=1.0, use_checkpoint_health_monitor=True,
                       final_persist=False, embedding_local_norm_threshold=1e-9).train()
    finally:
        logging.getLogger("easyckpt").removeHandler(release)
        arm.unlink(missing_ok=True)
    assert "writing checkpoint-5 synchronously" in caplog.text, caplog.text[-4000:]
    # the due step 4 found no slot either: its export gave up at once rather than holding up the end
    assert "no checkpoint-4: step 4 was not snapshotted on every rank" in caplog.text, caplog.text[-4000:]
    verdict = json.loads((tmp_path / "out" / "checkpoint-5" / HEALTH_NAME).read_text())
    assert verdict["healthy"] is False and verdict["reasons"][0].startswith("rank 0: embedding_local_norm "), verdict
