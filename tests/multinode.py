"""Simulate a multi-node job on one machine: each "node" is its own ``torchrun --nnodes=N --node-rank=i``
(c10d rendezvous on 127.0.0.1, hosted by node 0, which the tests never kill) with its own
EASYCKPT_NODE_ID, its own EASYCKPT_SHM_DIR and so its own agent, running examples/plain_ddp.py with
gradients averaged on one flat buffer (bitwise-stable across restarts)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil
from conftest import ROOT, Env, gone, wait_for
from soak_job import free_port  # below the ephemeral ports: no outgoing connection takes it first

from easyckpt_wire.protocol import job_id_for

SCRIPT = ROOT / "examples" / "plain_ddp.py"
# A lost node stays a participant of torchrun's rendezvous round until its heartbeats are missed for
# keep_alive_interval x keep_alive_max_attempt seconds (5 x 3 = 15 by default), and the survivors cannot form the
# next round before: 15 s of every node-loss test spent waiting, with nothing of easyckpt's running. 1 x 2 (torchrun
# takes whole seconds) tolerates a torchrun starved of CPU for a second (one job at a time; the soak, three jobs on two
# cores, takes 1 x 5), and a live node taken for dead is harmless: it only joins the next round from the wait list.
# The restart only comes sooner, a harder regime for the agents. 1 x 5 left both cores quiet for about 4 s of every
# node loss here.
FAST_RENDEZVOUS = "keep_alive_interval=1,keep_alive_max_attempt=2"
NODES = 2
RANKS_PER_NODE = 2


def accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Cluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks sharing one save_dir (the "shared storage") and one
    output directory. The loops run at full speed unless ``step_idle`` says otherwise.
    """

    def __init__(self, env: Env, out: Path, *, steps: int, step_idle: float = 0.0, save_storage_interval: int = 5,
                 peer_timeout: float = 10.0, node_env: dict[int, dict[str, str]] | None = None,
                 script: Path = SCRIPT, extra_args: list[str] | None = None, nodes: int = NODES,
                 ranks_per_node: int = RANKS_PER_NODE, local_vars: bool = True) -> None:
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world = nodes * ranks_per_node
        self.env = env
        self.out = out
        self.steps = steps
        self.script = script
        self.args = ["--save-dir", str(env.save_dir), "--out", str(out), "--steps", str(steps),
                     "--step-idle", str(step_idle), "--save-storage-interval", str(save_storage_interval)]
        # plain_ddp.py's own options; another script (examples/fsdp2_train.py) passes its own in extra_args
        self.args += ["--grad-sync", "flat", "--peer-timeout", str(peer_timeout)] if script == SCRIPT else []
        self.args += extra_args or []
        self.port = free_port()
        # torchrun's c10d rendezvous gives the ranks to the nodes in the order of (address, launcher pid); on one
        # machine the pids alone decided, and a long run that wraps them (pid_max 32768) let a restarted node 1 take
        # ranks 0-1 at random (CI, 2026-12-01). An address of its own per node (all of 127/8 is loopback) fixes the
        # order; a test gives a replacement node a lower one to make it take the lower ranks (``lose_last_node``).
        self.addrs = {i: f"127.0.0.{i + 2}" for i in range(nodes)}
        self.shm = {i: Path(tempfile.mkdtemp(prefix=f"easyckpt-test-node{i}-", dir="/dev/shm")) for i in range(nodes)}
        self.node_env = node_env or {}
        # False: the ranks run without torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE, as under a launcher that does not
        # say where each rank sits (mpirun without Open MPI's variables, srun, Lightning's launcher across nodes)
        self.local_vars = local_vars
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        self.launches = 0
        out.mkdir(parents=True, exist_ok=True)

    def environ(self, node: int) -> dict[str, str]:
        return self.env.environ(EASYCKPT_NODE_ID=f"node{node}", EASYCKPT_SHM_DIR=str(self.shm[node]),
                                EASYCKPT_AGENT_ADDR="127.0.0.1", EASYCKPT_LOG_LEVEL="INFO",
                                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **self.node_env.get(node, {}))

    def start(self, node: int, *, max_restarts: int = 0) -> None:
        self.launches += 1
        log = self.out / f"node{node}-{self.launches}.log"
        self.logs[node] = log
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}", f"--node-rank={node}",
                   f"--nproc-per-node={self.ranks_per_node}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=multinode",
                   f"--rdzv-conf=is_host={1 if node == 0 else 0},{FAST_RENDEZVOUS}",
                   f"--local-addr={self.addrs[node]}", f"--max-restarts={max_restarts}"]
        command += [str(self.script)] if self.local_vars else \
            ["--no-python", "env", "-u", "LOCAL_RANK", "-u", "LOCAL_WORLD_SIZE", sys.executable, str(self.script)]
        command += self.args
        with open(log, "w") as handle:
            self.procs[node] = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                                env=self.environ(node), cwd=str(ROOT))
        if node == 0:
            wait_for(lambda: accepting(self.port) or self.procs[0].poll() is not None, 60,
                     "node 0's torchrun to host the rendezvous store")

    def start_agents(self) -> None:
        """The standalone mode: one agent per node, launched by their own 2-node torchrun."""
        port = free_port()
        procs = {}
        for node in range(self.nodes):
            command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}", f"--node-rank={node}",
                       "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                       "--rdzv-id=agents", f"--rdzv-conf=is_host={1 if node == 0 else 0}", "-m", "easyckpt_agent",
                       "--save-dir", str(self.env.save_dir), "--idle-timeout", "120"]
            log = open(self.out / f"agents-node{node}.log", "w")
            procs[node] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.environ(node),
                                           cwd=str(ROOT))
            log.close()
            if node == 0:
                wait_for(lambda: accepting(port) or procs[0].poll() is not None, 60,
                         "node 0's agent torchrun to host its rendezvous store")
        for node, proc in procs.items():
            assert proc.wait(timeout=120) == 0, (self.out / f"agents-node{node}.log").read_text()[-3000:]

    def start_all(self, *, max_restarts: int = 0) -> None:
        """Every node; node 0 may restart its workers when a lost node rejoins."""
        self.start(0, max_restarts=max(2, max_restarts))
        for node in range(1, self.nodes):
            self.start(node, max_restarts=max_restarts)

    def wait(self, node: int, timeout: float = 180) -> int:
        return self.procs[node].wait(timeout=timeout)

    def log(self, node: int) -> str:
        return self.logs[node].read_text()

    def agent_pid(self, node: int) -> int | None:
        path = self.env.runtime_dir / f"{job_id_for(self.env.save_dir)}@node{node}" / "agent.pid"
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() and not gone(int(text)) else None

    def losses(self, rank: int) -> dict[int, dict[str, Any]]:
        path = self.out / f"losses-rank{rank}.jsonl"
        rows: dict[int, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    row = json.loads(line)
                    rows[row["step"]] = row
        return rows

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def reached(self, step: int) -> bool:
        return all(any(s >= step for s in self.losses(rank)) for rank in range(self.world))

    def frozen(self, ranks: range | list[int]) -> bool:
        """Every one of ``ranks`` froze itself at its kill step (plain_ddp.py --kill-signal STOP)."""
        return all((self.out / f"killed-rank{rank}").exists() for rank in ranks)

    def resumes(self, rank: int) -> list[dict[str, Any]]:
        paths = sorted(self.out.glob(f"resume-rank{rank}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return [json.loads(p.read_text()) for p in paths]

    def expected_sources(self, reports: list[dict[str, Any]], lost: set[int]) -> list[str]:
        """Where each rank of the last resume must have loaded from, given the nodes lost whole.

        A rank's own snapshots are in the memory of the node it first ran on. torchrun's c10d rendezvous orders
        the nodes by (address, launcher pid), so a node that joins anew with a lower address takes the lower ranks
        (as a replacement machine whose name sorts first would): then the survivors run other ranks than they
        snapshotted and load them from replicas too, bit for bit the same."""
        lost_ids = {f"node{node}" for node in lost}
        first = {rank: self.resumes(rank)[0]["node"] for rank in range(self.world)}
        return ["memory" if report["node"] == first[rank] and report["node"] not in lost_ids else "replica"
                for rank, report in enumerate(reports)]

    def kill_node(self, node: int, *, wipe: bool = True) -> None:
        """Everything of the node dies at once, as when its machine goes away: torchrun, ranks, agent, memory."""
        # The node's processes, not ranks_of(node): after a restart torchrun may have given its ranks to another node.
        victims = [self.procs[node].pid] + [child.pid for child in psutil.Process(self.procs[node].pid).children(True)]
        agent = self.agent_pid(node)
        for pid in victims + ([agent] if agent else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[node].wait(timeout=30)
        wait_for(lambda: all(gone(pid) for pid in victims + ([agent] if agent else [])), 30, f"node {node} to die")
        if wipe:
            for path in self.shm[node].iterdir():
                path.unlink()

    def kill_agent(self, node: int) -> None:
        pid = self.agent_pid(node)
        assert pid is not None, f"node {node} has no agent"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: gone(pid), 30, f"node {node}'s agent to die")

    def cleanup(self) -> None:
        for log in self.env.runtime_dir.glob("*/agent.log"):  # kept next to the job's logs for post-mortems
            shutil.copy(log, self.out / f"agent-{log.parent.name.rsplit('@', 1)[-1]}.log")
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for rank in range(self.world):
            try:
                os.kill(int((self.out / f"pid-rank{rank}").read_text()), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
        for directory in self.shm.values():
            shutil.rmtree(directory, ignore_errors=True)
