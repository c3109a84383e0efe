"""easyckpt.megatron with megatron-core on CPU: the three lines in a Megatron-style loop under real torchrun.

The loop is examples/megatron_gpt.py (megatron-core's GPTModel, its OptimizerParamScheduler, a torch
AdamW; gloo). Every resumed run is compared with one uninterrupted reference run of the same script:
the loss of every iteration and the final model/optimizer digest must be bitwise equal.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from conftest import Env, assert_same, gone, run_cli, seeded_random, wait_for, wipe_memory  # noqa: E402
from megatron_job import ITERS, Job, assert_same_curve  # noqa: E402

from easyckpt_wire import layout  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """One uninterrupted run: {rank: (losses, final)}."""
    tmp = tmp_path_factory.mktemp("megatron-reference")
    env = Env(tmp)
    try:
        job = Job(env, tmp / "run", save_dir=env.save_dir)
        assert job.wait() == 0, job.log()[-3000:]
        found = {rank: (job.losses(rank), job.final(rank)) for rank in (0, 1)}
        assert sorted(found[0][0]) == list(range(1, ITERS + 1))
        return found
    finally:
        env.cleanup()


# --- torchrun: kill and resume ------------------------------------------------------------------------
def test_kill_rank_resumes_from_memory_with_identical_losses(env: Env, reference: dict[int, Any]) -> None:
    """No idle standing for compute, and persists capped (EASYCKPT_PERSIST_MBPS) to take several iterations:
    a kill at a seeded iteration resumes from memory at most two iterations back (invariant 9)."""
    rng = seeded_random()
    at = rng.randint(6, ITERS - 6)
    job = Job(env, env.tmp_path / "run", save_dir=env.save_dir, max_restarts=1, idle="0",
              extra_env={"EASYCKPT_PERSIST_MBPS": "20"})
    job.wait_reached(1, at)
    os.kill(job.pid(1), signal.SIGKILL)
    killed_at = max(job.losses(1))
    assert job.wait() == 0, job.log()[-3000:]
    persists = [float(part.split("=")[1]) for line in (job.out / "persist.log").read_text().splitlines()
                for part in line.split() if part.startswith("seconds=")]
    print(f"persists took {persists} s")
    for rank in (0, 1):
        first, second = job.resumes(rank)
        assert first["source"] is None and second["source"] == "memory", second
        # The snapshot of killed_at + 1 may have started before its loss line was written.
        assert second["attempt"] == "1" and killed_at - 1 <= second["iteration"] <= killed_at + 1, (second, killed_at)
        assert second["consumed_train_samples"] == second["iteration"] * 8
    assert job.resumes(0)[1]["iteration"] == job.resumes(1)[1]["iteration"]
    assert_same_curve(job, reference)


def test_memory_wiped_resumes_from_disk_with_identical_losses(env: Env, reference: dict[int, Any]) -> None:
    first = Job(env, env.tmp_path / "run1", save_dir=env.save_dir)
    first.wait_reached(1, 13)
    os.kill(first.pid(1), signal.SIGKILL)
    assert first.wait() != 0
    wipe_memory(env)
    on_disk = [step for step, _ in layout.complete_iterations(env.save_dir)]
    assert on_disk, "nothing was persisted before the kill"

    second = Job(env, env.tmp_path / "run2", save_dir=env.save_dir)
    assert second.wait() == 0, second.log()[-3000:]
    for rank in (0, 1):
        (resume,) = second.resumes(rank)
        assert resume["source"] == "disk" and resume["iteration"] == max(on_disk), (resume, on_disk)
    assert_same_curve(second, reference, start=max(on_disk) + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on a GPU machine")
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_cuda_megatron_core_ddp_and_optimizer_resume_from_memory_then_disk(env: Env, distributed_optimizer: bool) -> None:
    """The real megatron-core loop (its DDP wrapper and get_megatron_optimizer, NCCL): kill -9 a rank and
    resume from memory; then, with the slots gone, from disk. CUDA kernels with atomics (embedding
    backward) are not bitwise reproducible, so the curves are compared with a tolerance."""
    nproc = min(2, torch.cuda.device_count())
    extra = ("--cuda", "--use-distributed-optimizer") if distributed_optimizer else ("--cuda",)
    reference = Job(env, env.tmp_path / "reference", save_dir=env.tmp_path / "reference-ckpt", extra=extra, nproc=nproc)
    assert reference.wait(300) == 0, reference.log()[-3000:]
    expected = reference.losses(0)
    assert sorted(expected) == list(range(1, ITERS + 1))

    job = Job(env, env.tmp_path / "run", save_dir=env.save_dir, max_restarts=1, extra=extra, nproc=nproc)
    job.wait_reached(nproc - 1, 10)
    os.kill(job.pid(nproc - 1), signal.SIGKILL)
    assert job.wait(300) == 0, job.log()[-3000:]
    resumed = job.resumes(0)[1]
    assert resumed["source"] == "memory" and resumed["iteration"] >= 9, resumed
    losses = job.losses(0)
    assert sorted(losses) == list(range(1, ITERS + 1))
    far = {i: (losses[i], expected[i]) for i in range(1, ITERS + 1)
           if not np.isclose(losses[i], expected[i], rtol=1e-3)}
    assert not far, f"resumed at {resumed['iteration']}; losses off the uninterrupted run (got, expected): {far}"

    env.wait_agent_gone()   # a clean end: the agent persisted what was due and released the slots
    on_disk = max(step for step, _ in layout.complete_iterations(env.save_dir))
    again = Job(env, env.tmp_path / "again", save_dir=env.save_dir, extra=extra, nproc=nproc)
    assert again.wait(300) == 0, again.log()[-3000:]
    (resume,) = again.resumes(0)
    assert resume["source"] == "disk" and resume["iteration"] == on_disk, resume
    tail = again.losses(0)
    assert sorted(tail) == list(range(on_disk + 1, ITERS + 1))
    assert np.allclose([tail[i] for i in sorted(tail)], [expected[i] for i in sorted(tail)], rtol=1e-3)


# --- the exit hook ------------------------------------------------------------------------------------
def _persisted(save_dir: Path) -> list[int]:
    return [step for step, _ in layout.complete_iterations(save_dir)]


def _persisted_before_exit(env: Env) -> list[int]:
    """The job has exited: kill its agent at once, so only what was durable before the exit counts."""
    agent = env.agent_pid()
    if agent is not None:
        os.kill(agent, signal.SIGKILL)
        wait_for(lambda: gone(agent), 30, "the agent to die")
    return _persisted(env.save_dir)


def test_hook_on_sigterm_persists_the_newest_snapshot(env: Env) -> None:
    # save_storage_interval 1000: nothing is ever due, so whatever reaches disk is the hook's flush.
    job = Job(env, env.tmp_path / "run", save_dir=env.save_dir, storage_interval=1000)
    job.wait_reached(0, 8)
    job.wait_reached(1, 8)
    job.proc.send_signal(signal.SIGTERM)   # torchrun passes SIGTERM on to both ranks
    assert job.wait() != 0
    steps = _persisted_before_exit(env)
    logged = [max(job.losses(rank)) for rank in (0, 1)]
    # The newest snapshot every rank holds: a rank logs an iteration right after its snapshot call.
    assert steps == [steps[0]] and min(logged) <= steps[0] <= max(logged) + 1, (steps, logged)
    assert f"SIGTERM: the newest snapshot (step {steps[0]}) is durable" in job.log(), job.log()[-3000:]
    verify = run_cli("verify", str(env.save_dir), env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_hook_on_uncaught_exception_persists_the_newest_snapshot(env: Env) -> None:
    job = Job(env, env.tmp_path / "run", save_dir=env.save_dir, storage_interval=1000, extra=("--raise-at", "7"))
    assert job.wait() != 0
    assert _persisted_before_exit(env) == [7]
    assert "uncaught RuntimeError: the newest snapshot (step 7) is durable" in job.log(), job.log()[-3000:]


# --- migration both ways ------------------------------------------------------------------------------
def test_migrates_from_a_native_megatron_checkpoint(env: Env, reference: dict[int, Any]) -> None:
    native = env.tmp_path / "megatron-native"
    first = Job(env, env.tmp_path / "run1", save_dir=env.tmp_path / "first", iters=10,
                extra=("--native-save-dir", str(native), "--native-save-at", "10"))
    assert first.wait() == 0, first.log()[-3000:]
    assert (native / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in (native / "iter_0000010").iterdir()) == ["mp_rank_00"]

    second = Job(env, env.tmp_path / "run2", save_dir=env.save_dir, extra=("--load-dir", str(native)))
    assert second.wait() == 0, second.log()[-3000:]
    for rank in (0, 1):
        (resume,) = second.resumes(rank)
        assert resume["source"] == "megatron-legacy" and resume["iteration"] == 10, resume
        assert resume["path"].endswith("iter_0000010/mp_rank_00/model_optim_rng.pt")
        assert resume["consumed_train_samples"] == 80
    assert_same_curve(second, reference, start=11)


def test_tensor_parallel_ranks_resume_their_own_shards_from_memory_and_a_native_checkpoint(env: Env) -> None:
    """TP=2 (gloo on CPU; every parameter is split across the two ranks, so each rank's state is its own):
    kill -9 one rank and both resume from memory; a native checkpoint (mp_rank_00 and mp_rank_01) migrates.
    Both must continue the uninterrupted run's curve bitwise, each with its own shard's final digest."""
    iters, tp = 16, ("--tp", "2")
    native = env.tmp_path / "megatron-native"
    reference = Job(env, env.tmp_path / "reference", save_dir=env.tmp_path / "reference-ckpt", iters=iters,
                    extra=(*tp, "--native-save-dir", str(native), "--native-save-at", "8"))
    assert reference.wait() == 0, reference.log()[-3000:]
    expected = {rank: (reference.losses(rank), reference.final(rank)["digest"]) for rank in (0, 1)}
    assert expected[0][1] != expected[1][1], "the two tensor-parallel ranks should hold different shards"
    assert sorted(p.name for p in (native / "iter_0000008").iterdir()) == ["mp_rank_00", "mp_rank_01"]

    def same_curve(job: Job, start: int) -> None:
        for rank in (0, 1):
            losses = job.losses(rank)
            assert sorted(losses) == list(range(start, iters + 1)), (rank, sorted(losses))
            assert all(losses[i] == expected[rank][0][i] for i in losses), (rank, losses, expected[rank][0])
            assert job.final(rank)["digest"] == expected[rank][1], f"rank {rank}: final state differs"

    killed = Job(env, env.tmp_path / "killed", save_dir=env.save_dir, iters=iters, max_restarts=1, extra=tp)
    killed.wait_reached(1, 6)
    os.kill(killed.pid(1), signal.SIGKILL)
    assert killed.wait() == 0, killed.log()[-3000:]
    for rank in (0, 1):
        assert killed.resumes(rank)[1]["source"] == "memory", killed.resumes(rank)
    same_curve(killed, 1)

    migrated = Job(env, env.tmp_path / "migrated", save_dir=env.tmp_path / "migrated-ckpt", iters=iters,
                   extra=(*tp, "--load-dir", str(native)))
    assert migrated.wait() == 0, migrated.log()[-3000:]
    for rank in (0, 1):
        (resume,) = migrated.resumes(rank)
        assert resume["source"] == "megatron-legacy" and resume["iteration"] == 8, resume
        assert resume["path"].endswith(f"iter_0000008/mp_rank_0{rank}/model_optim_rng.pt"), resume
    same_curve(migrated, 9)


def _megatron_loader_accepts(path: Path, iteration: int) -> None:
    """What megatron.training.checkpointing.load_checkpoint does with a legacy file, on CPU."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.safe_globals import register_safe_globals

    # What `import megatron.core` did in a Megatron process. In this pytest process a Trainer resume ran before
    # (test_hf): leaving transformers' torch.serialization.safe_globals() block dropped numpy's entries again.
    register_safe_globals()
    state = torch.load(path, map_location="cpu")   # Megatron's own call: torch's default weights_only=True
    args = state["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 32, 4)
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == iteration
    assert args.consumed_train_samples == iteration * 8
    model = _gpt(seed=5)
    model.load_state_dict(state["model"], strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    optimizer.load_state_dict(state["optimizer"])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=40,
                                        lr_decay_steps=1600, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=1600, wd_incr_style="constant")
    scheduler.load_state_dict(state["opt_param_scheduler"])
    assert scheduler.num_steps == iteration * 8
    rng = state["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    assert set(rng["rng_tracker_states"]) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}


def test_convert_to_megatron_output_loads_back(env: Env, reference: dict[int, Any], megatron_world: None) -> None:
    first = Job(env, env.tmp_path / "run1", save_dir=env.save_dir, iters=10)
    assert first.wait() == 0, first.log()[-3000:]
    # 10 unless its snapshot was skipped because the agent was still persisting 5 (training never waits)
    newest = max(_persisted(env.save_dir))
    assert newest in (5, 10)
    dst = env.tmp_path / "converted"
    done = run_cli("convert", "--to", "megatron", str(env.save_dir), str(dst), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == str(newest)
    files = sorted(dst.rglob("*.pt"))
    assert files == [dst / f"iter_{newest:07d}" / "mp_rank_00" / "model_optim_rng.pt"], files  # DP rank 0 only
    _megatron_loader_accepts(files[0], newest)
    again = run_cli("convert", "--to", "megatron", str(env.save_dir), str(dst), env=env)
    assert again.returncode == 1 and "exists already" in again.stderr

    second = Job(env, env.tmp_path / "run2", save_dir=env.tmp_path / "resumed", extra=("--load-dir", str(dst)))
    assert second.wait() == 0, second.log()[-3000:]
    for rank in (0, 1):
        (resume,) = second.resumes(rank)
        assert resume["source"] == "megatron-legacy" and resume["iteration"] == newest, resume
    assert_same_curve(second, reference, start=newest + 1)


# --- in one process: the state itself -----------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_world() -> Any:
    """A one-rank gloo group with Megatron's parallel state, as GPTModel needs to be built."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        yield
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _gpt(seed: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.1, attention_dropout=0.1)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def _training_objects(seed: int) -> tuple[list[Any], Any, Any]:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    chunks = [_gpt(seed), _gpt(seed + 1)]   # two virtual pipeline chunks: saved as model0, model1
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                        lr_decay_steps=10, lr_decay_style="linear", start_wd=0.0, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="linear")
    return chunks, optimizer, scheduler


def test_gpt_model_state_round_trips_through_memory(env: Env, megatron_world: None) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    import easyckpt.megatron as em

    chunks, optimizer, scheduler = _training_objects(seed=1)
    for _ in range(2):   # real optimizer state and a moved schedule (gradients made up: forward needs CUDA shims)
        for param in optimizer.param_groups[0]["params"]:
            param.grad = torch.randn_like(param)
        optimizer.step()
        scheduler.step(increment=1)
    tracker = get_cuda_rng_tracker()
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(7).get_state()})
    args = argparse.Namespace(consumed_train_samples=16, num_layers=2, params_dtype=torch.bfloat16,
                              init_method=lambda x: x, save=str(env.save_dir))
    with pytest.raises(RuntimeError, match="initialize_easyckpt"):
        em.save_checkpoint_if_needed(1, chunks, optimizer, scheduler)
    em.initialize_easyckpt(save_mem_interval=1, save_storage_interval=5, max_ckpt_num=2, save_dir=env.save_dir,
                           args=args)
    try:
        assert em.save_checkpoint_if_needed(2, chunks, optimizer, scheduler, num_floating_point_operations_so_far=123)
        em.get_checkpointer().wait()
        saved_rng = torch.get_rng_state()
        saved_py, saved_np = random.getstate(), np.random.get_state()
        expected = {"model0": chunks[0].state_dict(), "model1": chunks[1].state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

        fresh, fresh_optimizer, fresh_scheduler = _training_objects(seed=50)
        torch.manual_seed(999)
        random.seed(999)
        np.random.seed(999)
        tracker.set_states({})
        args.consumed_train_samples = 0
        # concat=True on the layout that saved it: the plain load (test_megatron_concat.py changes layouts)
        assert em.load_checkpoint(fresh, fresh_optimizer, fresh_scheduler, concat=True) == (2, 123)
        assert em.last_load().source == "memory"
        assert_same(fresh[0].state_dict(), expected["model0"])
        assert_same(fresh[1].state_dict(), expected["model1"])
        assert_same(fresh_optimizer.state_dict(), expected["optimizer"])
        assert fresh_scheduler.state_dict() == expected["scheduler"]
        assert torch.equal(torch.get_rng_state(), saved_rng)
        assert random.getstate() == saved_py
        assert_same(np.random.get_state(), saved_np)
        assert torch.equal(tracker.get_states()["model-parallel-rng"], torch.Generator().manual_seed(7).get_state())
        assert args.consumed_train_samples == 16

        from easyckpt.megatron import snapshot
        state = snapshot.build(3, chunks, optimizer, scheduler, args=args, flops=0)
        assert state["args"] == {"consumed_train_samples": 16, "num_layers": 2, "params_dtype": torch.bfloat16,
                                 "save": str(env.save_dir), "skipped_train_samples": 0,
                                 "consumed_valid_samples": 0}       # the function is not saved: never pickled
        assert {"model0", "model1", "optimizer", "opt_param_scheduler", "rng_state", "iteration",
                "num_floating_point_operations_so_far", "checkpoint_version"} <= set(state)
        assert state[snapshot.META_KEY]["parallel"]["dp_size"] == 1
    finally:
        tracker.set_states({})
        em.finalize_easyckpt()



def test_dirs_and_args_come_from_megatron_training_args(env: Env, megatron_world: None, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With megatron.training importable (a stand-in here: megatron-core alone does not ship it), --save is
    the save_dir, getattr(args, load_arg) the load dir, and its args are saved and restored."""
    import types

    import easyckpt.megatron as em

    margs = argparse.Namespace(save=str(env.save_dir), load=None, other_load=str(tmp_path / "empty"),
                               consumed_train_samples=24, no_save_rng=True)
    training, global_vars = types.ModuleType("megatron.training"), types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = margs
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    ckpt = em.initialize_easyckpt(save_mem_interval=2, save_storage_interval=4, max_ckpt_num=2)
    try:
        assert ckpt.config.save_dir == env.save_dir.resolve()
        chunks, optimizer, scheduler = _training_objects(seed=3)
        assert not em.save_checkpoint_if_needed(3, chunks, optimizer, scheduler)   # not due
        assert em.save_checkpoint_if_needed(4, chunks, optimizer, scheduler)
        ckpt.wait()
        margs.consumed_train_samples = 0
        assert em.load_checkpoint(chunks, optimizer, scheduler, load_arg="other_load") == (4, 0)
        assert margs.consumed_train_samples == 24 and em.last_load().source == "memory"
        state = ckpt.load().state
        assert "rng_state" not in state and state["args"]["consumed_train_samples"] == 24   # --no-save-rng honoured
    finally:
        em.finalize_easyckpt()

def test_legacy_files_are_read_without_unpickling_arbitrary_objects(tmp_path: Path) -> None:
    from easyckpt.megatron import legacy

    info = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "ep_rank": 0, "ep_size": 1}
    target = tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    target.parent.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    torch.save({"args": argparse.Namespace(hidden_size=8, odd=_Odd()), "iteration": 3, "model": {"w": torch.ones(2)}},
               target)
    with pytest.raises(legacy.LegacyCheckpointError, match="trust_legacy_pickle"):
        legacy.read(tmp_path, info)
    state, release, path = legacy.read(tmp_path, info, trust_pickle=True)
    assert state["args"] == {"hidden_size": 8} and state["iteration"] == 3 and not release and path == target
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert legacy.find(tmp_path) is None and legacy.other_format(tmp_path) is None   # iteration 4 is not there
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / ".metadata").write_bytes(b"")   # a torch_dist checkpoint: refused, not ignored
    assert "torch_dist" in legacy.other_format(tmp_path)


class _Odd:
    pass


# --- data skipping and checkpoint health (issue 13) -----------------------------------------------------
def _megatron_fp32_optimizer(params: list[torch.nn.Parameter], clip_grad: float) -> Any:
    """Megatron's FP32Optimizer, its step() as shipped (prepare_grads, clip_grad_norm or none,
    step_with_ready_grads), with only the norm computed by torch: Megatron's fused norm kernels and the
    constructor's scale tensor need CUDA."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    class CpuFP32Optimizer(FP32Optimizer):
        def get_grad_norm(self) -> float:
            grads = [p.grad for p in self.get_parameters() if p.grad is not None]
            return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

        def clip_grad_norm(self, clip_grad: float) -> float:
            norm = CpuFP32Optimizer.get_grad_norm(self)   # the class's, not the instance's (easyckpt wraps that)
            torch.nn.utils.clip_grads_with_norm_(self.get_parameters(), clip_grad, torch.tensor(norm))
            return norm

    optimizer = object.__new__(CpuFP32Optimizer)
    # one parameter group as get_megatron_optimizer makes them (its keys identify groups on load)
    optimizer.optimizer = torch.optim.AdamW([{"params": params, "wd_mult": 1.0, "lr_mult": 1.0,
                                              "is_expert_parallel": False, "is_decoupled_lr": False}], lr=1e-3)
    optimizer.config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=clip_grad)
    optimizer.init_state_fn = None
    optimizer.is_stub_optimizer = False
    return optimizer


def _made_up_grads(chunks: list[Any], iteration: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(iteration)
    for chunk in chunks:
        for param in chunk.parameters():
            param.grad = 1e-3 * scale * torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize("clip_grad", [1.0, 0.0], ids=["clipping", "no-clipping"])
def test_megatron_skips_a_spike_inside_the_optimizer_step_and_aborts_durably(
        env: Env, megatron_world: None, monkeypatch: pytest.MonkeyPatch, clip_grad: float) -> None:
    """Megatron's optimizer step with data skipping: a spike's step returns "not successful" (what Megatron's
    train_step counts as a skipped iteration, not stepping the scheduler) with model and optimizer untouched;
    each applied step's snapshot carries the embedding's pre-clip gradient norm and the given loss (a skipped
    one only the loss: its gradients were discarded); two spikes in a row
    abort after the newest snapshot was made durable, and the next load restores the skipper's count."""
    import copy

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    import easyckpt
    import easyckpt.megatron as em
    from easyckpt.checkpointer import Checkpointer

    seen: dict[int, Any] = {}
    original = Checkpointer.save_if_needed

    def spy(self: Checkpointer, step: int, state: Any, *, metrics: Any = None) -> bool:
        if state is not None:
            seen[step] = metrics
        return original(self, step, state, metrics=metrics)

    monkeypatch.setattr(Checkpointer, "save_if_needed", spy)

    def objects(seed: int) -> tuple[list[Any], Any, Any]:
        chunks = [_gpt(seed)]
        optimizer = _megatron_fp32_optimizer(list(chunks[0].parameters()), clip_grad)
        scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                            lr_decay_steps=10, lr_decay_style="linear", start_wd=0.0, end_wd=0.1,
                                            wd_incr_steps=10, wd_incr_style="linear")
        return chunks, optimizer, scheduler

    keywords = {"use_skip_data_by_global_norm": True, "global_norm_spike_threshold": 50.0,
                "global_norm_spike_count_threshold": 2, "use_checkpoint_health_monitor": True,
                "embedding_local_norm_threshold": 270.0}
    args = argparse.Namespace(consumed_train_samples=0, save=str(env.save_dir))
    em.initialize_easyckpt(save_mem_interval=1, save_storage_interval=1000, max_ckpt_num=2, save_dir=env.save_dir,
                           args=args, **keywords)
    try:
        chunks, optimizer, scheduler = objects(seed=1)
        assert em.load_checkpoint(chunks, optimizer, scheduler) == (0, 0)
        spikes = {3, 5, 6}
        for iteration in range(1, 7):
            _made_up_grads(chunks, iteration, 1e5 if iteration in spikes else 1.0)
            embedding_grad = float(chunks[0].embedding.word_embeddings.weight.grad.norm())
            before = copy.deepcopy((chunks[0].state_dict(), optimizer.optimizer.state_dict(), scheduler.state_dict()))
            if iteration == 6:
                with pytest.raises(easyckpt.TrainingAborted, match="step 6: global norm"):
                    optimizer.step()
                break
            success, norm, _ = optimizer.step()
            assert (norm is not None or clip_grad == 0.0) and success == (iteration not in spikes)
            if success:
                scheduler.step(increment=1)   # as Megatron's train_step: only after a successful update
            else:
                assert_same(chunks[0].state_dict(), before[0])
                assert_same(optimizer.optimizer.state_dict(), before[1])
            assert em.save_checkpoint_if_needed(iteration, chunks, optimizer, scheduler, metrics={"loss": 2.5})
            if success:
                assert set(seen[iteration]) == {"embedding_local_norm", "loss"}
                assert seen[iteration]["embedding_local_norm"] == pytest.approx(embedding_grad, rel=1e-6)
            else:   # the spiked gradients were discarded: the kept state is not judged by them
                assert set(seen[iteration]) == {"loss"}
            em.get_checkpointer().wait()
        assert scheduler.num_steps == 3   # iterations 1, 2, 4
        assert (env.save_dir / layout.iteration_dirname(5) / layout.METADATA).is_file()   # on_abort: flush
    finally:
        em.finalize_easyckpt()

    em.initialize_easyckpt(save_mem_interval=1, save_storage_interval=1000, max_ckpt_num=2, save_dir=env.save_dir,
                           args=args, **keywords)
    try:
        fresh, fresh_optimizer, fresh_scheduler = objects(seed=9)
        assert em.load_checkpoint(fresh, fresh_optimizer, fresh_scheduler)[0] == 5
        assert em._require().skipper.state_dict() == {"consecutive": 1, "skipped_total": 2}
        _made_up_grads(fresh, 6, 1e5)
        with pytest.raises(easyckpt.TrainingAborted):   # the restored count: a second spike in a row
            fresh_optimizer.step()
    finally:
        em.finalize_easyckpt()


def test_megatron_skipping_keywords(env: Env, megatron_world: None) -> None:
    import easyckpt.megatron as em

    with pytest.raises(ValueError, match="global_norm_spike_count_threshold=3 has no effect without "
                                         "use_skip_data_by_global_norm=True"):
        em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir, global_norm_spike_count_threshold=3)
    with pytest.raises(ValueError, match="global_norm_spike_threshold"):
        em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir, use_skip_data_by_global_norm=True,
                               global_norm_spike_threshold=0)
    with pytest.raises(ValueError, match="has no effect without use_checkpoint_health_monitor=True"):
        em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir, embedding_local_norm_threshold=5.0)
    assert em.get_checkpointer() is None
    chunks, optimizer, scheduler = _training_objects(seed=1)
    em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir, use_skip_data_by_global_norm=True)
    try:
        with pytest.raises(NotImplementedError, match="needs Megatron's optimizer.*DataSkipper"):
            em.load_checkpoint(chunks, optimizer, scheduler)
    finally:
        em.finalize_easyckpt()
    # the health monitor alone works with a torch optimizer (the CPU example's): the gradients after the step
    em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir, use_checkpoint_health_monitor=True,
                           embedding_local_norm_threshold=270.0)
    try:
        assert em.get_checkpointer().config.health_thresholds == {"embedding_local_norm": 270.0}
        assert em.load_checkpoint(chunks, optimizer, scheduler) == (0, 0)
        _made_up_grads(chunks, 1, 1.0)
        optimizer.step()
        assert em.save_checkpoint_if_needed(1, chunks, optimizer, scheduler)
    finally:
        em.finalize_easyckpt()


