"""FSDP2 (``fully_shard``, gloo, CPU) with AdamW under real torchrun: 4 ranks train, one is SIGKILLed, the
job resumes on 4 from memory with the uninterrupted run's losses bit for bit, and on 2 and on 3 ranks from the
4 ranks' slots (resharded from memory); two simulated nodes lose one, and the survivor's 2 ranks reshard from
its slots plus its agent's replicas of the lost node's ranks; the same persisted iteration resumes on 2 and on
3 ranks from disk (resharded through torch.distributed.checkpoint's planning), and plain ``dcp.load`` with
``easyckpt.dcp.StorageReader`` loads it too: every ``full_tensor()`` of model and optimizer state equals the
saved one bitwise; a 2-D (tensor x FSDP) save of 4 ranks resumes on a 1-D mesh of 2. Then bad input, in this
process on a 1-rank mesh: a template of other global shapes, a missing shard file, a checkpoint without
sharding metadata."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, Env, run_cli, seeded_random, wait_for
from ddp_job import Job

from easyckpt_wire import layout

SCRIPT = ROOT / "examples" / "fsdp2_train.py"
STEPS = 8
INTERVAL = 4
pytestmark = pytest.mark.slow


def fsdp_job(env: Env, out: Path, nproc: int, *extra: str, save_dir: Path | None = None) -> Job:
    return Job(env, save_dir or env.save_dir, out, steps=STEPS, nproc=nproc, step_seconds=0.0,
               save_storage_interval=INTERVAL, script=SCRIPT, extra_args=["--digest-every", "1", *extra])


def killed_run(env: Env, nproc: int) -> int:
    """``nproc`` ranks train until rank 1 SIGKILLs itself at a seeded step (the others end with it), leaving
    their slots in this node's shared memory; returns that step."""
    kill_at = seeded_random().randint(2, STEPS - 3)
    first = fsdp_job(env, env.tmp_path / "first", nproc, "--kill-at", str(kill_at))
    try:
        assert first.wait(240) != 0, "rank 1 should have been SIGKILLed"
    finally:
        first.kill()
    return kill_at


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def losses(out: Path, rank: int) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / f"losses-rank{rank}.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """One uninterrupted 4-rank run: (its out dir with losses and full-tensor digests, its save_dir)."""
    env = Env(tmp_path_factory.mktemp("reference"))
    try:
        job = fsdp_job(env, env.tmp_path / "out", 4)
        assert job.wait(240) == 0, job.log()[-3000:]
        wait_for(lambda: env.agent_pid() is None, 30, "the reference job's agent to exit after a clean finish")
        assert (env.save_dir / layout.iteration_dirname(INTERVAL) / layout.METADATA).is_file()
        yield env.tmp_path / "out", env.save_dir
    finally:
        env.cleanup()


def test_kill9_resume_on_4_from_memory_is_bit_exact(env: Env, reference: tuple[Path, Path]) -> None:
    ref_out, _ = reference
    kill_at = killed_run(env, 4)
    second = fsdp_job(env, env.tmp_path / "second", 4)
    assert second.wait(240) == 0, second.log()[-3000:]
    report = read_json(env.tmp_path / "second" / "resume-0.json")
    step = report["step"]
    assert report["source"] == "memory" and step is not None and kill_at - 2 <= step <= kill_at, report
    assert report["digests"] == read_json(ref_out / f"full-{step}.json"), "the resumed state is not the saved one"
    for rank in range(4):
        ours, theirs = losses(env.tmp_path / "second", rank), losses(ref_out, rank)
        assert sorted(ours) == list(range(step + 1, STEPS)), f"rank {rank} ran steps {sorted(ours)}"
        for later in ours:
            assert ours[later] == theirs[later], f"rank {rank}: loss at step {later} differs from the reference"


@pytest.mark.parametrize("nproc", [2, 3])
def test_resume_on_fewer_ranks_reshards_from_disk(env: Env, reference: tuple[Path, Path], nproc: int) -> None:
    """The 4-rank iteration alone in a save_dir: a job of 2 (or 3: shards that do not divide) reshards it in
    load(); plain dcp.load reads it too."""
    ref_out, ref_save = reference
    iteration = env.save_dir / layout.iteration_dirname(INTERVAL)
    shutil.copytree(ref_save / layout.iteration_dirname(INTERVAL), iteration)
    (env.save_dir / layout.TRACKER).write_text(f"{INTERVAL}\n")
    saved = read_json(ref_out / f"full-{INTERVAL}.json")
    out = env.tmp_path / "resumed"
    job = fsdp_job(env, out, nproc, "--dcp-check", str(iteration))
    assert job.wait(240) == 0, job.log()[-3000:]
    assert read_json(out / "dcp.json") == saved, "dcp.load with easyckpt.dcp.StorageReader changed a tensor"
    report = read_json(out / "resume-0.json")
    assert (report["step"], report["source"], report["world_size"]) == (INTERVAL, "disk", nproc), report
    assert report["digests"] == saved, "the resharded state is not the saved one"
    assert f"saved by 4 ranks, this job has {nproc}" in job.log()
    for rank in range(nproc):
        ours = losses(out, rank)
        assert sorted(ours) == list(range(INTERVAL + 1, STEPS)) and all(math.isfinite(v) for v in ours.values())


@pytest.mark.parametrize("nproc", [2, 3])
def test_kill9_then_resume_on_fewer_ranks_reshards_from_memory(env: Env, reference: tuple[Path, Path],
                                                               nproc: int) -> None:
    """4 ranks train, rank 1 is SIGKILLed (the others end with it): the 4 ranks' slots stay in this node's shared
    memory. A job of 2 (or 3) ranks reshards the newest step every old rank holds straight from those slots
    (dcp.load's planning over easyckpt.recovery.reshard.MemoryReader), not from disk: every full tensor equals
    the saved one bitwise, and training goes on."""
    ref_out, _ = reference
    kill_at = killed_run(env, 4)
    out = env.tmp_path / "resumed"
    job = fsdp_job(env, out, nproc)
    assert job.wait(240) == 0, job.log()[-3000:]
    report = read_json(out / "resume-0.json")
    step = report["step"]
    assert (report["source"], report["world_size"]) == ("memory", nproc), report
    assert step is not None and kill_at - 2 <= step <= kill_at, (kill_at, report)
    assert report["digests"] == read_json(ref_out / f"full-{step}.json"), "the resharded state is not the saved one"
    log = job.log()
    assert f"step {step} resharded from memory, 4 -> {nproc} ranks: ranks 0-3 local shm" in log, log[-3000:]
    assert f"saved by 4 ranks, this job has {nproc}" not in log, "the disk was read"
    # The old ranks >= nproc have no successor: released once this world has a safe step of its own (at the
    # latest when close() made the last snapshot durable).
    released = [line for line in log.splitlines() if "slots of the saved world's ranks" in line]
    assert len(released) == 1 and f"ranks >= {nproc}" in released[0] and "-r000003-s" in released[0], released
    for rank in range(nproc):
        ours = losses(out, rank)
        assert sorted(ours) == list(range(step + 1, STEPS)) and all(math.isfinite(v) for v in ours.values())


def test_kill9_on_2_then_resume_on_4_reshards_from_memory(env: Env) -> None:
    """The other way: 2 ranks train and one is SIGKILLed; a job of 4 reshards their slots. Old ranks 0-1's slot
    files are new ranks 0-1's, read before anyone snapshots; new ranks 2-3 take rank 0's private values (said
    in the log). Compared with an uninterrupted 2-rank run's full tensors."""
    ref = fsdp_job(env, env.tmp_path / "ref2", 2, save_dir=env.tmp_path / "ref2-ckpt")
    assert ref.wait(240) == 0, ref.log()[-3000:]
    kill_at = killed_run(env, 2)
    out = env.tmp_path / "resumed"
    job = fsdp_job(env, out, 4)
    assert job.wait(240) == 0, job.log()[-3000:]
    report = read_json(out / "resume-0.json")
    step = report["step"]
    assert (report["source"], report["world_size"]) == ("memory", 4) and kill_at - 2 <= step <= kill_at, report
    assert report["digests"] == read_json(env.tmp_path / "ref2" / f"full-{step}.json"), "not the saved state"
    log = job.log()
    assert f"step {step} resharded from memory, 2 -> 4 ranks: ranks 0-1 local shm" in log, log[-3000:]
    assert "new ranks 2-3 took rank 0's" in log
    for rank in range(4):
        ours = losses(out, rank)
        assert sorted(ours) == list(range(step + 1, STEPS)) and all(math.isfinite(v) for v in ours.values())


def test_lost_node_then_the_surviving_nodes_2_ranks_reshard_from_memory_and_replicas(env: Env) -> None:
    """Two simulated nodes of 2 ranks each train FSDP2 (tests/multinode.py); node 1 is lost whole (ranks, agent,
    shared memory), node 0's ranks die with the job. The job goes on with node 0's 2 ranks alone: it reshards
    the 4-rank world's step from node 0's slots of old ranks 0-1 plus the replicas of old ranks 2-3 that node
    0's agent backed up (read over the replica transfer), not from disk; every full tensor equals the saved
    one bitwise, and training goes on."""
    import os
    import signal
    import subprocess

    from ddp_job import TORCHRUN
    from multinode import Cluster

    from easyckpt.node.client import AgentTimeout, query_status

    steps = 40
    job = Cluster(env, env.tmp_path / "multi", steps=steps, save_storage_interval=INTERVAL, script=SCRIPT,
                  extra_args=["--digest-every", "1"])
    try:
        job.start(0)
        job.start(1)
        at = seeded_random().randint(6, 12)
        wait_for(lambda: job.reached(at) or job.procs[0].poll() is not None, 240, f"every rank to reach step {at}")
        assert job.procs[0].poll() is None, job.log(0)[-3000:]

        def pinned() -> int | None:
            found = [p for p in env.runtime_dir.iterdir() if p.name.endswith("@node0")]
            try:
                return query_status(found[0], timeout=5).get("pinned_step") if found else None
            except (AgentTimeout, OSError):
                return None

        # The safe step across nodes waits for the buddy's backup: once there is one, node 0 holds node 1's ranks.
        wait_for(pinned, 60, "node 0's agent to hold a step backed up from node 1")
        job.kill_node(1)
        victims = [job.procs[0].pid] + [int((job.out / f"pid-rank{r}").read_text()) for r in (0, 1)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.procs[0].wait(timeout=30)
        assert job.agent_pid(0) is not None, "node 0's agent should outlive its ranks"

        out = env.tmp_path / "shrunk"
        out.mkdir()
        command = TORCHRUN + ["--standalone", "--nproc-per-node=2", str(SCRIPT), "--save-dir", str(env.save_dir),
                              "--out", str(out), "--steps", str(steps), "--save-storage-interval", str(INTERVAL)]
        with open(out / "torchrun.log", "w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=job.environ(0), cwd=str(ROOT),
                                  timeout=300)
        text = (out / "torchrun.log").read_text()
        assert done.returncode == 0, text[-4000:]
        report = read_json(out / "resume-0.json")
        step = report["step"]
        assert (report["source"], report["world_size"]) == ("replica", 2), report
        saved = job.out / f"full-{step}.json"
        assert saved.exists(), f"the 4-rank run wrote no digests of step {step}"
        assert report["digests"] == read_json(saved), "the state resharded from memory and replicas is not the saved one"
        assert (f"step {step} resharded from memory, 4 -> 2 ranks: ranks 0-1 local shm, ranks 2-3 replica from node0"
                in text), text[-4000:]
        assert "saved by 4 ranks, this job has 2" not in text, "the disk was read"
        assert "local slots checked against the agent's checksums" in text, text[-4000:]
        # Node 0's agent stops waiting for backups from the lost node: the shrunk job's safe step moves, so its
        # ranks never skip a snapshot.
        agent_log = "".join(p.read_text() for p in env.runtime_dir.glob("*@node0/agent.log"))
        assert "now runs on node node0 alone" in agent_log, agent_log[-3000:]
        assert "skipped:" not in text, [line for line in text.splitlines() if "skipped:" in line][:3]
        for rank in range(2):
            ours = losses(out, rank)
            assert sorted(ours) == list(range(step + 1, steps)) and all(math.isfinite(v) for v in ours.values())
    finally:
        job.cleanup()


@pytest.fixture(scope="module")
def two_d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """One 4-rank run with DTensor tensor parallelism (ColwiseParallel/RowwiseParallel, 2-way) plus FSDP2
    (2-way) on a 2-D (dp, tp) mesh: (its out dir, its iteration of step INTERVAL, alone in a save_dir of its
    own). FSDP2 then shards the column-parallel weight with ``_StridedShard``, and the row-parallel bias (and
    its AdamW moments) is replicated on the tp dim: placements (S(0), R)."""
    env = Env(tmp_path_factory.mktemp("two-d"))
    try:
        job = Job(env, env.save_dir, env.tmp_path / "2d", steps=INTERVAL + 1, nproc=4, step_seconds=0.0,
                  save_storage_interval=INTERVAL, script=SCRIPT, extra_args=["--tp", "2", "--digest-every", "1"])
        assert job.wait(240) == 0, job.log()[-3000:]
        wait_for(lambda: env.agent_pid() is None, 30, "the 2-D job's agent to exit after a clean finish")
        # The iteration alone: nothing in memory for a new job to find (its save_dir names another job).
        iteration = env.tmp_path / "saved" / layout.iteration_dirname(INTERVAL)
        shutil.copytree(env.save_dir / layout.iteration_dirname(INTERVAL), iteration)
        (iteration.parent / layout.TRACKER).write_text(f"{INTERVAL}\n")
        yield env.tmp_path / "2d", iteration
    finally:
        env.cleanup()


def test_2d_replicated_tensors_are_written_once_per_replica_group(two_d: tuple[Path, Path]) -> None:
    """On the (dp, tp) mesh [[0, 1], [2, 3]] a tensor replicated on tp is in the file of tp rank 0 of each dp
    group (ranks 0 and 2) and in no other; the records of ranks 1 and 3 say which rank stored it, and a tensor
    without a replicated placement is in every rank's file."""
    from safetensors import safe_open

    _, iteration = two_d
    meta = read_json(iteration / layout.METADATA)
    placements = {t["name"]: t.get("placements") for t in meta["ranks"]["2"]["tensors"]}
    assert placements["model/mlp.up.weight"] == ["_S(0, 2)", "S(0)"], placements
    assert placements["model/mlp.down.weight"] == ["S(0)", "S(1)"], placements
    replicated = sorted(n for n, p in placements.items() if p and "R" in p)
    assert "model/mlp.down.bias" in replicated and len(replicated) == 3, replicated   # the bias and its 2 moments
    held: dict[str, list[int]] = {}
    for path in sorted(iteration.glob("*.safetensors")):
        rank = int(path.name.split("-")[2])
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                held.setdefault(name, []).append(rank)
    for name in replicated:
        assert sorted(held[name]) == [0, 2], f"{name} is in the files of ranks {held[name]}, expected [0, 2]"
        for rank, writer in ((0, None), (1, 0), (2, None), (3, 2)):
            record = next(t for t in meta["ranks"][str(rank)]["tensors"] if t["name"] == name)
            assert record.get("stored_by") == writer, (rank, record)
            stored = rank if writer is None else writer
            assert record["file"] == layout.rank_file_name(layout.tensor_group(name), stored, 4), record
            assert record["coordinate"] == [rank // 2, rank % 2], record
    assert sorted(held["model/mlp.down.weight"]) == [0, 1, 2, 3]
    assert sorted(held["model/embed.weight"]) == [0, 1, 2, 3]   # FSDP on the dp submesh: no declared replica


def test_2d_same_world_resume_from_disk_reads_the_writers_copy(env: Env, two_d: tuple[Path, Path]) -> None:
    """4 ranks on the same 2-D mesh, memory empty: each rank reads its own files, and ranks 1 and 3 their
    replicated tensors from the files of ranks 0 and 2; every full tensor equals the saved one bitwise."""
    ref_out, iteration = two_d
    save_dir = env.tmp_path / "same"
    shutil.copytree(iteration.parent, save_dir)
    out = env.tmp_path / "resumed"
    job = fsdp_job(env, out, 4, "--tp", "2", save_dir=save_dir)
    assert job.wait(240) == 0, job.log()[-3000:]
    report = read_json(out / "resume-0.json")
    assert (report["step"], report["source"], report["world_size"], report["tp"]) == (INTERVAL, "disk", 4, 2), report
    assert report["digests"] == read_json(ref_out / f"full-{INTERVAL}.json"), "the state read from disk is not the saved one"
    assert "saved by 4 ranks" not in job.log()   # the same world: no resharded load
    for rank in range(4):
        ours = losses(out, rank)
        assert sorted(ours) == list(range(INTERVAL + 1, STEPS)) and all(math.isfinite(v) for v in ours.values())


def test_2d_tensor_and_fsdp_parallel_resumes_on_a_1d_mesh_of_2(env: Env, two_d: tuple[Path, Path]) -> None:
    """The 2-D save resumes from disk on a 1-D mesh of 2 (FSDP only): every full tensor of model and optimizer
    state equals the saved one bitwise, plain dcp.load agrees, and training goes on."""
    ref_out, saved_iteration = two_d
    save_dir = env.tmp_path / "1d"
    shutil.copytree(saved_iteration.parent, save_dir)
    iteration = save_dir / layout.iteration_dirname(INTERVAL)
    out = env.tmp_path / "resumed"
    job = fsdp_job(env, out, 2, "--dcp-check", str(iteration), save_dir=save_dir)
    assert job.wait(240) == 0, job.log()[-3000:]
    saved = read_json(ref_out / f"full-{INTERVAL}.json")
    report = read_json(out / "resume-0.json")
    assert (report["step"], report["source"], report["world_size"], report["tp"]) == (INTERVAL, "disk", 2, 1), report
    assert report["digests"] == saved, "the state resharded from the 2-D mesh is not the saved one"
    assert read_json(out / "dcp.json") == saved, "dcp.load with easyckpt.dcp.StorageReader changed a tensor"
    assert "saved by 4 ranks, this job has 2" in job.log()
    for rank in range(2):
        ours = losses(out, rank)
        assert sorted(ours) == list(range(INTERVAL + 1, STEPS)) and all(math.isfinite(v) for v in ours.values())


def test_2d_missing_writer_file_names_tensor_file_and_writer(env: Env, two_d: tuple[Path, Path]) -> None:
    """Rank 2's model file gone: rank 3, whose copy of the tp-replicated bias rank 2 wrote, gets an error naming
    the tensor, the file and rank 2; `easyckpt verify` reports the iteration damaged; the resharded reader
    (DCP) names the file and rank 2 too."""
    import torch

    from easyckpt import dcp as edcp
    from easyckpt import storage
    from easyckpt.snapshot.state import torch_dtype

    _, saved_iteration = two_d
    iteration = env.tmp_path / "broken" / layout.iteration_dirname(INTERVAL)
    shutil.copytree(saved_iteration, iteration)
    missing = layout.rank_file_name("model", 2, 4)
    (iteration / missing).unlink()
    entry = storage.rank_entry(iteration, 3, 4)
    shared = [r for r in entry.records if r.stored_by == 2 and r.file == missing]
    assert shared, [r for r in entry.records if r.stored_by is not None]
    with pytest.raises(storage.CheckpointCorruptError) as caught:
        for _ in storage.read_tensors(dataclasses.replace(entry, records=shared)):
            pass
    message = str(caught.value)
    assert missing in message and "is missing" in message and "rank 2 wrote it" in message, message
    assert "'model/mlp.down.bias'" in message and "replica group" in message, message

    done = run_cli("verify", str(iteration), env=env)
    assert done.returncode == 1 and missing in done.stdout and "DAMAGED" in done.stdout, done.stdout

    index = edcp.checkpoint_index(iteration)
    key = "model.mlp.down.bias"
    assert {c.rank for c in index.tensors[key].chunks} == {0, 2}   # one saved copy per replica group
    full = {key: torch.empty(index.tensors[key].global_shape, dtype=torch_dtype(index.tensors[key].dtype))}
    with pytest.raises(storage.CheckpointCorruptError) as dcp_caught:
        edcp.load_into(full, iteration)
    message = str(dcp_caught.value)
    assert missing in message and "rank 2's shard of 'model/mlp.down.bias'" in message, message


# bad input: in this process, a 1-rank gloo group and mesh --------------------------------------------------
def fsdp_state(vocab: int = 64) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(the example module, model, optimizer, training state) of examples/fsdp2_train.py on this process's mesh."""
    import importlib.util

    import torch
    from torch.distributed.fsdp import fully_shard

    spec = importlib.util.spec_from_file_location("fsdp2_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.TinyLM(vocab=vocab)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    module.init_optimizer_state(optimizer)
    return module, model, optimizer, module.training_state(model, optimizer, -1)


def load_copy(env: Env, source: Path, state: dict[str, Any]) -> Any:
    import easyckpt

    ckpt = easyckpt.Checkpointer(env.save_dir, 1, 100, 2, start_agent=False)
    try:
        return ckpt.load(state, load_dir=source)
    finally:
        ckpt.close()


def copy_iteration(env: Env, reference: tuple[Path, Path]) -> Path:
    target = env.tmp_path / "copy" / layout.iteration_dirname(INTERVAL)
    shutil.copytree(reference[1] / layout.iteration_dirname(INTERVAL), target)
    return target


def test_resume_on_1_rank_and_bad_templates(env: Env, reference: tuple[Path, Path], one_rank: None) -> None:
    import easyckpt

    iteration = copy_iteration(env, reference)
    module, model, optimizer, state = fsdp_state()
    result = load_copy(env, iteration, state)
    assert (result.step, result.source) == (INTERVAL, "disk")
    model.load_state_dict(result.state["model"])
    optimizer.load_state_dict(result.state["optim"])
    assert module.full_digests(model, optimizer) == read_json(reference[0] / f"full-{INTERVAL}.json")

    _, _, _, wider = fsdp_state(vocab=65)
    with pytest.raises(easyckpt.StateMismatchError) as caught:
        load_copy(env, iteration, wider)
    message = str(caught.value)
    assert "model/embed.weight" in message and "(64, 32)" in message and "(65, 32)" in message, message
    assert "global shapes" in message and "configuration of the run that saved it" in message, message


def test_missing_shard_file_names_file_and_tensor(env: Env, reference: tuple[Path, Path], one_rank: None) -> None:
    import easyckpt

    iteration = copy_iteration(env, reference)
    (iteration / layout.rank_file_name("model", 2, 4)).unlink()
    _, _, _, state = fsdp_state()
    with pytest.raises(easyckpt.LoadError) as caught:
        load_copy(env, iteration, state)
    message = str(caught.value)
    assert layout.rank_file_name("model", 2, 4) in message and "is missing" in message, message
    assert "rank 2's shard of 'model/" in message and "Restore the file" in message, message


def test_checkpoint_without_sharding_metadata(env: Env, reference: tuple[Path, Path], one_rank: None) -> None:
    """As an easyckpt before sharded state wrote it: every tensor whole, no placements."""
    import easyckpt

    iteration = copy_iteration(env, reference)
    meta = read_json(iteration / layout.METADATA)
    meta.pop(layout.MARKER_CHECKSUM)   # nor did it checksum its marker
    for rank in meta["ranks"].values():
        for record in rank["tensors"]:
            for key in ("placements", "mesh_shape"):
                record.pop(key, None)
            record["global_shape"], record["offsets"] = record["shape"], [0] * len(record["shape"])
    (iteration / layout.METADATA).write_text(json.dumps(meta))
    _, _, _, state = fsdp_state()
    with pytest.raises(easyckpt.StateMismatchError) as caught:
        load_copy(env, iteration, state)
    message = str(caught.value)
    assert "model/embed.weight: checkpoint (16, 32) has no sharding metadata" in message, message
    assert "(64, 32)" in message and "before sharding it" in message, message


def test_convert_to_hf_gives_the_sharded_models_outputs(env: Env, reference: tuple[Path, Path], one_rank: None) -> None:
    """`easyckpt convert --to hf` of the 4-rank save: one safetensors file that an unsharded model loads, whose
    outputs equal those of the FSDP2 model resumed from the same iteration."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    iteration = copy_iteration(env, reference)
    out = env.tmp_path / "hf" / "model.safetensors"
    done = run_cli("convert", "--to", "hf", str(iteration), str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert f"step {INTERVAL}" in done.stdout and str(out) in done.stdout, done.stdout
    module, model, optimizer, state = fsdp_state()
    with safe_open(str(out), framework="pt") as handle:
        assert set(handle.keys()) == set(module.TinyLM().state_dict())
        assert handle.metadata()["easyckpt_step"] == str(INTERVAL)
    plain = module.TinyLM()
    plain.load_state_dict(load_file(str(out)), strict=True)
    result = load_copy(env, iteration, state)
    model.load_state_dict(result.state["model"])
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(5))
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))


def test_ranks_needed_plans_fsdp_dim0_shards_from_the_saved_files(env: Env, reference: tuple[Path, Path]) -> None:
    """The planning alone, in this process (no process group): for N target ranks each splitting every tensor on
    dim 0, the files DCP's planner reads match the overlap of the saved ranks' dim-0 ranges; the CLI prints them."""
    from easyckpt import dcp as edcp

    iteration = copy_iteration(env, reference)
    index = edcp.checkpoint_index(iteration)
    sharded = [t for t in index.tensors.values() if t.sharded]
    assert sharded and index.world_size == 4
    for world in (2, 3, 4, 5):
        _, plans = edcp.ranks_needed(iteration, world)
        for rank in range(world):
            expected: set[int] = set()
            for saved in sharded:
                rows = saved.global_shape[0] if saved.global_shape else 1
                ours = -(-rows // world)
                lo, hi = rank * ours, min(rows, (rank + 1) * ours)
                expected |= {c.rank for c in saved.chunks
                             if lo < hi and c.offsets[0] < hi and lo < c.offsets[0] + c.shape[0]}
            expected.add(rank if rank < 4 else 0)   # the rank whose private values it takes
            read = {int(name.split("-")[2]) for name in plans[rank]}
            assert read == expected, f"world {world} rank {rank}: reads ranks {sorted(read)}, expected {sorted(expected)}"
    done = run_cli("ranks-needed", str(iteration), "--world-size", "2", env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("easyckpt-model-" in line for line in lines), done.stdout


def test_convert_to_dcp_and_back_round_trips_bitwise(env: Env, reference: tuple[Path, Path], one_rank: None) -> None:
    """`convert --to dcp` of the 4-rank save: dcp.load of it gives every full tensor bitwise; `convert --from dcp`
    of that gives an easyckpt iteration that Checkpointer.load reads into an FSDP2 model, bitwise again."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from easyckpt import dcp as edcp
    from easyckpt.snapshot.sharding import is_dtensor
    from easyckpt.snapshot.state import torch_dtype

    iteration = copy_iteration(env, reference)
    index = edcp.checkpoint_index(iteration)
    full = {k: torch.empty(t.global_shape, dtype=torch_dtype(t.dtype)) for k, t in index.tensors.items() if t.sharded}
    dcp.load(full, storage_reader=edcp.StorageReader(iteration), no_dist=True)
    out = env.tmp_path / "as-dcp"
    done = run_cli("convert", "--to", "dcp", str(iteration), str(out), env=env)
    assert done.returncode == 0, done.stderr
    again = {k: torch.empty_like(v) for k, v in full.items()}
    dcp.load(again, storage_reader=FileSystemReader(str(out)), no_dist=True)
    differ = [k for k in full if not torch.equal(full[k], again[k])]
    assert not differ, f"{len(differ)} tensors differ after convert --to dcp: {differ[:3]}"

    back = env.tmp_path / "from-dcp"
    done = run_cli("convert", "--from", "dcp", "--step", str(INTERVAL), str(out), str(back), env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    _, _, _, state = fsdp_state()
    result = load_copy(env, back / layout.iteration_dirname(INTERVAL), state)
    assert result.step == INTERVAL
    loaded = {}
    for key, value in (("model." + k, v) for k, v in result.state["model"].items()):
        loaded[key] = value.full_tensor() if is_dtensor(value) else value
    model_keys = [k for k in full if k.startswith("model.")]
    assert model_keys
    differ = [k for k in model_keys if not torch.equal(full[k], loaded[k])]
    assert not differ, f"{len(differ)} model tensors differ after convert --from dcp: {differ[:3]}"


def test_dcp_reader_verifies_each_range_and_reads_boxes_from_the_mapped_file(env: Env,
                                                                           reference: tuple[Path, Path]) -> None:
    """The StorageReader maps each file: a flipped byte in a saved range fails its checksum (naming the file and
    the tensor) unless verify=False, which then reads that byte as it is; a truncated file is refused."""
    import torch

    from easyckpt import dcp as edcp
    from easyckpt import storage
    from easyckpt.snapshot.state import torch_dtype

    iteration = copy_iteration(env, reference)
    index = edcp.checkpoint_index(iteration)
    key = "model.embed.weight"
    chunk = next(c for c in index.tensors[key].chunks if c.rank == 1)

    def fresh() -> dict[str, Any]:
        saved = index.tensors[key]
        return {key: torch.empty(saved.global_shape, dtype=torch_dtype(saved.dtype))}

    good = fresh()
    edcp.load_into(good, iteration)
    path = iteration / chunk.file
    blob = bytearray(path.read_bytes())
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    at = 8 + int.from_bytes(blob[:8], "little") + header[chunk.name]["data_offsets"][0]
    blob[at] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(storage.CheckpointCorruptError) as caught:
        edcp.load_into(fresh(), iteration)
    message = str(caught.value)
    assert chunk.file in message and repr(chunk.name) in message and "fails its xxh3_128 checksum" in message, message
    unverified = fresh()
    import torch.distributed.checkpoint as dcp

    dcp.load(unverified, storage_reader=edcp.StorageReader(iteration, verify=False), no_dist=True)
    differ = (unverified[key] != good[key]).nonzero()
    assert len(differ) == 1 and int(differ[0][0]) == chunk.offsets[0], differ   # the flipped byte's element

    path.write_bytes(bytes(blob[:at]))
    with pytest.raises(storage.CheckpointCorruptError, match="truncated or damaged"):
        edcp.load_into(fresh(), iteration)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on a GPU machine")
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.xfail(
    strict=False, reason="failed on one H100 (torch 2.11, 2026-11-26) before the kill step, cause not captured "
    "(NCCL refusing two ranks on one GPU?); the job's log is in the failure message now"))])
def test_cuda_kill9_resume_from_memory_restores_the_saved_sharded_state(env: Env, nproc: int) -> None:
    """FSDP2 on CUDA (NCCL; 2 ranks share one GPU when there is one): the last rank is SIGKILLed at a seeded
    step; the job resumes from memory into the CUDA DTensors with every full tensor bitwise what the killed
    run had at that step, and the steps it trains again match the killed run's losses (within fp tolerance:
    some CUDA kernels, such as the embedding's backward, are not bitwise deterministic)."""
    kill_at = seeded_random().randint(2, STEPS - 3)
    first = fsdp_job(env, env.tmp_path / "first", nproc, "--device", "cuda", "--kill-at", str(kill_at),
                     "--kill-rank", str(nproc - 1))
    try:
        assert first.wait(240) != 0, f"rank {nproc - 1} should have been SIGKILLed: {first.log()[-3000:]}"
    finally:
        first.kill()
    assert (env.tmp_path / "first" / f"full-{kill_at}.json").is_file(), \
        f"the first run died before step {kill_at}: {first.log()[-3000:]}"
    second = fsdp_job(env, env.tmp_path / "second", nproc, "--device", "cuda")
    assert second.wait(240) == 0, second.log()[-3000:]
    report = read_json(env.tmp_path / "second" / "resume-0.json")
    step = report["step"]
    assert report["source"] == "memory" and step is not None and kill_at - 2 <= step <= kill_at, report
    assert report["digests"] == read_json(env.tmp_path / "first" / f"full-{step}.json"), "resumed a wrong state"
    for rank in range(nproc):
        ours, theirs = losses(env.tmp_path / "second", rank), losses(env.tmp_path / "first", rank)
        assert sorted(ours) == list(range(step + 1, STEPS)), f"rank {rank} ran steps {sorted(ours)}"
        for again in set(ours) & set(theirs):
            assert math.isclose(ours[again], theirs[again], rel_tol=1e-4), (rank, again, ours[again], theirs[again])
