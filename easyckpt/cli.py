"""``easyckpt ls DIR | verify DIR | status [SAVE_DIR] | clean SAVE_DIR | convert | ranks-needed``: look at
checkpoints and at the node agent, and free what a job left in memory (``status`` and ``clean``:
``easyckpt.tools.status``; ``convert`` and ``ranks-needed``: ``easyckpt.tools.convert``).

Only ``convert`` and ``ranks-needed`` import torch: ``--help``, ``ls``, ``verify`` (``easyckpt.tools.checks`` reads
safetensors files without it) and ``status`` must answer at once, so nothing imported at module level may
pull it in.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import easyckpt
from easyckpt.logs import LOG_LEVEL_ENV, parse_level
from easyckpt.tools import checks, convert
from easyckpt.tools.status import cmd_clean, cmd_status
from easyckpt_wire import health, layout, timeline
from easyckpt_wire.shm import format_bytes
from easyckpt_wire.storage import UnsupportedLocation, as_path

# This file's package directory, not easyckpt.__file__ (None when a directory named easyckpt shadows the package
# under an editable install: easyckpt.node.client._spawn)
_PACKAGE = Path(__file__).resolve().parent

# What each command reads from the environment, for its --help (the README's Configuration has them all).
_RUNTIME_ENV = ("EASYCKPT_RUNTIME_DIR  where agents keep their socket, lock and agent.log (default /tmp/easyckpt-<uid>)",
                "EASYCKPT_SHM_DIR      where the slots are (default /dev/shm)",
                "EASYCKPT_NODE_ID      this node's name, when several simulated nodes share one machine",
                "EASYCKPT_JOB_ID       the job id, when the job set one (instead of one derived from SAVE_DIR)")
_ALL_ENV = (*_RUNTIME_ENV,
            f"{LOG_LEVEL_ENV}    easyckpt's log level in training processes and here (DEBUG, INFO, WARNING, ...)",
            "EASYCKPT_SLOTS        slots per rank, 2 to 8 (default 3, 4 in a multi-node job, fewer down to 2 when shared "
            "memory lacks room)",
            "EASYCKPT_PERSIST_MBPS cap on the agent's write rate (MB/s)",
            "EASYCKPT_S3_MAX_ATTEMPTS, EASYCKPT_S3_TIMEOUT, EASYCKPT_S3_THREADS, EASYCKPT_S3_PART_MB: an s3:// save_dir's "
            "client (with the standard AWS_* variables: credentials, AWS_ENDPOINT_URL_S3 for another server)",
            "EASYCKPT_AGENT_ADDR, EASYCKPT_AGENT_PORT, EASYCKPT_AGENT_SHUTDOWN_TIMEOUT, EASYCKPT_KEEP_AGENT_LOG: the agent")


class _Formatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description or epilog; a paragraph with line breaks of its own (the list of
    environment variables) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(para if "\n" in para else super(_Formatter, self)._fill_text(para, width, indent)
                             for para in text.split("\n\n"))


def _epilog(lines: tuple[str, ...] | None) -> str:
    readme = _PACKAGE.parent / "README.md"
    where = f"{readme} (sections Tools and Configuration)" if readme.is_file() else "the README of easyckpt"
    env = ("environment variables:\n" + "\n".join(f"  {line}" for line in lines)) if lines else \
        "environment variables: none (it reads only the files under the directory given)"
    return f"{env}\n\nmore: {where}"


def _not_a_directory(path: Path) -> str | None:
    """Why ``path`` cannot be listed or verified (None: it is a directory)."""
    if path.is_dir():
        return None
    if path.exists():
        return f"{path} is a file, not a directory: give a save_dir or one iteration_N directory in it"
    return f"{path}: no such directory"


def _iterations(target: Path) -> tuple[Path, list[tuple[int, Path, bool]], bool]:
    """(save_dir, its iterations, whether ``target`` named one iteration_N directory); one: that row only."""
    if layout.ITERATION_RE.match(target.name):
        rows = [row for row in layout.list_iterations(target.parent) if row[1].name == target.name]
        return target.parent, rows, True
    return target, layout.list_iterations(target), False


def cmd_ls(args: argparse.Namespace) -> int:
    target = as_path(args.dir)   # another scheme: UnsupportedLocation, said by main
    problem = _not_a_directory(target)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    save_dir, rows, one = _iterations(target)
    tracker = layout.read_tracker(save_dir)
    verdicts = _health_column(save_dir)
    print(f"{'iteration':<20} {'step':>10} {'size':>12}  status")
    damaged = 0
    for step, path, complete in rows:
        if not (complete and _parses(path)):
            status = "INCOMPLETE (no commit marker)"
        else:
            # Sizes against metadata.json: a deleted or truncated file shows without reading the tensors.
            damage = checks.damage(path)
            status = "complete" if damage is None else "DAMAGED: " + damage.replace(f"{path}/", "")
            damaged += damage is not None
        mark = "  <- tracker" if step == tracker else ""
        verdict = f"  health: {verdicts[step]}" if step in verdicts else ""   # only with health_ckpts.json
        print(f"{path.name:<20} {step:>10} {format_bytes(checks.dir_bytes(path)):>12}  {status}{mark}{verdict}")
    if not rows:
        print("(no iterations)")
    if not one:
        for name, step, path in timeline.abandoned_iterations(save_dir):   # moved aside by a resume (invariant 10)
            print(f"{name}/{path.name:<20} {step:>10} {format_bytes(checks.dir_bytes(path)):>12}  abandoned timeline "
                  "(never loaded automatically; rotation removes it first)")
    if damaged:
        print(f"{damaged} damaged: a load passes over them to an older iteration; `easyckpt verify "
              f"{target}` checks every byte", file=sys.stderr)
    return 0


def _health_column(save_dir: Path) -> dict[int, str]:
    """{step: "healthy" | "UNHEALTHY: reasons"} from health_ckpts.json (none: no column values; corrupt:
    a warning on stderr, ``easyckpt verify`` says more)."""
    try:
        entries = health.read_health_file(save_dir) or []
    except health.HealthFileError as exc:
        print(f"warning: {exc}", file=sys.stderr)
        return {}
    return {e.step: "healthy" if e.healthy else "UNHEALTHY" + (f" ({'; '.join(e.reasons)})" if e.reasons else "")
            for e in entries}


def _verify_health(save_dir: Path) -> list[str]:
    """Problems of ``save_dir/health_ckpts.json``: unreadable, or entries naming iterations not on disk, or
    whose ckpt_name does not match their step. Nothing is changed."""
    path = save_dir / health.HEALTH_FILE
    try:
        entries = health.read_health_file(save_dir)
    except health.HealthFileError as exc:
        return [str(exc)]
    if entries is None:
        return []
    complete = {step for step, _ in layout.complete_iterations(save_dir)}
    problems = []
    for entry in entries:
        if entry.ckpt_name != layout.iteration_dirname(entry.step):
            problems.append(f"{path}: entry of step {entry.step} names {entry.ckpt_name!r}, expected "
                            f"{layout.iteration_dirname(entry.step)!r}")
        elif entry.step not in complete:
            problems.append(f"{path}: entry of step {entry.step} names {entry.ckpt_name}, which is not a complete "
                            "iteration in this save_dir (the agent drops it at its next persist)")
    return problems


def _parses(path: Path) -> bool:
    try:
        layout.read_metadata(path)
        return True
    except layout.CheckpointFormatError:
        return False


def cmd_verify(args: argparse.Namespace) -> int:
    target = as_path(args.dir)   # another scheme: UnsupportedLocation, said by main
    problem = _not_a_directory(target)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    save_dir, _, one = _iterations(target)
    results = checks.verify(target)
    bad = incomplete = 0
    for _step, path, problem in results:
        if problem == checks.INCOMPLETE:
            print(f"{path.name}: INCOMPLETE: no {layout.METADATA} (a persist under way, or one that failed: never "
                  f"loaded; `easyckpt clean` removes a dead writer's)")
            incomplete += 1
            continue
        print(f"{path.name}: {'OK' if problem is None else 'DAMAGED: ' + problem}")
        bad += problem is not None
    if not results:
        print(f"{target}: no iterations to verify")
    health_problems = [] if one else _verify_health(save_dir)
    for problem in health_problems:
        print(f"{health.HEALTH_FILE}: BAD: {problem}")
    print(f"{len(results) - bad - incomplete} ok, {bad} damaged" + (f", {incomplete} incomplete" if incomplete else "")
          + (f", {len(health_problems)} health index problem(s)" if health_problems else ""))
    return 1 if bad or health_problems else 0


def build_parser() -> argparse.ArgumentParser:
    formatter = _Formatter
    parser = argparse.ArgumentParser(
        prog="easyckpt", formatter_class=formatter, epilog=_epilog(_ALL_ENV),
        description="Inspect easyckpt checkpoints (ls, verify), the node agents of running jobs (status), free what "
                    "a job left in shared memory (clean), and convert checkpoints (convert, ranks-needed). "
                    "`easyckpt COMMAND --help` explains each.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("ls", help="list iterations: step, size, complete, damaged or incomplete",
                        formatter_class=formatter, epilog=_epilog(None),
                        description="One row per iteration_N directory, oldest first: its step, size on disk and "
                                    "status: complete; DAMAGED (a file metadata.json names is missing, or its size "
                                    "is not what metadata.json and the file's header add up to: judged without "
                                    "reading the tensors, `easyckpt verify` reads every byte); INCOMPLETE (no commit "
                                    "marker: a persist that never finished, never loaded). Marks the iteration the "
                                    "tracker names, the health verdicts of health_ckpts.json, and iterations a resume "
                                    "moved aside (.abandoned-*). Exit 0, or 2 when DIR is not a directory or cannot "
                                    "be read.")
    ls.add_argument("dir", metavar="DIR", help="a save_dir, or one iteration_N directory in it")
    ls.set_defaults(func=cmd_ls)
    verify = sub.add_parser("verify", help="re-read every file and check every checksum (exit 1 on damage)",
                            formatter_class=formatter, epilog=_epilog(None),
                            description="Reads every tensor of every iteration (or of the one given): dtype, shape "
                                        "and byte range in each safetensors file against metadata.json, and every "
                                        "byte against its xxh3-128 checksum; checks health_ckpts.json against the "
                                        "iterations. Prints OK or DAMAGED with the file and the tensor per iteration, "
                                        "or INCOMPLETE for one without its commit marker (a persist under way or one "
                                        "that failed: never loaded, not damage). Exit 0 when all is well, 1 on "
                                        "damage, 2 when DIR is not a directory or cannot be read.")
    verify.add_argument("dir", metavar="DIR", help="a save_dir, or one iteration_N directory in it")
    verify.set_defaults(func=cmd_verify)
    status = sub.add_parser(
        "status", help="a job's state on this node: its agent's view, or what it left", formatter_class=formatter,
        epilog=_epilog(_RUNTIME_ENV),
        description="With SAVE_DIR (or --job-id): that job on this node. A running job: its agent's view (ranks, slots "
                    "and steps, the safe step, the newest step on disk, the last persist, a failing persist, "
                    "multi-node replica coverage); when every rank died, how long the agent keeps the snapshots in "
                    "memory. A job that has ended: that it ended, and what is on disk. A job whose agent is gone "
                    "too: the snapshots it left in shared memory and the command that frees them.\n\n"
                    "Without SAVE_DIR or --job-id: every job of this user on this node whose agent runs, or whose "
                    "snapshots are left in shared memory (and it removes runtime directories of jobs that are over).\n\n"
                    "Exit 0 when all is well (a running job, or one that ended), 1 when an agent does not answer or "
                    "the named job's agent is gone while its ranks live or its snapshots are left in memory, 2 when "
                    "persists fail or a rank's tensors have a single copy in memory.")
    status.add_argument("save_dir_pos", nargs="?", metavar="SAVE_DIR",
                        help="the job's save_dir (default: every job of this user on this node)")
    status.add_argument("--save-dir", help="the same as SAVE_DIR (kept for scripts that use it)")
    status.add_argument("--job-id", help="the job id (EASYCKPT_JOB_ID), instead of SAVE_DIR")
    status.add_argument("--json", action="store_true", help="print the same as JSON, for scripts")
    status.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="how long to wait for each agent's answer (default 5); an agent that does not answer "
                             "in time is reported as busy or stuck (exit 1)")
    status.set_defaults(func=cmd_status)
    clean = sub.add_parser("clean", help="remove a job's slots in shared memory and its runtime directory",
                           formatter_class=formatter, epilog=_epilog(_RUNTIME_ENV),
                           description="Removes the slot files, the agent's control block and the runtime directory "
                                       "of a job whose agent and ranks are gone (snapshots not on disk are lost; "
                                       "`easyckpt status SAVE_DIR` shows them first). Refuses, naming the pids, while "
                                       "a process of the job lives. Exit 0 when done or nothing is left, 1 when "
                                       "refused.")
    clean.add_argument("save_dir_pos", nargs="?", metavar="SAVE_DIR", help="the job's save_dir")
    clean.add_argument("--save-dir", help="the same as SAVE_DIR")
    clean.add_argument("--job-id", help="the job id (EASYCKPT_JOB_ID), instead of SAVE_DIR")
    clean.set_defaults(func=cmd_clean)
    convert.add_parsers(sub, formatter, (_epilog(("EASYCKPT_SHM_DIR, EASYCKPT_RUNTIME_DIR: --from dcp writes through "
                                                  "a Checkpointer and its agent, which use them",)), _epilog(None)))
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        installed = version("easyckpt")
    except Exception:   # not installed (a source tree on PYTHONPATH): the package's own number
        installed = getattr(easyckpt, "__version__", "?")   # "?": a namespace package in its place (client._spawn)
    return f"easyckpt {installed} ({_PACKAGE}, python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING
    if os.environ.get(LOG_LEVEL_ENV, "").strip():
        try:
            level = parse_level(os.environ[LOG_LEVEL_ENV])
        except ValueError as exc:
            print(f"easyckpt: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (UnsupportedLocation, OSError) as exc:
        # A location that cannot be read (a scheme with no storage, a store that refuses us, a folder we may not
        # list): the message names the path and the fix; a traceback would only bury it. DEBUG keeps it.
        logging.getLogger(__name__).debug("easyckpt %s failed", args.command, exc_info=True)
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
        print(f"easyckpt {args.command}: {where}{said}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
