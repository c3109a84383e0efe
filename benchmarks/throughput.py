"""Throughput of each easyckpt data path against the raw limit measured in the same run, same state.

    python benchmarks/throughput.py --sizes-mb 200 1000 --repeats 3 --out benchmarks/results/throughput-cpu.json
    python benchmarks/throughput.py --device cuda --sizes-mb 200 1000 --out benchmarks/results/throughput-cuda.json

For each state size (GPT-like: MLP blocks plus AdamW's two moments, as in blocking.py) four paths are
timed, each next to its raw limit; the headline is the ratio of the two throughputs (bytes/second):

1. snapshot copy: ``save_if_needed`` + ``wait()`` (after two warm-up snapshots that allocate and touch
   both slots) vs a plain ``dst.copy_(src)`` of the same tensors into preallocated, touched CPU
   buffers (on CUDA: pinned host buffers, device-to-host ``copy_`` then synchronize); the two are timed
   in turn, ``--copy-repeats`` times each, so both see the same machine load.           target >= 0.90
2. persist: a real agent (``save_storage_interval=1``) writes the snapshot; seconds and bytes come from
   its ``log_file_path`` line. Raw: the same byte count written sequentially in 64 MiB writes from a
   touched buffer to one file in the same directory, then fsync (one stream: an agent writing its
   files in parallel can beat it on some disks, so a ratio above 1 is possible).           target >= 0.85
3. recovery from memory: ``load()`` in a new process, while the writer still holds its slots, into a
   touched state of the same structure (the usual ``load(model/optim state)`` resume). Raw: in a new
   process, mmap the slot file and copy every byte, as 8-byte words, into a touched buffer (on CUDA: a
   GPU buffer); the munmap is not counted, as load() keeps its mapping.
4. recovery from disk: after the agent persisted and the job closed (slots unlinked), every file of
   the iteration is fsynced and dropped from the page cache with posix_fadvise(DONTNEED), then
   ``load()`` runs in a new process. Raw: the same files, dropped the same way, read with plain
   ``readinto`` calls into a touched host buffer. Dropping the cache is BEST EFFORT (a no-op on tmpfs,
   and the kernel may keep pages); the fraction of the files still resident is measured with mincore
   and reported.

Every recovery run is a fresh process (Python and torch start-up not counted); load and raw runs
alternate. Recovery has no target: the ratio is reported. Each timed run is kept in the JSON
(``*_runs_s``); the table shows medians. Absolute figures hold only for the machine named.
``--dim 128 --sizes-mb 3`` gives a ~2 MB state for smoke runs (at the default dim one layer is ~100 MB).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.util
import json
import mmap
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import poll, write_result

import easyckpt
from easyckpt.snapshot.state import flatten
from easyckpt_wire import layout, owner
from easyckpt_wire.shm import shm_dir

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
CHUNK = 64 << 20
TARGETS = {"snapshot_copy": 0.90, "persist": 0.85, "recovery_memory": None, "recovery_disk": None}
CACHE_NOTE = ("page-cache drop is best effort: fsync + posix_fadvise(POSIX_FADV_DONTNEED) on every file of the "
              "iteration before each cold read; 'resident_after_drop' is the fraction mincore still saw cached")
_LOG_RE = re.compile(r"persisted step=(?P<step>\d+) ranks=(?P<ranks>\d+) bytes=(?P<bytes>\d+) .*?"
                     r"seconds=(?P<seconds>[0-9.]+) GB/s=(?P<gbps>\S+)")


def _blocking() -> Any:
    """blocking.py of this directory (for ``gpt_like_state``), loaded by path: benchmarks/ is no package."""
    spec = importlib.util.spec_from_file_location("easyckpt_bench_blocking", BENCH_DIR / "blocking.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PATHS = ("copy", "memory", "disk")   # --paths: the snapshot copy; load from memory; persist and load from disk


def to_device(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_state(size_mb: float, device: str, dim: int = 1024) -> dict[str, Any]:
    state = to_device(_blocking().gpt_like_state(size_mb, dim=dim), device)
    sync(device)
    return state


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def touched(nbytes: int, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    buffer = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device, pin_memory=pin)
    buffer.fill_(1)  # every page written once: no page faults in the timed part
    sync(device)
    return buffer


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median ``seconds`` (the upper one of an even count), with its other fields."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def entry(name: str, easy_bytes: int, easy_runs: list[float], raw_bytes: int, raw_runs: list[float],
          **extra: Any) -> dict[str, Any]:
    """Medians of both sides, their throughputs, and the ratio (easyckpt / raw); every run kept."""
    easy_s, raw_s = statistics.median(easy_runs), statistics.median(raw_runs)
    easy_gbps, raw_gbps = easy_bytes / easy_s / 1e9, raw_bytes / raw_s / 1e9
    return {"easyckpt_bytes": easy_bytes, "easyckpt_s": easy_s, "easyckpt_gbps": easy_gbps,
            "raw_bytes": raw_bytes, "raw_s": raw_s, "raw_gbps": raw_gbps, "ratio": easy_gbps / raw_gbps,
            "target": TARGETS[name], "easyckpt_runs_s": easy_runs, "raw_runs_s": raw_runs, **extra}


# page cache -----------------------------------------------------------------------------------------
def drop_cache(paths: list[Path]) -> None:
    """fsync then POSIX_FADV_DONTNEED every file: best effort, the kernel decides."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore); None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page, total, resident = mmap.PAGESIZE, 0, 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(address), size, vec) != 0:
                    return None
                resident += sum(v & 1 for v in vec)
                total += pages
            finally:
                libc.munmap(ctypes.c_void_p(address), size)
        finally:
            os.close(fd)
    return resident / total if total else None


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or 'unknown'."""
    best, kind = "", "unknown"
    try:
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


# child processes --------------------------------------------------------------------------------------
_CHILD = ("import importlib.util, json, sys\n"
          "spec = importlib.util.spec_from_file_location('easyckpt_bench_throughput_child', sys.argv[1])\n"
          "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
          "print('RESULT ' + json.dumps(getattr(module, sys.argv[2])(json.loads(sys.argv[3]))), flush=True)\n")


def in_child(function: str, args: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """Run ``function(args)`` of this file in a new Python process; returns its JSON result."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(BENCH_DIR), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).resolve()), function, json.dumps(args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{function} in a child process failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def child_load(args: dict[str, Any]) -> dict[str, Any]:
    """Child: a reader Checkpointer (no agent) times ``load()`` into a touched state of the same structure."""
    device = args["device"]
    template = make_state(args["size_mb"], device, args["dim"])
    ck = easyckpt.Checkpointer(args["save_dir"], 1, 10**9, 1, start_agent=False)
    try:
        start = time.perf_counter()
        result = ck.load(template)
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        ck.close()
    if result.source != args["source"] or result.step != args["step"]:
        raise RuntimeError(f"expected step {args['step']} from {args['source']}, load() gave step {result.step} "
                           f"from {result.source} ({result.path})")
    return {"seconds": seconds, "reported_seconds": result.seconds, "nbytes": result.nbytes, "path": result.path}


