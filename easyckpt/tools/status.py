"""``easyckpt status`` and ``easyckpt clean``: a job's agent and what it left in shared memory, as this node sees it.

``status`` asks the agent (its ``STATUS`` request) and, when none answers, says from the runtime directory,
the slot files and save_dir what state the job is in: running, ended (nothing left in memory: the normal
end), crashed with its snapshots left in shared memory, or an agent missing while ranks live. Like the rest
of the CLI it never imports torch.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from easyckpt.node.client import AgentTimeout, query_status
from easyckpt.tools import checks
from easyckpt_wire import layout, owner, protocol, runtime
from easyckpt_wire.control import control_path
from easyckpt_wire.savedir import AuditLog, clean_leftovers
from easyckpt_wire.shm import (
    HEADER_SIZE,
    SlotFormatError,
    SlotMap,
    SlotState,
    format_bytes,
    list_slots,
    shm_dir,
)
from easyckpt_wire.storage import as_path


def cmd_status(args: argparse.Namespace) -> int:
    base = protocol.runtime_base()
    if args.save_dir_pos and args.save_dir and Path(args.save_dir_pos).resolve() != Path(args.save_dir).resolve():
        print(f"status: SAVE_DIR {args.save_dir_pos} and --save-dir {args.save_dir} differ: give one of them",
              file=sys.stderr)
        return 2
    save_dir = args.save_dir_pos or args.save_dir
    if save_dir and Path(save_dir).exists() and not Path(save_dir).is_dir():
        print(f"status: {save_dir} is a file, not a directory: give the job's save_dir", file=sys.stderr)
        return 2
    if args.job_id or save_dir:
        job = base / protocol.job_dir_name(args.job_id or protocol.job_id_for(save_dir))
        entry, code = _probe(job, args.timeout, named=True, save_dir=save_dir)
        entries = [entry] if entry is not None else []
    else:
        # Every job of this user on this node (several simulated nodes share one runtime base). Job
        # directories outlive their agents, so only live and recoverable ones are shown.
        try:
            jobs = sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
        except OSError as exc:
            print(f"status: cannot list the runtime directory {base}: {exc.strerror}; set "
                  f"{protocol.RUNTIME_DIR_ENV} to the directory your jobs use", file=sys.stderr)
            return 1
        entries, code = [], 0
        for job in jobs:
            entry, job_code = _probe(job, args.timeout, named=False)
            if entry is not None:
                entries.append(entry)
                code = max(code, job_code)
            else:
                _prune(job)
    if args.json:
        print(json.dumps(entries, indent=2))
        return code
    if not entries:
        print(f"no easyckpt job is running (looked for agents in {base} and their slot files in {shm_dir()})")
        return 0
    for entry in entries:
        if entry["job_state"] == "live":
            code = max(code, _print_live(entry))
        elif entry["job_state"] in ("ended", "unknown"):
            _print_ended(entry)
        else:
            if "error" in entry:
                print(f"job {Path(entry['job_dir']).name}: {entry['error']}")
            if entry.get("slot_files"):  # a job whose agent does not answer has none listed: it still holds them
                _print_recoverable(entry)
    return code


def _probe(job: Path, timeout: float, *, named: bool, save_dir: str | None = None) -> tuple[dict[str, Any] | None, int]:
    """One job directory as a status entry and its exit code; None for a job that is over (its agent gone,
    no slot left) unless the user ``named`` it. ``job_state``: live, not answering, recoverable (no agent,
    snapshots left in memory), no agent (while ranks live), ended (nothing left but what is on disk)."""
    try:
        return {**query_status(job, timeout=timeout), "job_dir": str(job), "job_state": "live"}, 0
    except AgentTimeout as exc:
        error = str(exc)
    if protocol.agent_running(job):  # alive but busy or stuck: the one state that needs someone to look
        return {"job_id": job.name, "job_dir": str(job), "job_state": "not answering", "error": error}, 1
    # The agent is gone (or exited while we asked). The job dir is "<job_id>" or "<job_id>@<node>"
    # (protocol.job_dir_name) and a job id never contains "@" (shm.check_job_id).
    job_id = job.name.partition("@")[0]
    slots = _slot_files(job_id)
    if not slots and not named:
        return None, 0
    live = [f"rank {o.rank} (pid {o.pid})" for o in owner.live_owners(job)] if job.is_dir() else []
    directory = shm_dir()
    control = control_path(directory, job_id)
    recorded = save_dir or _recorded_save_dir(job, job_id)
    save = str(as_path(recorded).resolve()) if recorded else None
    if not slots and not live:
        # The normal end: the agent persisted the newest snapshot, released the memory and exited (and
        # removed its runtime directory). What is left is on disk.
        disk = _disk(save)
        # No runtime directory (a clean end removes it) and nothing on disk: nothing shows that it ever ran here.
        known = job.is_dir() or bool(disk and disk["steps"])
        entry: dict[str, Any] = {"job_id": job_id, "job_dir": str(job), "job_state": "ended" if known else "unknown",
                                 "shm_dir": str(directory), "save_dir": save, "disk": disk}
        return entry, 0 if known else 1
    entry = {
        "job_id": job_id, "job_dir": str(job), "job_state": "recoverable" if slots and not live else "no agent",
        "shm_dir": str(directory), "slot_files": slots, "live_ranks": live,
        # The agent's control block goes with the slots: a block left alone would hand a later run of the
        # job a safe step whose slots are gone.
        "control_file": str(control) if control.exists() else None,
        "remove": _clean_command(job, job_id),
        "save_dir": save,
    }
    if save is not None and as_path(save).is_dir():
        entry["persisted_step"] = max((step for step, _ in layout.complete_iterations(as_path(save))), default=None)
    if named:  # asked about this job by name: its memory is held by no agent, or its ranks run without one
        log = job / "agent.log"
        entry["error"] = ("no agent is running" + (f" while {', '.join(live)} live: the next snapshot starts one"
                                                   if live else "")
                          + (f" (its log: {log})" if log.is_file() else ""))
        return entry, 1
    return entry, 0


def _disk(save_dir: str | None) -> dict[str, Any] | None:
    """What ``save_dir`` holds, judged without reading tensors (``checks.damage``): None when unknown."""
    if save_dir is None or not as_path(save_dir).is_dir():
        return None
    complete = layout.complete_iterations(as_path(save_dir))
    damaged = [step for step, path in complete if checks.damage(path) is not None]
    return {"steps": [step for step, _ in complete], "tracker": layout.read_tracker(as_path(save_dir)),
            "damaged": damaged, "bytes": sum(checks.dir_bytes(path) for _, path in complete)}


def _print_ended(entry: dict[str, Any]) -> None:
    save, disk = entry["save_dir"], entry["disk"]
    if entry["job_state"] == "unknown":
        print(f"no job {entry['job_id']}" + (f" of save_dir {save}" if save else "") + " is known on this node: no "
              f"agent runs for it, nothing of it is in shared memory ({entry['shm_dir']}), and its runtime directory "
              f"{entry['job_dir']} does not exist")
    else:
        print(f"job {entry['job_id']} has ended: no agent runs and nothing of it is left in shared memory "
              f"({entry['shm_dir']})")
    if save is None:
        print("  give its SAVE_DIR to see what is on disk")
    elif disk is None:
        print(f"  {save}: no such directory, so nothing of this job is on disk either (is it the right save_dir?)")
    elif not disk["steps"]:
        print(f"  nothing on disk in {save}: no complete iteration")
    else:
        steps = disk["steps"]
        shown = ("..., " if len(steps) > 5 else "") + ", ".join(map(str, steps[-5:]))
        tracked = (f"the tracker names step {disk['tracker']}" if disk["tracker"] in steps
                   else f"no tracker names one of them (a load takes the newest, step {steps[-1]})")
        print(f"  on disk in {save}: {len(steps)} complete iteration(s), steps {shown}, "
              f"{format_bytes(disk['bytes'])}; {tracked}"
              + (f"; DAMAGED: steps {disk['damaged']} (`easyckpt ls {save}`)" if disk["damaged"] else ""))


def _recorded_save_dir(job: Path, job_id: str) -> str | None:
    """The job's save_dir as its ranks recorded it (owner files), if they agree and it maps to ``job_id``."""
    save_dirs = set()
    for rank, path in owner.list_owner_files(job).items():
        recorded = owner.read_owner(path, rank)
        if recorded is not None:
            save_dirs.add(recorded.save_dir)
    if len(save_dirs) == 1 and protocol.job_id_for(next(iter(save_dirs))) == job_id:
        return next(iter(save_dirs))
    return None


