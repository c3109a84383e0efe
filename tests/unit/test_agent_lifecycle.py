"""easyckpt_agent.lifecycle: wake-ups, a real SIGTERM to this process, shutdown, and when the agent exits (real slots)."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3server
from agent_slots import JOB, Harness
from common import poll
from conftest import s3_endpoint_down

from easyckpt_agent import lifecycle, persister
from easyckpt_agent.agreement import NodeState
from easyckpt_agent.cluster import stage_outlook
from easyckpt_agent.lifecycle import Lifecycle, WakePipe
from easyckpt_wire import layout
from easyckpt_wire.control import control_path
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import Manifest, PeerNode, PeerTable, SlotMeta
from easyckpt_wire.shm import list_slots
from easyckpt_wire.storage import location


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Harness]:
    node = Harness(tmp_path)
    yield node
    node.close()


def stopped(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    records = [r for r in caplog.records if r.getMessage().startswith("agent stopped by")]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    return records[0]


def test_a_wake_from_another_thread_makes_the_pipe_readable_until_drained(tmp_path: Path) -> None:
    pipe = WakePipe()
    pipe.wake()   # before it is open: nothing to do, nothing raised
    fd = pipe.open(tmp_path)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(0) == []

    def wake_thrice() -> None:
        for _ in range(3):
            pipe.wake()

    waker = threading.Thread(target=wake_thrice)
    waker.start()
    waker.join(timeout=10)
    assert poller.poll(5000) == [(fd, select.POLLIN)]
    pipe.drain()
    assert poller.poll(0) == []
    pipe.close()
    assert pipe.fd == -1
    pipe.wake()


def test_sigterm_ends_the_loop_and_a_second_signal_abandons_the_disk(node: Harness) -> None:
    life = node.agent.life
    previous = life.install_signal_handlers()
    try:
        assert signal.getsignal(signal.SIGTERM) == life.on_signal
        os.kill(os.getpid(), signal.SIGTERM)
        poll(lambda: life.stop_signal == signal.SIGTERM, 10, "the SIGTERM handler")
        assert not persister.ABORT.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        poll(persister.ABORT.is_set, 10, "the second signal to abort the persist")
        assert life.stop_signal == signal.SIGTERM
    finally:
        Lifecycle.restore_signal_handlers(previous)
        persister.ABORT.clear()
    assert signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]


def test_sigterm_persists_the_newest_snapshot_and_keeps_the_slots_of_live_ranks(
        node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    node.ranks.commit_all(0, 3)
    caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
    node.agent.life.stop_signal = signal.SIGTERM
    node.agent.life.stop()
    assert node.agent.scheduler.persisted == 3 and layout.read_tracker(node.save_dir) == 3
    record = stopped(caplog)
    kept = re.search(r"slots kept: rank\(s\) \[(\d+), (\d+)\] still run", record.getMessage())
    assert record.levelno == logging.INFO and kept is not None and sorted(kept.groups()) == ["0", "1"]
    assert len(list_slots(node.shm_dir, JOB)) == 6 and not node.agent.ended_cleanly


def test_sigterm_after_the_ranks_died_unlinks_slots_that_are_on_disk(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    node = Harness(tmp_path)
    try:
        node.ranks.kill(0)
        node.ranks.kill(1)
        node.ranks.commit_all(0, 3)
        node.agent.watcher.scan(relist_every=0)
        node.agent._tick()   # a persist of step 3 starts (flush on failure)
        assert node.agent.scheduler.inflight_step() == 3
        caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
        node.agent.life.stop()
        record = stopped(caplog)
        assert "finished the persist of step 3" in record.getMessage() and record.levelno == logging.INFO
        assert "slots unlinked" in record.getMessage() and node.agent.ended_cleanly
        assert list_slots(node.shm_dir, JOB) == {} and not control_path(node.shm_dir, JOB).exists()
    finally:
        node.close()


def test_sigterm_after_a_rank_left_saying_its_run_failed_keeps_the_slots_for_the_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The DeepSpeed launcher SIGTERMs the whole process tree of a failed job, the agent with it, often once the
    ranks are gone: a rank that left saying its run failed was promised this node's memory for the restart, so
    the slots stay even though disk holds their newest step (a ZeRO-2 restart read disk, CI 2026-12-06)."""
    node = Harness(tmp_path)
    try:
        node.ranks.kill(0)
        node.ranks.kill(1)   # died without a word
        node.ranks.commit_all(0, 3)
        node.agent.watcher.scan(relist_every=0)
        node.request(b"r0", Kind.BYE, rank=0, pid=os.getpid(), wait=False, failed=True)
        node.agent._tick()   # a persist of step 3 starts (flush on failure)
        caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
        node.agent.life.stop()
        assert node.agent.scheduler.persisted == 3
        record = stopped(caplog)
        assert record.levelno == logging.INFO, record.getMessage()
        assert f"slots kept in {node.shm_dir} for a restart: rank(s) [0] failed or still ran when SIGTERM came" \
            in record.getMessage() and f"easyckpt clean --job-id {JOB}" in record.getMessage()
        assert len(list_slots(node.shm_dir, JOB)) == 6 and not node.agent.ended_cleanly
    finally:
        node.close()