# --- checkpoint health on the CPU path (torch AdamW): the embedding's gradient norm is read by
# save_checkpoint_if_needed; the loss scaled by 1e4 puts it far above HEALTH_THRESHOLD ---------------------
HEALTH_THRESHOLD = "5"


def test_megatron_kill_after_an_unhealthy_iteration_resumes_the_newest_healthy_one_from_memory(env: Env) -> None:
    """Iteration 14 alone is spiked; rank 1 dies once its snapshot of 14 is in memory (if it took one); torchrun
    restarts the group, which passes 14 over and resumes at the newest healthy snapshot in memory."""
    from easyckpt_wire import health

    job = Job(env, env.tmp_path / "run", save_dir=env.save_dir, max_restarts=1, idle="0",
              extra=("--embedding-local-norm-threshold", HEALTH_THRESHOLD, "--spike-steps", "14", "--kill-at", "14"))
    assert job.wait() == 0, job.log()[-4000:]
    resumed = set()
    for rank in (0, 1):
        first, second = job.resumes(rank)
        assert first["source"] is None
        # 13, the newest healthy snapshot; or an older one when a starved agent still persisted a due step while
        # 11-14 were taken: its slot (and a spared due one) left the ranks fewer slots to take turns in, and 14 took
        # 13's place (CI rehearsals, 2026-11-28: resumed at 10 while step 5 was persisted for 0.3 s; at 12 while
        # step 10 was). Never older than 10, the due step before the spike, and always from memory.
        assert second["source"] == "memory" and 10 <= second["iteration"] <= 13, second
        resumed.add(second["iteration"])
        assert sorted(job.losses(rank)) == list(range(1, ITERS + 1))
    assert len(resumed) == 1, resumed
    log = job.log()
    # Rank 1 dies once its copy of 14 is done, if it took one: a starved agent late to declare 13 safe makes a rank
    # skip the snapshot of 14 to keep 13 (slot_choice.keep_newest; CI, 2026-12-02: rank 0 held 14, rank 1 did not).
    # Then 14 is in rank 0's memory only, no candidate, and there is nothing unhealthy to pass over. The resumed
    # ranks drop the slots newer than the resumed step, and say so.
    if re.search(r"rank 1: (dropped )?slot \d with step 14 ", log):
        assert f"passing over unhealthy snapshots newer than step {resumed.pop()}: step 14 (unhealthy on ranks " \
               "[0, 1]: rank 0: embedding_local_norm" in log, log[-4000:]
    else:   # the skip began at 14, or at 13 and went on (an episode is said once, when it begins)
        assert re.search(r"rank 1: snapshot of step 1[34] skipped", log), log[-4000:]
    entries = {e.step: e.is_health for e in health.read_health_file(env.save_dir) or []}
    assert entries and set(entries.values()) == {health.HEALTHY}, entries   # 14 was never persisted


