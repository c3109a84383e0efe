"""A simulated multi-node data-parallel job (one torchrun per node on 127.0.0.1, one agent and one shm
directory per node) at full speed: loops with no sleep and no idle time, a snapshot every step, a persist every
5th. Faults come at steps drawn from the printed seed before the run, and nothing waits for a backup, the safe
step or a persist before it strikes: a whole node dies (its memory wiped) or one rank is SIGKILLed. Every rank
resumes at the same step, the kill step or the one before (issue 24; invariant 9 allows two snapshot intervals plus
the backup's lag, and the rules meet one step in the simulation: ``tests/unit/test_agreement.py``), the lost node's
ranks from the replicas on the other nodes, never from disk, bit-exact; the uninterrupted run persists every due
step (or, while a persist runs, the next one). A node that dies in the middle of a persist never leaves a
complete-looking checkpoint."""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, Env, seeded_random, wait_for
from multinode import NODES, RANKS_PER_NODE, Cluster

from easyckpt_wire import layout, shm
from easyckpt_wire.protocol import job_id_for
from easyckpt_wire.records import SlotMeta

pytestmark = pytest.mark.slow
STEPS = 30
WORLD = NODES * RANKS_PER_NODE
INTERVAL = 5
# Two fault steps per kind, drawn from one seed before any run (EASYCKPT_TEST_SEED replays them).
FAULT_STEPS = (lambda rng: [rng.randint(8, 14), rng.randint(15, STEPS - 6)])(seeded_random())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """One uninterrupted 2-node run: the loss and state digest of every rank at every step."""
    env = Env(tmp_path_factory.mktemp("reference"))
    cluster = Cluster(env, env.tmp_path / "out", steps=STEPS)
    try:
        cluster.start(0)
        cluster.start(1)
        assert cluster.wait(0) == 0, cluster.log(0)[-3000:]
        assert cluster.wait(1) == 0, cluster.log(1)[-3000:]
        return cluster
    finally:
        cluster.cleanup()
        env.cleanup()


@pytest.fixture
def cluster(env: Env) -> Cluster:
    made: list[Cluster] = []

    def make(**kwargs: object) -> Cluster:
        kwargs.setdefault("steps", STEPS)
        made.append(Cluster(env, env.tmp_path / "out", **kwargs))
        return made[-1]

    yield make  # type: ignore[misc]
    for item in made:
        item.cleanup()


def node_loss_args(job_nodes: int, ranks_per_node: int, at: int, *, leads: bool = False) -> list[str]:
    """The last node's ranks freeze themselves right after step ``at``'s snapshot starts (plain_ddp.py), so that
    the test kills that node at that very step, whatever the speed of the loop. ``leads``: the last node runs
    ranks 0 and up (``lead_with_last_node``)."""
    lost = range(ranks_per_node) if leads else range((job_nodes - 1) * ranks_per_node, job_nodes * ranks_per_node)
    return ["--kill-at", str(at), "--kill-rank", ",".join(map(str, lost)), "--kill-signal", "STOP"]


def lead_with_last_node(job: Cluster) -> None:
    """Before the start: the last node's address sorts first, so torchrun gives it ranks 0 and up, and its agent
    (the node of rank 0) leads the job: it decides the job-wide steps and commits every multi-node checkpoint."""
    job.addrs[job.nodes - 1] = "127.0.0.1"


def lose_last_node(job: Cluster, *, replacement_first: bool = False) -> None:
    """Wait for the last node's ranks to freeze at their kill step, then kill everything of that node (ranks,
    torchrun, agent, shared memory) and start it again, as a replacement machine would join. With
    ``replacement_first`` its address sorts before every other node's, so torchrun gives it ranks 0 and up and the
    survivors run ranks they never snapshotted; otherwise it rejoins at its own address, after the survivors'
    if it led (``lead_with_last_node``), and the survivors then run the ranks it ran."""
    lost = job.nodes - 1
    led = job.addrs[lost] == "127.0.0.1"
    ranks = range(job.ranks_per_node) if led else job.ranks_of(lost)
    wait_for(lambda: job.frozen(ranks) or job.procs[0].poll() is not None, 180,
             f"node {lost}'s ranks to reach their kill step")
    job.kill_node(lost)
    job.addrs[lost] = "127.0.0.1" if replacement_first else f"127.0.0.{lost + 2}"
    job.start(lost)


