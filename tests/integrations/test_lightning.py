"""PyTorch Lightning + EasyCkpt under a real torchrun or Lightning's own launcher (2 ranks over gloo, CPU; DDP and
ModelParallelStrategy with FSDP2): kill -9 and resume from memory, a new job resuming from disk, a plain Lightning
Trainer resuming from the files EasyCkpt wrote, data skipping, and the strategies refused at start-up.

The reference is a plain Lightning run (no easyckpt) run uninterrupted: every resumed run must log the same
losses (exact float equality), train on the same samples (the mid-epoch data position) and hold the same
model and optimizer bits (digest) at every step after the resumed one. The model has dropout, so a resume
that lost an RNG state would show too.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the Lightning integration needs lightning: pip install -e '.[lightning]'")

import torch  # noqa: E402
from conftest import Env, persisted_states, seeded_random  # noqa: E402
from ddp_job import newest_common_committed, slot_states  # noqa: E402
from lightning_job import BATCHES_PER_EPOCH, SAVE_STEPS, SCRIPT, STEPS, LightningJob, assert_continues_exactly, run_to_end  # noqa: E402

from easyckpt_wire import layout  # noqa: E402

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LightningJob]:
    """Plain Lightning, no easyckpt, uninterrupted, 24 steps (the first 20 are those of a 20-step run); per
    strategy: DDP, and ModelParallelStrategy with FSDP2 (``fully_shard`` in ``configure_model``)."""
    strategy = request.param
    env = Env(tmp_path_factory.mktemp(f"plain-reference-{strategy}"))
    try:
        return strategy, run_to_end(LightningJob(env, env.tmp_path / "root", env.tmp_path / "out", steps=24,
                                                 args=["--plain"], strategy=strategy))
    finally:
        env.cleanup()


def test_kill9_resume_from_memory_then_disk_then_plain_lightning(env: Env, reference: tuple[str, LightningJob]) -> None:
    """A seeded kill -9 mid-epoch; the rerun resumes from memory with the same data position and RNGs; a job
    of another id (its memory unseen) resumes from disk; a plain Trainer resumes from an exported .ckpt (under
    FSDP2: whole tensors assembled from the shards, a file ModelParallelStrategy loads)."""
    strategy, reference_job = reference
    reference = reference_job   # type: ignore[assignment]
    root = env.tmp_path / "root"
    save_dir = root / "easyckpt"
    kill_at = seeded_random().randint(SAVE_STEPS + 1, 2 * SAVE_STEPS - 1)
    # DDP's killed run and its rerun without torchrun: Lightning's own launcher, as users on one machine run it
    launcher = "lightning" if strategy == "ddp" else "torchrun"
    first = LightningJob(env, root, env.tmp_path / "first", args=["--kill-rank", "1", "--kill-at", str(kill_at)],
                         strategy=strategy, launcher=launcher)
    try:
        assert first.wait(120) != 0, "rank 1 was to be killed"
    finally:
        first.kill()
    assert max(first.losses(1)) == kill_at
    newest = newest_common_committed(slot_states(env, save_dir))
    assert newest is not None and kill_at - 2 <= newest <= kill_at, (newest, kill_at)
    for rank in range(2):
        for step, row in first.losses(rank).items():
            assert row["digest"] == reference.losses(rank)[step]["digest"], f"rank {rank} step {step}"

    second = run_to_end(LightningJob(env, root, env.tmp_path / "second", strategy=strategy, launcher=launcher))
    for rank in range(2):
        report = second.report(rank)
        assert report["resumed"]["source"] == "memory" and report["global_step"] == newest, report
        assert report["digest"] == reference.losses(rank)[newest]["digest"], report
    # one node, one line (the callback said it again on every rank, at WARNING, until 2026-12-06)
    said = re.findall(r"resumed at step \d+ from (?:memory|disk)", second.log())
    assert said == [f"resumed at step {newest} from memory"], said
    # A kill in the second epoch's first step can leave the first epoch's end the newest common step (CI,
    # 2026-11-28: killed at 9, resumed at 8): then no batch of the epoch was consumed and none is skipped.
    mid_epoch = newest % BATCHES_PER_EPOCH != 0
    assert ("were skipped in the sampler" in second.log()) == mid_epoch, (newest, second.log()[-3000:])
    assert_continues_exactly(second, reference, newest, STEPS)

    # A new job (another id: the old job's memory is not its own) resumes from the newest complete iteration.
    on_disk = max(step for step, _ in layout.complete_iterations(save_dir))
    assert on_disk == STEPS, "close() made the final step durable"
    third = run_to_end(LightningJob(env, root, env.tmp_path / "third", steps=24, extra_env={"EASYCKPT_JOB_ID": "other"},
                                    strategy=strategy))
    for rank in range(2):
        assert third.report(rank)["resumed"]["source"] == "disk", third.report(rank)
    assert_continues_exactly(third, reference, STEPS, 24)

    # ModelCheckpoint's meaning: every_n_train_steps, save_top_k=2 (by step), save_last; each file the state of
    # its step exactly, written from the persisted iterations.
    checkpoints = root / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt",
                                                             "last.ckpt"]
    for path in checkpoints.iterdir():
        saved = torch.load(path, map_location="cpu", weights_only=False)
        assert saved["global_step"] in (16, 24) and (path.name != "last.ckpt" or saved["global_step"] == 24)
    # rank 0 reads each persisted iteration in one process on purpose: DCP's "torch.distributed is disabled ...
    # assuming the intent is to load in a single process" was said once per .ckpt written
    assert "assuming the intent" not in third.log(), third.log()[-3000:]

    plain = run_to_end(LightningJob(env, env.tmp_path / "plain-root", env.tmp_path / "plain", steps=24,
                                    args=["--plain", "--resume", str(checkpoints / "epoch=1-step=16.ckpt")],
                                    strategy=strategy))
    for rank in range(2):
        report = plain.report(rank)
        assert report["global_step"] == 16 and report["digest"] == reference.losses(rank)[16]["digest"], report
        # Plain Lightning restores no RNG (the dropout masks differ), but the data position of an epoch end is exact
        assert [row["ids"] for _, row in sorted(plain.losses(rank).items())] == \
            [reference.losses(rank)[step]["ids"] for step in range(17, 25)]


def _batch_rows(job: LightningJob, rank: int) -> list[dict[str, Any]]:
    """Every line of a rank's losses file, in order: one per batch (under gradient accumulation, several per step)."""
    return [json.loads(line) for line in (job.out / f"losses-rank{rank}.jsonl").read_text().splitlines()]


