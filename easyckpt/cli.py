"""``easyckpt ls DIR | verify DIR | status | convert``: look at checkpoints and at the node agent."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from easyckpt import storage
from easyckpt.agent_client import AgentTimeout, query_status
from easyckpt_wire import layout, protocol
from easyckpt_wire.shm import format_bytes


def cmd_ls(args: argparse.Namespace) -> int:
    save_dir = Path(args.dir)
    if not save_dir.is_dir():
        print(f"{save_dir}: no such directory", file=sys.stderr)
        return 2
    rows = layout.list_iterations(save_dir)
    tracker = layout.read_tracker(save_dir)
    print(f"{'iteration':<20} {'step':>10} {'size':>12}  status")
    for step, path, complete in rows:
        status = "complete" if complete and _parses(path) else "INCOMPLETE (no commit marker)"
        mark = "  <- tracker" if step == tracker else ""
        print(f"{path.name:<20} {step:>10} {format_bytes(storage.iteration_bytes(path)):>12}  {status}{mark}")
    if not rows:
        print("(no iterations)")
    return 0


def _parses(path: Path) -> bool:
    try:
        layout.read_metadata(path)
        return True
    except layout.CheckpointFormatError:
        return False


def cmd_verify(args: argparse.Namespace) -> int:
    save_dir = Path(args.dir)
    if not save_dir.is_dir():
        print(f"{save_dir}: no such directory", file=sys.stderr)
        return 2
    if layout.ITERATION_RE.match(save_dir.name):
        results = [r for r in storage.verify(save_dir.parent) if r[1] == save_dir]
    else:
        results = storage.verify(save_dir)
    bad = 0
    for step, path, problem in results:
        print(f"{path.name}: {'OK' if problem is None else 'DAMAGED: ' + problem}")
        bad += problem is not None
    if not results:
        print(f"{save_dir}: no iterations to verify")
    print(f"{len(results) - bad} ok, {bad} damaged")
    return 1 if bad else 0


def cmd_status(args: argparse.Namespace) -> int:
    base = protocol.runtime_base()
    if args.job_id or args.save_dir:
        jobs = [base / protocol.job_dir_name(args.job_id or protocol.job_id_for(args.save_dir))]
    else:  # every agent of this user on this node (several simulated nodes share one runtime base)
        jobs = sorted(p for p in base.iterdir() if (p / "agent.sock").exists()) if base.is_dir() else []
    if not jobs:
        print("no easyckpt agent found (is a job running on this node?)")
        return 1
    code = 0
    reports = []
    for job in jobs:
        try:
            reports.append(query_status(job, timeout=args.timeout))
        except AgentTimeout as exc:
            reports.append({"job_id": job.name, "error": str(exc)})
            code = 1
    if args.json:
        print(json.dumps(reports, indent=2))
        return code
    for report in reports:
        if "error" in report:
            print(f"job {report['job_id']}: {report['error']}")
            continue
        print(f"job {report['job_id']}: agent pid {report['pid']}, save_dir {report['save_dir']}, "
              f"shm {report['shm_dir']}, persist every {report['save_storage_interval']}, keep {report['max_ckpt_num']}")
        for rank in report["ranks"]:
            state = "finished" if rank["finished"] else ("alive" if rank["alive"] else "DEAD")
            print(f"  rank {rank['rank']}: pid {rank['pid']} {state}")
        for slot in report["slots"]:
            print(f"  rank {slot['rank']} slot {slot['slot']}: {slot['state']:<10} step {slot['step']} "
                  f"({format_bytes(slot['bytes'])})")
        if report.get("endpoint"):
            print(f"  node {report['node']} at {report['endpoint']}; leader {report['leader']}, buddy {report['buddy']}; "
                  f"nodes {report['nodes']}")
            code = max(code, _print_coverage(report.get("coverage")))
        last = report["last_persist"]
        print(f"  newest on disk: step {report['persisted_step']}" + (
            f"; last persist step {last['step']}, {format_bytes(last['bytes'])} in {last['seconds']:.2f}s"
            if last else "") + (f"; persisting step {report['persisting']}" if report["persisting"] is not None else "")
            + (f"; asked to persist steps {report['flush_requested']}" if report.get("flush_requested") else ""))
    return code


def _print_coverage(coverage: dict | None) -> int:
    """Copies in memory across nodes of each rank's tensors at the newest step; 0, or 2 on a warning."""
    if not coverage or coverage.get("step") is None:
        print("  replica coverage: not surveyed yet")
        return 0
    age = time.time() - coverage["as_of"]
    print(f"  replica coverage of step {coverage['step']} (surveyed {age:.0f}s ago)"
          + (f", unreachable nodes: {coverage['unreachable']}" if coverage["unreachable"] else ""))
    warned = 0
    for rank, info in sorted(coverage["ranks"].items(), key=lambda item: int(item[0])):
        line = f"    rank {rank}: {info['copies']} cop{'y' if info['copies'] == 1 else 'ies'} of every tensor"
        if info["copies"] == 0:
            line = f"    rank {rank}: NOT RECOVERABLE from memory; missing {info.get('missing') or 'its manifest'}"
        elif info["copies"] == 1:
            line += f"; WARNING: single copy of {info['single']}: losing that node loses them"
        warned |= info["copies"] <= 1
        print(line)
    return 2 if warned else 0


def cmd_convert(args: argparse.Namespace) -> int:
    """easyckpt -> Megatron's native legacy format (iter_N/mp_rank_XX/model_optim_rng.pt + tracker)."""
    from easyckpt.megatron.legacy import LegacyCheckpointError, convert_to_megatron

    src, dst = Path(args.src), Path(args.dst)
    if not src.is_dir():
        print(f"{src}: no such directory", file=sys.stderr)
        return 2
    try:
        step, files = convert_to_megatron(src, dst, no_optim=args.no_optim)
    except (LegacyCheckpointError, layout.CheckpointFormatError, OSError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    print(f"wrote iteration {step} of {src} as a Megatron checkpoint in {dst} ({len(files)} file(s)); "
          f"load it with Megatron's --load {dst} --ckpt-format torch")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="easyckpt", description="Inspect easyckpt checkpoints and agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list iterations: step, size, complete or not")
    ls.add_argument("dir")
    ls.set_defaults(func=cmd_ls)
    verify = sub.add_parser("verify", help="re-read every file and check every checksum (exit 1 on damage)")
    verify.add_argument("dir", help="a save_dir or one iteration_N directory")
    verify.set_defaults(func=cmd_verify)
    status = sub.add_parser("status", help="the agent's view: ranks, slots, steps, last persist")
    status.add_argument("--save-dir", help="the job's save_dir (default: every agent of this user)")
    status.add_argument("--job-id", help="the job id (EASYCKPT_JOB_ID)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(func=cmd_status)
    convert = sub.add_parser("convert", help="write a checkpoint in another framework's native format")
    convert.add_argument("--to", required=True, choices=["megatron"], help="target format")
    convert.add_argument("src", help="an easyckpt save_dir (its newest complete iteration) or one iteration_N directory")
    convert.add_argument("dst", help="the Megatron checkpoint directory to write (its --load)")
    convert.add_argument("--no-optim", action="store_true",
                         help="leave optimizer and scheduler out (resume Megatron with --no-load-optim)")
    convert.set_defaults(func=cmd_convert)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
