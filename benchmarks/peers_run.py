"""Launching one job of ``peers.py`` the way its system documents, and watching its memory.

A ``Job`` runs ``peers_job.py`` under ``torchrun`` (``dlrover-run`` for DLRover), on one node or on two simulated
ones, each launcher in a private /dev/shm (a mount namespace, when ``unshare`` is allowed) so that the job's
shared memory can be measured alone and a lost node's memory really goes. A sampler thread adds up, every
0.2 s, the anonymous resident memory of every process of the job (found by an environment tag, so that agents
and savers that left the launcher's tree count too) and the job's shared memory.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
from common import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RANKS = 2
PACKAGES = {"easyckpt": "easyckpt", "easyckpt_once": "easyckpt", "dlrover": "dlrover", "lm_resiliency": "lm-resiliency",
            "nvrx": "nvidia-resiliency-ext", "dcp": "torch", "none": "torch"}


@functools.cache
def private_shm_supported() -> bool:
    """Whether this user may give a process its own /dev/shm (root, or user namespaces)."""
    try:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                                "mount -t tmpfs -o size=1m peers-probe /dev/shm"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def versions(python: Path, system: str) -> dict[str, str]:
    code = ("import json, importlib.metadata as m, platform\n"
            "def v(n):\n    try: return m.version(n)\n    except Exception as e: return repr(e)\n"
            f"print(json.dumps({{'python': platform.python_version(), 'torch': v('torch'), "
            f"{PACKAGES[system]!r}: v({PACKAGES[system]!r})}}))")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {"error": repr(exc)}



def anon_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Job:
    """One launch (or two simulated nodes) of the benchmark job; ``work/out`` gets the ranks' reports."""

    def __init__(self, system: str, python: Path, work: Path, job_args: list[str], *, restarts: int = 0,
                 timeout: float = 900.0, nodes: int = 1) -> None:
        self.system, self.python, self.work, self.nodes = system, python, work, nodes
        self.out, self.ckpt = work / "out", work / "ckpt"
        self.job_args, self.restarts, self.timeout = job_args, restarts, timeout
        self.tag = uuid.uuid4().hex[:12]
        self.runtime = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))   # short: ipc socket paths
        self.port = free_port()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.launches = {n: 0 for n in range(nodes)}
        self.peak_bytes = 0
        self.peak_shm = 0
        self.wall_s = 0.0
        self.lingered = False   # the launcher outlived its finished ranks and was stopped
        self.rc: dict[int, int | None] = {}
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._shm_base = self._shm_used("/dev/shm")
        work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(exist_ok=True)

    # -- launching -----------------------------------------------------------------------------------------
    def command(self, node: int, extra: list[str]) -> list[str]:
        ckpt = self.ckpt / f"node{node}" if self.nodes > 1 and self.system in ("lm_resiliency", "nvrx") else self.ckpt
        job = [str(HERE / "peers_job.py"), "--system", self.system, "--out", str(self.out), "--ckpt-dir", str(ckpt),
               *self.job_args, *extra]
        if self.nodes > 1:
            launcher = [str(self.python), "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                        f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=peers-{self.tag}",
                        f"--rdzv-conf=is_host={1 if node == 0 else 0}",
                        f"--max-restarts={self.restarts if node == 0 else 0}"]
        elif self.system == "dlrover":
            launcher = [str(self.python), str(HERE / "peers_dlrover_run.py"), "--standalone",
                        f"--nproc_per_node={RANKS}", f"--max-restarts={self.restarts}"]
        else:
            launcher = [str(self.python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                        f"--max-restarts={self.restarts}"]
        if private_shm_supported():   # the namespace's /dev/shm starts empty: easyckpt's shm dir is made in it
            return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                    "mount -t tmpfs -o size=20g peers-shm /dev/shm && "
                    f'mkdir -p /dev/shm/peers-{self.tag}-node{node} && exec "$@"', "sh", *launcher, *job]
        Path(f"/dev/shm/peers-{self.tag}-node{node}").mkdir(exist_ok=True)
        return [*launcher, *job]

    def environ(self, node: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), PEERS_TAG=self.tag, PEERS_NODE=str(node),
                   PEERS_LAUNCH=str(self.launches[node]), EASYCKPT_RUNTIME_DIR=str(self.runtime),
                   EASYCKPT_SHM_DIR=f"/dev/shm/peers-{self.tag}-node{node}", EASYCKPT_NODE_ID=f"node{node}",
                   EASYCKPT_AGENT_ADDR="127.0.0.1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   EASYCKPT_KEEP_AGENT_LOG="1")
        env.pop("EASYCKPT_JOB_ID", None)
        return env

    def launch(self, node: int, extra: list[str]) -> None:
        log = open(self.work / f"node{node}-launch{self.launches[node]}.log", "wb")
        command = self.command(node, extra)
        self.procs[node] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.environ(node),
                                            cwd=str(ROOT), start_new_session=True)
        log.close()

    def run(self, extra: list[str] | None = None) -> None:
        started = time.monotonic()
        self._start_sampler()
        try:
            self.launch(0, extra or [])
            self.rc[0] = self._wait_launcher(self.procs[0], started)
        finally:
            self.stop()
            self.wall_s = time.monotonic() - started

    def _wait_launcher(self, proc: subprocess.Popen[bytes], started: float) -> int | None:
        """The launcher's exit code; 0 as well when every rank has finished and the launcher lingers past a grace
        period (dlrover-run sometimes waits on its master after a finished worker group), None on timeout."""
        finished_at = None
        while time.monotonic() - started < self.timeout:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if finished_at is None and len([r for r in self.reports() if "digest" in r]) >= RANKS:
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > 30:
                self.lingered = True
                return 0
        return None

    def start_nodes(self, kill: str) -> None:
        self._start_sampler()
        self._started = time.monotonic()
        self.launch(0, [])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # node 0's launcher hosts the rendezvous store
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.procs[0].poll() is not None:
                    break
                time.sleep(0.05)   # polling the port against a deadline
        self.launch(1, [kill])

    def ended(self, node: int) -> bool:
        return self.procs[node].poll() is not None

    def tagged(self, node: int | None = None) -> list[int]:
        pids = []
        for proc in psutil.process_iter(["pid", "environ"]):
            try:
                env = proc.info["environ"] or {}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if env.get("PEERS_TAG") == self.tag and (node is None or env.get("PEERS_NODE") == str(node)):
                pids.append(proc.info["pid"])
        return pids

    def kill_node(self, node: int) -> None:
        """Everything of the node at once, as when its machine goes: launcher, ranks, agents, its /dev/shm."""
        victims = set(self.tagged(node)) | {self.procs[node].pid}
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[node].wait(timeout=60)
        # its local disk goes with it (lm-resiliency and nvrx keep their files node-locally)
        shutil.rmtree(self.ckpt / f"node{node}", ignore_errors=True)
        deadline = time.monotonic() + 60
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in victims):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node}'s processes did not die within 60 s")
            time.sleep(0.05)   # polling against a deadline

    def restart_node(self, node: int) -> None:
        self.launches[node] += 1
        self.launch(node, [])

    def wait_all(self) -> None:
        deadline = time.monotonic() + self.timeout
        for node, proc in self.procs.items():
            try:
                self.rc[node] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.rc[node] = None
        self.wall_s = time.monotonic() - self._started

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=60)
        for pid in self.tagged():   # agents and savers that outlived their launcher
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None
        for log in self.runtime.glob("*/agent.log"):   # easyckpt's agents' logs stay with the job's for post-mortems
            shutil.copy(log, self.work / f"agent-{log.parent.name.rsplit('@', 1)[-1]}.log")
        shutil.rmtree(self.runtime, ignore_errors=True)

    # -- memory --------------------------------------------------------------------------------------------
    def _shm_used(self, path: str) -> int:
        try:
            st = os.statvfs(path)
        except OSError:
            return 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _start_sampler(self) -> None:
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        pids: list[int] = []
        refreshed = 0.0
        while not self._stop.wait(0.2):
            if time.monotonic() - refreshed > 1.0:
                pids = self.tagged()
                refreshed = time.monotonic()
            rss = sum(anon_rss(pid) for pid in pids)
            if private_shm_supported():
                shm = sum(self._shm_used(f"/proc/{p.pid}/root/dev/shm") for p in self.procs.values() if p.poll() is None)
            else:   # shared /dev/shm: what grew since the job started (other users' files count too)
                shm = max(0, self._shm_used("/dev/shm") - self._shm_base)
            self.peak_shm = max(self.peak_shm, shm)
            self.peak_bytes = max(self.peak_bytes, rss + shm)

    # -- results -------------------------------------------------------------------------------------------
    def reports(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.out.glob("rank*-launch*-attempt*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except ValueError:
                continue
        return found

    def read(self, name: str) -> Any:
        try:
            return json.loads((self.out / name).read_text())
        except (OSError, ValueError):
            return None

    def failed(self) -> bool:
        finals = [r for r in self.reports() if "digest" in r]
        return any(rc != 0 for rc in self.rc.values()) or len(finals) < RANKS

    def error(self) -> str:
        errors = [r["error"] for r in self.reports() if r.get("error")]
        if errors:
            return errors[0]
        logs = sorted(self.work.glob("node*-launch*.log"))
        tail = logs[-1].read_text(errors="replace")[-1500:] if logs else ""
        return f"launcher exit codes {self.rc}; log tail: {tail}"
