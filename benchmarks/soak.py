"""A fault soak: many short real jobs back to back, one seeded fault each, every loss measured.

    python benchmarks/soak.py --faults 1000 --seed 7 --json soak-7.json          # a thousand faults
    python benchmarks/soak.py --faults 1000 --seed 7 --json soak-7.json --resume-from soak-7.json   # go on
    python benchmarks/soak.py --merge soak-7.json soak-8.json --json soak.json   # add up split soaks
    python benchmarks/soak.py --smoke --json smoke.json                          # 20 faults, the CI mode
    python benchmarks/soak.py --seed 7 --only 412 --json replay.json             # replay one fault
    python benchmarks/soak.py --faults 100 --seed 8 --jobs 3 --json soak-8.json  # three jobs side by side
    python benchmarks/soak.py --seed 7 --only 3 --json r.json --reference-cache /tmp/refs   # reuse references

Each job runs examples/plain_ddp.py or examples/hf_trainer.py on one or two simulated nodes (three with
``--configs plain-3x1``; a torchrun, a shared-memory directory, an address and an agent each) at full speed, and
takes one fault (``soak_plan.KINDS``) at a step drawn from the seed. Each job is compared with one uninterrupted
reference run of its configuration: **torn** if any logged loss or state differs; **hung** if it outlives its
deadline; **leaked** if processes or shared-memory files of the job are left after it ends; **failed** if it did
not end as it should. A progress line per job; the table and the JSON at the end (the JSON is rewritten after every
job, so an interrupted soak can ``--resume-from`` it).
An object_store_outage job persists to an ``s3://`` save_dir on a local S3 server (moto's server mode, one per
soak, ``soak_store``) through a fault proxy that goes down inside a persist. Kinds the product cannot take yet
would be named as pending, never thrown; a disk_full whose tmpfs cannot be mounted (not root) is "not run", with
why, never a pass.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_check import Reference, format_table, judge, reference_rows, table  # noqa: E402
from soak_faults import DISK_MB, RUNNERS, STOP_BEYOND, Strike, tmpfs  # noqa: E402
from soak_job import Cluster, Hung  # noqa: E402
from soak_plan import (  # noqa: E402
    CONFIGS,
    DEFAULT_CONFIGS,
    KINDS,
    Fault,
    Shape,
    available_kinds,
    check_configs,
    check_names,
    expected_cost,
    fitting,
    plan,
)

# every kind two or three times (kinds come in blocks, soak_plan.plan)
SMOKE = {"faults": 20, "configs": ["plain-1x1", "plain-2x1"], "steps": 12, "interval": 3}
LEAK_GRACE = 30.0     # seconds a job's agents get to exit and free their memory once its ranks ended
SETTINGS = ("seed", "kinds", "configs", "steps", "interval")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=None, help="how many faults (jobs); default 100, or 20 with --smoke")
    p.add_argument("--seed", type=int, default=None, help="the seed every fault is drawn from (default: random, printed)")
    p.add_argument("--json", type=Path, required=True, help="where the result goes (rewritten after every job)")
    p.add_argument("--resume-from", type=Path, default=None, help="a JSON of an interrupted soak: run its missing faults")
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="add up the JSONs of several soaks; runs nothing")
    p.add_argument("--only", type=int, action="append", default=None, help="run only fault K of the seed (repeatable)")
    p.add_argument("--smoke", action="store_true", help="20 faults on 1x1 and 2x1 plain jobs of 12 steps (CI)")
    p.add_argument("--kinds", default=None, help="fault kinds to draw from, comma separated (default: every kind "
                   "the product can take that applies to one of --configs)")
    p.add_argument("--configs", default=None, help=f"job configurations, comma separated (of {', '.join(CONFIGS)}; "
                   f"default {', '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 20)")
    p.add_argument("--interval", type=int, default=None, help="save_storage_interval / save_steps (default 5)")
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds a job may take before it counts as hung "
                   "(HF jobs: 1.5x)")
    p.add_argument("--jobs", type=int, default=1, help="jobs run side by side (default 1; per-job CPU seconds are "
                   "only recorded with 1)")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default /tmp/easyckpt-soak-<seed>)")
    p.add_argument("--keep", action="store_true", help="keep every job's directory (default: only bad jobs')")
    p.add_argument("--reference-cache", type=Path, default=None,
                   help="a directory of reference runs: one of the same configuration, steps and interval found there "
                        "is taken instead of running it again, one run is stored there (for soaks of one checkout on "
                        "one machine, as the tests' smoke and replays: a reference is only valid for the code it ran)")
    return p.parse_args(argv)


def machine() -> dict[str, Any]:
    def version(name: str) -> str | None:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
        return None

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": version("torch"), "transformers": version("transformers"), "easyckpt": version("easyckpt"),
            "loadavg_at_start": [round(x, 1) for x in os.getloadavg()]}   # other work on the machine slows every job


def children_cpu() -> float:
    """CPU seconds of the launchers and their ranks so far (the agents, started in sessions of their own and
    never waited for, are not counted): what a job costs on any machine, where wall time says how busy this one was."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def check_json(path: Path) -> None:
    """Refuse a ``--json`` path the soak could not write, before any job runs: the result is written after each job,
    and a directory given for a file once lost every run of a soak at its first write."""
    if path.is_dir():
        raise SystemExit(f"--json {path}: a directory, not a file; give a file's path, e.g. {path / 'soak.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.partial")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise SystemExit(f"--json {path}: cannot be written ({exc.strerror or exc}); give a path in a directory this "
                         f"user can write") from None


