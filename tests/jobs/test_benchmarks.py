"""Each benchmark runs end to end at a tiny size (the figures themselves live in benchmarks/README.md)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
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
    for key in ("easyckpt_launch_s", "easyckpt_launch_copy_s", "torch_save_fsync_s", "safetensors_fsync_s",
                "dcp_save_s", "dcp_async_save_s", "ratio_dcp_async_over_launch"):
        assert row[key] > 0, key
    assert row["easyckpt_launch_copy_s"] >= row["easyckpt_launch_s"]
    assert not list(env.shm_dir.iterdir()), "the benchmark must not leave slots behind"


def test_throughput_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    from conftest import wait_for

    out = tmp_path / "throughput.json"
    result = load("throughput").main(["--sizes-mb", "3", "--dim", "128", "--repeats", "1", "--copy-repeats", "1",
                                      "--dir", str(tmp_path), "--persist-timeout", "30", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "throughput" and result["machine"]["cpus"] >= 1 and result["device"] == "cpu"
    row = result["rows"][0]
    assert 1e6 < row["bytes"] < 3e6 and row["tensors"] >= 4
    for path in ("snapshot_copy", "persist", "recovery_memory", "recovery_disk"):
        cell = row[path]
        for key in ("easyckpt_bytes", "easyckpt_s", "easyckpt_gbps", "raw_bytes", "raw_s", "raw_gbps", "ratio"):
            assert cell[key] > 0, (path, key)
        assert abs(cell["ratio"] - cell["easyckpt_gbps"] / cell["raw_gbps"]) < 1e-9, path
        assert "target" in cell, path
    assert row["snapshot_copy"]["target"] == 0.90 and row["persist"]["target"] == 0.85
    assert row["snapshot_copy"]["easyckpt_bytes"] == row["bytes"] == row["persist"]["easyckpt_bytes"]
    assert row["persist"]["raw_bytes"] == row["persist"]["easyckpt_bytes"]
    assert "persisted step=0" in row["persist"]["log_line"]
    assert row["recovery_memory"]["easyckpt_bytes"] == row["recovery_disk"]["easyckpt_bytes"] == row["bytes"]
    assert row["recovery_disk"]["cache_drop"] == "best effort" and "best effort" in result["notes"]["cache_drop"]
    assert row["snapshot_skipped"] == 0
    # The agent unlinks the persisted job's slots when it exits; the memory job's are removed by the benchmark.
    wait_for(lambda: not env.shm_files(), 30, "no slot files left in the test's shm dir")
    env.wait_agent_gone()


def test_overhead_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    result = load("overhead").main(["--layers", "1", "--d-model", "32", "--nhead", "2", "--vocab", "64",
                                    "--seq-len", "8", "--batch-size", "2", "--steps", "3", "--warmup", "2",
                                    "--rounds", "1", "--copy-repeats", "1", "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "overhead" and result["machine"]["device"] == "cpu" and result["target"] is None
    assert result["state_bytes"] > 0
    for mode in ("without", "with"):
        assert result[mode]["step_s"] > 0 and result[mode]["steps"] == 3, mode
    assert result["with"]["launch_s"] > 0 and result["copy_s"] > 0 and result["copy_gbps"] > 0
    assert result["with"]["skipped"] == 0 and result["with"]["committed"] == 5 + 1  # every step, and the lone copy
    assert result["overhead"] == (result["with"]["step_s"] - result["without"]["step_s"]) / result["without"]["step_s"]
    assert result["step_longer_than_copy"] == (result["without"]["step_s"] > result["copy_s"])
    assert result["with"]["final_loss"] == result["without"]["final_loss"], "same seeds, same training"
    assert not list(env.shm_dir.iterdir()), "the benchmark must not leave slots behind"


def test_plot_renders_every_timing_key(env: Env, tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (the optional 'plot' extra)")
    rows = [{"bytes": size, "tensors": 4, "easyckpt_launch_s": 1e-4 * k, "easyckpt_launch_copy_s": 2e-3 * k,
             "torch_save_fsync_s": 5e-2 * k, "dcp_save_s": 6e-2 * k, "dcp_async_save_s": 1e-2 * k,
             "easyckpt_skipped": 0, "ratio_torch_save_over_launch": 500.0}
            for k, size in enumerate((10**8, 3 * 10**8, 10**9), start=1)]
    source = tmp_path / "blocking.json"
    source.write_text(json.dumps({"benchmark": "blocking", "machine": {"device": "cpu"}, "rows": rows}))
    png = tmp_path / "plots" / "blocking.png"
    result = load("plot").main([str(source), "--out", str(png)])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    methods = {label.rsplit(" (", 1)[0] for label in result["lines"]}
    assert methods == {"easyckpt_launch", "easyckpt_launch_copy", "torch_save_fsync", "dcp_save", "dcp_async_save"}
    assert all(len(points) == 3 for points in result["lines"].values())


def test_many_tensors_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "many.json"
    result = load("many_tensors").main(["--tensors", "200", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["launch_per_tensor_us"] > 0 and result["copy_s"] >= result["launch_s"] > 0
    assert not list(env.shm_dir.iterdir()), "the benchmark must not leave slots behind"


def test_replica_fetch_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    from conftest import wait_for

    from easyckpt_wire import transfer

    out = tmp_path / "replica_fetch.json"
    result = load("replica_fetch").main(["--sizes-mb", "4", "--repeats", "1", "--chunks-mb", "1,8", "--windows", "2",
                                         "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "replica_fetch" and result["machine"]["cpus"] >= 1 and result["target"] == 0.70
    row = result["rows"][0]
    assert row["bytes"] == 4 << 20 and row["tensors"] == 4
    assert row["raw"]["gbps"] > 0 and len(row["raw"]["runs_s"]) == 1
    default = (transfer.CHUNK_BYTES / (1 << 20), transfer.WINDOW)
    tried = [default] + [config for config in ((1, 2), (8, 2)) if config != default]
    assert [(c["chunk_mb"], c["window"]) for c in row["grid"]] == tried
    for c in row["grid"]:
        assert c["gbps"] > 0 and abs(c["ratio"] - c["gbps"] / row["raw"]["gbps"]) < 1e-9, c
    assert row["easyckpt"] == row["grid"][0] and row["easyckpt"]["default"] is True
    assert row["met"] == (row["easyckpt"]["ratio"] >= 0.70) and row["xxh3_128_gbps"] > 0
    wait_for(lambda: not env.shm_files(), 30, "no slot files left in the test's shm dir")
    env.wait_agent_gone()


def test_freshness_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "freshness.json"
    result = load("freshness").main(["--persist-steps", "3", "--slots", "3", "--kills", "1", "--steps", "24",
                                     "--ballast-mb", "4", "--step-seconds", "0.02", "--seed", "7",
                                     "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["seed"] == 7
    row = result["rows"][0]
    assert row["slots"] == 3 and row["lag_samples"] > 0 and row["lag_max"] >= row["lag_median"] >= 0
    kill = row["kills"][0]
    assert kill["source"] == "memory" and kill["lost"] == kill["kill_at"] - kill["resumed_at"] >= 0


def test_reshard_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    """4 ranks save (easyckpt and dcp.save), then 4 -> 4 and 4 -> 2 loads are timed against dcp.load; the
    benchmark itself checks that its resharded load equals dcp.load's, tensor by tensor."""
    import importlib

    out = tmp_path / "reshard.json"
    # imported by name (benchmarks/ is on sys.path), not from a file spec: its spawned workers unpickle
    # reshard.worker by module name
    result = importlib.import_module("reshard").main(["--dim", "32", "--layers", "2", "--repeats", "1",
                                                      "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert (result["saved_world"], result["resharded_world"]) == (4, 2) and result["state_bytes"] > 0
    for key in ("easyckpt_same_world_s", "dcp_same_world_s", "easyckpt_resharded_s", "dcp_resharded_s"):
        assert result[key] > 0 and len(result["runs"][key]) == 1, key
    assert result["ratio_resharded_over_same_world"] == result["easyckpt_resharded_s"] / result["easyckpt_same_world_s"]
    from conftest import wait_for

    wait_for(lambda: not env.shm_files(), 60, "no slot files left in the test's shm dir (the agent exits after BYE)")


PEER_SKIPS = {
    "dlrover": "DLRover needs its own environment (dlrover[k8s]==0.6.1 pulls kubernetes, grpcio and tornado; protobuf "
               "and numpy are needed too), which CI does not build; set PEERS_VENV_DLROVER=<venv> to run it (about 40 s)",
    "nvrx": "nvidia-resiliency-ext 0.7.0 ships only cp312 manylinux_2_39 wheels (no sdist), so pip finds nothing for "
            "Python 3.11 / glibc 2.36; set PEERS_VENV_NVRX=<venv> with its files unpacked to run it (it then records "
            "its CPU error: BasicTensorAwareStateDict asserts CUDA tensors)",
}


def light_env(tmp_path: Path, requirement: str) -> Path:
    """A venv seeing this environment's packages (torch, numpy) plus ``requirement``: a few seconds, where a full venv
    with torch takes a minute. lm-resiliency may not go into the test environment itself: its torchrun rendezvous
    plugin (entry point ``torchrun.handlers``) is loaded by every torchrun there and prints a registration traceback."""
    import site
    import subprocess
    import sys

    import pytest

    venv = tmp_path / "peer-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    target = next((venv / "lib").glob("python3*/site-packages"))
    (target / "test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), requirement],
                         capture_output=True, text=True, timeout=180)
    if pip.returncode:
        pytest.skip(f"could not install {requirement} from the package index: {pip.stderr[-300:]}")
    return venv


def run_peers(tmp_path: Path, system: str, runs: str, venvs: list[str]) -> dict:
    from conftest import seeded_random

    seed = seeded_random().randrange(1 << 30)
    out = tmp_path / "peers.json"
    result = importlib.import_module("peers").main(
        ["--sizes", "1", "--steps", "10", "--systems", system, "--runs", runs, "--seed", str(seed), "--timeout", "120",
         "--dir", str(tmp_path / "work"), "--json", str(out), *venvs])
    assert json.loads(out.read_text()) == result and result["seed"] == seed
    (row,) = result["rows"]
    assert row["system"] == system and row["state_bytes"] == result["baselines"][0]["state_bytes"] > 1e6
    return row


@pytest.mark.extended   # about 4 min with the node-loss one; the peers' figures are benchmarks/README.md's
@pytest.mark.parametrize("system", ["easyckpt", "dcp", "lm_resiliency", "dlrover", "nvrx"])
def test_peers_benchmark_smoke(env: Env, tmp_path: Path, system: str) -> None:
    """peers.py at a tiny size, one system against the same job without checkpoints: blocking, overhead, and two
    seeded kills (steps lost, recovery, the state after both resumes bit-exact or not, shared-memory aliasing)."""
    import os

    venvs = []
    if system == "lm_resiliency":
        venvs = ["--venv", f"lm_resiliency={light_env(tmp_path, 'lm-resiliency==0.2.0')}"]
    elif system in PEER_SKIPS and not os.environ.get(f"PEERS_VENV_{system.upper()}"):
        pytest.skip(PEER_SKIPS[system])
    row = run_peers(tmp_path, system, "clean,kill", venvs)
    if system == "nvrx":   # cannot run on CPU: the row keeps its exact error
        assert "is_cuda" in row["error"], row
        return
    clean, kill = row["clean"], row["kill"]
    assert clean["exact"] is True, "an uninterrupted run with checkpoints must train exactly as one without"
    assert clean["blocking_median_s"] > 0 and clean["blocking_p99_s"] >= clean["blocking_median_s"]
    assert clean["step_s"] > 0 and "overhead" in clean and clean["peak_bytes"] > 0
    assert [k["happened"] for k in kill["kills"]] == [True, True], kill
    for k in kill["kills"]:
        assert k["resumed_at"] is not None and k["lost"] == k["kill_at"] - k["resumed_at"] >= 0, k
        assert k["recovery_s"] > 0 and k["downtime_s"] > 0 and k["restore_s"] >= 0, k
    assert isinstance(kill["exact"], bool) and "node" not in row
    if system == "easyckpt":
        assert kill["exact"] is True, "the state after two resumes must equal the uninterrupted run's, bit for bit"
        assert all(k["lost"] <= 2 and k["source"] == ["memory"] for k in kill["kills"]), kill["kills"]
        assert not any((a or {}).get("tensors") for k in kill["kills"] for a in k["aliases"]), "state left in shm"


@pytest.mark.extended
def test_peers_benchmark_node_loss(env: Env, tmp_path: Path) -> None:
    """peers.py's node-loss run for easyckpt: two simulated nodes, node 1 lost whole at a seeded step and replaced;
    the job resumes from memory and the surviving node's replica, and ends bit-exact."""
    node = run_peers(tmp_path, "easyckpt", "node", [])["node"]
    assert node["measured"] and node["happened"] and node["exact"] is True, node
    # Steps of a few ms on a busy machine outrun the buddy backup, so how many steps are lost varies (the README's
    # figures at 100 MB and 1 GB: 1); what must hold is a resume from memory and replicas, not from scratch.
    assert set(node["source"]) <= {"memory", "replica"} and node["resumed_at"] is not None, node
    assert node["lost"] == node["kill_at"] - node["resumed_at"] >= 0, node
def test_lightning_blocking_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "lightning_blocking.json"
    result = load("lightning_blocking").main(["--dim", "64", "--layers", "1", "--steps", "4", "--warmup", "1",
                                              "--rounds", "1", "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    row = result["rows"][0]
    assert row["steps_timed"] == 3 and row["state_bytes"] > 0
    assert set(row["median_step_s"]) == {"none", "lightning", "async_io", "easyckpt", "easyckpt_persist"}
    assert all(value > 0 for value in row["median_step_s"].values())
    assert all(value > 0 for value in row["median_blocking_s"].values())
    assert set(row["ratio_over_easyckpt"]) == {"lightning", "async_io"}


def test_hf_log_history_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="hf_log_history.py needs transformers (the 'hf' extra)")
    out = tmp_path / "hf_log_history.json"
    result = load("hf_log_history").main(["--entries", "0", "300", "--steps", "6", "--warmup", "1",
                                          "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [row["entries"] for row in result["rows"]] == [0, 300]
    for row in result["rows"]:
        assert set(row["median_step_s"]) == {"plain", "easyckpt"} and all(v > 0 for v in row["median_step_s"].values())
        assert row["ratio_easyckpt_over_plain"] > 0


def test_hf_lora_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    """A LoRA fine-tune's snapshot holds what trains: a few KiB of adapter and optimizer, not the frozen base."""
    pytest.importorskip("peft", reason="hf_lora.py needs peft (the 'test' extra)")
    out = tmp_path / "hf_lora.json"
    result = load("hf_lora").main(["--layers", "2", "--width", "64", "--steps", "6", "--warmup", "1",
                                   "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert set(rows) == {"plain", "easyckpt"} and all(row["median_step_s"] > 0 for row in rows.values())
    base_bytes = 4 * (rows["easyckpt"]["parameters"] - rows["easyckpt"]["trained"])
    assert 0 < rows["easyckpt"]["snapshot_bytes"] < base_bytes, rows


def test_cluster_sim_smoke(tmp_path: Path) -> None:
    """The seeded simulation of the job-wide rules: a tiny table, and the same seed gives the same table."""
    out = tmp_path / "sim.json"
    argv = ["cluster_sim.py", "--nodes", "2,8", "--faults", "3", "--steps", "30", "--seed", "7", "--json", str(out)]
    module = importlib.import_module("cluster_sim")
    import sys
    saved, sys.argv = sys.argv, argv
    try:
        module.main()
        first = json.loads(out.read_text())
        module.main()
    finally:
        sys.argv = saved
    assert json.loads(out.read_text())["rows"] == first["rows"], "the same seed must replay the same run"
    for row in first["rows"]:
        assert row["skipped"] == 0 and row["rank_kill_lost_max"] <= 2 and row["node_loss_lost_max"] <= 2, row


def test_multinode_freshness_benchmark_smoke(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "mnf.json"
    result = importlib.import_module("multinode_freshness").main(
        ["--idle-ms", "0", "--faults", "0", "--steps", "12", "--seed", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    (row,) = result["rows"]
    # every due step persisted or announced as passed over, but for one the end of the run overtook (close()
    # persisted the newest step instead): agents starved of CPU by four ranks on two cores may not decide it in time
    superseded = row["superseded_by_the_final_persist"]
    assert row["due"] == 3 and row["due_persisted"] + len(row["passed_over"]) + len(superseded) >= row["due"], row
    assert superseded in ([], [10]), row
    assert row["job_safe_lag"][0] is not None and row["backup_ms"][0] > 0
