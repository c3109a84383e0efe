"""``easyckpt-agent`` / ``python -m easyckpt_agent``: take the job's lock, then serve until the job ends.

Under ``torchrun --nnodes=N --nproc-per-node=1 -m easyckpt_agent ...`` the process becomes the launcher
``easyckpt.node.launcher`` instead (exec, so torch stays out of this package): it starts this node's agent
detached and introduces the agents to each other through torchrun's rendezvous."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import psutil

from easyckpt_agent import persister
from easyckpt_agent.lifecycle import start_successor
from easyckpt_agent.server import Agent, AgentConfig
from easyckpt_wire import protocol
from easyckpt_wire.faults import fault_point
from easyckpt_wire.runtime import remove_runtime_dir, take_lock
from easyckpt_wire.shm import check_job_id, shm_dir
from easyckpt_wire.storage import is_url, location

logger = logging.getLogger("easyckpt_agent")

SHUTDOWN_TIMEOUT_ENV = "EASYCKPT_AGENT_SHUTDOWN_TIMEOUT"
KEEP_LOG_ENV = "EASYCKPT_KEEP_AGENT_LOG"   # 1: a job that ended cleanly keeps its runtime dir with agent.log
LOG_LEVEL_ENV = "EASYCKPT_AGENT_LOG_LEVEL"
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class _Warned(logging.Handler):
    """Remembers whether the agent logged a warning: then its log is worth keeping after a clean end."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


_EPILOG = """environment variables:
  EASYCKPT_SHM_DIR      where the job's slots are (default /dev/shm), as for the training ranks
  EASYCKPT_RUNTIME_DIR  where the agent keeps its socket, lock, pid and agent.log (default /tmp/easyckpt-<uid>)
  EASYCKPT_JOB_ID       the job id (default: a digest of the absolute --save-dir)
  EASYCKPT_NODE_ID      this node's name (default: the host name)
  EASYCKPT_AGENT_ADDR, EASYCKPT_AGENT_PORT   multi-node: where other nodes reach this agent
  EASYCKPT_PERSIST_MBPS cap on the write rate (MB/s)
  EASYCKPT_AGENT_SHUTDOWN_TIMEOUT   --shutdown-timeout's default
  EASYCKPT_KEEP_AGENT_LOG=1         keep agent.log after a clean end (by default kept only when it warned)

more: the README of easyckpt (sections Tools, Several nodes and Configuration)"""


