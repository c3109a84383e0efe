"""Object storage (issue 26): 2-rank torchrun jobs whose save_dir is ``s3://bucket/prefix`` on a real S3 server
process (moto's server mode on 127.0.0.1, ``tests/s3server.py``), spoken to over HTTP.

- persists on cadence with rotation, a kill -9 and a resume from memory; then a new job id resumes from the
  object store, bit-exact; all of it through a fault proxy (``tests/s3proxy.py``) that throttles a seeded
  fraction of the requests (503 SlowDown): retried, and the retries logged once per persist;
- the server gone mid-persist (the proxy drops every connection and refuses new ones at a seeded write):
  that persist fails like a full disk, the ranks hear it, training goes on, the next due step persists, and
  nothing of the failed persist is left;
- start-up refuses other schemes and a missing bucket with the URL and the fix, and nothing is written to a
  local ``s3:`` folder;
- ``easyckpt ls`` and ``verify`` read the URL.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import s3server
from conftest import ROOT, Env, assert_same, run_cli, seeded_random, wait_for, wipe_memory
from ddp_job import Job
from s3proxy import FaultProxy

from easyckpt_wire import layout
from easyckpt_wire.storage import open_storage

pytestmark = pytest.mark.slow
STEPS = 24
INTERVAL = 4
STEPS_DOWN = 80   # the outage job: long enough to outlast the outage and the next persist


@pytest.fixture
def s3_url(env: Env, monkeypatch: pytest.MonkeyPatch) -> str:
    server = s3server.server()
    for key, value in s3server.env(server.url).items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3server.bucket(server.url)}/runs/a"


def _objects(url: str) -> list[str]:
    store = open_storage(url)
    prefix = store.name("")   # type: ignore[attr-defined]
    client = s3server.client(os.environ["AWS_ENDPOINT_URL_S3"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix + "/")  # type: ignore[attr-defined]
    return sorted(item["Key"][len(prefix) + 1:] for page in pages for item in page.get("Contents", []))


def test_a_job_persists_rotates_and_resumes_from_memory_then_from_the_object_store(
        env: Env, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request goes through a proxy that answers 503 SlowDown to a seeded 15%: persists succeed through
    the client's retries, counted and logged once per persist."""
    kill_at = seeded_random().randint(6, STEPS - 6)
    args = ["--max-ckpt-num", "2", "--grad-sync", "flat"]
    proxy = _proxied(monkeypatch, throttle=0.15)
    first = Job(env, s3_url, env.tmp_path / "first", steps=STEPS, save_storage_interval=INTERVAL, extra_args=args)
    try:
        first.kill_rank(1, kill_at)
        assert first.wait(90) != 0
    finally:
        first.kill()
    assert not (ROOT / "s3:").exists() and not Path("s3:").exists(), "a URL was taken for a local path"

    second = Job(env, s3_url, env.tmp_path / "second", steps=STEPS, save_storage_interval=INTERVAL, extra_args=args)
    assert second.wait() == 0, second.log()[-3000:]
    resumed = [second.resumes(rank)[-1] for rank in range(2)]
    assert {r["source"] for r in resumed} == {"memory"} and resumed[0]["step"] == resumed[1]["step"], resumed
    for rank in range(2):
        assert resumed[rank]["digest"] == first.losses(rank)[resumed[0]["step"]]["digest"]

    log = _agent_log(env)
    counted = re.findall(r"iteration_(\d+): (\d+) requests retried during this persist(?: \((.*)\))?", log)
    persisted = sorted(int(step) for step in re.findall(r"persisted step=(\d+)", log))
    assert persisted and sorted(int(step) for step, _, _ in counted) == persisted, "one retry count per persist"
    assert proxy.throttled > 0 and sum(int(n) for _, n, _ in counted) > 0, (proxy.throttled, counted)
    assert any("SlowDown" in reasons for _, _, reasons in counted), counted
    store = open_storage(s3_url)
    complete = [step for step, _ in layout.complete(store)]
    final = STEPS - 1
    assert complete[-1] == final and len(complete) == 2, f"rotation to max_ckpt_num=2: {complete}"
    assert layout.tracker(store) == final
    # Besides the due steps, the agent persists the newest step of every local rank when a rank dies (flush on
    # failure); when that persist outlasts the next due steps they are passed over, and the flushed step stays.
    flushed = {int(step) for step in re.findall(r"flush on failure: persisting step (\d+)", log)}
    assert all(step % INTERVAL == 0 or step in flushed for step in complete[:-1]), (complete, flushed)
    names = _objects(s3_url)
    assert not [n for n in names if n.startswith(".tmp-") or "/.easyckpt-" in n], names
    audit = [json.loads(line) for line in store.read(layout.AUDIT_LOG).decode().splitlines()]
    assert any(row["op"] == "write" and row["path"] == f"{s3_url}/{layout.iteration_dirname(final)}" for row in audit)
    assert any(row["op"] == "delete" for row in audit), "rotation deletes are audited"
    assert not [row for row in audit if "replaced" in row.get("reason", "")], "no step was persisted twice"

    third = Job(env, s3_url, env.tmp_path / "third", steps=STEPS + 2, save_storage_interval=INTERVAL, extra_args=args,
                extra_env={"EASYCKPT_JOB_ID": "another-job"})
    assert third.wait() == 0, third.log()[-3000:]
    for rank in range(2):
        report = third.resumes(rank)[-1]
        assert (report["step"], report["source"]) == (final, "disk"), report
        assert report["digest"] == second.losses(rank)[final]["digest"], f"rank {rank}: not bit-exact"

    proxy.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3server.server().url)
    assert _leftovers(s3_url) == []
    newest = layout.complete(open_storage(s3_url))[-1][1]   # the third job's last step (rotation took the final one)
    _dcp_reads_it_on_another_world_size(f"{s3_url}/{newest}", env.tmp_path / "copy")
    listing = run_cli("ls", s3_url, env=env)
    assert newest == layout.iteration_dirname(STEPS + 1)   # the third job's close() persisted its last step
    assert listing.returncode == 0 and f"{newest}" in listing.stdout and "<- tracker" in listing.stdout, (
        listing.stdout + listing.stderr)
    verified = run_cli("verify", s3_url, env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_start_up_refuses_other_schemes_and_a_missing_bucket_naming_the_fix(env: Env, s3_url: str,
                                                                             tmp_path: Path) -> None:
    import easyckpt

    os.chdir(tmp_path)
    for url, expected in (("gs://bucket/run", "gs:// scheme has no storage implementation"),
                          ("hdfs://namenode/run", "hdfs:// scheme"),
                          ("file://otherhost/run", "file:// scheme")):
        with pytest.raises(ValueError, match=expected) as caught:
            easyckpt.Checkpointer(save_dir=url, save_mem_interval=1, save_storage_interval=1, max_ckpt_num=1)
        assert "s3://bucket/prefix" in str(caught.value)
    missing = "s3://no-such-bucket-here/run"
    with pytest.raises(FileNotFoundError) as lost:
        easyckpt.Checkpointer(save_dir=missing, save_mem_interval=1, save_storage_interval=1, max_ckpt_num=1)
    text = str(lost.value)
    assert missing in text and "create it" in text and "AWS_ENDPOINT_URL_S3" in text, text
    assert "testing" not in text, "a credential is in the message"
    assert list(tmp_path.iterdir()) == [], "nothing local was written"


def _dcp_reads_it_on_another_world_size(iteration: str, local: Path) -> None:
    """torch.distributed.checkpoint.load through easyckpt.dcp.StorageReader of the s3:// iteration (2 ranks
    saved it) into one process, bitwise equal to the same load of a local copy of its objects."""
    import torch
    import torch.distributed.checkpoint as dcp

    from easyckpt import dcp as edcp
    from easyckpt.snapshot.state import torch_dtype

    store = open_storage(iteration.rsplit("/", 1)[0])
    name = iteration.rsplit("/", 1)[1]
    local.mkdir()
    for entry in store.entries(name):
        (local / entry.name).write_bytes(store.read(f"{name}/{entry.name}"))
    index = edcp.checkpoint_index(iteration)   # type: ignore[arg-type]
    assert index.world_size == 2
    loaded = {}
    for where in (iteration, str(local)):
        state = {k: torch.zeros(t.global_shape, dtype=torch_dtype(t.dtype)) for k, t in index.tensors.items()}
        dcp.load(state, storage_reader=edcp.StorageReader(where), no_dist=True)
        loaded[where] = state
    assert loaded[iteration] and all(torch.equal(loaded[iteration][k], loaded[str(local)][k]) for k in loaded[iteration])
    assert any(bool(t.any()) for t in loaded[iteration].values()), "nothing was read"


def _agent_log(env: Env) -> str:
    return "".join(log.read_text(errors="replace") for log in env.runtime_dir.glob("*/agent.log"))


def _leftovers(url: str) -> list[str]:
    """What a persist in progress or a failed one leaves: leases, scratch copies, marker-less iterations,
    multipart uploads never completed."""
    store = open_storage(url)
    names = _objects(url)
    found = [n for n in names if n.startswith((".tmp-", ".stage-")) or "/.easyckpt-" in n]
    found += [key for _, key, complete in layout.iterations(store) if not complete]
    uploads = s3server.client(os.environ["AWS_ENDPOINT_URL_S3"]).list_multipart_uploads(
        Bucket=store.bucket, Prefix=store.name("") + "/")   # type: ignore[attr-defined]
    return found + [f"upload {u['Key']}" for u in uploads.get("Uploads", [])]


def _proxied(monkeypatch: pytest.MonkeyPatch, **faults: object) -> FaultProxy:
    proxy = FaultProxy(s3server.server().url, seed=seeded_random().randrange(1 << 30), **faults)  # type: ignore[arg-type]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    return proxy


def test_the_server_gone_mid_persist_fails_it_cleanly_and_the_next_due_step_persists(
        env: Env, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy drops every connection and refuses new ones at a seeded write of a persist, and stays down
    until the agent has given that persist up (retries exhausted); training goes on, the ranks hear of it,
    the next due step persists once the server is back, and nothing of the failed persist is left."""
    down_at = seeded_random().randint(2, 12)
    proxy = _proxied(monkeypatch, down_at=down_at)
    monkeypatch.setenv("EASYCKPT_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("EASYCKPT_S3_TIMEOUT", "3")
    try:
        job = Job(env, s3_url, env.tmp_path / "job", steps=STEPS_DOWN, save_storage_interval=INTERVAL,
                  extra_args=["--max-ckpt-num", "3"])
        assert proxy.went_down.wait(120), f"the job made only {proxy.writes} writes:\n{job.log()[-3000:]}"
        wait_for(lambda: re.search(r"persist of step \d+ failed", _agent_log(env)) or job.proc.poll() is not None,
                 120, "the agent to give the persist up")
        failed = int(re.findall(r"persist of step (\d+) failed", _agent_log(env))[0])
        proxy.come_back()
        assert job.wait(300) == 0, job.log()[-3000:]
    finally:
        proxy.close()
    log = _agent_log(env)
    assert "ConnectionError" in log or "cannot reach" in log or "TimeoutError" in log or "Errno" in log, log[-3000:]
    assert re.search(rf"rank \d: persist of step {failed} failed", job.log()), "the ranks heard of it"
    assert "persists succeed again" in job.log()
    assert set(re.findall(r"persist of step (\d+) failed", log)) == {str(failed)}, "one failed persist"
    after = log[log.index(f"persist of step {failed} failed"):]
    tried = [int(s) for s in re.findall(r"persisting step (\d+) to", after)]
    later = [int(s) for s in re.findall(r"persisted step=(\d+)", after)]
    assert tried and later and later[0] == tried[0] > failed, f"failed at {failed}, then tried {tried}, persisted {later}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3server.server().url)
    store = open_storage(s3_url)
    assert layout.tracker(store) == STEPS_DOWN - 1 and failed not in [s for s, _ in layout.complete(store)]
    assert _leftovers(s3_url) == [], "the failed persist's leftovers are gone by the end of the run"
    verified = run_cli("verify", s3_url, env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_workers_restarted_while_the_store_is_down_resume_from_memory_and_persist_once_it_is_back(
        env: Env, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 dies while the object store is unreachable; torchrun restarts both workers. Their start-up check
    of the store fails as it would for a wrong endpoint, but a restarted worker's store answered before, so it
    says so and goes on: both resume from this node's memory (not a crash loop that ends the job), and the
    persists work again once the store is back."""
    kill_at = seeded_random().randint(6, STEPS - 8)
    proxy = _proxied(monkeypatch)
    monkeypatch.setenv("EASYCKPT_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("EASYCKPT_S3_TIMEOUT", "3")
    try:
        job = Job(env, s3_url, env.tmp_path / "job", steps=STEPS, save_storage_interval=INTERVAL, max_restarts=1,
                  extra_args=["--kill-at", str(kill_at), "--kill-rank", "1", "--kill-signal", "STOP"])
        killed = job.out / "killed-rank1"
        wait_for(lambda: killed.exists() or job.proc.poll() is not None, 120, f"rank 1 to stop at step {kill_at}")
        assert job.proc.poll() is None, job.log()[-3000:]
        proxy.go_down()
        os.kill(job.pid(1), signal.SIGKILL)
        wait_for(lambda: len(job.resumes(1)) > 1 or job.proc.poll() is not None, 120, "the restarted rank 1 to resume")
        proxy.come_back()
        assert job.wait(300) == 0, job.log()[-3000:]
    finally:
        proxy.close()
    resumed = [job.resumes(rank)[-1] for rank in range(2)]
    assert {r["source"] for r in resumed} == {"memory"}, resumed
    assert {r["step"] for r in resumed} <= {kill_at - 1, kill_at} and resumed[0]["step"] == resumed[1]["step"], \
        (kill_at, resumed)
    log = job.log()
    assert f"save_dir {s3_url} cannot be reached now" in log and "restart 1 of this job's workers" in log, log[-3000:]
    agents = _agent_log(env)
    assert "exited before answering" not in log and "Traceback" not in agents, agents[-6000:]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3server.server().url)
    assert layout.tracker(open_storage(s3_url)) == STEPS - 1, "close() persisted the last step once the store was back"


def test_convert_and_ranks_needed_read_an_s3_save_dir_and_convert_from_dcp_writes_into_one(env: Env, s3_url: str,
                                                                                          tmp_path: Path) -> None:
    """`easyckpt convert --to hf|dcp` and `ranks-needed` take the s3:// save_dir as their source, bitwise; `convert
    --from dcp` writes a new iteration into an s3:// save_dir; a local-only output given as a URL is refused
    with the fix, and nothing local named "s3:" appears."""
    import torch
    from safetensors.torch import load_file

    import easyckpt
    from easyckpt.tools.convert import full_state, read_dcp
    from easyckpt_wire.storage import as_path

    os.chdir(tmp_path)
    gen = torch.Generator().manual_seed(seeded_random().randint(0, 2**31))
    state = {"model": {"weight": torch.randn(64, 32, generator=gen), "bias": torch.randn(64, generator=gen)},
             "optim": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=gen)}}}, "step": 3}
    ck = easyckpt.Checkpointer(s3_url, 1, 1, 2)
    try:
        assert ck.save(3, state, persist=True)
    finally:
        ck.close()
    assert [step for step, _ in layout.complete(open_storage(s3_url))] == [3]

    hf = tmp_path / "hf"
    done = run_cli("convert", "--to", "hf", s3_url, str(hf), env=env)
    assert done.returncode == 0, done.stderr
    weights = load_file(hf / "model.safetensors")
    assert set(weights) == {"weight", "bias"} and all(torch.equal(weights[k], state["model"][k]) for k in weights)

    as_dcp = tmp_path / "dcp"
    done = run_cli("convert", "--to", "dcp", s3_url, str(as_dcp), env=env)
    assert done.returncode == 0, done.stderr
    read = read_dcp(as_dcp)
    assert torch.equal(read["model"]["weight"], state["model"]["weight"])
    # DCP keeps keys as strings: the optimizer's param id 0 comes back as "0" (DCP's own round trip does the same)
    assert torch.equal(read["optim"]["state"]["0"]["exp_avg"], state["optim"]["state"][0]["exp_avg"])

    back = f"{s3_url}-from-dcp"
    done = run_cli("convert", "--from", "dcp", "--step", "7", str(as_dcp), back, env=env, timeout=180)
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"{back}/iteration_0000007" in done.stdout, done.stdout
    again = full_state(as_path(f"{back}/iteration_0000007"))
    assert torch.equal(again["model"]["bias"], state["model"]["bias"])
    assert torch.equal(again["optim"]["state"]["0"]["exp_avg"], state["optim"]["state"][0]["exp_avg"])

    needed = run_cli("ranks-needed", s3_url, "--world-size", "2", env=env)
    assert needed.returncode == 0 and "rank 1: easyckpt-model-" in needed.stdout, needed.stdout + needed.stderr

    for args, side in ((("--to", "hf", s3_url, f"{s3_url}-hf"), "hf destination"),
                       (("--to", "dcp", s3_url, f"{s3_url}-dcp"), "DCP destination"),
                       (("--from", "dcp", f"{s3_url}-dcp", str(tmp_path / "local")), "DCP source")):
        refused = run_cli("convert", *args, env=env)
        assert refused.returncode == 2 and f"the {side}" in refused.stderr and "local directory" in refused.stderr, (
            refused.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "hf"], "a URL was taken for a local path"