def test_gradient_accumulation_resumes_from_memory_exactly(env: Env) -> None:
    """accumulate_grad_batches=4 (two optimizer steps per epoch), rank 1 SIGKILLed at a seeded step: the rerun resumes
    from memory within two steps, and every batch after it (loss, sample ids, digest of model and optimizer, lr) is
    the uninterrupted plain run's. The callback snapshots once per optimizer step, not once per batch."""
    steps, accumulate = 12, ["--accumulate", "4"]
    reference = run_to_end(LightningJob(env, env.tmp_path / "plain-root", env.tmp_path / "plain", steps=steps,
                                        args=["--plain", "--resume", "none", *accumulate]))
    root = env.tmp_path / "root"
    kill_at = seeded_random().randint(3, steps - 3)
    first = LightningJob(env, root, env.tmp_path / "first", steps=steps,
                         args=[*accumulate, "--kill-rank", "1", "--kill-at", str(kill_at)])
    try:
        assert first.wait(120) != 0, "rank 1 was to be killed"
    finally:
        first.kill()
    second = run_to_end(LightningJob(env, root, env.tmp_path / "second", steps=steps, args=accumulate))
    for rank in range(2):
        report = second.report(rank)
        resumed = report["global_step"]
        assert report["resumed"]["source"] == "memory" and kill_at - 2 <= resumed <= kill_at, (kill_at, report)
        ours, theirs = _batch_rows(second, rank), _batch_rows(reference, rank)
        assert len(theirs) == 4 * steps and len(ours) == 4 * (steps - resumed), (len(ours), resumed)
        for row, expected in zip(ours, theirs[-len(ours):]):
            for key in ("step", "loss", "ids", "digest", "lr", "epoch"):
                assert row[key] == expected[key], f"rank {rank}, a batch of step {row['step']}: {key} differs"
    snapshots = [int(n) for n in re.findall(r"closed: (\d+) snapshots", second.log())]
    assert snapshots and max(snapshots) <= steps - resumed + 1, (snapshots, resumed)


