"""easyckpt side by side with the in-memory checkpoint systems it is chosen against, on the same job, in one run.

    python benchmarks/peers.py --json benchmarks/results/peers-cpu.json --sizes 100,1000 --seed 7

Systems: easyckpt, DLRover Flash Checkpoint (``dlrover``), lm-resiliency's GEMINI (``lm_resiliency``), NVIDIA
Resiliency Extension's local checkpoints (``nvrx``) and torch's ``dcp.async_save`` (``dcp``); ``none`` is the
same job with no checkpoint. Each peer runs in its own virtual environment (their pins differ), named by
``--venv NAME=DIR`` or ``PEERS_VENV_<NAME>``, default ``/work/peer-venvs/<name>``; easyckpt, dcp and none run
in this interpreter. A peer whose environment is missing or that fails keeps its row with the exact error.

The job (``peers_job.py``): 2 ranks under the launcher each system documents (``torchrun``; ``dlrover-run``
through ``peers_dlrover_run.py``), DDP on gloo, an MLP stack with AdamW whose model + moments make
``--sizes`` MB per rank; a checkpoint every step, a persist every ``--persist-every``-th where a system has both
tiers. Per system and size:

* **clean run** (``--steps``): blocking per checkpoint (median, p99 of what the loop waited on the system per
  step), step time against ``none``, peak host memory of the job (every process's anonymous RSS plus the job's
  shared memory, each job in a private /dev/shm when ``unshare`` is allowed) and the final state's digest;
* **kill run**: two seeded SIGKILLs of a seeded rank (right after a step's optimizer update), restarted by the
  launcher: steps recomputed per kill, recovery (process start to the first finished step) and downtime (kill
  to the first finished step), and whether the state after both resumes equals the uninterrupted run's bit for
  bit; aliasing (model or optimizer tensors left in shared memory after a resume) is recorded;
* **node run** where a system claims peer recovery: two simulated nodes of one rank (each its own launcher and
  /dev/shm; easyckpt also its EASYCKPT_NODE_ID), node 1 lost whole at a seeded step and started afresh.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from common import poll, write_result  # noqa: E402
from peers_run import Job, private_shm_supported, versions  # noqa: E402

SYSTEMS = ("easyckpt", "dlrover", "lm_resiliency", "nvrx", "dcp")
PEER_VENVS = {"dlrover": "dlrover", "lm_resiliency": "lmres", "nvrx": "nvrx"}
# Which systems claim recovery of a lost node from peers' memory, and how each is asked for it.
NODE_LOSS = {"easyckpt": "replicas on other nodes' agents (automatic)",
             "dlrover": "DdpCheckpointer(replica_count=1)", "lm_resiliency": "GEMINI peer replication (replication_jump)",
             "nvrx": "CliqueReplicationStrategy"}
RANKS = 2


def shape_for(mb: float) -> tuple[int, int]:
    """(dim, layers) whose model + AdamW moments come closest to ``mb`` MB per rank."""
    from peers_job import state_bytes

    dim = 1024 if mb >= 50 else 256 if mb >= 4 else 64
    layers = max(1, round(mb * 1e6 / state_bytes(dim, 1)))
    return dim, layers


def interpreter(system: str, venvs: dict[str, str]) -> Path:
    if system not in PEER_VENVS:   # easyckpt, easyckpt_once, dcp, none: this environment
        return Path(sys.executable)
    name = PEER_VENVS[system]
    base = venvs.get(system) or os.environ.get(f"PEERS_VENV_{system.upper()}") or f"/work/peer-venvs/{name}"
    return Path(base) / "bin" / "python"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def clean_figures(job: Job) -> dict[str, Any]:
    reports = job.reports()
    finals = [r for r in reports if "digest" in r]
    steps = [s for r in finals for s in r["step_s"][2:]]   # the first two steps warm up
    # Per step, the slowest rank's wait: DDP's next all-reduce waits for it (DLRover copies on local rank 0 only).
    blocking = [max(waits) for waits in zip(*(r["blocking_s"][2:] for r in finals))]
    per_rank = {str(r["rank"]): pct(r["blocking_s"][2:], 0.5) for r in finals}
    return {"step_s": statistics.median(steps) if steps else None, "blocking_median_s": pct(blocking, 0.5),
            "blocking_median_per_rank_s": per_rank,
            "blocking_p99_s": pct(blocking, 0.99), "blocking_max_s": max(blocking) if blocking else None,
            "digests": sorted({r["digest"] for r in finals}), "peak_bytes": job.peak_bytes,
            "peak_shm_bytes": job.peak_shm, "wall_s": job.wall_s, "stats": [r.get("stats") for r in finals],
            "launcher_lingered": job.lingered}


def kill_figures(job: Job, kills: list[tuple[int, int, int]]) -> dict[str, Any]:
    reports = job.reports()
    rows: list[dict[str, Any]] = []
    for attempt, step, rank in kills:
        killed = job.read(f"killed-attempt{attempt}")
        after = [r for r in reports if r["attempt"] == attempt + 1 and r.get("launch", "0") == "0"]
        if killed is None or not after:
            rows.append({"kill_at": step, "rank": rank, "happened": killed is not None, "resumed_at": None})
            continue
        resumed = [r.get("resumed") for r in after]
        low = min((-1 if x is None else x) for x in resumed)
        first = [r["first_step_done"] for r in after if "first_step_done" in r]
        rows.append({"kill_at": step, "rank": rank, "happened": True, "resumed_at": None if low < 0 else low,
                     "lost": step - low, "source": sorted({str(r.get("source")) for r in after}),
                     "recovery_s": max(r["first_step_done"] - r["started"] for r in after if "first_step_done" in r)
                     if first else None,
                     "downtime_s": max(first) - killed["time"] if first else None,
                     "restore_s": max(r["load_done"] - r["pg_ready"] for r in after if "load_done" in r),
                     "aliases": [r.get("aliases") for r in after]})
    finals = [r for r in reports if "digest" in r]
    return {"kills": rows, "digests": sorted({r["digest"] for r in finals}), "wall_s": job.wall_s,
            "errors": sorted({r["error"] for r in reports if r.get("error")})}


def run_system(system: str, args: argparse.Namespace, size_mb: float, work: Path, rng: random.Random,
               reference: str | None, none_step: float | None, none_peak: int | None) -> dict[str, Any]:
    dim, layers = shape_for(size_mb)
    python = interpreter(system, args.venv)
    row: dict[str, Any] = {"system": system, "size_mb": size_mb, "dim": dim, "layers": layers, "python": str(python)}
    if not python.exists():
        row["error"] = (f"no environment: {python} is missing (make it with benchmarks/peer_venvs.sh, or pass "
                        f"--venv {system}=DIR)")
        return row
    row["versions"] = versions(python, system)
    job_args = ["--dim", str(dim), "--layers", str(layers), "--persist-every", str(args.persist_every)]
    if "clean" in args.runs:
        clean_run(system, python, job_args, work, args, row, reference, none_step, none_peak)
        if row.get("error"):
            return row
    if system == "easyckpt_once":   # the probe of copying replicated state once per node: clean run only
        return row
    if "kill" in args.runs:
        k1 = rng.randint(3, args.steps // 2 - 1)
        kills = [(0, k1, rng.randrange(RANKS)), (1, rng.randint(k1 + 3, args.steps - 3), rng.randrange(RANKS))]
        killed = Job(system, python, work / "kill", job_args + ["--steps", str(args.steps)] +
                     [f"--kill-at={a}:{s}:{r}" for a, s, r in kills], restarts=2, timeout=args.timeout)
        killed.run()
        row["kill"] = kill_figures(killed, kills)
        row["kill"]["exact"] = row["kill"]["digests"] == [reference] if reference else None
        if killed.failed():
            row["kill"]["error"] = killed.error()
    if "node" in args.runs and system in NODE_LOSS:
        row["node"] = node_loss(system, python, job_args, work / "node", rng, args, reference)
    return row


def clean_run(system: str, python: Path, job_args: list[str], work: Path, args: argparse.Namespace,
              row: dict[str, Any], reference: str | None, none_step: float | None, none_peak: int | None) -> None:
    """The uninterrupted run: blocking, step time (against ``none``), memory, and its state against the reference."""
    clean = Job(system, python, work / "clean", job_args + ["--steps", str(args.steps)], timeout=args.timeout)
    clean.run()
    row["clean"] = clean_figures(clean)
    if args.paired:   # the job without checkpoints again, right after: this VM's speed drifts within minutes
        alone = Job("none", Path(sys.executable), work / "none", job_args + ["--steps", str(args.steps)],
                    timeout=args.timeout)
        alone.run()
        paired = clean_figures(alone)
        row["none_paired"] = {k: paired[k] for k in ("step_s", "peak_bytes", "digests")}
        none_step, none_peak = paired["step_s"] or none_step, paired["peak_bytes"] or none_peak
    if clean.failed():
        row["error"] = clean.error()
        return
    c = row["clean"]
    c["exact"] = c["digests"] == [reference] if reference else None
    if none_step and c["step_s"]:
        c["overhead"] = c["step_s"] / none_step - 1
    if none_peak and c["peak_bytes"]:
        c["extra_bytes_per_rank"] = (c["peak_bytes"] - none_peak) / RANKS


def node_loss(system: str, python: Path, job_args: list[str], work: Path, rng: random.Random,
              args: argparse.Namespace, reference: str | None) -> dict[str, Any]:
    if system == "dlrover":
        return {"measured": False, "why": "dlrover-run --standalone runs one node only ('RuntimeError: Only single "
                "node is supported in standalone mode.'); two nodes need a DLRover job master (Kubernetes or Ray "
                "platform) that this machine does not run"}
    if system == "nvrx":
        return {"measured": False, "why": "does not run on CPU (see its row)"}
    step = rng.randint(4, args.steps - 4)
    result: dict[str, Any] = {"measured": True, "claim": NODE_LOSS[system], "kill_at": step}
    nodes = Job(system, python, work, job_args + ["--steps", str(args.steps), "--replicas"], restarts=2,
                timeout=args.timeout, nodes=2)
    nodes.start_nodes(kill=f"--kill-at=0:{step}:1")
    try:
        poll(lambda: nodes.read("killed-attempt0") or nodes.ended(0), args.timeout, f"{system}: node 1's kill")
        killed = nodes.read("killed-attempt0")
        nodes.kill_node(1)
        nodes.restart_node(1)
        nodes.wait_all()
    finally:
        nodes.stop()
    reports = nodes.reports()
    after = [r for r in reports if (r["node"], r.get("launch")) in (("0", "0"), ("1", "1")) and
             (r["node"] == "1" or r["attempt"] >= 1)]
    resumed = [r.get("resumed") for r in after]
    low = min((-1 if x is None else x) for x in resumed) if resumed else None
    first = [r["first_step_done"] for r in after if "first_step_done" in r]
    result.update(resumed_at=None if low is None or low < 0 else low, lost=None if low is None else step - low,
                  source=sorted({str(r.get("source")) for r in after}), happened=killed is not None,
                  downtime_s=(max(first) - killed["time"]) if first and killed else None,
                  digests=sorted({r["digest"] for r in reports if "digest" in r}),
                  errors=sorted({r["error"][:300] for r in reports if r.get("error")}))
    result["exact"] = result["digests"] == [reference] if reference else None
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of benchmarks/README.md."""
    head = ("| system | MB/rank | block median ms | block p99 ms | step ms | overhead | lost per kill | recovery s | "
            "restore s | downtime s | exact after kills | aliases shm | node loss: lost (source) | peak MB/rank (extra) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['system']} | {row['size_mb']:g} | did not run: {row.get('error', '')[:160]} |")
            continue
        c, k, n = row.get("clean", {}), row.get("kill", {}), row.get("node", {})
        lost = ", ".join(str(x.get("lost")) for x in k.get("kills", []))
        rec = [x.get("recovery_s") for x in k.get("kills", []) if x.get("recovery_s")]
        down = [x.get("downtime_s") for x in k.get("kills", []) if x.get("downtime_s")]
        restore = [x.get("restore_s") for x in k.get("kills", []) if x.get("restore_s") is not None]
        alias = any((a or {}).get("tensors") for x in k.get("kills", []) for a in (x.get("aliases") or []))
        node = (f"{n.get('lost')} ({', '.join(n.get('source', [])).replace('None', 'from scratch')})"
                if n.get("measured") else
                "n/a" if not n else "not measured")
        extra = c.get("extra_bytes_per_rank")
        peak = fmt(c["peak_bytes"] / RANKS if c.get("peak_bytes") else None, 1e-6, "", 0)
        lines.append(
            f"| {row['system']} | {row['size_mb']:g} | {fmt(c.get('blocking_median_s'), 1e3)} "
            f"| {fmt(c.get('blocking_p99_s'), 1e3)} | {fmt(c.get('step_s'), 1e3)} "
            f"| {fmt(c.get('overhead'), 100, '%')} | {lost} | "
            f"{' / '.join(fmt(x, 1, '', 1) for x in rec)} | {' / '.join(fmt(x, 1, '', 2) for x in restore)} | "
            f"{' / '.join(fmt(x, 1, '', 1) for x in down)} | "
            f"{k.get('exact')} | {alias} | {node} | {peak}"
            f" ({fmt(extra, 1e-6, '', 0)}) |")
    return "\n".join(lines)