def run_until_killed(job: Cluster, first: int = 8, last: int = 14) -> int:
    """Train on both nodes; node 1 is lost whole at a seeded step (nothing waits for backups first)."""
    at = seeded_random().randint(first, last)
    job.args += node_loss_args(NODES, RANKS_PER_NODE, at)
    job.start_all()
    wait_for(lambda: job.frozen(job.ranks_of(1)) or job.procs[0].poll() is not None, 180,
             f"node 1's ranks to reach step {at}")
    job.kill_node(1)
    return at


def agent_log(job: Cluster, node: int) -> str:
    """The log of node ``node``'s agents (a restarted one appends to it)."""
    return "".join(p.read_text() for p in job.env.runtime_dir.glob(f"*@node{node}/agent.log"))


def finish(job: Cluster) -> list[dict]:
    """Restart node 1; node 0's torchrun restarts its own workers when node 1 rejoins. Both must finish."""
    job.start(1)
    return wait_all(job)


def wait_all(job: Cluster) -> list[dict]:
    for node in range(job.nodes):
        assert job.wait(node) == 0, job.log(node)[-4000:]
    return [job.resumes(rank)[-1] for rank in range(job.world)]


def check_exact(job: Cluster, reference: Cluster, reports: list[dict]) -> int:
    """Every rank resumed the same step with the uninterrupted run's exact state, and continued its curve."""
    steps = {r["step"] for r in reports}
    assert len(steps) == 1 and None not in steps, f"ranks resumed different steps: {reports}"
    step = steps.pop()
    for rank, report in enumerate(reports):
        assert report["digest"] == reference.losses(rank)[step]["digest"], f"rank {rank} resumed a wrong state"
        ours, theirs = job.losses(rank), reference.losses(rank)
        for later in range(step + 1, STEPS):
            assert ours[later]["loss"] == theirs[later]["loss"], f"rank {rank}: loss differs at step {later}"
            assert ours[later]["digest"] == theirs[later]["digest"], f"rank {rank}: state differs at step {later}"
    return step


def check_from_disk(job: Cluster, reference: Cluster, on_disk: int | None, reports: list[dict]) -> None:
    """Only disk was left to resume from: every rank resumed the newest step there (a stage both nodes finished
    before the fault may still be committed by node 0's next agent, so at least ``on_disk``, the tracker read
    right after the fault). At full speed, and more so on a loaded machine, no step may have reached disk whole
    before the fault (seen in CI: the tracker was empty); then the only right outcome is that every rank starts
    over and trains the reference curve."""
    if on_disk is None and all(r["step"] is None for r in reports):
        assert {r["source"] for r in reports} == {None}, reports
        for rank in range(job.world):
            assert job.losses(rank) == reference.losses(rank), f"rank {rank}: the rerun from scratch differs"
        return
    step = check_exact(job, reference, reports)
    assert step >= (on_disk or 0) and {r["source"] for r in reports} == {"disk"}, (on_disk, reports)


RACE = "the agent was taking a slot for a persist as the rank chose one"


