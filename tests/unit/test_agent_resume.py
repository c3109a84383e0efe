"""easyckpt_agent.resume: a rank resumed at an older step, and every part of the agent starts the new timeline."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_slots import JOB, Harness
from conftest import s3_endpoint_down

from easyckpt_wire import layout
from easyckpt_wire.control import ControlReader, control_path
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import PeerNode, PeerTable
from easyckpt_wire.shm import SlotState
from easyckpt_wire.storage import location, open_storage


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Harness]:
    node = Harness(tmp_path)
    yield node
    node.close()


def persist(node: Harness, slot: int, step: int) -> None:
    """Every rank snapshots ``step`` (a due step) into ``slot``, and the agent persists it."""
    node.ranks.commit_all(slot, step)
    node.agent._tick()
    assert node.agent.scheduler.inflight_step() == step
    node.settle()
    assert node.agent.scheduler.persisted == step


def on_disk(save_dir: Path) -> list[int]:
    return [step for step, _ in layout.complete_iterations(save_dir)]


def store_at(node: Harness, url: str) -> None:
    """The agent's resume and timeline read ``url`` from now on (its persists still go to the harness's directory)."""
    where = location(url)
    for part in (node.agent.resumer, node.agent.timeline):
        part.save_dir = where
    node.agent.timeline.store = open_storage(where)


def count_requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every request the S3 client sends from now on, in order (each still goes to the server)."""
    from botocore.client import BaseClient

    calls: list[str] = []
    real = BaseClient._make_api_call
    monkeypatch.setattr(BaseClient, "_make_api_call", lambda self, name, params: calls.append(name) or real(
        self, name, params))
    return calls


def test_a_resume_moves_newer_iterations_aside_once_and_the_new_timeline_is_persisted_again(node: Harness) -> None:
    for slot, step in enumerate((5, 10, 15)):
        persist(node, slot, step)
    agent = node.agent
    assert agent.protection.safe == 15 and on_disk(node.save_dir) == [5, 10, 15]
    agent.scheduler.flushes.wanted.add(20)   # a rank asked for a step of the abandoned timeline
    node.request(b"r0", Kind.RESUME, rank=0, step=10, stale=[], id=1)
    reply = node.sent[-1][1]
    assert reply["ok"] and (reply["moved"], reply["tracker"], reply["persisted"], reply["error"]) == ([15], 10, 10, None)
    assert on_disk(node.save_dir) == [5, 10] and layout.read_tracker(node.save_dir) == 10
    assert [p.name for p in node.save_dir.glob(".abandoned-*/*")] == [layout.iteration_dirname(15)]
    assert agent.scheduler.flushes.failed == {20: "the job resumed at step 10: step 20 was abandoned"}
    assert agent.protection.safe is None and node.ranks.writable(0, 2)   # step 15's slots go back to the ranks
    view = ControlReader(control_path(node.shm_dir, JOB)).read()
    assert view is not None and view.safe is None and view.persisted == 10
    node.request(b"r1", Kind.RESUME, rank=1, step=10, stale=[], id=2)   # every rank sends the same step
    assert node.sent[-1][1]["moved"] == [] and node.sent[-1][1]["persisted"] == 10
    persist(node, 2, 15)   # the new timeline's step 15 reaches disk, whatever the abandoned one reached
    assert on_disk(node.save_dir) == [5, 10, 15]