def fmt(value: float | None, scale: float, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """easyckpt / peer for blocking, overhead, steps lost and recovery time, per size."""
    out = []
    for ours in (r for r in rows if r["system"] == "easyckpt" and "clean" in r):
        for peer in (r for r in rows if r["system"] not in ("easyckpt", "easyckpt_once") and
                     r["size_mb"] == ours["size_mb"] and "clean" in r and not r.get("error")):
            def kill_mean(row: dict[str, Any], key: str) -> float | None:
                values = [x[key] for x in row.get("kill", {}).get("kills", []) if x.get(key) is not None]
                return statistics.mean(values) if values else None
            out.append({"size_mb": ours["size_mb"], "peer": peer["system"],
                        "blocking": ratio(ours["clean"]["blocking_median_s"], peer["clean"]["blocking_median_s"]),
                        # (1 + overhead) / (1 + overhead'): step times relative to each one's own run without
                        # checkpoints, since the machine's speed drifts between runs
                        "overhead": ratio(1 + ours["clean"]["overhead"], 1 + peer["clean"]["overhead"])
                        if "overhead" in ours["clean"] and "overhead" in peer["clean"] else None,
                        "lost": ratio(kill_mean(ours, "lost"), kill_mean(peer, "lost")),
                        "recovery": ratio(kill_mean(ours, "recovery_s"), kill_mean(peer, "recovery_s")),
                        "restore": ratio(kill_mean(ours, "restore_s"), kill_mean(peer, "restore_s")),
                        "extra_memory": ratio(ours["clean"].get("extra_bytes_per_rank"),
                                              peer["clean"].get("extra_bytes_per_rank"))})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--sizes", default="100,1000", help="MB of model + AdamW state per rank, comma separated")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=30, help="steps of every run (kill points fall inside)")
    parser.add_argument("--persist-every", type=int, default=10)
    parser.add_argument("--runs", default="clean,kill,node", help="which runs per system (comma separated)")
    parser.add_argument("--no-node", dest="node", action="store_false", help="skip the node-loss runs")
    parser.add_argument("--paired", action="store_true",
                        help="run the job without checkpoints again after each system's clean run and take the "
                             "overhead against that run (slower; steadier on a noisy machine)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one launch may take")
    parser.add_argument("--venv", action="append", default=[], help="SYSTEM=DIR: a peer's virtual environment")
    parser.add_argument("--dir", type=Path, default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    args.venv = dict(v.split("=", 1) for v in args.venv)
    args.runs = [r for r in args.runs.split(",") if args.node or r != "node"]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    base = args.dir or Path(tempfile.mkdtemp(prefix="peers-"))
    rows: list[dict[str, Any]] = []
    baselines = []
    for size in [float(s) for s in args.sizes.split(",")]:
        dim, layers = shape_for(size)
        from peers_job import state_bytes

        none = Job("none", Path(sys.executable), base / f"{size:g}" / "none",
                   ["--dim", str(dim), "--layers", str(layers), "--steps", str(args.steps)], timeout=args.timeout)
        none.run()
        if none.failed():
            raise RuntimeError(f"the job without checkpoints failed: {none.error()}")
        baseline = clean_figures(none)
        baseline.update(size_mb=size, state_bytes=state_bytes(dim, layers), dim=dim, layers=layers)
        baselines.append(baseline)
        reference = baseline["digests"][0] if len(baseline["digests"]) == 1 else None
        print(f"{size:g} MB: {state_bytes(dim, layers) / 1e6:.1f} MB of state per rank, step "
              f"{baseline['step_s'] * 1e3:.1f} ms without checkpoints", flush=True)
        for system in args.systems.split(","):
            row = run_system(system, args, size, base / f"{size:g}" / system, rng, reference, baseline["step_s"],
                             baseline["peak_bytes"])
            row["state_bytes"] = baseline["state_bytes"]
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            shutil.rmtree(base / f"{size:g}" / system / "clean" / "ckpt", ignore_errors=True)
    result = {"benchmark": "peers", "seed": seed, "device": "cpu", "ranks": RANKS,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "private_shm": private_shm_supported()},
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
              "baselines": baselines, "rows": rows, "ratios": ratios(rows), "table": table(rows)}
    print(result["table"], flush=True)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return write_result(args.json, result)


if __name__ == "__main__":
    main()
