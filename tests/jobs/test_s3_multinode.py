"""Object storage with several nodes (issue 26): 2 simulated nodes x 2 ranks (``tests/multinode.py``) share one
``s3://`` save_dir on a real S3 server process (moto's server mode on 127.0.0.1). Each node's agent writes its
ranks' files under the step's prefix and its note; the leader writes the commit object once every rank's
files are in. The last node is lost whole at a seeded step (nothing waits for a backup or a persist first)
and comes back: every rank resumes the same step (the lost ranks from the replicas), and every iteration in
the bucket is complete, verified, and none is left half-written."""
from __future__ import annotations

import json
import os

import pytest
import s3server
from conftest import Env, run_cli, seeded_random, wait_for
from multinode import NODES, RANKS_PER_NODE, Cluster
from s3proxy import FaultProxy

from easyckpt_wire import layout
from easyckpt_wire.storage import open_storage

pytestmark = pytest.mark.slow
STEPS = 24
INTERVAL = 4


def test_two_nodes_commit_one_s3_save_dir_and_a_lost_node_resumes(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    server = s3server.server()
    for key, value in s3server.env(server.url).items():
        monkeypatch.setenv(key, value)
    url = f"s3://{s3server.bucket(server.url)}/multi"
    env.save_dir = url   # type: ignore[assignment]   (the nodes' shared storage is the bucket)
    at = seeded_random().randint(8, 14)
    lost = range((NODES - 1) * RANKS_PER_NODE, NODES * RANKS_PER_NODE)
    job = Cluster(env, env.tmp_path / "out", steps=STEPS, save_storage_interval=INTERVAL,
                  extra_args=["--kill-at", str(at), "--kill-rank", ",".join(map(str, lost)), "--kill-signal", "STOP"])
    try:
        job.start_all()
        wait_for(lambda: job.frozen(job.ranks_of(NODES - 1)) or job.procs[0].poll() is not None, 180,
                 f"node {NODES - 1}'s ranks to reach step {at}")
        job.kill_node(NODES - 1)
        job.start(NODES - 1)
        for node in range(NODES):
            assert job.wait(node) == 0, job.log(node)[-4000:]
    finally:
        job.cleanup()
    reports = [job.resumes(rank)[-1] for rank in range(job.world)]
    # Memory and replicas, never disk. Invariant 9's bound for a node loss: two snapshot intervals (here two steps)
    # plus the backup's lag, which the ranks' max_backup_lag gate keeps near two steps (its default since
    # 2026-12-04; save_storage_interval, INTERVAL here, before) unless a gate's wait runs out; the bound below is
    # the old one. Mostly the loss step or the one before: the object store's persists hold this 2-core machine's
    # CPU and the backups lag. Seen: lost at 10 resumed at 8 (2026-11-27); lost at 9 resumed at 6,
    # node 1's agent still writing its first iteration (CI rehearsal, 2026-11-29); lost at 14 with the node-safe step
    # at 9 and the survivors' memory [14, 10, 9, 8] (CI, 2026-11-29: it fell to disk at 8, the bug fixed in
    # recovery.candidates; it now resumes at 10). The rank-kill tests keep the two-step bound without a backup's lag.
    assert [r["source"] for r in reports] == job.expected_sources(reports, lost={NODES - 1}), reports
    bound = at - 2 - INTERVAL
    assert len({r["step"] for r in reports}) == 1 and bound <= reports[0]["step"] <= at, (at, reports)

    store = open_storage(url)
    complete = layout.complete(store)
    assert complete and layout.tracker(store) == STEPS - 1 == complete[-1][0], complete
    for step, key in complete:
        meta = layout.metadata(store, key)
        assert meta["world_size"] == 4 and sorted(meta["ranks"], key=int) == ["0", "1", "2", "3"], (step, meta)
    leftovers = [key for _, key, done in layout.iterations(store) if not done] + store.stages()
    assert leftovers == [], f"half-written iterations or stages left: {leftovers}"
    audit = [json.loads(line) for line in store.read(layout.AUDIT_LOG).decode().splitlines()]
    assert any(row["op"] == "write" and row.get("nodes") == "all" for row in audit), "the leader's commits are audited"
    # Each node's part of a persist is audited in a log of its own (appends to one object would race every node's).
    assert not [row for row in audit if "node" in row], "a node's own line in the log that every node would race for"
    for node in range(NODES):
        own = [json.loads(line) for line in store.read(layout.node_audit_log(f"node{node}")).decode().splitlines()]
        assert {row["op"] for row in own} >= {"write-begin", "write"} and {row["node"] for row in own} == {f"node{node}"}
    verified = run_cli("verify", url, env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert os.environ["AWS_ENDPOINT_URL_S3"] == server.url


def test_a_last_step_only_the_leader_cannot_persist_fails_every_node_at_once_and_stays_in_memory(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Soak seed 1323, fault 523 (leaked): the other node wrote its files of the run's last step, then the leader's
    persist of it failed (its disk full). That node's rank waited flush_timeout (25 s) for a commit that could not
    come, and its agent, never told, did not say it kept its memory on purpose; the launcher killed the rank first.
    Here the leader's node alone reaches the object store through a proxy that goes down at a seeded step: the
    leader's verdict names its failed persist once its rank has ended, the other node's rank ends with PersistError
    naming it (unless its launcher kills it first), both agents keep their slots and say so, and a rerun once the
    store is back resumes every rank from memory at the last step and commits it."""
    server = s3server.server()
    for key, value in s3server.env(server.url).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("EASYCKPT_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("EASYCKPT_S3_TIMEOUT", "3")
    url = f"s3://{s3server.bucket(server.url)}/leader-down"
    env.save_dir = url   # type: ignore[assignment]
    random = seeded_random()
    steps, down_at = 12, random.randint(5, 9)
    proxy = FaultProxy(server.url, seed=random.randrange(1 << 30))
    job = Cluster(env, env.tmp_path / "out", steps=steps, save_storage_interval=INTERVAL, ranks_per_node=1,
                  node_env={0: {"AWS_ENDPOINT_URL_S3": proxy.url}})
    try:
        job.start(0)   # no restart: torchrun's restart of the group would kill the other node's rank at once
        job.start(1)
        wait_for(lambda: job.reached(down_at) or job.procs[0].poll() is not None, 180, f"step {down_at}")
        proxy.go_down()
        codes = [job.wait(node) for node in range(NODES)]
        assert codes[0] != 0 and "PersistError" in job.log(0), job.log(0)[-3000:]
        said = {node: "".join(p.read_text() for p in env.runtime_dir.glob(f"*@node{node}/agent.log"))
                for node in range(NODES)}
        assert "so the job's slots are kept in" in said[0], said[0][-3000:]
        assert "so the job's slots are kept in" in said[1] and "on node node0:" in said[1], said[1][-3000:]
        if codes[1] == 1:   # it heard before its launcher ended it: at once, not after flush_timeout
            assert f"PersistError: easyckpt rank 1: the final snapshot (step {steps - 1}) could not be made durable" \
                in job.log(1) and f"persist of step {steps - 1} failed: on node node0: " in job.log(1), job.log(1)[-3000:]
        assert "not committed yet after" not in job.log(1), job.log(1)[-3000:]
        proxy.come_back()
        job.start(0)
        job.start(1)
        for node in range(NODES):
            assert job.wait(node) == 0, job.log(node)[-4000:]
    finally:
        proxy.close()
        job.cleanup()
    reports = [job.resumes(rank)[-1] for rank in range(job.world)]
    assert [(r["source"], r["step"]) for r in reports] == [("memory", steps - 1)] * job.world, reports
    assert layout.tracker(open_storage(url)) == steps - 1, "the rerun committed the last step"