def never_skipped(job: Cluster) -> None:
    """No snapshot skipped for want of a slot. A moment's race with the agent's round (it flocks a claimed step's
    slot before it publishes the claim; invariant 4, said at INFO) skipped one snapshot in CI's rehearsal of
    2026-11-30 (seed 35802263, step 6, slow persists). Since 2026-12-01 the agent marks its word as changing before
    any new flock and the rank chooses again on its next word (``tests/unit/test_slot_choice_live.py``); one skip
    per node is still let pass, for a round that a starved machine holds up longer than the rank waits for it
    (``MOVE_WAIT``, 50 ms)."""
    for node in range(job.nodes):
        skipped = [line for line in job.log(node).splitlines() if "skipped:" in line]
        short = [line for line in skipped if RACE not in line]
        assert not short, f"node {node} skipped snapshots: {short[:3]}"
        assert len(skipped) <= 1, f"node {node} lost more than one snapshot to races with its agent: {skipped[:3]}"
        if skipped:
            print(f"node {node}: one snapshot skipped in a race with its agent's claim: {skipped[0]}")


def test_uninterrupted_run_persists_every_due_step(reference: Cluster) -> None:
    """Invariant 12 at full speed: every due step reaches disk job-wide, unless a persist still runs (then the
    next one); a due step passed over is announced with the reason, in the log of every node."""
    audit = [json.loads(line) for line in (reference.env.save_dir / layout.AUDIT_LOG).read_text().splitlines()]
    committed = {r["step"] for r in audit if r["op"] == "write" and Path(r["path"]).name.startswith("iteration_")}
    logs = "".join(p.read_text() for p in reference.out.glob("agent-*.log"))
    passed = {int(step): why for step, why in re.findall(r"due step (\d+) passed over on every node: (.*?) \(save", logs)}
    print(f"committed {sorted(committed)}; passed over {passed}")
    for step in range(0, STEPS, INTERVAL):
        why = passed.get(step, "")
        assert step in committed or "still persist" in why or "every node persists" in why, \
            f"due step {step} was {'passed over: ' + why if why else 'neither persisted nor announced'}"
    assert STEPS - 1 in committed, "close() makes the newest snapshot durable"
    never_skipped(reference)


@pytest.mark.parametrize("which,replacement_first,leads", [(0, False, False), (1, True, False), (1, False, True)],
                         ids=["0", "1-replacement-first", "1-the-leader"])
def test_lost_node_resumes_from_replicas_at_most_one_step_back(cluster: Cluster, reference: Cluster, which: int,
                                                               replacement_first: bool, leads: bool) -> None:
    """Node 1 lost whole at a seeded step: every rank resumes from memory or replicas (never from disk), at the kill step
    or the one before (issue 24; invariant 9 allows two snapshot intervals plus the backup's lag, which the lag gate
    holds within two steps: one such job on this machine's two cores has lagged a step at most, while three at a time
    reached the gate's bound: ``benchmarks/README.md``, "Five slots, a second trial"). CI, 2026-11-27: node 1 lost at
    23, the survivors held [23, 22, 20, 19], the node-safe step's slots had been let go, and every rank resumed from
    disk at 15: a node-safe step that trails is now held (``agreement.plan_holds``). In the second case the replacement
    node takes ranks 0-1 (CI, 2026-12-01, by a pid wrap-around; a replacement machine whose name sorts first does it
    too): the survivors run ranks 2-3, whose snapshots died with node 1, and every rank loads from the replicas. CI,
    2026-12-04: node 1 lost at 8, resumed at 5, the backups three steps behind in the job's first second, within the lag
    gate's bound of the time (save_storage_interval); the gate now holds the node-safe step within two snapshots by
    default (``easyckpt.config.BACKUP_LAG_SNAPSHOTS``). In the third the lost node ran ranks 0-1, so its agent led the
    job (decided the job-wide steps, committed the multi-node checkpoints) until it died with its stage of the newest
    persist: the survivor's agent leads from the restart on, commits what the dead leader left, and its node runs ranks
    0-1 from the replicas it holds."""
    at = FAULT_STEPS[which]
    job = cluster(extra_args=node_loss_args(NODES, RANKS_PER_NODE, at, leads=leads))
    if leads:
        lead_with_last_node(job)
    job.start_all()
    lose_last_node(job, replacement_first=replacement_first)
    reports = wait_all(job)
    step = check_exact(job, reference, reports)
    print(f"node 1 lost at step {at}, resumed at {step} from {[r['source'] for r in reports]}")
    assert [r["source"] for r in reports] == job.expected_sources(reports, lost={NODES - 1}), reports
    if replacement_first or leads:
        runs_low = "node1" if replacement_first else "node0"
        assert {r["node"] for r in reports[:RANKS_PER_NODE]} == {runs_low}, f"{runs_low} should run ranks 0-1: {reports}"
        assert {r["source"] for r in reports} == {"replica"}, reports
    if leads:
        led = re.findall(r"job spans nodes .*; leader (\w+);", agent_log(job, 0))
        assert led[:1] == ["node1"] and led[-1] == "node0", f"node 0's agent should lead after the loss: {led}"
        assert (job.env.save_dir / layout.iteration_dirname(STEPS - 1)).is_dir(), "the new leader commits the last step"
    assert at - 1 <= step <= at, f"node 1 lost at step {at}, resumed at {step}"
    log = job.log(1)
    assert "pulled step" in log and "served" in log and "GB/s" in log, "the log must say who served what"
    never_skipped(job)


