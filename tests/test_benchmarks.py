"""Each benchmark runs end to end at a tiny size (the figures themselves live in benchmarks/README.md)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from conftest import ROOT, Env


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocking_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "blocking.json"
    result = load("blocking").main(["--sizes-mb", "3", "--repeats", "1", "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    row = result["rows"][0]
    assert row["bytes"] > 1e6 and row["tensors"] >= 4
    for key in ("easyckpt_launch_s", "easyckpt_launch_copy_s", "torch_save_fsync_s", "safetensors_fsync_s"):
        assert row[key] > 0, key
    assert row["easyckpt_launch_copy_s"] >= row["easyckpt_launch_s"]
    assert not list(env.shm_dir.iterdir()), "the benchmark must not leave slots behind"