def _clean_command(job: Path, job_id: str) -> str:
    """The ``easyckpt clean`` line that removes this job's slots and runtime directory: by save_dir when a
    rank recorded it, else by job id, with the node id the directory name carries."""
    _, _, node = job.name.partition("@")
    prefix = f"{protocol.NODE_ID_ENV}={shlex.quote(node)} " if node else ""
    save_dir = _recorded_save_dir(job, job_id)
    if save_dir is not None:
        return f"{prefix}easyckpt clean {shlex.quote(save_dir)}"
    return f"{prefix}easyckpt clean --job-id {shlex.quote(job_id)}"


def _prune(job: Path) -> bool:
    """Remove the runtime directory of a job that is over (no agent, no slot, no live rank, left alone for
    runtime.STALE_AFTER); the agent removes its own at a clean end, this catches crashed and older ones."""
    try:
        names = os.listdir(job)
    except OSError:
        return False
    job_id = job.name.partition("@")[0]
    if not runtime.prunable(names, age=time.time() - runtime.newest_mtime(job), agent_running=protocol.agent_running(job),
                            slots=len(list_slots(shm_dir(), job_id)), live_ranks=len(owner.live_owners(job))):
        return False
    fd = runtime.lock_existing(job)
    if fd is None:
        return False
    try:
        return runtime.remove_runtime_dir(job, keep=set())
    except OSError:
        return False
    finally:
        os.close(fd)


