"""``torchrun --nnodes=N --nproc-per-node=1 -m easyckpt.node.launcher --save-dir DIR [agent options]``: node agents
that find each other through torchrun's own rendezvous, before (or without) any training job.

Each torchrun worker is only a launcher: it starts this node's agent detached (its own session, as the
library does, so that torchrun restarting or tearing down its workers never takes the agent along; an
agent that already runs for this job and node is reused), waits for its tcp endpoint, and introduces the
agents to each other exactly as a training job does (``replica.introduce`` over a gloo group: endpoints,
the job token from worker 0, the leader), but with no training ranks. Then the worker exits and torchrun
finishes. A training job started later on the same nodes (same save_dir, same EASYCKPT_NODE_ID) finds
these agents through their lock and introduces them again with its own ranks, token and leader; until
then they already serve each other. ``torchrun -m easyckpt_agent`` hands over to this module, which keeps torch
out of the agent package.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from easyckpt_wire import protocol
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.shm import check_job_id

logger = logging.getLogger(__name__)

_WORKER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _start_agent(agent_argv: list[str], job_dir: Path, node: str) -> None:
    if protocol.agent_running(job_dir):
        logger.info("node %s: reusing the agent that runs for this job (%s)", node, job_dir)
        return
    # The agent must not look like a torchrun worker (it would take the launcher path again).
    env = {k: v for k, v in os.environ.items() if k not in _WORKER_VARS}
    with open(job_dir / "agent.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "easyckpt_agent", *agent_argv, "--serve-peers"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env, cwd="/")
    logger.info("node %s: started agent pid %d (log %s)", node, proc.pid, job_dir / "agent.log")


def _wait_for_endpoint(job_dir: Path, node: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        problem = "it serves no tcp endpoint (started by a single-node job?)"
        try:
            reply = protocol.request_agent(job_dir, Kind.PING, min(2.0, max(0.1, deadline - time.monotonic())))
            if reply.get("endpoint"):
                return True
        except (TimeoutError, ProtocolError) as exc:
            problem = str(exc)
        if time.monotonic() > deadline:
            logger.error("node %s: the agent in %s did not come up for peers within %.0fs: %s",
                         node, job_dir, timeout, problem)
            return False
        time.sleep(0.05)  # polling a starting agent against the deadline


def launch(agent_argv: list[str], job_id: str, timeout: float = 60.0) -> int:
    """Start (or find) this node's agent and introduce it to the others; returns an exit code."""
    import torch.distributed as dist

    from easyckpt.node.replicas import ReplicaError, introduce

    node = protocol.node_id()
    job_dir = protocol.runtime_dir(job_id)
    _start_agent(agent_argv, job_dir, node)
    if not _wait_for_endpoint(job_dir, node, timeout):
        return 1

    def request(kind: Kind, wait: float, **fields: Any) -> dict[str, Any]:
        return protocol.request_agent(job_dir, kind, wait, **fields)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        peers = introduce(request, rank=dist.get_rank(), world_size=dist.get_world_size(), replicate_unique=True,
                          timeout=timeout, training=False)
    except (ReplicaError, ProtocolError, TimeoutError) as exc:
        logger.error("node %s: introducing the agents failed: %s", node, exc)
        return 1
    finally:
        dist.destroy_process_group()
    logger.info("node %s: agent knows nodes %s; leader %s", node, sorted(peers.nodes), peers.leader)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only what the launcher needs; everything is handed to the agent unchanged.
    parser = argparse.ArgumentParser(prog="torchrun ... -m easyckpt.node.launcher", add_help=False)
    parser.add_argument("--save-dir", required=True, type=Path)
    parser.add_argument("--job-id")
    parser.add_argument("--node-id")
    parser.add_argument("--log-level", default="INFO")
    known, _ = parser.parse_known_args(argv)
    logging.basicConfig(level=known.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [launcher %(process)d] %(name)s: %(message)s")
    if not under_torchrun():
        logger.error("easyckpt.node.launcher runs under torchrun (--nproc-per-node=1, one worker per node); "
                     "to run one agent by hand use: python -m easyckpt_agent --save-dir DIR")
        return 2
    if known.node_id:
        os.environ[protocol.NODE_ID_ENV] = known.node_id  # the runtime directory is per node
    save_dir = known.save_dir.resolve()
    job_id = check_job_id(known.job_id or protocol.job_id_for(save_dir))
    # The agent runs from "/" (it must not keep the launcher's directory busy): give it the absolute path.
    return launch([*argv, "--save-dir", str(save_dir)], job_id)


if __name__ == "__main__":
    sys.exit(main())