@pytest.mark.parametrize("which,local_vars", [(0, True), (1, False)], ids=["0", "1-no-local-variables"])
def test_killed_rank_resumes_from_memory_at_most_one_step_back(cluster: Cluster, reference: Cluster,
                                                                which: int, local_vars: bool) -> None:
    """Only rank 3 (node 1) is SIGKILLed; node 1 and its memory live on, both torchruns restart their workers.
    Every rank resumes from memory, or reads the step through the agents when its own slot already holds a newer
    snapshot: while a node-safe step trails, the agents hold it in the fourth slot, and a rank that took a step
    more than the killed one wrote it over its previous step (its agent serves the shared tensors from the other
    local rank's slot, the buddy the rank-private bytes; CI, 2026-11-27: rank 2 so at step 18). Never from disk.
    ``local_vars=False``: the ranks run without LOCAL_RANK and LOCAL_WORLD_SIZE (a launcher that does not say where
    each rank sits), so the ranks ask the process group; until 2026-12-06 each node's agent waited for all four
    ranks, persisted nothing and held the job's end."""
    at = FAULT_STEPS[which]
    job = cluster(extra_args=["--kill-at", str(at), "--kill-rank", str(WORLD - 1)], local_vars=local_vars)
    job.start_all(max_restarts=1)
    reports = wait_all(job)
    step = check_exact(job, reference, reports)
    print(f"rank {WORLD - 1} killed at step {at}, resumed at {step}")
    # Issue 24: the kill step or the one before (invariant 9 allows two snapshot intervals). Two back until
    # 2026-11-28 (CI: killed at 12, resumed at 10), when the agents had not declared the newest step safe as the next
    # snapshot took its slot; with four slots across nodes the simulation's rank kills cost one step at most.
    assert at - 1 <= step <= at, f"rank {WORLD - 1} killed at step {at}, resumed at {step}"
    assert {r["source"] for r in reports} <= {"memory", "replica"}, reports
    never_skipped(job)
    if not local_vars:
        for node in range(NODES):
            assert "2 of the 4 ranks are on this node (the node names" in job.log(node), job.log(node)[-3000:]