def cmd_clean(args: argparse.Namespace) -> int:
    """Remove a job's slot files, control block and runtime directory once none of its processes lives."""
    save_dir = args.save_dir_pos or args.save_dir
    if args.save_dir_pos and args.save_dir and Path(args.save_dir_pos).resolve() != Path(args.save_dir).resolve():
        print(f"clean: SAVE_DIR {args.save_dir_pos} and --save-dir {args.save_dir} differ: give one of them",
              file=sys.stderr)
        return 2
    if not (save_dir or args.job_id):
        print("clean: give the job's SAVE_DIR (or --job-id)", file=sys.stderr)
        return 2
    job_id = args.job_id or protocol.job_id_for(save_dir)
    job = protocol.runtime_base() / protocol.job_dir_name(job_id)
    what = f"job {job_id}" + (f" (save_dir {save_dir})" if save_dir else "")
    alive = _live_processes(job)
    if alive:
        print(f"clean: {what} is still running: {', '.join(alive)}. Its slots are in use; stop those processes "
              f"(or let the job end) and run this again", file=sys.stderr)
        return 1
    fd = runtime.lock_existing(job) if job.is_dir() else None
    if job.is_dir() and fd is None and protocol.agent_running(job):
        print(f"clean: the agent of {what} started meanwhile: {', '.join(_live_processes(job))}; nothing removed",
              file=sys.stderr)
        return 1
    try:
        directory = shm_dir()
        slots = _slot_files(job_id)
        removed, freed = 0, 0
        steps = sorted({s["step"] for s in slots if s["step"] is not None})
        for slot in slots:
            Path(slot["path"]).unlink(missing_ok=True)
            removed += 1
            freed += slot["memory_bytes"]
            print(f"removed {slot['path']} (rank {slot['rank']} slot {slot['slot']}, "
                  f"{'step ' + str(slot['step']) if slot['step'] is not None else slot['state']}, "
                  f"{format_bytes(slot['memory_bytes'])})")
        control = control_path(directory, job_id)
        if control.exists():
            control.unlink(missing_ok=True)
            removed += 1
            print(f"removed {control} (the agent's control block)")
        if job.is_dir():
            if runtime.remove_runtime_dir(job, keep=set()):
                print(f"removed {job} (runtime directory)")
            else:
                print(f"kept {job}: it holds files that are not easyckpt's")
            removed += 1
    finally:
        if fd is not None:
            os.close(fd)
    if save_dir:
        removed += _clean_storage(save_dir)
    if not removed:
        print(f"nothing to clean for {what} (no slot in {directory}, no runtime directory in {job.parent})")
        return 0
    on_disk = layout.read_tracker(as_path(save_dir)) if save_dir and as_path(save_dir).is_dir() else None
    print(f"freed {format_bytes(freed)} of shared memory" + (
        f"; the snapshots of step(s) {', '.join(map(str, steps))} are gone" if steps else "")
        + (f"; newest on disk: step {on_disk}" if save_dir else ""))
    return 0