def test_a_run_resumed_at_an_epoch_end_saves_states_that_resume_exactly(env: Env,
                                                                         reference: tuple[str, LightningJob]) -> None:
    """A run resumed at an epoch's end (step 8, the last batch of epoch 0) goes on to save step 16, the end of
    epoch 1; a resume from that iteration continues the uninterrupted run exactly. Lightning 2.6 alone leaves the
    first epoch after such a resume uncounted as started, so step 16's state named epoch 1 where it was epoch 2:
    the resume drew epoch 1's order again (CI, seed 304718819). The exported .ckpt holds the uninterrupted run's
    epoch counts, so a plain Lightning resume from it is right too. Under FSDP2 too: the snapshot of a held
    ModelCheckpoint save once took the loop state of the next epoch's start, where the take came (2026-11-28)."""
    strategy, reference_job = reference
    reference = reference_job   # type: ignore[assignment]
    root = env.tmp_path / "root"
    save_dir = root / "easyckpt"
    first = run_to_end(LightningJob(env, root, env.tmp_path / "to-8", steps=SAVE_STEPS, strategy=strategy))
    # One copy of step 8 per rank, the saves' state, persisted on both ranks. With two (the step's snapshot, then
    # the saves'), the agent claimed rank 0's older copy when rank 1 asked first; the ranks resumed with different
    # last_model_paths and ModelCheckpoint's collectives at step 16 hung (CI, 2026-11-29).
    assert "dropped the older snapshot" not in first.log()
    last = str(root / "checkpoints" / "last.ckpt")
    assert [value["last_model_path"] for state in persisted_states(save_dir / layout.iteration_dirname(SAVE_STEPS))
            for key, value in state["callbacks"].items() if "ModelCheckpoint" in key] == [last, last]
    resumed = run_to_end(LightningJob(env, root, env.tmp_path / "to-20", strategy=strategy))
    for rank in range(2):
        assert resumed.report(rank)["global_step"] == SAVE_STEPS, resumed.report(rank)
    assert_continues_exactly(resumed, reference, SAVE_STEPS, STEPS)
    # ModelCheckpoint's last_model_path came back with the resume, so step 16 overwrote last.ckpt: the snapshot
    # of step 8 was once taken at the top-k save, before save_last set it, and a last-v1.ckpt appeared instead.
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt",
                                                                        "last.ckpt"]
    assert torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 16
    ours = torch.load(root / "checkpoints" / "epoch=1-step=16.ckpt", map_location="cpu", weights_only=False)
    if strategy == "ddp":   # plain Lightning under FSDP2 writes a distributed checkpoint (a directory), not a file
        theirs = torch.load(reference.out.parent / "root" / "checkpoints" / "epoch=1-step=16.ckpt", map_location="cpu",
                            weights_only=False)
        assert ours["loops"]["fit_loop"]["epoch_progress"] == theirs["loops"]["fit_loop"]["epoch_progress"]
    assert ours["epoch"] == 1 and ours["global_step"] == 2 * SAVE_STEPS, (ours["epoch"], ours["global_step"])

    at_end = run_to_end(LightningJob(env, root, env.tmp_path / "from-16",
                                     args=["--resume", str(save_dir / layout.iteration_dirname(2 * SAVE_STEPS))],
                                     strategy=strategy))
    for rank in range(2):
        assert at_end.report(rank)["resumed"]["source"] == "disk" and at_end.report(rank)["global_step"] == 16
    assert_continues_exactly(at_end, reference, 2 * SAVE_STEPS, STEPS)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch_and_at_an_epoch_end_exactly(env: Env, workers: int) -> None:
    """torchdata's StatefulDataLoader(shuffle=True) under DDP: Lightning shards its sampler through
    DistributedSamplerWrapper, whose order comes from a generator neither Lightning nor the loader restores, and
    a plain Lightning resume trains on another order. With EasyCkpt, a seeded kill -9 in the first two epochs
    resumes from memory, a new job from disk in the third epoch, and a resume at an epoch's end from that
    iteration, each continuing an uninterrupted plain Lightning run bit for bit (losses, samples, digests).
    With and without worker processes (a fresh iterator draws the sampler's order twice with them)."""
    pytest.importorskip("torchdata", reason="the StatefulDataLoader test needs torchdata: pip install torchdata")
    loader = ["--loader", "stateful", "--loader-workers", str(workers)]
    reference = run_to_end(LightningJob(env, env.tmp_path / "plain-root", env.tmp_path / "plain", steps=24,
                                        args=["--plain", "--resume", "none", *loader]))
    root = env.tmp_path / "root"
    save_dir = root / "easyckpt"
    kill_at = seeded_random().randint(2, 2 * SAVE_STEPS - 1)
    first = LightningJob(env, root, env.tmp_path / "first", args=["--kill-rank", "1", "--kill-at", str(kill_at), *loader])
    try:
        assert first.wait(120) != 0, "rank 1 was to be killed"
    finally:
        first.kill()
    newest = newest_common_committed(slot_states(env, save_dir))
    assert newest is not None and kill_at - 2 <= newest <= kill_at, (newest, kill_at)
    second = run_to_end(LightningJob(env, root, env.tmp_path / "second", args=loader))
    for rank in range(2):
        report = second.report(rank)
        assert report["resumed"]["source"] == "memory" and report["global_step"] == newest, report
    assert_continues_exactly(second, reference, newest, STEPS)

    # An epoch's end: ModelCheckpoint(every_n_train_steps=8) persisted step 16, the last batch of epoch 1. A copy
    # of the save_dir, so that this run's own persists leave the next job's iterations alone.
    boundary = env.tmp_path / "boundary-root"
    shutil.copytree(save_dir, boundary / "easyckpt")
    at_end = run_to_end(LightningJob(env, boundary, env.tmp_path / "boundary",
                                     args=["--resume", str(boundary / "easyckpt" / layout.iteration_dirname(16)),
                                           *loader], extra_env={"EASYCKPT_JOB_ID": "boundary"}))
    for rank in range(2):
        assert at_end.report(rank)["resumed"] is not None and at_end.report(rank)["global_step"] == 16
    assert_continues_exactly(at_end, reference, 16, STEPS)

    # A new job resumes from disk at step 20, in the middle of the third epoch: the generator state of an epoch
    # that began in a resumed run.
    third = run_to_end(LightningJob(env, root, env.tmp_path / "third", steps=24, args=loader,
                                    extra_env={"EASYCKPT_JOB_ID": "other"}))
    for rank in range(2):
        assert third.report(rank)["resumed"]["source"] == "disk" and third.report(rank)["global_step"] == STEPS
    assert_continues_exactly(third, reference, STEPS, 24)
    assert "saved positions" in second.log() + third.log()