def _under_torchrun() -> bool:
    return all(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _location(text: str) -> Path:
    """--save-dir: a path or an s3:// URL; argparse says the reason (another scheme, a lost '//'), not only that
    the value is invalid."""
    try:
        if text == text.lstrip() and text != text.rstrip() and not is_url(text):
            # A rank starts its agent with save_dir resolved: whitespace at its end was in a pathlib.Path it was given
            return location(Path(text), "--save-dir")
        return location(text, "--save-dir")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(kind: type[int] | type[float], least: float, what: str, most: float = float("inf")) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not least <= value <= most or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_COUNT = _number(int, 1, "a positive int")
_SECONDS = _number(float, 1e-9, "a positive number of seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="easyckpt-agent", description=__doc__, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-dir", required=True, type=_location,
                        help="checkpoint directory: a POSIX path or s3://bucket/prefix")
    parser.add_argument("--job-id", help="job id (default: EASYCKPT_JOB_ID, else derived from --save-dir)")
    parser.add_argument("--shm-dir", type=Path, help="where the slots live (default: EASYCKPT_SHM_DIR or /dev/shm)")
    parser.add_argument("--save-storage-interval", type=_number(int, 0, "an int >= 0 (0: learned from the ranks)"),
                        default=0, help="persist every Nth step (default: learned from the training ranks)")
    parser.add_argument("--max-ckpt-num", type=_COUNT, default=3, help="complete checkpoints to keep")
    parser.add_argument("--log-file", help="append one line per persist (step, bytes, seconds, GB/s)")
    parser.add_argument("--idle-timeout", type=_SECONDS, default=300.0,
                        help="exit after this many seconds with no live rank (default 300)")
    parser.add_argument("--nice", type=int, default=10,
                        help="lower the CPU priority of persisting and hashing by this much (default 10)")
    parser.add_argument("--persist-threads", type=_COUNT, default=2, help="files written in parallel (default 2)")
    parser.add_argument("--node-id", help="this node's name in the job (default: EASYCKPT_NODE_ID, else the host name)")
    parser.add_argument("--addr", help="address peers reach this agent at, multi-node jobs only "
                                       "(default: EASYCKPT_AGENT_ADDR, else the route to MASTER_ADDR)")
    # argparse converts a default given as text too: a bad EASYCKPT_AGENT_PORT is a usage error, not a traceback
    parser.add_argument("--port", type=_number(int, 0, f"a tcp port, 0 to 65535 (0: any; or {protocol.AGENT_PORT_ENV})",
                                               65535), default=os.environ.get(protocol.AGENT_PORT_ENV) or None,
                        help="tcp port of the replica server (default: EASYCKPT_AGENT_PORT, else any)")
    parser.add_argument("--serve-peers", action="store_true",
                        help="start the tcp replica server at once (set by the torchrun launcher)")
    parser.add_argument("--started-by", type=_number(int, 1, "a pid"), metavar="PID",
                        help="pid of the training rank that started this agent (set by the library): if that rank's "
                             "process tree is terminated with the agent in it (DeepSpeed's launcher ends a failed job "
                             "so), a detached agent takes over the memory kept for a restart")
    parser.add_argument("--shutdown-timeout", default=os.environ.get(SHUTDOWN_TIMEOUT_ENV) or "20",
                        help="on SIGTERM/SIGINT, persist for at most this many seconds before exiting "
                             f"(default: {SHUTDOWN_TIMEOUT_ENV}, else 20)",
                        type=_number(float, 1e-9, f"a positive number of seconds (or {SHUTDOWN_TIMEOUT_ENV})"))
    parser.add_argument("--log-level", default=os.environ.get(LOG_LEVEL_ENV) or "INFO", type=str.upper,
                        choices=LOG_LEVELS,
                        help="what the agent logs to stderr: the library starts it with stderr appended to "
                             "EASYCKPT_RUNTIME_DIR/<job id>/agent.log (default INFO: one line per persist, "
                             f"rotation and rank event; {LOG_LEVEL_ENV} sets it for agents the library starts)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:   # argparse checks the choices of a given value, not of its default
        parser.error(f"{LOG_LEVEL_ENV}={os.environ.get(LOG_LEVEL_ENV)!r} is not a logging level: use one of "
                     f"{', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [agent %(process)d] %(name)s: %(message)s")
    save_dir = args.save_dir.resolve()
    blocker = None if is_url(save_dir) else protocol.file_in_the_way(save_dir)
    if blocker is not None:
        build_parser().error(f"--save-dir {save_dir}: {blocker} is a file, not a directory; give the directory that "
                             "holds (or will hold) the iteration_N checkpoints")
    job_id = check_job_id(args.job_id or protocol.job_id_for(save_dir))
    fault_point("agent.start")
    if args.node_id:
        os.environ[protocol.NODE_ID_ENV] = args.node_id  # the runtime directory is per node
    if _under_torchrun() and not args.serve_peers:
        launcher = [sys.executable, "-m", "easyckpt.node.launcher", *(sys.argv[1:] if argv is None else argv)]
        os.execv(sys.executable, launcher)
    taken = take_lock(job_id)
    if taken is None:
        job_dir = protocol.runtime_dir(job_id)
        pid = (job_dir / "agent.pid").read_text().strip() if (job_dir / "agent.pid").exists() else "?"
        logger.info("an agent for job %s is already running (pid %s): nothing to do", job_id, pid)
        return 0
    job_dir, lock_fd = taken
    warned = _Warned()
    logging.getLogger().addHandler(warned)
    # Persisting and hashing must not slow training down: their threads run at a lower priority
    # (persister.lower_priority); the loop that answers ranks and declares safe steps does not.
    persister.BACKGROUND_NICE = args.nice
    if args.nice:
        try:
            psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)  # lowest best-effort I/O priority
        except (AttributeError, OSError, psutil.Error) as exc:
            logger.info("cannot lower I/O priority: %s", exc)
    (job_dir / "agent.pid").write_text(f"{os.getpid()}\n")
    config = AgentConfig(save_dir=save_dir, job_id=job_id, shm_dir=(args.shm_dir or shm_dir()).resolve(),
                         job_dir=job_dir, save_storage_interval=args.save_storage_interval,
                         max_ckpt_num=args.max_ckpt_num, log_file_path=args.log_file,
                         idle_timeout=args.idle_timeout, persist_threads=args.persist_threads,
                         node_id=protocol.node_id(), bind_host=args.addr or protocol.advertised_address(),
                         port=args.port if args.port is not None else 0,
                         serve_peers=args.serve_peers, shutdown_timeout=args.shutdown_timeout,
                         started_by=args.started_by)
    agent: Agent | None = None
    try:
        agent = Agent(config)
        return agent.run()
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 130
    finally:
        (job_dir / "agent.pid").unlink(missing_ok=True)
        if agent is not None and agent.ended_cleanly:
            # Nothing of the job is left in memory: its runtime dir goes too (issue 11: they piled up),
            # except the log of a run that warned about something, or when asked to keep it.
            keep = {"agent.log"} if warned.seen or os.environ.get(KEEP_LOG_ENV, "") not in ("", "0") else set()
            try:
                remove_runtime_dir(job_dir, keep=keep)
            except OSError as exc:
                logger.info("cannot remove the runtime directory %s: %s", job_dir, exc)
        os.close(lock_fd)
        if agent is not None and agent.hand_over:
            try:
                start_successor(sys.argv[1:] if argv is None else argv)
            except OSError as exc:
                logger.warning("cannot start an agent to take over the job's memory (%s): `easyckpt clean --job-id %s` "
                               "removes it if no restart comes", exc, job_id)
        if agent is not None and agent.hung_writer:
            # A write that does not return (a hung file system) would hang the interpreter's exit, which
            # joins every worker thread; everything else is done.
            logging.shutdown()
            os._exit(0)
