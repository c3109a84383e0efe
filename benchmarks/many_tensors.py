"""Python overhead per tensor of a snapshot: many small tensors (target: <= ~20 us each at 10,000).

    python benchmarks/many_tensors.py --tensors 10000 --numel 16 --out benchmarks/results/many-tensors-cpu.json

Reports the launch time of ``save_if_needed`` (flatten, plan lookup, metadata, slot choice, copy launch)
divided by the tensor count, and the copy time (launch to commit) likewise, median of ``--repeats``.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import write_result

import easyckpt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--numel", type=int, default=16, help="elements per tensor (fp32)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    state = {"model": {f"layers.{i}.weight": torch.randn(args.numel) for i in range(args.tensors)}, "step": 0}
    launches, copies = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = easyckpt.Checkpointer(Path(tmp) / "ckpt", 1, 10**9, 1, start_agent=False)
        try:
            for step in range(2 + args.repeats):  # the first two plan the layout and allocate the slots
                ckpt.wait()
                start = time.perf_counter()
                ckpt.save_if_needed(step, state)
                launched = time.perf_counter() - start
                ckpt.wait()
                if step >= 2:
                    launches.append(launched)
                    copies.append(ckpt.stats()["last_copy_seconds"])
        finally:
            ckpt.close()
            for path in ckpt.slots.directory.glob(f"easyckpt-{ckpt.config.job_id}-*"):
                path.unlink()  # no agent ran to clean up after this job
    launch, copy = statistics.median(launches), statistics.median(copies)
    result = {"benchmark": "many_tensors", "tensors": args.tensors, "numel": args.numel,
              "launch_s": launch, "launch_per_tensor_us": launch / args.tensors * 1e6,
              "copy_s": copy, "copy_per_tensor_us": copy / args.tensors * 1e6, "target_per_tensor_us": 20.0,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}}
    print(f"{args.tensors} tensors of {args.numel} fp32: launch {launch * 1e3:.2f} ms "
          f"({result['launch_per_tensor_us']:.2f} us/tensor, target <= 20), launch to commit {copy * 1e3:.2f} ms "
          f"({result['copy_per_tensor_us']:.2f} us/tensor)")
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