def test_three_nodes_one_lost_resume_from_memory_and_replicas(cluster: Cluster) -> None:
    """3 nodes of one rank; the last is lost whole at a seeded step. The resumed state is bit for bit the one
    the first attempt had at that step (its digest per step), and the curve goes on as it went."""
    at = seeded_random().randint(8, STEPS - 6)
    job = cluster(nodes=3, ranks_per_node=1, extra_args=node_loss_args(3, 1, at))
    job.start_all(max_restarts=1)
    lose_last_node(job)
    reports = wait_all(job)
    steps = {r["step"] for r in reports}
    assert len(steps) == 1, reports
    step = steps.pop()
    print(f"node 2 lost at step {at}, resumed at {step} from {[r['source'] for r in reports]}")
    assert at - 1 <= step <= at, f"node 2 lost at step {at}, resumed at {step}"
    assert [r["source"] for r in reports] == job.expected_sources(reports, lost={2}), reports
    # The digest covers the model and the optimizer, which the data-parallel ranks share: rank 0's first attempt
    # (its node never restarted before the loss) says what every rank had at each step.
    first = {row["step"]: row for row in map(json.loads, (job.out / "losses-rank0.jsonl").read_text().splitlines())
             if row["attempt"] == "0"}
    for rank, report in enumerate(reports):
        assert report["digest"] == first[step]["digest"], f"rank {rank} resumed a state the first attempt never had"


def test_lost_node_with_slow_persists_resumes_at_most_one_step_back(cluster: Cluster, reference: Cluster) -> None:
    """Invariant 9 across nodes with persists capped to take several steps (2 x 156 KiB at 0.3 MB/s, about a
    second): node 1 lost whole at a seeded step resumes at the kill step or the one before from memory and replicas, no
    snapshot is ever skipped, and every node persisted the same steps."""
    at = seeded_random().randint(10, STEPS - 8)
    slow = {"EASYCKPT_PERSIST_MBPS": "0.3"}
    job = cluster(node_env={0: slow, 1: slow}, extra_args=node_loss_args(NODES, RANKS_PER_NODE, at))
    job.start_all()
    lose_last_node(job)
    reports = wait_all(job)
    step = check_exact(job, reference, reports)
    print(f"node 1 lost at step {at}, resumed at {step}")
    assert at - 1 <= step <= at, f"node 1 lost at step {at}, resumed at {step}"
    assert [r["source"] for r in reports] == job.expected_sources(reports, lost={NODES - 1}), reports
    never_skipped(job)
    # Every due step that node 1's first agent started persisting, node 0's did too (no iteration is left
    # with one node's shards because the nodes disagreed).
    log1 = agent_log(job, 1)
    # The first agent that served (a second one started at the same moment may log first, then exits).
    first_agent = re.search(r"\[agent (\d+)\] easyckpt_agent.server: agent pid \d+ serving", log1).group(1)  # type: ignore[union-attr]
    node1 = {int(s) for s in re.findall(rf"\[agent {first_agent}\] easyckpt_agent.persister: persisting step (\d+)", log1)}
    node0 = {int(s) for s in re.findall(r"persisting step (\d+)", agent_log(job, 0))}
    print(f"node 1 persisted {sorted(node1)} before the kill; node 0 {sorted(node0)}")
    assert node1 and node1 <= node0, (sorted(node1), sorted(node0))


def test_no_replica_holding_the_step_falls_back_to_disk(cluster: Cluster, reference: Cluster) -> None:
    """Node 0's agent (which held node 1's unique tensors and manifests) dies too: only disk is left."""
    job = cluster()
    run_until_killed(job, 12, 18)   # step 10 is due before the kill: usually the disk has a step to fall back to
    job.kill_agent(0)
    on_disk = layout.read_tracker(job.env.save_dir)
    check_from_disk(job, reference, on_disk, finish(job))
    assert "no agent holds a replica of rank 2" in job.log(1)