def test_a_resume_while_the_store_is_down_starts_the_new_timeline_and_tries_the_store_once_per_restart(
        node: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarted the workers while the object store was unreachable (the soak's outage with a rank killed
    in it): the RESUME once ended the agent (a tracker read outside the error handling). It is answered with what
    could not be moved, the new timeline starts all the same, and the store is tried once, not once per listing:
    each try takes the client's retries out of the loop that answers the ranks."""
    for slot, step in enumerate((5, 10)):
        persist(node, slot, step)
    agent = node.agent
    s3_endpoint_down(monkeypatch)
    store_at(node, "s3://bucket/ckpt")
    calls = count_requests(monkeypatch)
    node.request(b"r0", Kind.RESUME, rank=0, step=5, stale=[], id=1)
    reply = node.sent[-1][1]
    assert not reply["ok"] and "could not move the iterations newer than step 5 aside in s3://bucket/ckpt" in \
        reply["error"] and "until a resume finds the store up" in reply["error"], reply
    assert len(calls) == 1, f"the store was tried {len(calls)} times: {calls}"
    # The other ranks of the restart resume moments later at the same step: answered with what the first found, not
    # tried again (each try, one rank after the other, delayed a node's last rank by seconds; soak, seed 11301).
    node.request(b"r1", Kind.RESUME, rank=1, step=5, stale=[], id=2)
    assert node.sent[-1][1]["error"] == reply["error"] and len(calls) == 1, calls
    node.request(b"r1", Kind.RESUME, rank=1, step=4, stale=[], id=3)   # another resume: the store is tried again
    assert "newer than step 4" in node.sent[-1][1]["error"] and len(calls) == 2, calls
    # the new timeline starts: step 10 of the abandoned one no longer counts as on disk (what is, is unknown while
    # the store is down), and step 10's hold goes back to the ranks
    assert agent.scheduler.persisted is None and agent.protection.safe is None, agent.scheduler.persisted


def test_the_store_is_read_once_per_restart_not_once_per_rank(node: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank of a restart sends RESUME at the same step, and the agent's loop answers no one while it reads the
    store (listings and the tracker: a few requests, tens of milliseconds each on an object store and seconds when
    it throttles; a node of eight ranks paid it eight times over). The first rank's reading answers the others; the
    same rank again is a new restart, and reads again. Against a real S3 server process."""
    import s3server

    for slot, step in enumerate((5, 10)):
        persist(node, slot, step)
    s3server.server()
    store_at(node, f"s3://{s3server.bucket()}/ckpt")
    calls = count_requests(monkeypatch)
    node.request(b"r0", Kind.RESUME, rank=0, step=10, stale=[], id=1)
    first = node.sent[-1][1]
    assert first["ok"] and first["error"] is None and first["persisted"] == 10, first
    read = len(calls)
    assert read >= 2, f"the first RESUME should list the store: {calls}"
    node.request(b"r1", Kind.RESUME, rank=1, step=10, stale=[], id=2)
    second = node.sent[-1][1]
    assert {k: second[k] for k in ("ok", "tracker", "persisted", "error")} == \
        {k: first[k] for k in ("ok", "tracker", "persisted", "error")} and second["moved"] == [], second
    assert len(calls) == read, f"the restart's second rank read the store again: {calls[read:]}"
    node.request(b"r0", Kind.RESUME, rank=0, step=10, stale=[], id=3)   # rank 0 again: another restart
    assert node.sent[-1][1]["ok"] and len(calls) == 2 * read, calls


def test_snapshots_a_rank_could_not_invalidate_are_let_go_and_invalidated_once_free(node: Harness) -> None:
    ranks, agent = node.ranks, node.agent
    ranks.commit_all(0, 5)
    stale = {rank: ranks.commit(rank, 1, 6) for rank in (0, 1)}
    agent._tick()
    assert agent.protection.safe == 6 and not ranks.writable(0, 1)   # held: the ranks could not invalidate them
    for rank in (0, 1):
        agent.resumer.resume(rank, 5, [[1, stale[rank]]])
    assert agent.watcher.abandoned == {(0, 1, stale[0]), (1, 1, stale[1])}
    assert agent.protection.safe is None
    info = agent.watcher.slots[0, 1]
    assert agent.scheduler.claims.claim(6, 0, info)   # something holds rank 0's copy: left alone for now
    agent.resumer.invalidate_abandoned()
    assert ranks.maps[0, 1].header().state == SlotState.COMMITTED
    assert ranks.maps[1, 1].header().state == SlotState.EMPTY   # nothing holds rank 1's: no load takes it now
    agent.scheduler.claims.drop(6)
    agent._tick()   # every round invalidates what is left, and the safe step moves back to the new timeline
    assert ranks.maps[0, 1].header().state == SlotState.EMPTY and agent.watcher.abandoned == set()
    assert agent.protection.safe == 5


def test_a_node_that_does_not_commit_drops_its_shards_of_abandoned_steps(tmp_path: Path) -> None:
    node = Harness(tmp_path, world_size=4, first_rank=2, node_id="n1")   # ranks 2 and 3 of a 4-rank job
    try:
        agent = node.agent
        agent.cluster.peers = PeerTable("t" * 16, "n1", "n0", {"n0": PeerNode("tcp://127.0.0.1:1", (0, 1)),
                                                               "n1": PeerNode("tcp://127.0.0.1:2", (2, 3))})
        node.ranks.commit_all(0, 10)
        node.scan()
        assert agent.scheduler.claim_newest(10)
        agent.scheduler.start_ready()
        node.settle()
        stage = node.save_dir / layout.stage_dirname(10)
        assert (stage / layout.node_file_name("n1")).is_file()   # this node's shards of step 10 are durable
        agent.cluster.complete = 10
        node.request(b"r2", Kind.RESUME, rank=2, step=5, stale=[], id=7)
        reply = node.sent[-1][1]
        assert reply["ok"] and reply["moved"] == [] and reply["persisted"] is None
        assert not (stage / layout.node_file_name("n1")).exists() and list(stage.glob("*.safetensors")) == []
        assert agent.cluster.complete is None and agent.cluster.jobwide.verdict is None
    finally:
        node.close()
