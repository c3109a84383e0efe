"""Shared test fixtures: an isolated shm dir and runtime dir per test, agents cleaned up after.

Nothing here sleeps to synchronise: ``wait_for`` polls a condition against a deadline and fails
with a message naming what it waited for.
"""
from __future__ import annotations

import compileall
import contextlib
import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The benchmarks' shared helpers (tests/jobs/test_benchmarks.py loads the benchmarks, which import it as ``common``).
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import FAST_EXIT, poll  # noqa: E402

# Every process the tests start skips CPython's final garbage collection (tests/fast_exit/sitecustomize.py says why:
# about a second of CPU per process that imported torch)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAST_EXIT), os.environ.get("PYTHONPATH")) if p)

# --cpu-times=PATH: each test's wall and CPU time, to tell a test that waits from one that computes
pytest_plugins = ("cpu_times",)

_OWN_EXTENSIONS_DIR: list[str] = []
_CHILDREN_TMPDIR: list[str] = []


# Compiled once here for every process the tests start (ranks, agents, CLI runs): where PYTHONDONTWRITEBYTECODE is
# set, as on this project's VM, no process writes __pycache__, and each compiled easyckpt and the job scripts from
# source again: 0.21 CPU-s more per 2-rank 12-step job in torchrun and its workers (agent not counted; 8 pairs
# alternated on 2026-12-08, every one higher). pip compiled the installed packages; a file already compiled is
# only stat'ed, so this costs 0.4 s once, then nothing.
OWN_SOURCES = ("easyckpt", "easyckpt_agent", "easyckpt_wire", "tests", "examples", "benchmarks")


def pytest_configure(config: pytest.Config) -> None:
    for name in OWN_SOURCES:
        compileall.compile_dir(ROOT / name, quiet=2)
    # Every torchrun launch leaves a torchelastic_* folder in the temporary directory (torch's DefaultLogsSpecs makes
    # one per launch and never removes it): some 300 in /tmp after each run of the suite. The processes the tests
    # start get a temporary directory of this session's own, removed at its end; this process keeps /tmp (read
    # before TMPDIR changes, and cached by tempfile), so pytest's tmp_path folders stay for post-mortems.
    if not _CHILDREN_TMPDIR:
        tempfile.gettempdir()
        _CHILDREN_TMPDIR.append(tempfile.mkdtemp(prefix="easyckpt-test-tmp-"))
        os.environ["TMPDIR"] = _CHILDREN_TMPDIR[0]
    # DeepSpeed on CPU builds its shm op at start-up under TORCH_EXTENSIONS_DIR, guarded by a lock file that a build
    # killed midway leaves behind for good: every later DeepSpeed job, of this run or any later one, then waits in
    # FileBaton.wait until its test times out (2026-11-28: one slow build, then six tests). A fresh clone rebuilds
    # anyway (the venv's path is in the build command), so each test session builds in a directory of its own.
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="easyckpt-test-torch-extensions-")
        _OWN_EXTENSIONS_DIR.append(os.environ["TORCH_EXTENSIONS_DIR"])


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _OWN_EXTENSIONS_DIR + _CHILDREN_TMPDIR:
        shutil.rmtree(path, ignore_errors=True)


DEEPSPEED_BUILD_TIMEOUT = 600.0   # seconds; 282 s on this 2-vCPU VM beside a 3-job soak (2026-11-28), far less when quiet


@pytest.fixture(scope="session")
def deepspeed_cpu_ops() -> None:
    """DeepSpeed's CPU shm op, built once before the first DeepSpeed job: each rank would build it at start-up,
    inside the job's own deadline, and a build cut off there leaves its lock for every later job (above)."""
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"   # what each rank's init_distributed calls
    try:
        proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                              capture_output=True, text=True, timeout=DEEPSPEED_BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building DeepSpeed's CPU shm op in {os.environ['TORCH_EXTENSIONS_DIR']} took over "
                    f"{DEEPSPEED_BUILD_TIMEOUT:.0f}s (deepspeed_cpu_ops)")
    assert proc.returncode == 0, f"building DeepSpeed's CPU shm op failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