def test_megatron_diverged_run_keeps_and_resumes_the_newest_healthy_iteration_from_disk(env: Env) -> None:
    """Every iteration from 12 on is spiked; persists every 5, max_ckpt_num=2: rotation keeps 10, the
    newest healthy, besides the final 24; health_ckpts.json marks exactly those; a rerun (a clean end left
    no slots) resumes at 10 from disk."""
    from easyckpt_wire import health

    spiked = ",".join(str(i) for i in range(12, ITERS + 1))
    flags = ("--embedding-local-norm-threshold", HEALTH_THRESHOLD, "--max-ckpt-num", "2")
    # paced (IDLE per iteration) so that the agent persists every due iteration, not the newest one it finds
    first = Job(env, env.tmp_path / "first", save_dir=env.save_dir, extra=(*flags, "--spike-steps", spiked))
    assert first.wait() == 0, first.log()[-4000:]
    env.wait_agent_gone()
    kept = [step for step, _ in layout.complete_iterations(env.save_dir)]
    assert kept == [10, ITERS], kept
    entries = {e.step: e.is_health for e in health.read_health_file(env.save_dir) or []}
    assert entries == {10: health.HEALTHY, ITERS: health.UNHEALTHY}, entries
    assert not list(env.shm_dir.glob("easyckpt-*")), "a clean end leaves no slots: the rerun has only disk"
    second = Job(env, env.tmp_path / "second", save_dir=env.save_dir, idle="0", extra=flags)
    assert second.wait() == 0, second.log()[-4000:]
    for rank in (0, 1):
        resume = second.resumes(rank)[0]
        assert (resume["iteration"], resume["source"]) == (10, "disk"), resume
    assert "passing over unhealthy snapshots newer than step 10" in second.log(), second.log()[-4000:]