def test_trainer_wrapper_persists_to_s3_exports_checkpoints_from_it_and_resumes_from_it(env: Env, s3_url: str) -> None:
    """HF TrainerWrapper(save_dir="s3://...") on 2 ranks at full speed: persisted steps reach the bucket and are
    exported from it as Trainer-native checkpoint-N folders; after a kill -9 with the node's memory wiped, the
    rerun resumes from the bucket and continues an uninterrupted plain Trainer's curve exactly."""
    pytest.importorskip("transformers")
    from hf_job import SAVE_STEPS, STEPS, HFJob, assert_continues_exactly, killed_run, resumed_at, run_to_end

    output_dir = env.tmp_path / "hf"
    at = seeded_random().randint(11, 14)
    killed_run(env, output_dir, env.tmp_path / "first", at, step_seconds=0.0, extra_args=["--save-dir", s3_url])
    wipe_memory(env)
    persisted = [step for step, _ in layout.complete(open_storage(s3_url))]
    assert persisted and persisted[-1] >= SAVE_STEPS, persisted
    assert not (output_dir / "easyckpt").exists() and not (ROOT / "s3:").exists(), "a URL was taken for a local path"

    second = run_to_end(HFJob(env, output_dir, env.tmp_path / "second", resume="newest",
                              extra_args=["--save-dir", s3_url]))
    newest = persisted[-1]
    for report in resumed_at(second):
        assert (report["step"], report["source"], report["path"]) == (
            newest, "disk", f"{s3_url}/{layout.iteration_dirname(newest)}"), report
    reference = run_to_end(HFJob(env, env.tmp_path / "plain", env.tmp_path / "plain-out", plain=True))
    assert_continues_exactly(second, reference, newest)

    exported = {int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*")}
    due = set(range(SAVE_STEPS, STEPS + 1, SAVE_STEPS))
    # Every save step, even one asked for while the previous persist ran and the ranks were killed before it
    # started (the agent writes it before the failure flush of the newest, policy.next_to_persist).
    assert exported == due, (sorted(exported), newest)
    assert {SAVE_STEPS, STEPS} <= exported and (output_dir / f"checkpoint-{STEPS}" / "model.safetensors").is_file()
    assert f"exported {s3_url}/{layout.iteration_dirname(STEPS)} to checkpoint-{STEPS}" in second.log()


def test_lightning_callback_persists_to_s3_exports_checkpoints_from_it_and_resumes_from_it(env: Env,
                                                                                         s3_url: str) -> None:
    """Lightning DDP with EasyCkpt(save_dir="s3://..."): after a kill -9 with the node's memory wiped,
    fit(ckpt_path="last") resumes from the bucket and continues a plain Lightning run's curve exactly; the
    ModelCheckpoint files are exported from the bucket's iterations."""
    pytest.importorskip("lightning")
    from lightning_job import SAVE_STEPS, STEPS, LightningJob, assert_continues_exactly, run_to_end

    root = env.tmp_path / "root"
    at = seeded_random().randint(SAVE_STEPS + 1, 2 * SAVE_STEPS - 1)
    args = ["--save-dir", s3_url]
    first = LightningJob(env, root, env.tmp_path / "first", args=[*args, "--kill-rank", "1", "--kill-at", str(at)])
    try:
        assert first.wait(120) != 0, "rank 1 was to be killed"
    finally:
        first.kill()
    wipe_memory(env)
    persisted = [step for step, _ in layout.complete(open_storage(s3_url))]
    assert persisted and persisted[-1] >= SAVE_STEPS, persisted
    assert not (root / "easyckpt").exists() and not (ROOT / "s3:").exists(), "a URL was taken for a local path"

    second = run_to_end(LightningJob(env, root, env.tmp_path / "second", args=args))
    newest = persisted[-1]
    for rank in range(2):
        report = second.report(rank)
        assert report["resumed"]["source"] == "disk" and report["global_step"] == newest, report
    reference = run_to_end(LightningJob(env, env.tmp_path / "plain-root", env.tmp_path / "plain", args=["--plain"]))
    assert_continues_exactly(second, reference, newest, STEPS)
    import torch

    checkpoints = root / "checkpoints"   # every_n_train_steps=8, save_top_k=2, save_last
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"], names
    saved = torch.load(checkpoints / "epoch=1-step=16.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 16 and "state_dict" in saved and "optimizer_states" in saved, sorted(saved)
    assert [step for step, _ in layout.complete(open_storage(s3_url))][-1] == STEPS, "close() made the last step durable"


def test_megatron_persists_to_s3_resumes_from_it_and_converts_it_to_megatron(env: Env, s3_url: str) -> None:
    """examples/megatron_gpt.py with --save s3://...: after a kill -9 with the node's memory and agent gone, the
    rerun resumes from the bucket on the uninterrupted run's curve; `convert --to megatron` of the bucket
    writes a native checkpoint Megatron's loader accepts."""
    pytest.importorskip("megatron.core")
    from megatron_job import Job, assert_same_curve

    reference_job = Job(env, env.tmp_path / "reference", save_dir=env.tmp_path / "reference-ckpt")
    assert reference_job.wait() == 0, reference_job.log()[-3000:]
    reference = {rank: (reference_job.losses(rank), reference_job.final(rank)) for rank in (0, 1)}
    env.wait_agent_gone()

    at = seeded_random().randint(8, 14)
    first = Job(env, env.tmp_path / "run1", save_dir=s3_url, idle="0")   # type: ignore[arg-type]   (full speed)
    first.wait_reached(1, at)
    os.kill(first.pid(1), signal.SIGKILL)
    assert first.wait() != 0
    wipe_memory(env)
    on_disk = [step for step, _ in layout.complete(open_storage(s3_url))]
    assert on_disk, "nothing was persisted before the kill"

    second = Job(env, env.tmp_path / "run2", save_dir=s3_url)   # type: ignore[arg-type]
    assert second.wait() == 0, second.log()[-3000:]
    for rank in (0, 1):
        (resume,) = second.resumes(rank)
        assert resume["source"] == "disk" and resume["iteration"] == max(on_disk), (resume, on_disk)
    assert_same_curve(second, reference, start=max(on_disk) + 1)

    # The bucket's newest iteration converts to the same Megatron file as a local copy of its objects does
    # (test_megatron shows Megatron's loader accepts that one).
    import torch

    store = open_storage(s3_url)
    newest, name = layout.complete(store)[-1]
    local = env.tmp_path / "local" / name
    local.mkdir(parents=True)
    for entry in store.entries(name):
        (local / entry.name).write_bytes(store.read(f"{name}/{entry.name}"))
    converted = {}
    for source, dst in ((s3_url, env.tmp_path / "from-s3"), (str(local), env.tmp_path / "from-local")):
        done = run_cli("convert", "--to", "megatron", source, str(dst), env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (dst / "latest_checkpointed_iteration.txt").read_text() == str(newest)
        converted[source] = torch.load(dst / f"iter_{newest:07d}" / "mp_rank_00" / "model_optim_rng.pt",
                                       map_location="cpu", weights_only=False)
    assert converted[s3_url]["iteration"] == newest
    assert_same(converted[s3_url], converted[str(local)])


def test_an_agent_started_while_the_object_store_is_down_serves_its_node_and_says_so(env: Env,
                                                                                      s3_url: str) -> None:
    """A replacement agent starting mid-job while the store is unreachable (the soak's object_store_outage found
    every agent of the job crash-looping at start-up): it starts, says once what it cannot read, answers its
    ranks, and exits on its idle timeout like any other."""
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL_S3"], seed=0)
    proxy.go_down()
    environ = {**env.environ(), **s3server.env(proxy.url)}
    agent = subprocess.Popen([sys.executable, "-m", "easyckpt_agent", "--save-dir", s3_url, "--shm-dir",
                              str(env.shm_dir), "--idle-timeout", "1"], env=environ, cwd=str(ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-3000:]
    assert f"cannot read what {s3_url} holds" in out and "persists try again at the next due step" in out, out[-3000:]
    assert f"cannot look for what dead writers left in {s3_url}" in out and "serving job" in out, out[-3000:]
    assert "no rank alive for" in out and "Traceback" not in out, out[-3000:]