def seeded_random() -> random.Random:
    """The random source of a test's kill points and interleavings: EASYCKPT_TEST_SEED, or a fresh seed,
    printed either way so that a failure replays (``EASYCKPT_TEST_SEED=<seed> pytest ...``)."""
    seed = int(os.environ.get("EASYCKPT_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"EASYCKPT_TEST_SEED={seed}")
    return random.Random(seed)


def s3_endpoint_down(monkeypatch: pytest.MonkeyPatch) -> str:
    """Point S3 clients at 127.0.0.1 on a port where nothing listens (an object store that is down), one try per
    request and test credentials; returns that endpoint."""
    import socket

    with socket.socket() as probe:   # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for key, value in {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "EASYCKPT_S3_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, value)
    return endpoint


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    try:
        return poll(predicate, timeout, what, interval)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def gone(pid: int | None) -> bool:
    """True once ``pid`` has exited (a zombie counts: the agent may be a child of the test process)."""
    if pid is None:
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def agent_pids(runtime_dir: Path) -> list[int]:
    """Pids of running agents, found by their command line naming this test's runtime (via env)."""
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = proc.info["cmdline"] or []
            env = proc.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "easyckpt_agent" in cmd and "-m" in cmd and env.get("EASYCKPT_RUNTIME_DIR") == str(runtime_dir):
            pids.append(proc.info["pid"])
    return pids


class Env:
    """Where one test's job lives: its shm dir, runtime dir and save_dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.shm_dir = Path(tempfile.mkdtemp(prefix="easyckpt-test-", dir="/dev/shm"))
        # Short on purpose: ipc:// socket paths must stay under ~107 characters.
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="ec-", dir="/tmp"))
        self.save_dir = tmp_path / "ckpt"
        self.tmp_path = tmp_path

    def vars(self) -> dict[str, str]:
        # The agent log stays for the tests' post-mortems: an agent that ended cleanly would remove its runtime
        # directory, log included (tests/agent/test_shutdown.py unsets this to check that).
        return {"EASYCKPT_SHM_DIR": str(self.shm_dir), "EASYCKPT_RUNTIME_DIR": str(self.runtime_dir),
                "EASYCKPT_KEEP_AGENT_LOG": "1"}

    def environ(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.vars())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env["PYTHONFAULTHANDLER"] = "1"   # a hung job's processes print every thread's stack on SIGABRT (dump_stacks)
        env.update(extra)
        return env

    def job_dir(self) -> Path:
        dirs = [p for p in self.runtime_dir.iterdir() if p.is_dir()]
        assert len(dirs) == 1, f"expected one job dir in {self.runtime_dir}, found {dirs}"
        return dirs[0]

    def agent_pid(self) -> int | None:
        """The pid of the agent holding the job's lock, from its pid file (None if none runs)."""
        for job in self.runtime_dir.iterdir():
            try:
                text = (job / "agent.pid").read_text().strip()
            except FileNotFoundError:
                continue  # none, or an exiting agent removed it between our listing and the read
            if text.isdigit() and not gone(int(text)):
                return int(text)
        return None

    def agent_alive(self) -> bool:
        """Whether an agent of this test's job holds its lock (it drops the lock last, after its pid file)."""
        for job in self.runtime_dir.iterdir():
            try:
                fd = os.open(job / "agent.lock", os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            finally:
                os.close(fd)
        return False

    def wait_agent_gone(self) -> None:
        wait_for(lambda: not self.agent_alive(), 30, "the agent to exit (release its lock)")

    def slot_files(self) -> list[Path]:
        """The job's slot files (not the agent's control block)."""
        return [p for p in self.shm_files() if not p.name.endswith("-control")]

    def shm_files(self) -> list[Path]:
        """Every file the job keeps in shared memory: its slots and the agent's control block."""
        return sorted(self.shm_dir.glob("easyckpt-*"))

    def cleanup(self) -> None:
        for pid in agent_pids(self.runtime_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        for log in self.runtime_dir.glob("*/agent.log"):   # kept next to the test's files for post-mortems
            with contextlib.suppress(OSError):
                shutil.copy(log, self.tmp_path / f"agent-{log.parent.name}.log")
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    environment = Env(tmp_path)
    for key, value in environment.vars().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("EASYCKPT_JOB_ID", raising=False)
    monkeypatch.delenv("EASYCKPT_FAULT", raising=False)
    yield environment
    environment.cleanup()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """mount(options) -> a fresh tmpfs mount point; every mount is undone at teardown."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def wipe_memory(env: Env) -> None:
    """The node lost its memory: the agent is gone and so are the slot files."""
    pid = env.agent_pid()
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: gone(pid), 30, f"agent {pid} to die")
    env.wait_agent_gone()
    for path in env.slot_files():
        path.unlink()


def run_cli(*args: str, env: Env, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "easyckpt.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env.environ())


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Exact equality: same types at every node (tuple vs list, OrderedDict and its _metadata), same bits."""
    import numpy as np
    import torch

    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}._metadata"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def marker_iteration(save_dir: Path, step: int, *, under: str = "", **fields: Any) -> Path:
    """``iteration_N`` with nothing but a valid commit marker (``metadata.json``; ``fields`` added to it): complete
    in the eyes of listing, rotation, timelines and exporters, which never open its rank files."""
    import json

    from easyckpt_wire import layout

    path = save_dir / under / layout.iteration_dirname(step)
    path.mkdir(parents=True)
    (path / layout.METADATA).write_text(json.dumps({"format": layout.METADATA_FORMAT, "step": step,
                                                    "format_version": layout.METADATA_VERSION, **fields}))
    return path


def persisted_states(iteration: Path) -> list[Any]:
    """Each rank's state in a persisted iteration, in rank order, with every tensor an empty one: what the
    ranks' non-tensor entries (a framework's own records) say."""
    import torch

    from easyckpt.snapshot.state import unflatten
    from easyckpt_wire import layout

    store, key = layout.locate(iteration)
    meta = layout.metadata(store, key)
    common = layout.read_common(store, key, meta)   # checked against the marker's checksum
    return [unflatten(common["ranks"][rank]["skeleton"], [torch.zeros(0)] * len(meta["ranks"][rank]["tensors"]))
            for rank in sorted(common["ranks"], key=int)]


def _tracked(save_dir: Path) -> int:
    from easyckpt_wire import layout

    step = layout.read_tracker(save_dir)
    return -1 if step is None else step


def save_and_persist(ck: Any, env: Env, step: int, state: Any, metrics: dict[str, float] | None = None) -> Path:
    """Snapshot ``step`` and wait until the agent has it on disk; returns the iteration directory.

    The agent may still hold the other slot from the previous persist for a moment (its claim is
    released after the tracker update): then the snapshot is skipped, by design, and retried here.
    """
    from easyckpt_wire import layout

    wait_for(lambda: ck.save_if_needed(step, state, metrics=metrics), 30, f"a free slot for step {step}")
    ck.wait()
    path = env.save_dir / layout.iteration_dirname(step)
    wait_for(lambda: (path / layout.METADATA).is_file(), 60, f"{path}/{layout.METADATA} (persist of step {step})")
    # The tracker is written just after the rename (the commit point): a caller reads it next.
    wait_for(lambda: _tracked(env.save_dir) >= step, 60, f"the tracker to name step {step}")
    return path


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    """A 1-rank gloo process group in this process (DTensors on a 1-rank mesh), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def state_at(step: int) -> dict[str, Any]:
    """A small training state whose every tensor depends on ``step`` (so steps are distinguishable)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    model = OrderedDict(weight=torch.randn(4, 8, generator=gen), bias=torch.randn(4, generator=gen))
    optim = {"state": {0: {"exp_avg": torch.randn(4, 8, generator=gen)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return {"model": model, "optim": optim, "step": step}