# --- data skipping in the example's loop (Megatron's optimizer step; the loss scaled by 1e4 puts the
# global gradient norm far above SPIKE_THRESHOLD, which no normal iteration reaches) --------------------
SPIKE_THRESHOLD = "100"


def test_megatron_example_skips_a_spike_bit_exactly(env: Env, reference: dict[int, Any],
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Iteration 10 spikes and is skipped on both ranks: the state and every other loss equal, bit for bit,
    a run that never applied iteration 10's update (``--drop-steps 10``), which differs from the run that did."""
    skipped = Job(env, env.tmp_path / "skipped", save_dir=env.save_dir, idle="0",
                  extra=("--spike-steps", "10", "--global-norm-spike-threshold", SPIKE_THRESHOLD))
    assert skipped.wait() == 0, skipped.log()[-4000:]
    log = skipped.log()
    assert log.count("consecutive time(s); data skipped") == 2, log[-4000:]   # once per rank
    assert "step 10: global norm" in log and "step 11: global norm" in log, log[-4000:]   # skipped, then back under
    ref_env = Env(tmp_path_factory.mktemp("dropped"))
    try:
        dropped = Job(ref_env, ref_env.tmp_path / "dropped", save_dir=ref_env.save_dir, idle="0",
                      extra=("--drop-steps", "10"))
        assert dropped.wait() == 0, dropped.log()[-4000:]
    finally:
        ref_env.cleanup()
    for rank in (0, 1):
        ours, theirs = skipped.losses(rank), dropped.losses(rank)
        assert sorted(ours) == sorted(theirs) == list(range(1, ITERS + 1))
        assert {i: ours[i] for i in ours if i != 10} == {i: theirs[i] for i in theirs if i != 10}, f"rank {rank}"
        assert skipped.final(rank)["digest"] == dropped.final(rank)["digest"], f"rank {rank}: state differs"
        assert skipped.final(rank)["digest"] != reference[rank][1]["digest"], "the skip changed nothing"


def test_megatron_example_consecutive_spikes_abort_durably_and_the_count_resumes(env: Env) -> None:
    """Spikes at 12 and 13 with count threshold 2: 12 is skipped, 13 raises TrainingAborted after iteration
    12's snapshot was made durable, and the job fails. A rerun resumes at 12 with the skipper's count (1 in
    a row), so a single spike at 13 aborts it at once; a rerun without spikes then finishes."""
    flags = ("--global-norm-spike-threshold", SPIKE_THRESHOLD, "--global-norm-spike-count-threshold", "2")
    first = Job(env, env.tmp_path / "first", save_dir=env.save_dir, idle="0", extra=(*flags, "--spike-steps", "12,13"))
    assert first.wait() != 0
    log = first.log()
    assert "TrainingAborted: step 13: global norm" in log and "2 consecutive" in log, log[-4000:]
    assert 12 in [step for step, _ in layout.complete_iterations(env.save_dir)], "the newest snapshot is durable"
    second = Job(env, env.tmp_path / "second", save_dir=env.save_dir, idle="0", extra=(*flags, "--spike-steps", "13"))
    assert second.wait() != 0
    assert "TrainingAborted: step 13: global norm" in second.log(), second.log()[-4000:]
    for rank in (0, 1):
        assert second.resumes(rank)[0]["iteration"] == 12
        assert sorted(second.losses(rank)) == [], "no iteration was done: the restored count aborted at once"
    third = Job(env, env.tmp_path / "third", save_dir=env.save_dir, idle="0", extra=flags)
    assert third.wait() == 0, third.log()[-4000:]
    for rank in (0, 1):
        assert third.resumes(rank)[0]["iteration"] == 12
        assert sorted(third.losses(rank)) == list(range(13, ITERS + 1))


def test_concat_refuses_a_gated_mlp_before_loading_anything(env: Env, megatron_world: None) -> None:
    """SwiGLU's fc1 shards hold parts of both halves: resharding them as slices would load wrong weights
    silently, so concat=True refuses such a model up front, naming the setting."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import easyckpt.megatron as em

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               gated_linear_unit=True)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                   max_sequence_length=16)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir)
    try:
        with pytest.raises(NotImplementedError, match=r"gated MLPs yet \(gated_linear_unit=True"):
            em.load_checkpoint([gpt], optimizer, None, concat=True)
        assert em.load_checkpoint([gpt], optimizer, None) == (0, 0)   # without concat=True: as before
        assert em.save_checkpoint_if_needed(1, [gpt], optimizer, None)    # strided shards save as they are
    finally:
        em.finalize_easyckpt()
    saved = {k: v.clone() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for param in gpt.parameters():
            param.zero_()
    em.initialize_easyckpt(1, 5, 2, save_dir=env.save_dir)
    try:
        assert em.load_checkpoint([gpt], optimizer, None)[0] == 1
        assert_same({k: v for k, v in gpt.state_dict().items() if k in saved}, saved)
    finally:
        em.finalize_easyckpt()