def test_sigterm_that_came_while_ranks_ran_keeps_the_slots_though_the_ranks_are_gone_when_it_is_handled(
        node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """A process-tree kill signals the agent an instant before the ranks (children first): by the time the loop
    handles the signal they are gone, but the job was torn down, not finished."""
    node.ranks.commit_all(0, 3)
    node.agent.watcher.scan(relist_every=0)
    node.agent.life.on_signal(signal.SIGTERM, None)
    for proc in node.agent.watcher.ranks.values():
        proc.dead = True   # what alive() finds once the tree kill reached them
    caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
    node.agent.life.stop()
    record = stopped(caplog)
    assert node.agent.scheduler.persisted == 3 and record.levelno == logging.INFO, record.getMessage()
    assert "for a restart: rank(s) [0, 1] failed or still ran when SIGTERM came" in record.getMessage()
    assert len(list_slots(node.shm_dir, JOB)) == 6 and not node.agent.ended_cleanly


def test_sigterm_while_the_ranks_ran_unlinks_what_disk_holds_once_every_rank_said_goodbye(
        node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """The signal came while the ranks ran, but they finished (a goodbye each) before it was handled: the job
    ended, nothing is kept for a restart."""
    node.ranks.commit_all(0, 3)
    node.agent.watcher.scan(relist_every=0)
    node.agent.life.on_signal(signal.SIGTERM, None)
    assert sorted(node.agent.life.running_at_signal) == [0, 1]
    for rank in (0, 1):
        node.request(b"r%d" % rank, Kind.BYE, rank=rank, pid=os.getpid(), wait=False)
    caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
    node.agent.life.stop()
    record = stopped(caplog)
    assert "slots unlinked" in record.getMessage() and node.agent.ended_cleanly, record.getMessage()
    assert list_slots(node.shm_dir, JOB) == {}


def test_sigterm_handled_after_a_rank_died_that_the_loop_had_not_seen_die_keeps_the_slots(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tree kill's other order: the rank died (SIGTERMed with the agent, before it could say its run failed)
    an instant before the agent's handler ran. The loop had not seen it die, so it still ran as far as the job is
    concerned: its memory is for the restart (with is_alive() in the handler the slots went, and the restart read
    disk). Once the loop has seen the ranks die, a later SIGTERM is someone ending a job that is over: unlinked."""
    for seen_dead in (False, True):
        (tmp_path / str(seen_dead)).mkdir()
        node = Harness(tmp_path / str(seen_dead))
        try:
            node.ranks.kill(0)
            node.ranks.kill(1)
            node.ranks.commit_all(0, 3)
            node.agent.watcher.scan(relist_every=0)   # the ranks as the loop knew them: alive at its last look
            if seen_dead:
                node.agent._tick()   # their end (they had ended before it adopted their slots), the flush of step 3
            node.agent.life.on_signal(signal.SIGTERM, None)
            assert sorted(node.agent.life.running_at_signal) == ([] if seen_dead else [0, 1])
            caplog.clear()
            caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
            node.agent.life.stop()
            message = stopped(caplog).getMessage()
            assert node.agent.scheduler.persisted == 3, message
            if seen_dead:
                assert "slots unlinked" in message and list_slots(node.shm_dir, JOB) == {}, message
            else:
                assert "for a restart: rank(s) [0, 1] failed or still ran when SIGTERM came" in message, message
                assert len(list_slots(node.shm_dir, JOB)) == 6 and not node.agent.ended_cleanly
            assert not node.agent.hand_over, message   # nobody said this agent was a rank's child
        finally:
            node.close()


@pytest.mark.parametrize("dead_at_adoption", [True, False], ids=["ended-before", "died-after"])
def test_a_rank_that_ended_before_the_agent_adopted_its_slots_is_not_said_to_die_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, dead_at_adoption: bool) -> None:
    """A successor (after a tree kill) or an agent started again finds the slots of ranks that ended under the agent
    before it, which said how: one INFO line that the slots stay, not a second "died without closing" WARNING per
    rank. A rank alive when its slots were adopted and dead later died under this agent: the WARNING."""
    node = Harness(tmp_path)
    try:
        if dead_at_adoption:
            node.ranks.kill(0)   # its slots name a process that is gone
        node.ranks.commit_all(0, 3)
        node.agent.watcher.scan(relist_every=0)
        if not dead_at_adoption:
            node.agent.watcher.ranks[0].start_time = 1.0   # the harness's death: its pid now started at another time
        caplog.set_level(logging.INFO, logger="easyckpt_agent.server")
        node.agent._tick()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 0 (pid")]
        assert len(lines) == 1, lines
        said = "had ended before this agent adopted its slots" if dead_at_adoption else "died without closing"
        assert said in lines[0], lines
        node.settle()
        assert node.agent.scheduler.persisted == 3, "either way the node flushes the newest step its ranks hold"
    finally:
        node.close()


@pytest.mark.parametrize("case", ["parent", "died-an-instant-before", "seen-dead-before", "someone-else"])
def test_a_tree_kill_hands_the_kept_slots_to_a_detached_agent(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             case: str) -> None:
    """The rank that started the agent was still its parent when the signal came: a launcher is terminating that
    rank's process tree (DeepSpeed's, children first). The slots stay for the restart, and since that launcher takes
    the agent down with every failed job, nothing would free them if no restart came: a detached agent takes them
    over (it waits idle_timeout, as an agent under torchrun does). The launcher signals the rank an instant after
    the agent, so an agent that handles the signal late finds that rank dead, itself reparented: still a tree kill
    while the loop had not seen the rank die. One the loop had seen die before, or a starter that is none of the
    job's ranks: a SIGTERM is someone stopping a lingering agent, and it hands nothing over."""
    node = Harness(tmp_path)
    node.agent.life.launcher_kills_trees = True   # this process's parent runs under DeepSpeed's launcher, say
    tree_kill = case in ("parent", "died-an-instant-before")
    try:
        node.ranks.commit_all(0, 3)
        node.agent.watcher.scan(relist_every=0)
        rank = node.agent.watcher.ranks[0]
        node.config.started_by = {"parent": os.getppid(), "someone-else": 1 << 22}.get(case, rank.pid)
        assert rank.pid != os.getppid()
        for proc in node.agent.watcher.ranks.values():   # the fake ranks share this process's pid
            proc.dead = case == "seen-dead-before"
        node.agent.life.on_signal(signal.SIGTERM, None)
        assert node.agent.life.tree_kill is tree_kill
        for proc in node.agent.watcher.ranks.values():
            proc.dead = True
        caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
        node.agent.life.stop()
        record = stopped(caplog)
        assert node.agent.hand_over is tree_kill
        assert ("a detached agent takes the slots over; it serves the restart, or leaves after 300 s "
                "(agent_idle_timeout)" in record.getMessage()) is tree_kill
        if case != "seen-dead-before":   # deaths no loop handled (none runs here): what stop() keeps is not in question
            assert record.levelno == logging.INFO and len(list_slots(node.shm_dir, JOB)) == 6, record.getMessage()
            assert ("easyckpt clean" in record.getMessage()) is not tree_kill   # refused while the successor runs
    finally:
        node.close()


def test_a_signal_is_a_tree_kill_only_from_a_tree_killing_launcher_while_the_starting_rank_was_running() -> None:
    kill = lifecycle.is_tree_kill
    assert kill(launcher_kills_trees=True, started_by=7, parent=7, running=[])
    assert kill(launcher_kills_trees=True, started_by=7, parent=1, running=[5, 7])   # handled after the rank died
    assert not kill(launcher_kills_trees=True, started_by=7, parent=1, running=[5])   # the loop had seen it die
    assert not kill(launcher_kills_trees=False, started_by=7, parent=7, running=[7])   # torchrun, systemd, SLURM
    assert not kill(launcher_kills_trees=True, started_by=None, parent=7, running=[7])   # started by hand


def test_a_tree_kill_before_any_slot_hands_nothing_over(tmp_path: Path) -> None:
    node = Harness(tmp_path, started_by=os.getppid())
    node.agent.life.launcher_kills_trees = True
    try:
        for path in list_slots(node.shm_dir, JOB).values():
            path.unlink()   # the ranks refused their launch before they made a slot
        node.agent.life.on_signal(signal.SIGTERM, None)
        node.agent.life.stop()
        assert node.agent.life.tree_kill and not node.agent.hand_over
    finally:
        node.close()


def test_a_tree_kill_after_the_job_ended_cleanly_hands_nothing_over(node: Harness) -> None:
    node.config.started_by = os.getppid()
    node.agent.life.launcher_kills_trees = True
    node.ranks.commit_all(0, 3)
    node.agent.watcher.scan(relist_every=0)
    for rank in (0, 1):
        node.request(b"r%d" % rank, Kind.BYE, rank=rank, pid=os.getpid(), wait=False)
    node.settle()
    node.agent.life.on_signal(signal.SIGTERM, None)
    node.agent.life.stop()
    assert node.agent.life.tree_kill and node.agent.ended_cleanly and not node.agent.hand_over
    assert list_slots(node.shm_dir, JOB) == {}


def test_only_a_launcher_that_kills_process_trees_makes_a_signal_a_tree_kill(node: Harness) -> None:
    """DeepSpeed's launcher (as its ``deepspeed`` command runs it on each node) ends jobs by process trees. A kill of
    everything at once (systemd, SLURM) reaches the agent while its rank is still its parent too, but waits for every
    process: a successor there would hold up the stop. This process's parent is no such launcher."""
    deepspeed = ["/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=eyJsb2NhbGhvc3QiOiBbMF19",
                 "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=29500", "--no_local_rank", "train.py"]
    assert lifecycle.is_tree_killing_launcher(deepspeed)
    for other in (["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"],
                  ["torchrun", "train.py", "-m", "x"], ["python", "-c", "deepspeed.launcher.launch"],
                  ["python", "train.py", "-m"], []):
        assert not lifecycle.is_tree_killing_launcher(other), other
    assert not lifecycle.launcher_kills_trees(os.getpid()) and not lifecycle.launcher_kills_trees(None)
    assert not lifecycle.launcher_kills_trees(1 << 22)   # no such process
    node.config.started_by = os.getppid()
    node.ranks.commit_all(0, 3)
    node.agent.watcher.scan(relist_every=0)
    node.agent.life.on_signal(signal.SIGTERM, None)
    node.agent.life.stop()
    assert not node.agent.life.tree_kill and not node.agent.hand_over


def test_the_successor_runs_the_same_command_line_but_hands_nothing_over_itself() -> None:
    argv = ["--save-dir", "/ckpt", "--started-by", "123", "--idle-timeout", "5", "--started-by=9"]
    assert lifecycle.successor_command(argv) == [sys.executable, "-m", "easyckpt_agent", "--save-dir", "/ckpt",
                                                 "--idle-timeout", "5"]


def test_sigterm_without_time_left_keeps_what_disk_lacks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Harness(tmp_path, shutdown_timeout=0.0)
    try:
        node.ranks.kill(0)
        node.ranks.kill(1)
        node.ranks.commit_all(0, 3)
        caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
        node.agent.life.stop()
        record = stopped(caplog)
        assert record.levelno == logging.WARNING
        assert "no time left to persist step 3 (shutdown_timeout=0s)" in record.getMessage()
        assert "step 3 is newer than disk (None)" in record.getMessage()
        assert len(list_slots(node.shm_dir, JOB)) == 6 and node.agent.scheduler.persisted is None
    finally:
        node.close()


def test_a_persist_that_fails_during_shutdown_is_given_up(node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    node.ranks.commit_all(0, 3)
    caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
    persister.ABORT.set()   # a second signal came first: the writers stop at their first write
    try:
        node.agent.life.stop()
    finally:
        persister.ABORT.clear()
    record = stopped(caplog)
    assert "the persist of step 3 failed (persist abandoned" in record.getMessage()
    assert record.levelno == logging.WARNING and node.agent.life.given_up_on_stop
    scheduler = node.agent.scheduler
    assert scheduler.given_up == 3 and scheduler.inflight is None and not scheduler.claims
    assert node.ranks.writable(0, 0) and layout.complete_iterations(node.save_dir) == []


def test_sigterm_in_a_multi_node_job_leaves_persisting_to_the_job(node: Harness,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    node.agent.cluster.peers = PeerTable("t" * 16, "n0", "n0", {"n0": PeerNode("tcp://127.0.0.1:1", (0, 1)),
                                                                "n1": PeerNode("tcp://127.0.0.1:2", (2, 3))})
    node.ranks.commit_all(0, 3)
    caplog.set_level(logging.INFO, logger="easyckpt_agent.lifecycle")
    node.agent.life.stop()
    assert "step 3 not persisted (a multi-node iteration needs every node's files)" in stopped(caplog).getMessage()
    assert not node.agent.scheduler.busy()


def test_the_agent_exits_once_every_rank_said_goodbye(node: Harness) -> None:
    node.ranks.commit_all(0, 5)
    node.agent._tick()
    life = node.agent.life
    assert not life.should_exit()   # ranks alive, a persist in flight
    node.settle()
    for proc in node.agent.watcher.ranks.values():
        proc.said_bye = True
    assert life.should_exit() and life.ended_cleanly
    assert list_slots(node.shm_dir, JOB) == {} and not control_path(node.shm_dir, JOB).exists()


def test_memory_newer_than_disk_after_failed_persists_is_kept_at_exit(node: Harness, tmp_path: Path) -> None:
    aside = tmp_path / "ckpt-aside"
    node.save_dir.rename(aside)
    node.save_dir.write_text("not a directory")
    node.ranks.commit_all(0, 5)
    node.agent._tick()
    node.settle()
    assert node.agent.scheduler.failure is not None
    for proc in node.agent.watcher.ranks.values():
        proc.said_bye = True
    assert node.agent.life.should_exit() and not node.agent.life.ended_cleanly
    assert len(list_slots(node.shm_dir, JOB)) == 6 and node.ranks.writable(0, 0)   # kept, but let go of


@pytest.mark.parametrize("persisted", [True, False])
def test_no_rank_alive_for_idle_timeout_ends_the_agent(tmp_path: Path, persisted: bool) -> None:
    node = Harness(tmp_path, idle_timeout=1e-6)
    try:
        node.ranks.kill(0)
        node.ranks.kill(1)
        node.ranks.commit_all(0, 4)
        node.agent.watcher.scan(relist_every=0)
        node.agent.scheduler.failed_ranks.clear()   # no flush on failure here: disk has what the test says
        if persisted:
            node.agent.scheduler.persisted = 4
        life = node.agent.life
        assert not life.should_exit()   # the idle clock starts
        assert life.no_rank_since is not None
        assert poll(life.should_exit, 10, "idle_timeout to pass")
        assert life.ended_cleanly == persisted
        assert len(list_slots(node.shm_dir, JOB)) == (0 if persisted else 6)
    finally:
        node.close()


def lead_two_nodes(node: Harness, stage_notes: dict[int, list[str]]) -> str:
    """Make the harness's agent the leader of a two-node job whose stages hold ``stage_notes``; its ranks said
    goodbye. Returns the leader's node name."""
    me = node.agent.cluster.node
    node.agent.cluster.peers = PeerTable("t" * 16, me, me, {me: PeerNode("tcp://127.0.0.1:1", (0, 1)),
                                                            "other": PeerNode("tcp://127.0.0.1:2", (2, 3))})
    for step, writers in stage_notes.items():
        stage = node.save_dir / layout.stage_dirname(step)
        stage.mkdir(parents=True)
        for writer in writers:
            (stage / layout.node_file_name(writer)).write_text("{}")
    node.ranks.commit_all(0, 3)
    node.agent.watcher.scan(relist_every=0)
    for proc in node.agent.watcher.ranks.values():
        proc.said_bye = True
    return me


def test_a_leader_lists_its_stages_again_at_once_when_a_persist_reached_the_store_during_its_backoff(
        node: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Soak seed 1127 fault 11 (a 2x2 job, the store down, a rank killed meanwhile): the store came back, both
    nodes persisted the final step, the job ended, and the leader committed it 20 s later, at the end of the pause
    its failed listings had grown to. A persist that reaches the store since the last failed listing ends the
    pause; without one the leader does not list again before the pause is over."""
    server = s3server.server()
    lead_two_nodes(node, {})
    cluster = node.agent.cluster
    cluster.save_dir = location(f"s3://{s3server.bucket(server.url)}/ckpt")
    s3_endpoint_down(monkeypatch)
    caplog.set_level(logging.INFO, logger="easyckpt_agent.cluster")
    cluster._commit_stages()
    assert f"cannot list the staged steps in {cluster.save_dir}" in caplog.text and cluster._list_pause >= 1.0
    cluster._list_pause = 30.0   # as after several failures
    cluster._stages_at = time.monotonic() + 30.0
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.url)   # the store is back
    cluster._commit_stages()
    assert "can be listed again" not in caplog.text, "still in the pause, and no persist reached the store since"
    node.agent.scheduler.stored_at = time.monotonic()
    cluster._commit_stages()
    assert f"the staged steps in {cluster.save_dir} can be listed again" in caplog.text and cluster._list_pause == 0.0


def test_a_leader_does_not_wait_for_a_stage_its_own_failed_persist_left(node: Harness,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    # soak seed 101 fault 19: the disk filled while both nodes persisted step 5; the other node's shards made
    # it, the leader's did not. The leader stayed STAGE_WAIT (120 s) after the job ended, holding its slots.
    lead_two_nodes(node, {5: ["other"]})
    node.agent.scheduler.given_up = 20
    caplog.set_level(logging.WARNING, logger="easyckpt_agent.cluster")
    assert node.agent.life.should_exit()
    assert "staged step(s) [5] can never be committed" in caplog.text


def test_a_leader_does_not_wait_for_a_stage_another_nodes_failed_persist_left(node: Harness) -> None:
    lead_two_nodes(node, {5: [node.agent.cluster.node]})
    node.agent.scheduler.given_up = 20   # the leader failed its own newer persists
    assert node.agent.life.should_exit()


def test_a_leader_waits_for_other_nodes_still_writing_its_stages(node: Harness) -> None:
    me = lead_two_nodes(node, {5: [node.agent.cluster.node]})
    node.agent.scheduler.persisted = 5   # the final step: the leader's shards are in, the other node's to come
    assert not node.agent.life.should_exit()
    node.agent.scheduler.given_up = 10   # moved on, but the other node says it writes step 5
    node.agent.cluster.jobwide.states["other"] = NodeState("other", busy=5)
    assert not node.agent.life.should_exit()
    node.agent.cluster.jobwide.states["other"] = NodeState("other", busy=None)
    node.agent.cluster.jobwide.states[me] = NodeState(me, busy=5)   # the leader's own state does not count
    assert node.agent.life.should_exit()


def test_stage_outlook() -> None:
    def outlook(own_note: bool, floor: int, others: dict[str, NodeState | None], missing: tuple[str, ...] = ("n1",)
                ) -> str | None:
        return stage_outlook(5, own_note=own_note, node="n0", floor=floor, others=others, missing=missing)

    assert outlook(False, -1, {}) is not None
    assert outlook(False, 5, {"n1": NodeState("n1", busy=5)}) is not None
    assert outlook(True, 5, {"n1": None}) is None   # not heard from since this incarnation began: wait
    assert outlook(True, 10, {"n1": NodeState("n1", busy=5)}) is None
    assert outlook(True, 10, {"n1": NodeState("n1", busy=None)}) is not None
    gone = NodeState("n1", alive=False)
    # every node it lacks said its ranks are gone and it neither holds step 5 nor writes it: hopeless, whatever
    # the floor
    assert "n1 never wrote their shards of step 5" in (outlook(True, 0, {"n1": gone}) or "")
    for able in (NodeState("n1"), dataclasses.replace(gone, busy=5), dataclasses.replace(gone, wrote=5),
                 dataclasses.replace(gone, local=frozenset({5, 6})), dataclasses.replace(gone, held=frozenset({5}))):
        assert outlook(True, 0, {"n1": able}) is None, able   # its ranks live (a slower node), or it has step 5
    # one of two lacking nodes unheard, or still holding it: wait; a node whose note is in counts for nothing
    assert outlook(True, 0, {"n1": gone, "n2": None}, ("n1", "n2")) is None
    assert outlook(True, 0, {"n1": gone, "n2": NodeState("n2", held=frozenset({5}), alive=False)}, ("n1", "n2")) is None
    assert outlook(True, 0, {"n1": gone, "n2": None}, ("n1",)) is not None
    assert outlook(True, 0, {"n1": gone}, ()) is None   # every note is in


def test_a_leader_does_not_wait_for_a_stage_of_an_earlier_incarnation_nobody_can_finish(
        node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Soak seed 33569623 fault 11 (plain-2x1): the whole job was lost at step 3 just after the leader wrote its
    shards of step 3; the rerun's ranks refused the only (damaged) iteration and died with nothing in memory. The
    other node's agent left after EMPTY_IDLE, the leader's waited STAGE_WAIT (120 s) for the other node's shards
    of step 3, which died with the first incarnation. Once the other node says it neither holds nor writes the
    step and its ranks are gone, the leader stops waiting."""
    me = lead_two_nodes(node, {3: [node.agent.cluster.node]})
    states = node.agent.cluster.jobwide.states
    assert not node.agent.life.should_exit(), "the other node has not said anything yet: it may still write them"
    states["other"] = NodeState("other")
    assert not node.agent.life.should_exit(), "the other node's ranks live: they may still commit step 3"
    states["other"] = NodeState("other", held=frozenset({3}), alive=False)
    assert not node.agent.life.should_exit(), "the other node holds step 3: it may still write it"
    states["other"] = NodeState("other", alive=False)
    states[me] = NodeState(me, held=frozenset({3}), alive=False)   # the leader's own state does not count
    caplog.set_level(logging.WARNING, logger="easyckpt_agent.cluster")
    assert node.agent.life.should_exit()
    assert "staged step(s) [3] can never be committed (node(s) other never wrote their shards of step 3" in caplog.text


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_ranks_that_died_with_nothing_in_memory_end_the_agent_before_idle_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The soak found it (flip_disk on plain-1x1, seed 4242: 3 of 6 jobs): the job's only iteration was damaged,
    the load refused it and the ranks died before their first snapshot; their agent then waited the whole
    idle_timeout (300 s) for a restart that nothing in memory could help. With nothing committed it leaves after
    EMPTY_IDLE, and takes its slots and control block with it."""
    monkeypatch.setattr(lifecycle, "EMPTY_IDLE", 0.05)
    node = Harness(tmp_path, idle_timeout=600)
    try:
        life = node.agent.life
        assert not life.should_exit() and not life._nothing_kept(), "no rank came yet: it waits for them"
        for rank in (0, 1):
            node.agent.watcher.register(rank, dead_pid(), None)
        node.agent.watcher.scan(relist_every=0)
        assert life._nothing_kept()
        assert poll(life.should_exit, 10, "EMPTY_IDLE to pass")
        assert life.ended_cleanly and not list_slots(node.shm_dir, JOB)
    finally:
        node.close()


def test_a_multi_node_agent_with_nothing_in_memory_leaves_early_unless_it_holds_another_nodes_backup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The soak found it (flip_disk on plain-2x2, seed 20261127, fault 57): the same refused load in a 2-node job
    left both agents waiting their whole idle_timeout. With no backup of another node's ranks either, nothing
    this agent holds can help a restart; a backup (another node's only way back after a node loss) keeps it."""
    monkeypatch.setattr(lifecycle, "EMPTY_IDLE", 0.05)
    node = Harness(tmp_path, idle_timeout=600)
    try:
        node.agent.cluster.peers = PeerTable("t" * 16, "n0", "n0", {"n0": PeerNode("tcp://127.0.0.1:1", (0, 1)),
                                                                    "n1": PeerNode("tcp://127.0.0.1:2", (2, 3))})
        life = node.agent.life
        for rank in (0, 1):
            node.agent.watcher.register(rank, dead_pid(), None)
        node.agent.watcher.scan(relist_every=0)
        assert life._nothing_kept(), "no step in memory and no backup held"
        meta = SlotMeta(job=JOB, rank=2, world_size=4, local_rank=0, local_world_size=2, pid=None, pid_start=None,
                        skeleton_version=1, tensors=(), step=4, skeleton=None, created=0.0)
        backup = Manifest(meta=meta, checksums=(), node="n1", generation=1)
        node.agent.cluster.holdings.backups[(2, 4)] = backup
        assert not life._nothing_kept(), "a backup of node n1's rank 2 may be asked for"
        del node.agent.cluster.holdings.backups[(2, 4)]
        assert poll(life.should_exit, 10, "EMPTY_IDLE to pass")
        assert life.ended_cleanly and not list_slots(node.shm_dir, JOB)
    finally:
        node.close()


def test_a_committed_step_keeps_the_agent_for_idle_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "EMPTY_IDLE", 0.05)
    node = Harness(tmp_path, idle_timeout=600)
    try:
        node.ranks.kill(0)
        node.ranks.kill(1)
        node.ranks.commit_all(0, 4)
        node.agent.watcher.scan(relist_every=0)
        node.agent.scheduler.failed_ranks.clear()
        life = node.agent.life
        deadline = time.monotonic() + 0.5   # ten times EMPTY_IDLE: the step in memory keeps it
        while time.monotonic() < deadline:
            assert not life.should_exit()
        assert not life._nothing_kept() and len(list_slots(node.shm_dir, JOB)) == 6
    finally:
        node.close()