def child_raw_memory(args: dict[str, Any]) -> dict[str, Any]:
    """Child: mmap the slot file and copy every byte into a touched buffer on the target device."""
    device, path = args["device"], args["path"]
    size = os.path.getsize(path)
    word = torch.int64 if size % 8 == 0 else torch.uint8  # slot files are page-sized: copied as 8-byte words
    buffer = touched(size, device).view(word)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable
            source = torch.frombuffer(mm, dtype=torch.uint8).view(word)
        buffer.copy_(source)
        sync(device)
        seconds = time.perf_counter() - start  # load() keeps its mapping too: the munmap is not counted
        del source
        mm.close()
    finally:
        os.close(fd)
    return {"seconds": seconds, "nbytes": size}


def child_raw_disk(args: dict[str, Any]) -> dict[str, Any]:
    """Child: read every byte of the files with plain readinto calls (64 MiB) into a touched host buffer."""
    paths = [Path(p) for p in args["paths"]]
    total = sum(p.stat().st_size for p in paths)
    view = memoryview(touched(total).numpy())
    start = time.perf_counter()
    position = 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while True:
                got = handle.readinto(view[position:position + CHUNK])
                if not got:
                    break
                position += got
    seconds = time.perf_counter() - start
    if position != total:
        raise RuntimeError(f"read {position} bytes of {total}")
    return {"seconds": seconds, "nbytes": total}