def test_corrupted_replica_is_caught(cluster: Cluster, reference: Cluster) -> None:
    """Bytes flipped in every committed slot of rank 0 on node 0 (the first copy node 1's ranks would pull), node 1
    lost: the checksums catch it where rank 0 reads its own memory and where node 1's ranks pull the model. Every
    rank takes rank 1's copy instead, rank 0 too (its own damaged copy is pulled from the replicas: before
    2026-11-29 it fell back to disk, and when no step had reached disk yet, as in a stress run, the job could not
    start again), so the job resumes from memory and replicas and nobody resumes a wrong state."""
    job = cluster()
    at = run_until_killed(job, 12, 18)
    # What is corrupted must be what node 0's agent checksummed (every snapshot it can: a snapshot flipped before
    # its agent hashed it would be hashed flipped, and no checksum could tell): a precondition of the fault, not
    # a wait for the job's protection.
    from easyckpt.node.client import AgentTimeout, query_status

    runtime = next(p for p in job.env.runtime_dir.iterdir() if p.name.endswith("@node0"))

    def all_hashed() -> bool:
        # Against the slots' own headers, not only the agent's view: an agent that has not read a slot's new header
        # yet reports the older snapshot there, hashed (CI rehearsal, 2026-12-04: rank 0 resumed the flipped bytes,
        # hashed after the flip, from memory).
        try:
            seen = {(Path(s["path"]).name, s["step"]) for s in query_status(runtime, timeout=5)["slots"]
                    if s["state"] == "COMMITTED" and s["hashed"]}
        except (AgentTimeout, OSError):
            return False
        for path in shm.list_slots(job.shm[0], job_id_for(job.env.save_dir)).values():
            slot = shm.SlotMap(path, writable=False)
            try:
                header = slot.header()
                if header.committed and (path.name, header.step) not in seen:
                    return False
            finally:
                slot.close()
        return True

    wait_for(all_hashed, 60, "node 0's agent to checksum every committed snapshot")
    slots = shm.list_slots(job.shm[0], job_id_for(job.env.save_dir))
    flipped = []
    for (rank, _), path in slots.items():
        slot = shm.SlotMap(path, writable=True)
        try:
            header = slot.header()
            if rank == 0 and header.committed:
                meta = SlotMeta.from_wire(slot.read_meta(header), str(path))
                entry = next(e for e in meta.tensors if e.name == "model/embed.weight")
                start = shm.DATA_OFFSET + entry.offset
                slot.mm[start:start + 64] = bytes(b ^ 0xFF for b in slot.mm[start:start + 64])
                flipped.append(header.step)
        finally:
            slot.close()
    assert len(flipped) >= 2, f"rank 0 should hold two or three snapshots on node 0, found {flipped}"
    reports = finish(job)
    step = check_exact(job, reference, reports)
    assert [r["source"] for r in reports] == ["replica", "memory", "replica", "replica"], reports
    assert at - 1 <= step <= at, f"node 1 lost at step {at}, resumed at {step}"
    assert "does not match the checksum" in job.log(0), "rank 0 must notice its own corrupted memory"
    assert "trying another copy" in job.log(1), "node 1's ranks must skip the corrupted copy"


def test_hung_peer_agent_times_out_and_the_job_still_resumes(cluster: Cluster, reference: Cluster, env: Env) -> None:
    """Node 0's agent freezes (SIGSTOP) on the first chunk it serves after node 1 comes back. Node 1's
    persists are capped to take several steps: with the disk as fresh as the replica, node 1's ranks
    would come back from disk without asking node 0 and the hang would go untested (seen in CI)."""
    armed = env.tmp_path / "armed"
    job = cluster(peer_timeout=3.0, node_env={0: {"EASYCKPT_FAULT": "agent.replica.fetch:stop",
                                                  "EASYCKPT_FAULT_ARM": str(armed)},
                                              1: {"EASYCKPT_PERSIST_MBPS": "2"}})
    run_until_killed(job, 15, 20)   # late enough for a due step on disk to fall back to
    frozen = job.agent_pid(0)
    armed.touch()
    job.start(1)
    node1 = range(RANKS_PER_NODE, WORLD)
    wait_for(lambda: all(len(job.resumes(rank)) >= 2 for rank in node1) or job.procs[1].poll() is not None,
             180, "node 1's ranks to resume after the peer agent hung")
    armed.unlink()
    assert frozen is not None
    # Node 0's ranks are waiting for it to acknowledge their resume (they would for agent_start_timeout, 30 s,
    # then go on); killed, it is replaced at once by one they start
    os.kill(frozen, signal.SIGKILL)
    assert job.wait(1) == 0, job.log(1)[-4000:]
    assert job.wait(0) == 0, job.log(0)[-4000:]
    reports = [job.resumes(rank)[-1] for rank in range(WORLD)]
    check_exact(job, reference, reports)
    assert "no reply within" in job.log(1), "the hang must surface as a timeout naming the peer"
    assert {r["source"] for r in reports[2:]} == {"disk"}, reports
    # The hung agent costs each rank one peer_timeout in its load, not one per step tried: until 2026-12-07 every
    # older step asked it again (steps 14, 13 and 12, three timeouts, before the disk).
    asked = (r"rank (\d+): (?:\S+ of step \d+ from node \S+ failed \(FETCH|step \d+ read from memory unverified: "
             r"agent MANIFEST)[^\n]*no reply within")
    waits = collections.Counter(re.findall(asked, job.log(0) + job.log(1)))
    assert waits and max(waits.values()) == 1, f"ranks waited for the hung agent more than once: {waits}"
    assert "it is not asked again during this load" in job.log(1), job.log(1)[-3000:]


