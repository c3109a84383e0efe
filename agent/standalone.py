"""``torchrun --nnodes=N --nproc-per-node=1 -m agent --save-dir DIR``: node agents that find each other
through torchrun's own rendezvous, before (or without) any training job.

The torchrun worker is only a launcher: it starts this node's agent detached (its own session, as the
library does, so that torchrun restarting or tearing down its workers never takes the agent along;
an agent that already runs for this job and node is reused), asks it for its tcp endpoint, exchanges
the endpoints of all nodes with one gloo all-gather, takes the job token from worker 0 and hands the
agent the node list with the leader (worker 0's node). Then the worker exits and torchrun finishes.
Only fixed-size byte tensors cross the rendezvous: nothing is unpickled. A training job started later
on the same nodes (same save_dir, same EASYCKPT_NODE_ID) finds these agents through their lock and
introduces them again with its own token and leader; until then they already serve each other.

torch is imported here, in the launcher process, never in the agent itself.
"""
from __future__ import annotations

import datetime
import logging
import os
import secrets
import subprocess
import sys
import time
from typing import Any


from easyckpt_wire import protocol
from easyckpt_wire.protocol import Kind, ProtocolError

logger = logging.getLogger(__name__)

_FIELD = 256


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _gather(text: str, world_size: int) -> list[str]:
    import torch
    import torch.distributed as dist

    raw = text.encode()
    if len(raw) > _FIELD:
        raise ValueError(f"{text!r} is longer than {_FIELD} bytes")
    local = torch.zeros(_FIELD, dtype=torch.uint8)
    if raw:
        local[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(rows, local)
    return [bytes(row.numpy()).rstrip(b"\0").decode() for row in rows]


def launch(agent_argv: list[str], job_id: str, timeout: float = 60.0) -> int:
    """Start (or find) this node's agent, introduce it to the others through torchrun; returns an exit code."""
    import torch.distributed as dist

    node = protocol.node_id()
    job_dir = protocol.runtime_dir(job_id)
    if not protocol.agent_running(job_dir):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}
        with open(job_dir / "agent.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "agent", *agent_argv, "--serve-peers"],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True, env=env, cwd="/")
        logger.info("node %s: started agent pid %d (log %s)", node, proc.pid, job_dir / "agent.log")
    deadline = time.monotonic() + timeout
    while True:
        problem = "it serves no tcp endpoint (started by a single-node job?)"
        try:
            reply = protocol.request_agent(job_dir, Kind.PING, min(2.0, max(0.1, deadline - time.monotonic())))
            if reply.get("endpoint"):
                break
        except (TimeoutError, ProtocolError) as exc:
            problem = str(exc)
        if time.monotonic() > deadline:
            logger.error("node %s: the agent in %s did not come up for peers: %s", node, job_dir, problem)
            return 1
        time.sleep(0.05)  # polling a starting agent against the deadline
    endpoint = reply["endpoint"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        rows = [row.split("\n", 1) for row in _gather(f"{node}\n{endpoint}", world_size)]
        token = _gather(secrets.token_hex(16) if rank == 0 else "", world_size)[0]
        nodes: dict[str, dict[str, Any]] = {}
        for name, address in rows:
            if nodes.setdefault(name, {"endpoint": address, "ranks": []})["endpoint"] != address:
                logger.error("node id %r names two agents (%s and %s): give every node its own %s", name,
                             nodes[name]["endpoint"], address, protocol.NODE_ID_ENV)
                return 1
        reply = protocol.request_agent(job_dir, Kind.PEERS, timeout, token=token, node=node, leader=rows[0][0],
                                       nodes=[{"node": n, **v} for n, v in sorted(nodes.items())], world_size=1,
                                       replicate_unique=True)
        if not reply.get("ok"):
            logger.error("node %s: the agent refused the peer list: %s", node, reply.get("error"))
            return 1
        _gather("", world_size)  # every agent knows the others before any launcher exits
        logger.info("node %s: agent at %s knows nodes %s; leader %s", node, endpoint, sorted(nodes), rows[0][0])
        return 0
    finally:
        dist.destroy_process_group()