def test_spikes_are_skipped_on_both_ranks_then_abort_with_the_newest_snapshot_durable(env: Env) -> None:
    """use_skip_data_by_global_norm: a spiky step changes neither weights, optimizer nor LR schedule on either
    rank; two in a row (count threshold 2) abort training once the newest snapshot is durable. Health metrics
    (use_checkpoint_health_monitor) ride with every snapshot: the iterations carry a verdict."""
    root = env.tmp_path / "root"
    job = LightningJob(env, root, env.tmp_path / "out", steps=12,
                       args=["--skip-spikes", "--health", "--spike-at", "3,6,7"])
    try:
        assert job.wait(120) != 0, "two spikes in a row abort"
    finally:
        job.kill()
    assert "TrainingAborted" in job.log() and "training aborted: step 6 is durable" in job.log(), job.log()[-3000:]
    for rank in range(2):
        rows = job.losses(rank)
        assert sorted(rows) == list(range(1, 7)), sorted(rows)   # step 7 raised before its batch end
        for skipped in (3, 6):
            assert rows[skipped]["digest"] == rows[skipped - 1]["digest"], f"rank {rank}: step {skipped} was applied"
            assert rows[skipped]["lr"] == rows[skipped - 1]["lr"], f"rank {rank}: the scheduler stepped at {skipped}"
            assert rows[skipped]["loss"] > 100 * rows[skipped - 1]["loss"], "the spike was injected"
        assert rows[4]["digest"] != rows[3]["digest"] and rows[5]["lr"] != rows[2]["lr"], "normal steps apply"
    iteration = root / "easyckpt" / layout.iteration_dirname(6)
    assert 6 in dict(layout.complete_iterations(root / "easyckpt")), "the abort flushed the newest snapshot"
    verdict = layout.read_metadata(iteration)["health"]
    assert verdict is not None and verdict.get("healthy", verdict.get("is_health")) in (True, 1), verdict

    # fit(ckpt_path=<an iteration_N directory>) loads that iteration, the skipper's count with it
    resumed = run_to_end(LightningJob(env, root, env.tmp_path / "again", steps=12,
                                      args=["--skip-spikes", "--health", "--resume", str(iteration)]))
    for rank in range(2):
        report = resumed.report(rank)
        assert (report["global_step"], report["resumed"]["source"]) == (6, "disk"), report
        assert report["digest"] == job.losses(rank)[6]["digest"]
        assert sorted(resumed.losses(rank)) == list(range(7, 13))
    assert "data skipping resumed: {'consecutive': 1, 'skipped_total': 2}" in resumed.log()