def read_soak(path: Path, option: str) -> dict[str, Any]:
    """An earlier soak's JSON (``--resume-from``, ``--merge``), or SystemExit naming the file and what it needs."""
    try:
        found = json.loads(path.read_text())
    except OSError as exc:
        raise SystemExit(f"{option} {path}: cannot be read ({exc.strerror or exc}); give the --json file of an "
                         f"earlier soak") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{option} {path}: not a soak's JSON ({exc})") from None
    if not isinstance(found, dict) or not isinstance(found.get("runs"), list) or "seed" not in found:
        raise SystemExit(f"{option} {path}: not a soak's JSON (no seed and runs); give the --json file of an earlier "
                         f"soak")
    return found


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(result, indent=1))
    os.replace(partial, path)


def run_reference(name: str, shape: Shape, work: Path, timeout: float) -> tuple[Reference, dict[str, Any]]:
    config = CONFIGS[name]
    started = time.monotonic()
    cluster = Cluster(config, work / f"reference-{name}", shape=shape, deadline=started + timeout)
    try:
        cluster.start_all()
        codes = cluster.wait_all()
        if any(codes.values()):
            raise RuntimeError(f"the reference run of {name} failed {codes}: {cluster.tail()}")
        rows = reference_rows(cluster)
        procs, files = cluster.wait_clean(LEAK_GRACE)
        if procs or files:
            raise RuntimeError(f"the reference run of {name} leaked {procs} {files}")
        return rows, {"seconds": round(time.monotonic() - started, 1)}
    finally:
        cluster.cleanup()


def cached_reference(cache: Path | None, name: str, shape: Shape,
                     run: Callable[[], tuple[Reference, dict[str, Any]]]) -> tuple[Reference, dict[str, Any]]:
    """``run()``'s reference, or the one stored in ``cache`` for this configuration and shape: a job's reference is
    a pure function of them (the examples seed everything), so soaks of one checkout can share it."""
    if cache is None:
        return run()
    path = cache / f"{name}-{shape.first}-{shape.last}-every{shape.interval}.json"
    try:
        stored = json.loads(path.read_text())
        rows = {int(rank): {int(step): row for step, row in steps.items()} for rank, steps in stored["rows"].items()}
        return rows, {**stored["info"], "cached": str(path)}
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # The reference can always be run again: a damaged entry costs one run, never the soak.
        print(f"reference cache {path} is unreadable ({type(exc).__name__}: {exc}): running the reference again "
              f"and replacing it", flush=True)
    rows, info = run()
    write(path, {"rows": rows, "info": info})
    return rows, info


