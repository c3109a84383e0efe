"""One soak job: simulated nodes on this machine, each its own ``torchrun`` with its own shared-memory directory,
runtime directory (so its own agent) and ``EASYCKPT_NODE_ID``, running one of the examples at full speed.

Only the product's public surface is used: the examples' options and output files (``losses-rank<r>.jsonl``,
``resume-rank<r>-<n>.json``, ``pid-rank<r>``), environment variables, the agent's pid file in its runtime
directory, the ``easyckpt`` CLI. Every wait polls against the job's one deadline; :class:`Hung` names what it
waited for.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from common import FAST_EXIT  # first on every job's PYTHONPATH: some 15% of the smoke's CPU is the exit it skips
from soak_plan import Config, Shape

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"plain": ROOT / "examples" / "plain_ddp.py", "hf": ROOT / "examples" / "hf_trainer.py"}
PEER_TIMEOUT = 3.0   # plain_ddp.py --peer-timeout: one request to another node's agent
POLL = 0.01
PASSED = ("EASYCKPT_LOG_LEVEL", "EASYCKPT_AGENT_LOG_LEVEL")   # taken from the soak's environment


class Hung(Exception):
    """The job's deadline passed while the soak waited for ``what``."""


_GIVEN: set[int] = set()
_GIVEN_LOCK = threading.Lock()


_PORTS = random.Random()   # which free port a job listens on changes nothing a seed decides


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default when it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, and never handed to another job of this soak (jobs may
    run side by side, ``--jobs``). Not a port the kernel picks (bind to 0): in the seconds before torchrun listens on
    it, another process's outgoing connection (an S3 client, a peer's socket) can be given the same port, and the
    relaunched node 0's torchrun then failed with EADDRINUSE (soak seed 1323, fault 26)."""
    low = ephemeral_low()
    with _GIVEN_LOCK:
        for _ in range(10_000):
            port = _PORTS.randrange(max(1024, low - 16384), low)
            if port in _GIVEN:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue   # a listener of someone else's
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port below {low} (the ephemeral range) that this soak has not used")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def signal_pid(pid: int | None, signum: signal.Signals) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