def test_a_resume_from_an_older_lightning_file_begins_a_new_timeline(env: Env) -> None:
    """``fit(ckpt_path=<the step-8 .ckpt>)`` after a run that reached step 20: Lightning restores its own file, the
    run goes another way (a spike at step 9) and is killed at 10-12. The first run's newer state must not come
    back: EasyCkpt starts a new timeline at step 8 (its iterations 16 and 20 set aside, its snapshots past 8
    dropped), so ``ckpt_path="last"`` then resumes the second run's step from memory. Before, the first run's
    iteration 20 was the newest state, and the third run resumed it and trained nothing."""
    root, save_dir = env.tmp_path / "root", env.tmp_path / "root" / "easyckpt"
    first = run_to_end(LightningJob(env, root, env.tmp_path / "first"))
    assert {16, 20} <= {step for step, _ in layout.complete_iterations(save_dir)}
    older = root / "checkpoints" / "epoch=0-step=8.ckpt"
    assert older.is_file(), sorted(p.name for p in (root / "checkpoints").iterdir())
    kill_at = seeded_random().randint(10, 12)
    second = LightningJob(env, root, env.tmp_path / "second", args=["--resume", str(older), "--spike-at", "9",
                                                                    "--kill-rank", "1", "--kill-at", str(kill_at)])
    try:
        assert second.wait(120) != 0, "rank 1 was to be killed"
    finally:
        second.kill()
    assert all(second.report(rank)["global_step"] == 8 for rank in range(2))
    assert "without load()" not in second.log(), second.log()[-3000:]
    aside = {p.name for d in save_dir.glob(".abandoned-*") for p in d.iterdir()}
    assert layout.iteration_dirname(20) in aside, aside
    assert all(step <= kill_at for step, _ in layout.complete_iterations(save_dir)), \
        layout.complete_iterations(save_dir)

    third = run_to_end(LightningJob(env, root, env.tmp_path / "third", args=["--spike-at", "9"]))
    for rank in range(2):
        report = third.report(rank)
        assert report["resumed"]["source"] == "memory" and kill_at - 2 <= report["global_step"] <= kill_at, report
        assert third.losses(rank)[STEPS]["loss"] != first.losses(rank)[STEPS]["loss"], "the spike changed nothing?"


def test_unsupported_strategies_and_bad_keywords_are_refused_at_start(tmp_path: Path) -> None:
    """A strategy EasyCkpt was not built for is refused before anything is written: a strategy subclass of the
    user's (its saves may differ) in a real fit(); FSDP1, which Lightning runs on GPUs only, by its reason."""
    import types

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

    from easyckpt.lightning import EasyCkpt
    from easyckpt.lightning.callback import check_strategy

    class CustomStrategy(SingleDeviceStrategy):
        pass

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from lightning_trainer import Model
    finally:
        sys.path.remove(str(SCRIPT.parent))
    trainer = pl.Trainer(strategy=CustomStrategy(device="cpu"), accelerator="cpu", devices=1, logger=False,
                         max_steps=1, default_root_dir=tmp_path, callbacks=[EasyCkpt()], enable_progress_bar=False)
    with pytest.raises(NotImplementedError, match="strategy=CustomStrategy.: it is not one EasyCkpt was built"
                       ) as refused:
        trainer.fit(Model())
    assert "ModelParallelStrategy (FSDP2" in str(refused.value) and "Nothing was written" in str(refused.value)
    with pytest.raises(NotImplementedError, match="FSDP1 keeps flat parameters"):
        check_strategy(types.SimpleNamespace(strategy=FSDPStrategy()))   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no effect without use_skip_data_by_global_norm"):
        EasyCkpt(global_norm_spike_threshold=1.0)
    with pytest.raises(ValueError, match="save_mem_interval must be a positive int"):
        EasyCkpt(save_mem_interval=0)
    with pytest.raises(ValueError, match="EasyCkpt: export_timeout must be a positive, finite number of seconds"):
        EasyCkpt(export_timeout=float("nan"))
    assert not (tmp_path / "easyckpt").exists(), "nothing written"