def run_job(fault: Fault, shape: Shape, ref: Callable[[], Reference], work: Path, timeout: float, keep: bool,
            cpu_of_children: bool = True, seed: int = 0, repeat: int = 0) -> dict[str, Any]:
    """``ref`` gives the reference run of the job's configuration, waiting for it: only the judge needs it, so a
    job starts while the reference still runs. ``repeat`` numbers a fault asked for again (``--only K --only K``):
    each run gets a directory of its own, since they may run side by side."""
    config = CONFIGS[fault.config]
    started, cpu = time.monotonic(), children_cpu()
    limit = timeout * (1.5 if config.api == "hf" else 1.0) + (fault.hold_s + STOP_BEYOND[config.api]
                                                              if fault.kind == "rank_stop" else 0.0)
    root = work / (f"job-{fault.index:05d}" + (f"-{repeat + 1}" if repeat else ""))
    shutil.rmtree(root, ignore_errors=True)
    record: dict[str, Any] = {"index": fault.index, "fault": fault.kind, "moment": fault.moment,
                              "variant": fault.variant, "config": fault.config, "step": fault.step,
                              "victim": fault.victim, "hung": False, "leaked": False, "torn": False, "failed": False,
                              "not_run": False}
    with contextlib.ExitStack() as stack:
        disk = None
        if fault.kind == "disk_full":
            try:
                disk = stack.enter_context(tmpfs(root / "disk", DISK_MB))
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                # never counted as passed: the table shows it under "not run", with why
                record.update(not_run=True, fired=False, why=[str(exc)], seconds=round(time.monotonic() - started, 1))
                return record
        store = None
        if fault.kind == "object_store_outage":
            import soak_store  # here: moto and boto3 (the test extra) only for the jobs that use them

            store = soak_store.job_store(seed, fault.index)
            stack.callback(store.close)
        cluster = Cluster(config, root, shape=shape, deadline=started + limit, disk=disk, store=store)
        stack.callback(cluster.cleanup)
        strike = Strike(at=None)
        try:
            strike = RUNNERS[fault.kind](cluster, fault)
            codes = cluster.wait_all()
            if store is not None:
                store.proxy.come_back()   # for the judge: the tracker and `easyckpt verify` read the store
            record.update(judge(cluster, ref(), strike, codes))
        except Hung as exc:
            alive = cluster.dump_stacks()
            record.update(hung=True, why=[f"hung: still waiting for {exc} after {limit:.0f} s"],
                          tail=cluster.tail(1500),
                          notes=[f"{len(alive)} live processes (pid, state, command: {alive}) wrote their stacks to "
                                 f"the job's logs in {cluster.out}"])
        except Exception as exc:  # noqa: BLE001 - a job that breaks the harness is a failed run, said and kept
            record.update(failed=True, why=[f"{type(exc).__name__}: {exc}"], tail=cluster.tail(1500))
        record.update(at=strike.at, fired=strike.fired, notes=record.get("notes", []) + strike.notes)
        if not record["hung"] and not record["failed"]:
            # a failed final persist: the agents keep the only copy, and say so
            procs, files = cluster.wait_clean(LEAK_GRACE, kept=strike.expect_error)
            if strike.expect_error:
                record["kept"] = sorted(cluster.kept())
            if procs or files:
                record.update(leaked=True, leftovers=procs + files)
        bad = any(record[k] for k in ("torn", "hung", "leaked", "failed"))
        cluster.cleanup()
    record.update(seconds=round(time.monotonic() - started, 1))
    if cpu_of_children:   # jobs side by side share the counter: then no job's own figure can be told
        record["cpu_s"] = round(children_cpu() - cpu, 1)
    if bad or keep:
        record["dir"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return record


def describe(record: dict[str, Any]) -> str:
    if record.get("source") in (None, "none"):
        outcome = "no resume"
    else:
        outcome = f"{record['source']} at {record['resumed_at']}, lost {record['lost']}"
    flags = [k.upper().replace("_", " ") for k in ("torn", "hung", "leaked", "failed", "not_run") if record.get(k)]
    if not record.get("fired", True) and not record.get("not_run"):
        flags.append("not fired")
    why = "; ".join(record.get("why", []))[:300]
    return f"{outcome}, {' '.join(flags) or 'ok'}{': ' + why if why else ''}"


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    check_json(out)
    parts = [read_soak(p, "--merge") for p in paths]
    seeds = [part["seed"] for part in parts]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: the same seed twice in {seeds}: its faults would count twice")
    runs = [{**run, "seed": part["seed"]} for part in parts for run in part["runs"]]
    result = {"seeds": seeds, "faults": sum(p["faults"] for p in parts), "merged": [str(p) for p in paths],
              "complete": all(p.get("complete") for p in parts), "machine": parts[0].get("machine"),
              "duration_s": round(sum(p.get("duration_s", 0) for p in parts), 1), "runs": runs, "table": table(runs)}
    write(out, result)
    print(format_table(result["table"]))
    print(f"{len(runs)} faults from seeds {seeds}, {result['duration_s'] / 3600:.2f} h of soaking; wrote {out}")
    return result


def pending() -> dict[str, str]:
    """Fault kinds of the issue the product cannot take yet: never thrown, always named in the output."""
    return {name: kind.unavailable for name, kind in KINDS.items() if kind.unavailable}


def settle(args: argparse.Namespace, prior: dict[str, Any]) -> dict[str, Any]:
    """The soak's settings: the command line's, else the resumed JSON's, else the defaults (smoke's with --smoke)."""
    settings = {"seed": args.seed, "kinds": args.kinds.split(",") if args.kinds else None, "steps": args.steps,
                "interval": args.interval, "configs": args.configs.split(",") if args.configs else None,
                "faults": args.faults}
    defaults = {**SMOKE} if args.smoke else {"faults": 100, "configs": DEFAULT_CONFIGS, "steps": 20, "interval": 5}
    defaults["kinds"] = available_kinds()
    for key, value in settings.items():
        if prior and value is not None and key in prior and prior[key] != value:
            raise SystemExit(f"--resume-from {args.resume_from}: it ran {key}={prior[key]!r}, not {value!r}")
        settings[key] = prior.get(key, value) if value is None else value
        if settings[key] is None:
            settings[key] = defaults[key] if key != "seed" else random.SystemRandom().randrange(1 << 30)
    check_configs(settings["configs"])   # the kinds left out below are looked up by configuration
    if args.kinds is None and "kinds" not in prior:
        # every kind by default: those that fit none of the chosen configurations are left out, and said so
        left_out = [kind for kind in settings["kinds"] if not fitting(kind, settings["configs"])]
        if left_out:
            print(f"left out: {', '.join(left_out)} (applies to none of {', '.join(settings['configs'])})", flush=True)
            settings["kinds"] = [kind for kind in settings["kinds"] if kind not in left_out]
    check_names(settings["kinds"], settings["configs"])
    return settings


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_signals() -> Any:
    """Ctrl-C and SIGTERM stop a soak alike: no new job starts, those under way end and clean up, and the JSON
    keeps every finished job (``--resume-from`` runs the rest). SIGINT is set here because a shell starts a
    background command (``soak.py ... &``) with SIGINT ignored, and Python then leaves it ignored: such a soak
    could only be killed, leaving its jobs' processes and memory behind. The handlers before are restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in before:
        signal.signal(signum, _interrupt)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.merge:
        return merge(args.merge, args.json)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be 1 or more, got {args.jobs}")
    if args.reference_cache is not None and args.reference_cache.exists() and not args.reference_cache.is_dir():
        raise SystemExit(f"--reference-cache {args.reference_cache}: a file, not a directory; give a directory (it is "
                         f"created if missing) where the reference runs are kept")
    check_json(args.json)
    prior: dict[str, Any] = read_soak(args.resume_from, "--resume-from") if args.resume_from else {}
    settings = settle(args, prior)
    seed = settings["seed"]
    print(f"soak seed {seed}: {settings['faults']} faults of {settings['kinds']} on {settings['configs']}, "
          f"{settings['steps']} steps, persist every {settings['interval']}, {args.jobs} job(s) at a time "
          f"(replay: --seed {seed})", flush=True)
    for name, why in pending().items():
        print(f"pending, not thrown: {name} ({why})", flush=True)
    work = args.dir or Path(f"/tmp/easyckpt-soak-{seed}")
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = list(prior.get("runs", []))
    done = {run["index"] for run in runs}
    indices = args.only if args.only is not None else list(range(settings["faults"]))
    faults = [plan(seed, index, kinds=settings["kinds"], configs=settings["configs"], steps=settings["steps"],
                   interval=settings["interval"]) for index in indices if index not in done]
    result = {**settings, "only": args.only, "jobs": args.jobs, "pending": pending(), "machine": machine(),
              "references": dict(prior.get("references", {})), "runs": runs, "complete": False,
              "duration_s": prior.get("duration_s", 0.0)}
    shapes = {name: Shape.of(CONFIGS[name].api, settings["steps"], settings["interval"]) for name in CONFIGS}
    started, base, lock = time.monotonic(), result["duration_s"], threading.Lock()
    total = len(indices)

    def reference(name: str) -> Reference:
        rows, info = cached_reference(args.reference_cache, name, shapes[name],
                                      lambda: run_reference(name, shapes[name], work, args.job_timeout * 2))
        with lock:
            result["references"][name] = info
            print(f"reference run of {name}: " + (f"taken from {info['cached']} (it took {info['seconds']} s)"
                                                  if "cached" in info else f"{info['seconds']} s"), flush=True)
        return rows

    def job(fault: Fault, ref: Future[Reference], repeat: int) -> None:
        record = run_job(fault, shapes[fault.config], ref.result, work, args.job_timeout, args.keep,
                         cpu_of_children=args.jobs == 1, seed=seed, repeat=repeat)
        ref.result()   # a broken reference stops the soak with its own error, not as a failed job
        with lock:
            runs.append(record)
            runs.sort(key=lambda run: run["index"])   # the JSON lists the faults in the order they were asked for
            cpu = f", {record['cpu_s']} s CPU" if "cpu_s" in record else ""
            print(f"[{len(runs)}/{total}] #{fault.index} {fault.label()} {fault.config} @{fault.step} -> "
                  f"{describe(record)} ({record.get('seconds')} s{cpu})", flush=True)
            result.update(duration_s=round(base + time.monotonic() - started, 1), table=table(runs))
            write(args.json, result)

    with ThreadPoolExecutor(max_workers=args.jobs, thread_name_prefix="soak") as pool:
        # the references first: a job's judge waits for its configuration's, which the pool has already started
        refs = {name: pool.submit(reference, name) for name in dict.fromkeys(f.config for f in faults)}
        # the longest jobs first: the pool's lanes then run dry together (the JSON keeps the order asked for)
        repeats = [sum(f.index == fault.index for f in faults[:n]) for n, fault in enumerate(faults)]
        futures = [pool.submit(job, fault, refs[fault.config], repeat)
                   for fault, repeat in sorted(zip(faults, repeats), key=lambda fr: expected_cost(fr[0]), reverse=True)]
        try:
            with stop_on_signals():
                for future in futures:
                    future.result()
        except BaseException as exc:   # a stop signal or a broken reference: the jobs under way end and clean up
            if isinstance(exc, KeyboardInterrupt):
                print(f"stopping ({exc or 'Ctrl-C'}): the jobs under way end and clean up, no new one starts; "
                      f"--resume-from {args.json} runs the rest", flush=True)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    result.update(complete=True, duration_s=round(base + time.monotonic() - started, 1), table=table(runs),
                  loadavg_at_end=[round(x, 1) for x in os.getloadavg()])
    write(args.json, result)
    print(format_table(result["table"]))
    for name, why in pending().items():
        print(f"pending, not thrown: {name} ({why})")
    cpu = [run["cpu_s"] for run in runs if "cpu_s" in run]
    per_job = f", {sum(cpu) / len(cpu):.1f} s of CPU a job in the launchers and ranks" if cpu else ""
    print(f"seed {seed}: {len(runs)} faults in {result['duration_s'] / 60:.1f} min "
          f"({result['duration_s'] / max(1, len(runs)):.1f} s a job{per_job}, {args.jobs} at a time); "
          f"wrote {args.json}", flush=True)
    return result


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:   # a stop asked for: the line above said how to resume, a traceback would add nothing
        sys.exit(130)