def test_node_dying_mid_persist_leaves_no_complete_checkpoint(cluster: Cluster, env: Env) -> None:
    """Node 1's agent is SIGKILLed after its first file of the first step it persists: that step is never
    complete unless a later agent of node 1 wrote all its shards again; every complete iteration verifies.
    (Not a fixed step: at full speed a due step may be passed over while a persist runs, and then a fault
    armed for it never fires.)"""
    job = cluster(node_env={1: {"EASYCKPT_FAULT": "agent.persist.after_file",
                                "EASYCKPT_FAULT_ONCE": str(env.tmp_path / "fired")}})
    job.start_all()
    assert job.wait(1) == 0, job.log(1)[-4000:]
    assert job.wait(0) == 0, job.log(0)[-4000:]
    assert (env.tmp_path / "fired").exists(), "the fault point never fired"
    audit = [json.loads(line) for line in (env.save_dir / layout.AUDIT_LOG).read_text().splitlines()]
    begun = [r for r in audit if r.get("node") == "node1" and r["op"] == "write-begin"]
    assert begun, "node 1 never began a persist"
    killed, step = begun[0]["pid"], begun[0]["step"]
    stage = str(env.save_dir / layout.stage_dirname(step))
    assert not any(r["op"] == "write" and r["pid"] == killed and r["path"] == stage for r in audit), \
        f"the killed agent finished its shards of step {step}?"
    for index, record in enumerate(audit):
        if record["op"] == "write" and Path(record["path"]).name == layout.iteration_dirname(record["step"]):
            stage = str(env.save_dir / layout.stage_dirname(record["step"]))
            done = {r["node"] for r in audit[:index] if r["op"] == "write" and r["path"] == stage}
            assert done == {"node0", "node1"}, f"step {record['step']} committed with shards of {done} only"
    verify = subprocess.run([sys.executable, "-m", "easyckpt.cli", "verify", str(env.save_dir)], capture_output=True,
                            text=True, timeout=120, env=env.environ(), cwd=str(ROOT))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "0 damaged" in verify.stdout