def _clean_storage(save_dir: str) -> int:
    """What persists that did not finish left in ``save_dir`` (a dead writer's pending copy: on an object store,
    an iteration without its commit object), removed and audited as the agent's start does it."""
    where = as_path(save_dir)
    if not where.is_dir():
        return 0
    try:
        removed = clean_leftovers(where, AuditLog(where))
    except OSError as exc:
        print(f"clean: could not remove what unfinished persists left in {save_dir}: {exc}", file=sys.stderr)
        return 0
    for path in removed:
        print(f"removed {path} (left by a persist that did not finish)")
    return len(removed)


def _live_processes(job: Path) -> list[str]:
    """The job's live processes on this node, as 'agent pid N' and 'rank R pid N'."""
    alive = []
    if protocol.agent_running(job):
        try:
            pid = (job / "agent.pid").read_text().strip()
        except OSError:
            pid = "?"
        alive.append(f"agent pid {pid}")
    alive += [f"rank {o.rank} pid {o.pid}" for o in owner.live_owners(job)]
    return alive


def _slot_files(job_id: str) -> list[dict[str, Any]]:
    """The job's slot files in this node's shm dir: path, rank, slot, sizes, and the step each holds."""
    found = []
    for (rank, slot), path in sorted(list_slots(shm_dir(), job_id).items()):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue  # removed between the listing and now
        info: dict[str, Any] = {"path": str(path), "rank": rank, "slot": slot, "bytes": stat.st_size,
                                "memory_bytes": stat.st_blocks * 512, "state": "UNREADABLE", "step": None}
        if stat.st_size >= HEADER_SIZE:  # SlotMap leaks its fd when the file is too small to map
            try:
                # No flock: a shared lock, however short, makes a rank still writing skip its snapshot.
                # The header's generation says whether what we read is a committed snapshot.
                slot_map = SlotMap(path, writable=False)
                try:
                    header = slot_map.header()
                finally:
                    slot_map.close()
                if header.committed:
                    info["state"], info["step"] = "COMMITTED", header.step
                elif header.damaged:   # its header changed in memory after the commit: never loaded
                    info["state"] = "DAMAGED"
                else:  # an odd generation is a write that never finished (its rank died mid-snapshot)
                    info["state"] = "EMPTY" if header.state == SlotState.EMPTY else "INCOMPLETE"
            except (OSError, SlotFormatError, ValueError) as exc:
                info["error"] = str(exc)
        found.append(info)
    return found


def _print_recoverable(entry: dict[str, Any]) -> None:
    slots = entry["slot_files"]
    memory = sum(s["memory_bytes"] for s in slots)
    steps = sorted({s["step"] for s in slots if s["step"] is not None})
    if "error" not in entry:
        print(f"job {Path(entry['job_dir']).name}: no agent is running, but {len(slots)} slot file(s) of the job "
              f"are left in shared memory, holding {format_bytes(memory)}:")
    else:
        print(f"  {len(slots)} slot file(s) of the job are left in shared memory, holding {format_bytes(memory)}:")
    for slot in slots:
        what = f"step {slot['step']}" if slot["step"] is not None else slot["state"]
        size = format_bytes(slot["memory_bytes"]) + (
            f" (file size {format_bytes(slot['bytes'])})" if slot["bytes"] != slot["memory_bytes"] else "")
        print(f"  {slot['path']}: rank {slot['rank']} slot {slot['slot']}, {what}, {size}"
              + (f"; {slot['error']}" if "error" in slot else ""))
    if entry["control_file"]:
        print(f"  {entry['control_file']}: the agent's control block")
    if "persisted_step" in entry:
        on_disk = entry["persisted_step"]
        newer = [step for step in steps if on_disk is None or step > on_disk]
        print(f"  newest on disk in {entry['save_dir']}: " + ("nothing" if on_disk is None else f"step {on_disk}")
              + (f"; only in memory: step(s) {', '.join(map(str, newer))}" if newer else "; nothing newer in memory"))
    if steps:
        print(f"  they hold snapshots of step(s) {', '.join(map(str, steps))}, not necessarily on disk (see "
              f"`easyckpt ls SAVE_DIR`): restart the job with the same save_dir (and {protocol.JOB_ID_ENV}, if it "
              f"was set) to resume from them, or free the memory, once no process of the job is left, with:")
    else:
        print("  they hold no complete snapshot; free the memory, once no process of the job is left, with:")
    print(f"    {entry['remove']}")


