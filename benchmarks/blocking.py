"""Blocking time per checkpoint seen by the training loop: easyckpt vs torch.save vs safetensors.

    python benchmarks/blocking.py --sizes-mb 100 400 --repeats 3 --out results/blocking.json
    python benchmarks/blocking.py --device cuda --sizes-mb 1000 10000 --peers torch_save dcp_async


The state is GPT-like: a stack of linear layers plus AdamW's two moments (so ~3x the parameter
bytes). For easyckpt, "launch" is what ``save_if_needed`` costs the loop when the next step's compute
hides the copy; "launch+copy" is the worst case where the loop waits for the copy at once. torch.save
and safetensors write to a file in ``--dir`` and fsync it, as a classic checkpoint does. With ``--device
cuda`` the state lives on the GPU: easyckpt copies into its pinned slots on a side stream, DCP's
async_save stages into pinned memory (its DefaultStager), torch.save copies to host as it pickles.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import easyckpt
from easyckpt.snapshot.state import flatten

PEERS = ("torch_save", "safetensors", "dcp_save", "dcp_async")


def gpt_like_state(total_mb: float, dim: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Parameters + AdamW moments adding up to ~``total_mb`` MB, with a realistic mix of sizes."""
    dim = dim or (1024 if total_mb >= 100 else 128)
    if device != "cpu":   # built there: a 10 GB state built on the host and moved would double host memory
        with torch.device(device):
            return gpt_like_state(total_mb, dim)
    per_layer = 4 * (dim * 4 * dim * 2 + dim * 3)   # an MLP block: two matrices, biases and a norm, fp32
    layers = max(1, int(total_mb * 1e6 / 3 / per_layer))
    model = {}
    for i in range(layers):
        model[f"layers.{i}.fc1.weight"] = torch.randn(4 * dim, dim)
        model[f"layers.{i}.fc2.weight"] = torch.randn(dim, 4 * dim)
        model[f"layers.{i}.fc1.bias"] = torch.randn(4 * dim)
        model[f"layers.{i}.norm.weight"] = torch.randn(dim)
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
                       for i, t in enumerate(model.values())},
             "param_groups": [{"lr": 1e-4, "betas": [0.9, 0.95], "params": list(range(len(model)))}]}
    return {"model": model, "optim": optim, "step": 10}