def test_a_job_ends_once_the_leader_tracked_its_final_step(cluster: Cluster, env: Env) -> None:
    """close() returns once the leader's agent published and tracked the final step, not once this node's files are
    durable (a CI soak on 2026-11-28 saw both launchers exit with the tracker at 6; the leader committed the final
    step 11 after they had). Node 0's agent freezes just before it writes the final step's tracker: node 1's rank
    waits for it, and once it is let go the job ends with the tracker naming the final step, no agent exit awaited."""
    last = 11
    job = cluster(steps=last + 1, node_env={0: {"EASYCKPT_FAULT": f"agent.persist.before_tracker@{last}:stop"}})
    job.start_all()
    frozen: list[int] = []

    def leader_frozen() -> bool:
        pid = job.agent_pid(0)
        with contextlib.suppress(psutil.Error):
            if pid is not None and psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                frozen.append(pid)
        return bool(frozen) or job.procs[1].poll() is not None

    wait_for(leader_frozen, 180, f"node 0's agent to freeze before the tracker of step {last}")
    assert frozen, f"node 1 ended before the leader's agent froze:\n{job.log(1)[-3000:]}"
    try:
        wait_for(lambda: "waiting for the leader's agent to commit" in job.log(1) or job.procs[1].poll() is not None,
                 120, "node 1's rank to wait for the commit of its final step")
        assert job.procs[1].poll() is None, f"node 1 ended before its final step was tracked:\n{job.log(1)[-3000:]}"
    finally:
        os.kill(frozen[0], signal.SIGCONT)
    assert job.wait(1) == 0, job.log(1)[-4000:]
    assert job.wait(0) == 0, job.log(0)[-4000:]
    assert layout.read_tracker(env.save_dir) == last
    assert f"step {last} committed by the leader's agent" in job.log(1), job.log(1)[-3000:]


def test_status_shows_replica_coverage(cluster: Cluster, env: Env) -> None:
    # Steps enough to outlast the checks even under load: once the job ends its agents exit, and there is
    # nothing left to ask (the cleanup kills the job).
    job = cluster(step_idle=0.3, steps=1000)
    job.start_all()
    wait_for(lambda: job.reached(3), 120, "every rank to reach step 3")

    def status(node: int) -> dict:
        result = subprocess.run([sys.executable, "-m", "easyckpt.cli", "status", "--save-dir", str(env.save_dir),
                                 "--json"], capture_output=True, text=True, timeout=60, env=job.environ(node))
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)[0]

    report = wait_for(lambda: (r := status(0))["coverage"] and r["coverage"]["step"] is not None
                      and len(r["coverage"]["ranks"]) == WORLD
                      and all(i["copies"] == 2 for i in r["coverage"]["ranks"].values()) and r, 60,
                      "a coverage survey finding every rank's tensors on both nodes")
    assert report["node"] == "node0" and report["endpoint"].startswith("tcp://127.0.0.1:")
    assert set(report["nodes"]) == {"node0", "node1"} and report["pid"] > 0
    assert {s["rank"] for s in report["slots"]} == {0, 1}
    job.kill_node(1)
    text = wait_for(lambda: "WARNING: single copy" in (out := subprocess.run(
        [sys.executable, "-m", "easyckpt.cli", "status", "--save-dir", str(env.save_dir)], capture_output=True,
        text=True, timeout=60, env=job.environ(0)).stdout) and out, 60, "status to warn about single copies")
    assert "unreachable nodes: ['node1']" in text


def test_standalone_agents_find_each_other_through_their_own_torchrun(cluster: Cluster, reference: Cluster,
                                                                       env: Env) -> None:
    """``torchrun --nnodes=2 --nproc-per-node=1 -m easyckpt_agent``: the agents rendezvous on their own, the training
    ranks use them (no agent is spawned by the library), and a lost node still comes back from replicas."""
    job = cluster()
    job.start_agents()
    agents = {node: job.agent_pid(node) for node in range(NODES)}
    assert all(agents.values()), f"the launchers must leave one agent per node running: {agents}"
    status = subprocess.run([sys.executable, "-m", "easyckpt.cli", "status", "--save-dir", str(env.save_dir), "--json"],
                            capture_output=True, text=True, timeout=60, env=job.environ(1))
    report = json.loads(status.stdout)[0]
    assert set(report["nodes"]) == {"node0", "node1"} and report["leader"] == "node0", report
    run_until_killed(job)
    assert job.agent_pid(0) == agents[0], "the training ranks of node 0 must have used the standalone agent"
    reports = finish(job)
    check_exact(job, reference, reports)
    assert [r["source"] for r in reports] == job.expected_sources(reports, lost={NODES - 1}), reports
