"""easyckpt_agent.server: the dispatch of ranks' requests and one round of the loop, in process (real slots, no sockets)."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_slots import JOB, Harness

from easyckpt_wire.control import ControlReader, control_path
from easyckpt_wire.protocol import Kind


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Harness]:
    node = Harness(tmp_path, save_storage_interval=0)   # the interval comes with the ranks' HELLO
    yield node
    node.close()


def hello(node: Harness, rank: int, **config: object) -> dict[str, object]:
    fields = {"save_storage_interval": 5, "max_ckpt_num": 2, "log_file_path": None, **config}
    node.request(b"r%d" % rank, Kind.HELLO, rank=rank, pid=os.getpid(), world_size=2, local_world_size=2,
                 id=rank, **fields)
    return node.sent[-1][1]


def test_hello_registers_the_rank_and_adopts_the_jobs_config(node: Harness) -> None:
    reply = hello(node, 0)
    assert reply["ok"] and reply["id"] == 0 and reply["pid"] == os.getpid()
    agent = node.agent
    assert agent.watcher.ranks[0].pid == os.getpid() and agent.watcher.local_world_size == 2
    assert (agent.config.save_storage_interval, agent.config.max_ckpt_num) == (5, 2)
    agent.watcher.ranks[0].said_bye = True
    agent.scheduler.failed_ranks.add(0)
    hello(node, 0)   # a new Checkpointer in the same process
    assert not agent.watcher.ranks[0].said_bye and agent.scheduler.failed_ranks == set()
    assert agent.cluster.replica is None   # the job fits this node: no replica server


def test_a_round_declares_the_safe_step_and_persists_the_due_one(node: Harness) -> None:
    hello(node, 0)
    hello(node, 1)
    node.ranks.commit_all(0, 5)
    node.agent._tick()
    view = ControlReader(control_path(node.shm_dir, JOB)).read()
    assert view is not None and view.safe == 5 and 5 in view.held
    node.settle()
    node.agent._tick()
    view = ControlReader(control_path(node.shm_dir, JOB)).read()
    assert view is not None and view.persisted == 5 and view.held == frozenset()


def test_waiting_flush_and_bye_are_answered_once_the_step_is_on_disk(node: Harness) -> None:
    hello(node, 0)
    hello(node, 1)
    node.ranks.commit_all(0, 3)   # not a due step: persisted because rank 0 asks
    node.request(b"r0", Kind.FLUSH, rank=0, step=3, wait=True, id=10)
    node.request(b"r1", Kind.BYE, rank=1, pid=os.getpid(), wait=True, id=11)
    node.sent.clear()
    node.agent._tick()
    assert node.sent == []   # both wait for the persist
    node.settle()
    node.agent._tick()
    replies = {identity: message for identity, message in node.sent}
    assert replies[b"r0"]["ok"] and replies[b"r0"]["persisted"] == 3 and replies[b"r0"]["committed"]
    assert replies[b"r1"]["ok"] and replies[b"r1"]["persisted"] == 3
    assert node.agent.watcher.ranks[1].said_bye and not node.agent.watcher.ranks[0].said_bye
    node.request(b"r0", Kind.BYE, rank=0, pid=os.getpid(), wait=False, id=12)
    assert node.sent[-1] == (b"r0", {**node.sent[-1][1], "ok": True, "id": 12})


def test_status_ping_and_refusals(node: Harness, caplog: pytest.LogCaptureFixture) -> None:
    hello(node, 0)
    node.ranks.commit_all(0, 2)
    node.agent._tick()
    node.request(b"cli", Kind.STATUS, id=1)
    status = node.sent[-1][1]
    assert status["job_id"] == JOB and status["safe_step"] == 2 and status["persisted_step"] is None
    assert [r["rank"] for r in status["ranks"]] == [0, 1] and len(status["slots"]) == 6
    assert status["newest_step"] == 2 and status["job_safe_lag"] == 0 and status["node_safe_step"] is None
    node.request(b"cli", Kind.PING, id=2)
    assert node.sent[-1][1]["pid"] == os.getpid() and node.sent[-1][1]["node"] == "localhost"
    node.request(b"r0", Kind.PEERS, token="t" * 16, node="elsewhere", leader="elsewhere", world_size=2,
                 replicate_unique=True, nodes=[{"node": "elsewhere", "endpoint": "tcp://127.0.0.1:1", "ranks": [0, 1]}],
                 id=3)
    assert not node.sent[-1][1]["ok"] and "EASYCKPT_NODE_ID" in node.sent[-1][1]["error"]
    assert node.agent.cluster.peers is None
    caplog.set_level(logging.WARNING, logger="easyckpt_agent.server")
    sent = len(node.sent)
    node.request(b"x", Kind.REPLY, ok=True)
    assert len(node.sent) == sent and "dropped a REPLY message: not a request" in caplog.text