def timed(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fsynced(path: Path, write: Callable[[Path], None]) -> Callable[[], None]:
    def run() -> None:
        write(path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        path.unlink()
    return run


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(size_mb: float, repeats: int, directory: Path, copy_threads: int = 1, device: str = "cpu",
            peers: tuple[str, ...] = PEERS, cuda_copy_streams: int = 2) -> dict[str, Any]:
    state = gpt_like_state(size_mb, device=device)
    sync(device)
    _, refs, values = flatten(state)
    flat = {ref.name: value for ref, value in zip(refs, values)}
    ckpt = easyckpt.Checkpointer(directory / "ckpt", 1, 10**9, 1, start_agent=False, copy_threads=copy_threads,
                                 cuda_copy_streams=cuda_copy_streams)
    every_launch, every_full, phases = [], [], []
    try:
        # The first snapshot into each slot allocates and touches it (and pins it on CUDA), once per job: the
        # steady state is every save after each slot was written once, the first save is reported on its own.
        first_round = ckpt.slots.count
        for step in range(first_round + 2 * repeats):
            ckpt.wait()  # untimed: in training the next step's compute hides the copy
            sync(device)
            start = time.perf_counter()
            ckpt.save_if_needed(step, state)
            launched = time.perf_counter()
            phases.append(ckpt.stager.last_launch_phases)
            ckpt.wait()
            every_launch.append(launched - start)
            every_full.append(time.perf_counter() - start)
        launch = statistics.median(every_launch[first_round:])
        full = statistics.median(every_full[first_round:])
        skipped = ckpt.stats()["skipped"]
    finally:
        ckpt.close()
        for path in ckpt.slots.directory.glob(f"easyckpt-{ckpt.config.job_id}-*"):
            path.unlink()  # no agent ran to clean up after this job
    nan = float("nan")
    torch_save = timed(fsynced(directory / "state.pt", lambda p: torch.save(state, p)), repeats) \
        if "torch_save" in peers else nan
    st_save = timed(fsynced(directory / "state.safetensors", lambda p: save_file(flat, str(p))), repeats) \
        if "safetensors" in peers else nan
    dcp_save, dcp_async, stager = measure_dcp(state, directory, repeats, peers)
    return {"device": device, "dcp_async_stager": stager, "bytes": sum(ref.nbytes for ref in refs), "tensors": len(flat),
            "cuda_copy_streams": cuda_copy_streams, "easyckpt_first_launch_s": every_launch[0],
            "easyckpt_first_launch_copy_s": every_full[0], "easyckpt_every_launch_s": every_launch,
            "easyckpt_every_launch_copy_s": every_full, "easyckpt_every_launch_phases": phases,
            "easyckpt_launch_s": launch,
            "easyckpt_launch_copy_s": full, "torch_save_fsync_s": torch_save, "safetensors_fsync_s": st_save,
            "dcp_save_s": dcp_save, "dcp_async_save_s": dcp_async, "easyckpt_skipped": skipped,
            "ratio_torch_save_over_launch": torch_save / launch, "ratio_torch_save_over_launch_copy": torch_save / full,
            "ratio_dcp_async_over_launch": dcp_async / launch, "ratio_dcp_async_over_launch_copy": dcp_async / full}


def measure_dcp(state: dict[str, Any], directory: Path, repeats: int, peers: tuple[str, ...] = PEERS
                ) -> tuple[float, float, str | None]:
    """torch.distributed.checkpoint: save (blocking) and async_save (the call is what the loop waits for).

    async_save stages a copy before it returns; with CUDA, DCP's DefaultStager stages into pinned memory.
    """
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    # DCP's pinned-memory stager first; torch 2.11's DefaultStager failed on CUDA state (KeyError: <class
    # 'type'> in its deepcopy), so the next options are tried and the one that ran is reported.
    attempts: list[tuple[str, dict[str, Any]]] = []
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = torch.cuda.is_available()
        attempts.append(("DefaultStager(pinned)", {"async_stager": lambda: DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda))}))
        attempts.append(("DefaultStager(pinned, blocking copy)", {"async_stager": lambda: DefaultStager(
            StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                           use_non_blocking_copy=False))}))
    except (ImportError, TypeError):
        pass  # older torch: async_save's default stager
    attempts.append(("async_save default", {}))
    path = directory / "dcp"

    def save() -> None:
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
        shutil.rmtree(path)

    times: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocking = timed(save, repeats) if "dcp_save" in peers else float("nan")
        used = None
        for name, factory in attempts if "dcp_async" in peers else []:
            kwargs = {key: make() for key, make in factory.items()}
            try:
                for _ in range(repeats):
                    start = time.perf_counter()
                    response = dcp.async_save(state, checkpoint_id=str(path), no_dist=True, **kwargs)
                    times.append(time.perf_counter() - start)
                    future = getattr(response, "upload_completion", response)
                    future.result()  # untimed: the write finishes in the background
                    shutil.rmtree(path)
                used = name
                break
            except Exception as exc:   # a peer's failure is reported, not fatal to the benchmark
                print(f"DCP async_save with {name} failed: {type(exc).__name__}: {exc}")
                times.clear()
                shutil.rmtree(path, ignore_errors=True)
            finally:
                closer = kwargs.get("async_stager")
                if closer is not None and hasattr(closer, "close"):
                    closer.close()
    return blocking, statistics.median(times) if times else float("nan"), used


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[100.0, 400.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-threads", type=int, default=1, help="easyckpt's CPU copy threads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                        help="which peers to time (the slow ones dominate the run at 10 GB)")
    parser.add_argument("--cuda-copy-streams", type=int, default=2, help="easyckpt's CUDA copy streams")
    parser.add_argument("--dir", type=Path, default=None, help="where torch.save/safetensors write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [measure(size, args.repeats, Path(tmp), args.copy_threads, args.device, tuple(args.peers),
                        args.cuda_copy_streams) for size in args.sizes_mb]
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "device": args.device, "python": platform.python_version()}
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    print(f"{'MB':>7} {'tensors':>7} {'1st launch':>10} {'launch ms':>9} {'+copy ms':>9} {'torch.save':>10} "
          f"{'safetensors':>11} "
          f"{'dcp.save':>9} {'dcp.async':>9} {'save/launch':>11} {'async/launch':>12} {'save/+copy':>10} "
          f"{'async/+copy':>11}")
    for row in rows:
        print(f"{row['bytes'] / 1e6:7.0f} {row['tensors']:7d} {row['easyckpt_first_launch_s'] * 1e3:10.2f} "
              f"{row['easyckpt_launch_s'] * 1e3:9.2f} "
              f"{row['easyckpt_launch_copy_s'] * 1e3:9.1f} {row['torch_save_fsync_s'] * 1e3:10.1f} "
              f"{row['safetensors_fsync_s'] * 1e3:11.1f} {row['dcp_save_s'] * 1e3:9.1f} "
              f"{row['dcp_async_save_s'] * 1e3:9.1f} {row['ratio_torch_save_over_launch']:11.0f} "
              f"{row['ratio_dcp_async_over_launch']:12.0f} {row['ratio_torch_save_over_launch_copy']:10.1f} "
              f"{row['ratio_dcp_async_over_launch_copy']:11.1f}")
    result = {"benchmark": "blocking", "machine": machine, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # a peer left out is NaN in the table and null in the JSON (NaN is not JSON)
        args.out.write_text(json.dumps(json.loads(json.dumps(result), parse_constant=lambda _: None), indent=2))
    return result


if __name__ == "__main__":
    main()