def _print_live(report: dict[str, Any]) -> int:
    """The agent's report as text; 2 when replica coverage warrants a warning, else 0."""
    code = 0
    print(f"job {report['job_id']}: agent pid {report['pid']}, save_dir {report['save_dir']}, "
          f"shm {report['shm_dir']}, persist every {report['save_storage_interval']}, keep {report['max_ckpt_num']}")
    for rank in report["ranks"]:
        # "failed" is absent from an older agent's report
        state = ("finished" if rank["finished"] else "alive" if rank["alive"]
                 else "exited after its run failed" if rank.get("failed") else "DEAD")
        print(f"  rank {rank['rank']}: pid {rank['pid']} {state}")
    for slot in report["slots"]:
        print(f"  rank {slot['rank']} slot {slot['slot']}: {slot['state']:<10} step {slot['step']} "
              f"({format_bytes(slot['bytes'])})")
    _print_orphaned(report)
    if "safe_step" in report:
        held = report.get("held_steps") or []
        print(f"  safe step (every rank keeps it): {report['safe_step']}"
              + (f"; held for persisting: {held}" if held else ""))
        print(_protection(report))
    if report.get("endpoint"):
        print(f"  node {report['node']} at {report['endpoint']}; leader {report['leader']}, buddy {report['buddy']}; "
              f"nodes {report['nodes']}")
        code = max(code, _print_coverage(report.get("coverage")))
    last = report["last_persist"]
    print(f"  newest on disk: step {report['persisted_step']}" + (
        f"; last persist step {last['step']}, {format_bytes(last['bytes'])} in {last['seconds']:.2f}s"
        if last else "") + (f"; persisting step {report['persisting']}" if report["persisting"] is not None else "")
        + (f"; asked to persist steps {report['flush_requested']}" if report.get("flush_requested") else ""))
    failure = report.get("persist_failure")
    if failure:
        from easyckpt.node.persist_watch import describe_failure
        print(f"  PERSISTS FAILING since {time.strftime('%H:%M:%S', time.localtime(failure['since']))}: "
              f"{describe_failure(failure)} ({report.get('persist_failures')} failed in all); training goes on and "
              f"the snapshots stay in memory until a persist succeeds")
        code = max(code, 2)
    return code


def _protection(report: dict[str, Any]) -> str:
    """What a failure now would cost: the newest step in memory and how far each protection trails it."""
    newest = report.get("newest_step")
    text = (f"  newest step in memory: {newest}; a rank kill resumes from the job-safe step "
            f"{report.get('safe_step')} ({report.get('job_safe_lag')} step(s) back)")
    if report.get("node_safe_lag") is not None or report.get("endpoint"):
        text += (f", a node loss from the node-safe step {report.get('node_safe_step')} "
                 f"({report.get('node_safe_lag')} step(s) back)")
    passed = report.get("passed_over") or []
    return text + (f"; due steps passed over lately: {passed}" if passed else "")


def _print_orphaned(report: dict[str, Any]) -> None:
    """Every rank of a job died (none said goodbye): how long its agent keeps the snapshots in memory."""
    ranks = report["ranks"]
    if not ranks or any(rank["alive"] for rank in ranks) or all(rank["finished"] for rank in ranks):
        return
    steps = sorted({slot["step"] for slot in report["slots"] if slot["state"] == "COMMITTED"})
    held = format_bytes(sum(slot["bytes"] for slot in report["slots"]))
    idle, left = report.get("idle_timeout"), report.get("idle_exit_in")
    if left is not None:
        until = (f"until about {time.strftime('%H:%M:%S', time.localtime(time.time() + left))} (in {left:.0f}s: its "
                 f"idle timeout is {idle:.0f}s after the last rank died)")
    elif idle is not None:
        until = f"until its persist ends and {idle:.0f}s (its idle timeout) have passed"
    else:
        until = "until its idle timeout has passed"
    newest = steps[-1] if steps else None
    on_disk = report.get("persisted_step")
    after = ("then it exits and frees them (the newest step is on disk)" if newest is not None and on_disk is not None
             and newest <= on_disk else "then it exits, leaving them in shared memory for a rerun")
    print(f"  no rank is alive (the job crashed or was killed): agent pid {report['pid']} keeps the snapshots of step(s) "
          f"{', '.join(map(str, steps)) or 'none'} ({held} of shared memory) {until}; {after}. Rerun the job with the "
          "same save_dir to resume from memory")


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


