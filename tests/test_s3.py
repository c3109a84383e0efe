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
from pathlib import Path

import pytest
import s3server
from conftest import ROOT, Env, run_cli, seeded_random, wait_for
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
    assert all(step % INTERVAL == 0 for step in complete[:-1]), complete
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