# the four measurements --------------------------------------------------------------------------------
class RawCopy:
    """The limit for the snapshot: ``dst.copy_(src)`` per tensor into preallocated, touched host buffers."""

    def __init__(self, values: list[torch.Tensor], device: str) -> None:
        self.values, self.device, self.pin = values, device, device == "cuda"
        self.dst = [touched(v.numel() * v.element_size(), "cpu", self.pin).view(v.dtype).view(v.shape)
                    if v.numel() else torch.empty(v.shape, dtype=v.dtype) for v in values]
        self()  # warm-up

    def __call__(self) -> float:
        start = time.perf_counter()
        for target, value in zip(self.dst, self.values):
            target.copy_(value, non_blocking=self.pin)
        sync(self.device)
        return time.perf_counter() - start


def measure_memory(state: dict[str, Any], size_mb: float, dim: int, nbytes: int, repeats: int, copy_repeats: int,
                   directory: Path, device: str, copy_threads: int = 1, cuda_copy_streams: int = 2,
                   recovery: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """Snapshot copy vs raw copy; then load() from memory in new processes while the writer holds its slots."""
    values = [v for v in flatten(state)[2] if isinstance(v, torch.Tensor)]
    ck = easyckpt.Checkpointer(directory / "mem", 1, 10**9, 1, start_agent=False, copy_threads=copy_threads,
                               cuda_copy_streams=cuda_copy_streams)
    try:
        raw_copy = RawCopy(values, device)
        times, raw_times = [], []
        first_round = ck.slots.count   # each slot's first use allocates, touches (and on CUDA pins) it: untimed
        last = first_round - 1 + copy_repeats
        for step in range(last + 1):
            ck.wait()
            start = time.perf_counter()
            if not ck.save_if_needed(step, state):
                raise RuntimeError(f"snapshot of step {step} skipped with no agent running: {ck.stats()}")
            ck.wait()
            if step >= first_round:
                times.append(time.perf_counter() - start)
                raw_times.append(raw_copy())  # interleaved: both see the same machine load
        del raw_copy
        skipped = ck.stats()["skipped"]
        copy = entry("snapshot_copy", nbytes, times, nbytes, raw_times, skipped=skipped,
                     cuda_copy_streams=cuda_copy_streams)
        if not recovery:
            return copy, None, skipped
        index, _header = ck.slots.committed()[last]
        slot_file = ck.slots.path(index)
        # The readers stand in for a restarted rank, which finds its predecessor gone: the writer gives up
        # ownership of the rank (it keeps its slots mapped), or a reader would refuse the busy save_dir.
        owner.release(ck.agent.job_dir, ck.rank)
        loads, raws = [], []
        for run in range(repeats):
            for which in (("load", "raw") if run % 2 == 0 else ("raw", "load")):  # alternate: no order bias
                if which == "load":
                    loads.append(in_child("child_load", {"device": device, "size_mb": size_mb, "dim": dim,
                                                         "source": "memory", "save_dir": str(ck.config.save_dir),
                                                         "step": last}))
                else:
                    raws.append(in_child("child_raw_memory", {"device": device, "path": str(slot_file)}))
        memory = entry("recovery_memory", loads[0]["nbytes"], [r["seconds"] for r in loads], raws[0]["nbytes"],
                       [r["seconds"] for r in raws], load_reported_s=median_run(loads)["reported_seconds"],
                       slot_file=str(slot_file))
    finally:
        ck.close()
        for path in ck.slots.directory.glob(f"easyckpt-{ck.config.job_id}-*"):
            path.unlink()  # no agent ran to clean up after this job
    return copy, memory, skipped


def read_persist_line(log_file: Path, step: int) -> dict[str, Any] | None:
    try:
        text = log_file.read_text()
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        match = _LOG_RE.search(line)
        if match and int(match["step"]) == step:
            return {"step": step, "ranks": int(match["ranks"]), "bytes": int(match["bytes"]),
                    "seconds": float(match["seconds"]), "gbps": match["gbps"], "line": line.strip()}
    return None


def raw_write(path: Path, nbytes: int, source: torch.Tensor) -> float:
    chunk = memoryview(source.numpy())
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def measure_disk(state: dict[str, Any], size_mb: float, dim: int, repeats: int, directory: Path, device: str,
                 persist_timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """A real agent persists ``repeats`` snapshots (vs raw writes); then cold load() from disk vs raw reads."""
    base = directory / f"disk-{size_mb:g}MB"  # one job per size: its own save_dir, slots and log
    save_dir, log_file = base / "ckpt", base / "persist.log"
    ck = easyckpt.Checkpointer(save_dir, 1, 1, 2, log_file_path=str(log_file), start_agent=True, close_timeout=300)
    job, shm = ck.config.job_id, ck.slots.directory
    source = touched(CHUNK)
    persists, writes = [], []
    closed = False
    try:
        for step in range(repeats):
            # The agent may hold the other slot a moment longer (its claim ends after the tracker update):
            # the snapshot is then skipped, by design, and tried again.
            poll(lambda step=step: ck.save_if_needed(step, state), 60, f"a free slot for step {step}")
            ck.wait()
            persists.append(poll(lambda step=step: read_persist_line(log_file, step), persist_timeout,
                                 f"the agent's log line for step {step} in {log_file}"))
            writes.append(raw_write(save_dir / "raw-write.bin", persists[-1]["bytes"], source))
        ck.close()
        closed = True
        poll(lambda: not list(shm.glob(f"easyckpt-{job}-*")), 60, "the agent to unlink the job's slots")
        poll(lambda: not ck.agent.alive(), 60, "the agent to exit")  # the readers below must not meet it
    finally:
        if not closed:
            ck.close()
            try:
                poll(lambda: not list(shm.glob(f"easyckpt-{job}-*")), 30, "the agent to unlink the job's slots")
            except TimeoutError:
                for path in shm.glob(f"easyckpt-{job}-*"):
                    path.unlink(missing_ok=True)
    del source
    persist = median_run(persists)
    seconds = [p["seconds"] or 0.00005 for p in persists]  # the log has 0.1 ms resolution
    persist_entry = entry("persist", persist["bytes"], seconds, persist["bytes"], writes,
                          log_line=persist["line"], log_seconds_resolution=0.0001)

    iteration = save_dir / layout.iteration_dirname(repeats - 1)
    files = sorted(p for p in iteration.iterdir() if p.is_file())
    loads, raws, resident = [], [], []
    for run in range(repeats):
        for which in (("load", "raw") if run % 2 == 0 else ("raw", "load")):  # alternate: no order bias
            drop_cache(files)
            resident.append(resident_fraction(files))
            if which == "load":
                loads.append(in_child("child_load", {"device": device, "size_mb": size_mb, "dim": dim,
                                                     "save_dir": str(save_dir), "source": "disk", "step": repeats - 1}))
            else:
                raws.append(in_child("child_raw_disk", {"paths": [str(p) for p in files]}))
    known = [r for r in resident if r is not None]
    disk = entry("recovery_disk", loads[0]["nbytes"], [r["seconds"] for r in loads], raws[0]["nbytes"],
                 [r["seconds"] for r in raws], load_reported_s=median_run(loads)["reported_seconds"],
                 files=len(files), resident_after_drop=max(known) if known else None, cache_drop="best effort")
    return persist_entry, disk


def measure(size_mb: float, dim: int, repeats: int, copy_repeats: int, directory: Path, device: str,
            persist_timeout: float, copy_threads: int = 1, cuda_copy_streams: int = 2,
            paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    state = make_state(size_mb, device, dim)
    _, refs, _ = flatten(state)
    nbytes = sum(ref.nbytes for ref in refs)
    copy, memory, skipped = measure_memory(state, size_mb, dim, nbytes, repeats, copy_repeats, directory, device,
                                           copy_threads, cuda_copy_streams, recovery="memory" in paths)
    persist, disk = measure_disk(state, size_mb, dim, repeats, directory, device, persist_timeout) \
        if "disk" in paths else (None, None)
    return {"bytes": nbytes, "tensors": len(refs), "snapshot_copy": copy, "persist": persist,
            "recovery_memory": memory, "recovery_disk": disk, "snapshot_skipped": skipped}


def machine(device: str, directory: Path) -> dict[str, Any]:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__, "device": device,
            "python": platform.python_version(), "dir": str(directory), "dir_fs": fs_type(directory),
            "shm_dir": str(shm_dir()), "shm_fs": fs_type(shm_dir())}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[200.0, 1000.0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of persist and recovery, each in fresh processes (median reported)")
    parser.add_argument("--copy-repeats", type=int, default=10, help="timed snapshot copies (median reported)")
    parser.add_argument("--dim", type=int, default=1024,
                        help="hidden size of the GPT-like state (one layer is ~100 MB at 1024; use e.g. 128 for tiny runs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    parser.add_argument("--copy-threads", type=int, default=1, help="easyckpt's CPU copy threads")
    parser.add_argument("--cuda-copy-streams", type=int, default=2, help="easyckpt's CUDA copy streams")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="which paths to measure (the snapshot copy always runs; at the largest sizes the "
                             "persist and the loads take minutes)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="parent of the temporary save_dirs (default: the system temp dir); "
                             "put it on the disk to measure")
    parser.add_argument("--persist-timeout", type=float, default=600.0, help="seconds to wait for one persist")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.copy_repeats < 1:
        parser.error("--repeats and --copy-repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="easyckpt-throughput-") as tmp:
        directory = Path(tmp)
        info = machine(args.device, directory)
        rows = [measure(size, args.dim, args.repeats, args.copy_repeats, directory, args.device, args.persist_timeout,
                        args.copy_threads, args.cuda_copy_streams, tuple(args.paths)) for size in args.sizes_mb]
    names = {"snapshot_copy": "snapshot copy", "persist": "persist", "recovery_memory": "recovery (memory)",
             "recovery_disk": "recovery (disk)"}
    print(f"{'MB':>8} {'path':<18} {'easyckpt s':>11} {'GB/s':>7} {'raw s':>9} {'raw GB/s':>9} {'ratio':>6} {'target':>7}")
    for row in rows:
        for key, name in names.items():
            cell = row[key]
            if cell is None:
                continue
            target = cell["target"]
            verdict = "" if target is None else (f">={target:.2f} " + ("ok" if cell["ratio"] >= target else "MISS"))
            print(f"{row['bytes'] / 1e6:8.0f} {name:<18} {cell['easyckpt_s']:11.4f} {cell['easyckpt_gbps']:7.2f} "
                  f"{cell['raw_s']:9.4f} {cell['raw_gbps']:9.2f} {cell['ratio']:6.2f} {verdict}")
    resident = [row["recovery_disk"]["resident_after_drop"] for row in rows if row["recovery_disk"]]
    print(f"note: {CACHE_NOTE} (here: {resident}); save_dir on {info['dir_fs']}, slots on {info['shm_fs']}")
    result = {"benchmark": "throughput", "machine": info, "device": args.device, "repeats": args.repeats,
              "copy_repeats": args.copy_repeats, "dim": args.dim,
              "targets": TARGETS, "notes": {"cache_drop": CACHE_NOTE,
                                            "ratio": "easyckpt throughput / raw throughput, bytes per second each"},
              "rows": rows}
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