class Cluster:
    """``config.nodes`` simulated nodes sharing one save_dir ("shared storage") and one output directory."""

    def __init__(self, config: Config, root: Path, *, shape: Shape, deadline: float, disk: Path | None = None,
                 store: Any = None) -> None:
        """``disk``: a tmpfs to put save_dir on; ``store``: a ``soak_store.JobStore`` whose ``s3://`` URL is the
        save_dir instead (plain jobs), reached through its fault proxy."""
        self.config = config
        self.shape = shape
        self.deadline = deadline
        self.root = root
        self.out = root / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        base = disk or root
        steps = shape.last - shape.first + 1
        self.store = store
        if config.api == "plain":
            self.save_dir = base / "ckpt"
            self.location = store.url if store is not None else str(self.save_dir)   # what the job and the CLI get
            self.args = ["--save-dir", self.location, "--out", str(self.out), "--steps", str(steps),
                         "--save-storage-interval", str(shape.interval), "--max-ckpt-num", "2",
                         "--grad-sync", "flat", "--peer-timeout", str(PEER_TIMEOUT)]
        else:
            if store is not None:
                raise ValueError("an s3:// save_dir is for plain jobs: the HF example writes under --output-dir")
            self.save_dir = base / "hf" / "easyckpt"
            self.location = str(self.save_dir)
            self.args = ["--output-dir", str(base / "hf"), "--out", str(self.out), "--steps", str(steps),
                         "--save-steps", str(shape.interval), "--save-total-limit", "2", "--max-ckpt-num", "2",
                         "--resume"]
        tag = root.name
        self.shm = {n: Path(tempfile.mkdtemp(prefix=f"easyckpt-soak-{tag}-n{n}-", dir="/dev/shm"))
                    for n in range(config.nodes)}
        # Short: the agent's ipc:// socket path lives under it (about 107 characters at most)
        self.runtime = {n: Path(tempfile.mkdtemp(prefix="ecs-", dir="/tmp")) for n in range(config.nodes)}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.launches = 0
        self.port = free_port()
        self.rdzv = 0
        # torchrun's c10d rendezvous gives the ranks to the nodes in the order of (address, launcher pid): with one
        # address for all, a restarted node took the lower ranks whenever the pids wrapped. An address of its own per
        # node (all of 127/8 is loopback) fixes the order; ``lead_with`` gives one node the lowest.
        self.addrs = {n: self.address(n) for n in range(config.nodes)}

    @staticmethod
    def address(node: int) -> str:
        return f"127.0.0.{node + 2}"

    def lead_with(self, node: int) -> None:
        """Before the start: ``node`` runs ranks 0 and up, so its agent leads the job (decides the job-wide steps and
        commits every checkpoint). A replacement started after ``kill_node`` rejoins at its own address, after the
        other nodes', and they then run the ranks it ran."""
        self.addrs[node] = "127.0.0.1"

    # launching ------------------------------------------------------------------------------------------
    def environ(self, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        # The soak's own settings only (a stray EASYCKPT_FAULT would strike every job), but the log levels
        env = {k: v for k, v in os.environ.items() if not k.startswith("EASYCKPT_") or k in PASSED}
        env.setdefault("EASYCKPT_LOG_LEVEL", "INFO")
        env.update(EASYCKPT_NODE_ID=f"node{node}", EASYCKPT_SHM_DIR=str(self.shm[node]),
                   EASYCKPT_RUNTIME_DIR=str(self.runtime[node]), EASYCKPT_AGENT_ADDR="127.0.0.1",
                   EASYCKPT_KEEP_AGENT_LOG="1", EASYCKPT_STACKS_ON_SIGUSR2="1",
                   # torch's shared rendezvous store hands restarted workers the previous attempt's gloo
                   # addresses (pytorch/pytorch#135712); a store of their own per attempt avoids that
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join(p for p in (str(FAST_EXIT), str(ROOT), os.environ.get("PYTHONPATH"))
                                              if p))
        env.update(self.store.environ() if self.store is not None else {})
        env.update(extra or {})
        return env

    def start(self, node: int, *, max_restarts: int = 2, env: dict[str, str] | None = None) -> None:
        self.launches += 1
        log = self.out / f"node{node}-{self.launches}.log"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.config.nodes}",
                   f"--node-rank={node}", f"--nproc-per-node={self.config.ranks_per_node}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=soak{self.rdzv}",
                   # a lost node leaves the rendezvous after 5 missed 1 s heartbeats, not torchrun's 3 x 5 s: the
                   # survivors restart 10 s sooner (tests/multinode.py says why)
                   f"--rdzv-conf=is_host={1 if node == 0 else 0},keep_alive_interval=1,keep_alive_max_attempt=5",
                   f"--local-addr={self.addrs[node]}", f"--max-restarts={max_restarts}",
                   str(SCRIPTS[self.config.api]), *self.args]
        with open(log, "w") as handle:
            self.procs[node] = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                                env=self.environ(node, env), cwd=str(ROOT))

    def start_all(self, *, env: dict[int, dict[str, str]] | None = None, fresh: bool = False,
                  max_restarts: int = 2) -> None:
        """Every node; ``fresh``: a new rendezvous (the whole job was lost and is launched again)."""
        if fresh:
            self.port, self.rdzv = free_port(), self.rdzv + 1
        for node in range(self.config.nodes):
            self.start(node, env=(env or {}).get(node), max_restarts=max_restarts)

    # watching -------------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def wait_until(self, predicate: Callable[[], Any], what: str, limit: float | None = None) -> Any:
        """Poll ``predicate`` until truthy; Hung when the job's deadline (or ``limit`` seconds) passes first."""
        end = min(self.deadline, time.monotonic() + limit) if limit is not None else self.deadline
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > end:
                raise Hung(what)
            time.sleep(POLL)   # polling interval against a deadline, not a synchronisation

    def ended(self) -> bool:
        return all(proc.poll() is not None for proc in self.procs.values())

    def wait_all(self) -> dict[int, int]:
        self.wait_until(self.ended, "every node's torchrun to exit")
        return {node: proc.returncode for node, proc in self.procs.items()}

    def ranks_of(self, node: int) -> range:
        """The ranks ``node`` runs in the current rendezvous round: the nodes take them in the order of their
        addresses."""
        place = sorted(self.addrs, key=lambda n: ipaddress.ip_address(self.addrs[n])).index(node)
        return range(place * self.config.ranks_per_node, (place + 1) * self.config.ranks_per_node)

    def rows(self, rank: int) -> list[dict[str, Any]]:
        path = self.out / f"losses-rank{rank}.jsonl"
        try:
            text = path.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def newest(self, rank: int) -> int | None:
        rows = self.rows(rank)
        return max(row["step"] for row in rows) if rows else None

    def newest_all(self) -> int:
        """The newest step any rank logged (the work a fault can cost is counted from it)."""
        return max((s for s in (self.newest(r) for r in range(self.config.world)) if s is not None),
                   default=self.shape.first - 1)

    def reached(self, step: int, ranks: range | list[int] | None = None) -> bool:
        ranks = range(self.config.world) if ranks is None else ranks
        return all((self.newest(r) or -1) >= step for r in ranks)

    def wait_step(self, step: int, ranks: range | list[int] | None = None) -> None:
        self.wait_until(lambda: self.reached(step, ranks) or self.ended(), f"the ranks to log step {step}")
        if not self.reached(step, ranks):
            raise RuntimeError(f"the job ended before step {step}: {self.tail()}")

    def resumes(self, rank: int) -> list[dict[str, Any]]:
        paths = sorted(self.out.glob(f"resume-rank{rank}-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        return [json.loads(p.read_text()) for p in paths]

    def rank_pid(self, rank: int) -> int | None:
        try:
            text = (self.out / f"pid-rank{rank}").read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() and not gone(int(text)) else None

    def agent_pid(self, node: int) -> int | None:
        for path in self.runtime[node].glob("*/agent.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(path.read_text().strip())
                if not gone(pid):
                    return pid
        return None

    def stopped(self, pid: int | None) -> bool:
        try:
            return pid is not None and psutil.Process(pid).status() == psutil.STATUS_STOPPED
        except psutil.NoSuchProcess:
            return False

    def tail(self, chars: int = 2500) -> str:
        logs = sorted(self.out.glob("node*-*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace")[-chars:] if logs else "(no log)"

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.out.glob("node*-*.log")))

    # faults ---------------------------------------------------------------------------------------------
    def node_pids(self, node: int) -> list[int]:
        """Everything a node runs: its launcher, its ranks and whatever they started (the agent included)."""
        pids = []
        for proc in psutil.process_iter(["pid", "environ"]):
            with contextlib.suppress(psutil.Error):
                if (proc.info["environ"] or {}).get("EASYCKPT_RUNTIME_DIR") == str(self.runtime[node]):
                    pids.append(proc.info["pid"])
        return pids

    def kill_node(self, node: int, *, wipe: bool) -> None:
        """The node's machine goes away at once: every process SIGKILLed, its shared memory gone if ``wipe``."""
        victims = self.node_pids(node)
        for pid in victims:
            signal_pid(pid, signal.SIGKILL)
        self.procs[node].wait(timeout=max(1.0, self.left()))
        self.wait_until(lambda: all(gone(pid) for pid in victims), f"node {node}'s processes to die")
        if wipe:
            for path in self.shm[node].iterdir():
                path.unlink()
        self.addrs[node] = self.address(node)   # its replacement is another machine

    def kill_launchers_and_ranks(self) -> None:
        """Every rank of the job dies (and its launcher), the agents and their memory live on."""
        pids = [self.procs[n].pid for n in self.procs] + [p for r in range(self.config.world)
                                                          if (p := self.rank_pid(r)) is not None]
        for pid in pids:
            signal_pid(pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(timeout=max(1.0, self.left()))
        self.wait_until(lambda: all(gone(pid) for pid in pids), "the ranks to die")

    def status(self, node: int) -> list[dict[str, Any]] | None:
        """``easyckpt status --json`` as the node sees it (None when its agent does not answer)."""
        proc = subprocess.run([sys.executable, "-m", "easyckpt.cli", "status", "--save-dir", self.location,
                               "--json"], capture_output=True, text=True, env=self.environ(node),
                              timeout=max(5.0, min(60.0, self.left())))
        try:
            report = json.loads(proc.stdout)
        except json.JSONDecodeError:
            return None
        return report if isinstance(report, list) else None

    def verify(self) -> tuple[bool, str]:
        proc = subprocess.run([sys.executable, "-m", "easyckpt.cli", "verify", self.location],
                              capture_output=True, text=True, env=self.environ(0),
                              timeout=max(5.0, min(120.0, self.left())))
        return proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]

    # the end ----------------------------------------------------------------------------------------------
    def leftovers(self) -> tuple[list[str], list[str]]:
        """Processes of this job still running, files it left in its shared-memory directories."""
        procs = []
        runtimes = {str(p) for p in self.runtime.values()}
        for proc in psutil.process_iter(["pid", "environ", "cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                if (proc.info["environ"] or {}).get("EASYCKPT_RUNTIME_DIR") in runtimes \
                        and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    procs.append(f"{proc.info['pid']} {' '.join(proc.info['cmdline'] or [])[:400]}")
        files = [str(p) for d in self.shm.values() if d.exists() for p in d.iterdir()]
        return procs, files

    def kept(self) -> set[str]:
        """Shared-memory directories an agent said it keeps on purpose (the newest step is only in memory after a
        failed final persist: nothing lost), read from the agents' logs."""
        said = set()
        for log in (p for runtime in self.runtime.values() for p in runtime.glob("*/agent.log")):
            with contextlib.suppress(OSError):
                said |= set(re.findall(r"so the job's slots are kept in (\S+)", log.read_text(errors="replace")))
        return said

    def wait_clean(self, grace: float, *, kept: bool = False) -> tuple[list[str], list[str]]:
        """After a job ends its agents exit and remove their slots: what is still there after ``grace``. With
        ``kept``, an agent that said it keeps its node's slots (a failed final persist: the newest step is only in
        memory) is no leftover, nor are those slots: the wait ends once everything else is gone, not after the
        whole grace."""
        end = time.monotonic() + grace
        while True:
            procs, files = self.leftovers()
            if kept:
                dirs = self.kept()
                files = [f for f in files if str(Path(f).parent) not in dirs]
                # an agent whose ranks died (not closed) keeps them for their restart, agent_idle_timeout long
                procs = [p for p in procs if not any(f"--shm-dir {d}" in p for d in dirs)]
            if (not procs and not files) or time.monotonic() > end:
                return procs, files
            time.sleep(0.05)   # polling interval against a deadline

    def dump_stacks(self, limit: float = 5.0) -> list[str]:
        """Every live process of the job writes its threads' stacks to its log (SIGUSR2: ``tests/fast_exit``), for
        a job that hangs; returns each one's pid, command and state as found (a stopped one is continued first, so
        its state is said here). Waits, at most ``limit`` seconds, until the logs hold a stack from each of them."""
        def stacks() -> int:
            agents = "".join(log.read_text(errors="replace") for runtime in self.runtime.values()
                             for log in runtime.glob("*/agent.log"))
            return (self.logs() + agents).count("(most recent call first)")

        before, found = stacks(), []
        for pid in (pid for node in range(self.config.nodes) for pid in self.node_pids(node)):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                found.append(f"{pid} {proc.status()} {' '.join(proc.cmdline()[1:4])}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)   # a stopped process cannot write
                os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + limit
        while stacks() - before < len(found) and time.monotonic() < deadline:
            time.sleep(0.05)   # polling the logs against the deadline above
        return found

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
        for node in range(self.config.nodes):
            for pid in self.node_pids(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                signal_pid(pid, signal.SIGKILL)
        for node, runtime in self.runtime.items():
            for log in runtime.glob("*/agent.log"):   # kept with the job's files for post-mortems
                with contextlib.suppress(OSError):
                    shutil.copy(log, self.out / f"agent-node{node}.log")
            shutil.rmtree(runtime, ignore_errors=True)
        for directory in self.shm.values():
            shutil.rmtree(directory, ignore_errors=True)
