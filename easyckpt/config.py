"""Checkpointer configuration: keyword-only, checked once at construction with errors that say the fix."""
from __future__ import annotations

import dataclasses
import errno
import logging
import operator
import os
import tempfile
from pathlib import Path

from easyckpt_wire import protocol
from easyckpt_wire.health import check_thresholds
from easyckpt_wire.shm import MAX_SLOTS, check_job_id, list_slots, shm_dir
from easyckpt_wire.storage import is_url, location, open_storage, unavailable

logger = logging.getLogger(__name__)

SLOTS_ENV = "EASYCKPT_SLOTS"
# The default max_backup_lag in snapshot intervals. It was save_storage_interval (5 steps in the multi-node tests)
# until CI of 2026-12-04 met a node loss at step 8 that resumed at 5: in a job's first seconds the agents' backups
# trailed by three steps, within that bound and over invariant 9's two intervals (benchmarks/README.md, "The lag
# gate at two snapshots").
BACKUP_LAG_SNAPSHOTS = 2
MIN_SLOTS = 2
# A save_storage_interval this large persists no step by the interval, only those asked for (the HF and Lightning
# integrations' saves, flush, close): those integrations pass save_mem_interval times this.
PERSIST_ON_REQUEST = 1 << 40
# One text for slots= and EASYCKPT_SLOTS, so that what the message offers is what is accepted.
SLOTS_RANGE = (f"use an int from {MIN_SLOTS} to {MAX_SLOTS} slots per rank (the default is 3 when shared memory has "
               "room, else 2; 2 needs less memory, more keep older snapshots in memory)")


@dataclasses.dataclass(kw_only=True)
class CheckpointerConfig:
    save_dir: Path
    save_mem_interval: int
    save_storage_interval: int
    max_ckpt_num: int
    log_file_path: str | None = None
    job_id: str | None = None            # default: EASYCKPT_JOB_ID, else derived from the absolute save_dir
    shm_dir: Path | None = None          # default: EASYCKPT_SHM_DIR, else /dev/shm
    start_agent: bool = True             # False: never spawn one (tests, or an agent you run yourself)
    agent_idle_timeout: float = 300.0    # the agent exits this long after the last rank of the job died (10 s at
    #                                      most when they left nothing in memory and it holds no other node's backup)
    agent_start_timeout: float = 30.0    # __init__ waits this long at most for the agent to answer
    load_timeout: float = 120.0          # reading a slot that another process holds for writing
    close_timeout: float = 600.0         # close() waiting for the agent to persist the newest snapshot
    # close() (and the end of a process that never called it) makes the newest snapshot durable, so the
    # steps after the last save_storage_interval multiple are not lost; False: only due steps reach disk
    final_persist: bool = True
    # slots per rank: None takes 3 (4 across nodes) when shared memory has room (EASYCKPT_SLOTS overrides), else
    # fewer; with 2 a kill may cost a persist's time plus two intervals instead of two intervals, with 3 across nodes
    # more than two intervals while persists outlast a step (said once when asked for: shm_space.say_asked_count)
    slots: int | None = None
    pin_timeout: float = 60.0            # HF Trainer: longest a due snapshot that found no free slot retries
    copy_threads: int = 1                # CPU copy threads: more copies faster, but takes cores from training
    # CUDA state: side streams the device-to-host copy is spread over (tensors over 64 MiB split into pieces
    # across them), so the copy is not one stream's queue of thousands of copies one after the other
    cuda_copy_streams: int = 2
    replicate_unique: bool = True        # multi-node: the buddy node also keeps large tensors no other node holds
    peer_timeout: float = 10.0           # multi-node: one request to another node's agent
    # multi-node: save_if_needed waits (bounded by a few step times, said once per episode) while the node-safe
    # step (backed up off every node: what a node loss resumes from) trails the step by more than this many
    # steps. None: two snapshot intervals (BACKUP_LAG_SNAPSHOTS), at most save_storage_interval, so that a node
    # loss costs what a rank kill may (invariant 9) and never more than the disk would; 0: never
    max_backup_lag: int | None = None
    # flush() waiting for the newest snapshot to be durable; under torchrun a SIGTERMed worker is killed
    # 30 s later, so the exit hook's flush must end before that
    flush_timeout: float = 25.0
    # checkpoint health: a snapshot whose reported metric (save_if_needed(..., metrics=)) exceeds its
    # threshold here, or is not finite, is unhealthy; load() passes unhealthy steps over
    health_thresholds: dict[str, float] | None = None

    def __post_init__(self) -> None:
        self.save_dir = location(self.save_dir, "save_dir")   # a URL of a scheme with no storage here is refused now
        for name in ("save_mem_interval", "save_storage_interval", "max_ckpt_num", "copy_threads",
                     "cuda_copy_streams"):
            check_count(name, getattr(self, name))
        if self.save_storage_interval % self.save_mem_interval:
            suggestion = self.save_storage_interval // self.save_mem_interval * self.save_mem_interval \
                or self.save_mem_interval
            raise ValueError(
                f"save_storage_interval={self.save_storage_interval} is not a multiple of "
                f"save_mem_interval={self.save_mem_interval}: a persisted step must also be a snapshot step; "
                f"use e.g. save_storage_interval={suggestion}"
            )
        for name in ("agent_idle_timeout", "agent_start_timeout", "load_timeout", "close_timeout", "pin_timeout",
                     "peer_timeout", "flush_timeout"):
            check_seconds(name, getattr(self, name))
        if self.max_backup_lag is None:
            self.max_backup_lag = min(BACKUP_LAG_SNAPSHOTS * self.save_mem_interval, self.save_storage_interval)
        if not isinstance(self.max_backup_lag, int) or isinstance(self.max_backup_lag, bool) or self.max_backup_lag < 0:
            raise ValueError(f"max_backup_lag must be an int >= 0 (steps; 0: never wait), got {self.max_backup_lag!r}")
        for name in ("final_persist", "start_agent", "replicate_unique"):
            if not isinstance(getattr(self, name), bool):
                # a string from a config file or the environment ("false") would be taken as True
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.slots is None and os.environ.get(SLOTS_ENV):
            text = os.environ[SLOTS_ENV]
            if not text.strip().isdigit() or not MIN_SLOTS <= int(text) <= MAX_SLOTS:
                raise ValueError(f"{SLOTS_ENV}={text!r} is not a slot count: {SLOTS_RANGE}; unset it for the default")
            self.slots = int(text)
        if self.slots is not None and (not isinstance(self.slots, int) or isinstance(self.slots, bool)
                                       or not MIN_SLOTS <= self.slots <= MAX_SLOTS):
            raise ValueError(f"slots must be an int from {MIN_SLOTS} to {MAX_SLOTS}, got {self.slots!r}: {SLOTS_RANGE}; "
                             "or None for the default")
        self.health_thresholds = check_thresholds(self.health_thresholds)
        self.job_id = check_job_id(self.job_id or protocol.job_id_for(self.save_dir))
        self.shm_dir = Path(self.shm_dir) if self.shm_dir is not None else shm_dir()
        blocker = protocol.file_in_the_way(self.shm_dir)
        if blocker is not None:
            raise NotADirectoryError(f"shm_dir {self.shm_dir} (EASYCKPT_SHM_DIR or shm_dir=): {_is_a_file(blocker)}; "
                                     "point it at a directory on a tmpfs such as /dev/shm")
        try:
            self.shm_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"shm_dir {self.shm_dir} (EASYCKPT_SHM_DIR or shm_dir=) does not exist and cannot be "
                          f"created: {exc.strerror or exc}; point it at a writable tmpfs such as /dev/shm") from None
        if self.log_file_path is not None:
            self.log_file_path = str(_log_file(Path(self.log_file_path).expanduser().resolve()))
        # torchrun counts only the restarts its own workers' failures caused: workers restarted because another
        # node's failed (a membership change) see TORCHELASTIC_RESTART_COUNT=0, but find this job's slots here
        check_writable(self.save_dir, resuming=is_url(self.save_dir) and bool(list_slots(self.shm_dir, self.job_id)))

    def persist_due(self, step: int) -> bool:
        return step % self.save_storage_interval == 0


def _is_a_file(path: Path) -> str:
    return f"{path} is a file, not a directory"


def check_count(name: str, value: object) -> int:
    """A positive int (steps, slots, checkpoints, threads), refused by name otherwise: also what the integrations
    check their own counts with, when they are constructed rather than when training starts."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """A timeout in seconds: a positive, finite real number (a string read from a config file, NaN or infinity is
    refused here, naming the setting, rather than failing in a comparison or never ending a wait)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (int or float), got {type(value).__name__} {value!r}")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return value


def _log_file(path: Path) -> Path:
    """The agent appends one line per persist to ``path``: a directory there, or a folder that cannot be created,
    is said now (the agent could only warn in its own log, which nobody reads, at every persist)."""
    if path.is_dir():
        raise IsADirectoryError(f"log_file_path {path} is a directory; give a file in it, e.g. "
                                f"log_file_path='{path / 'easyckpt-persists.log'}'")
    blocker = protocol.file_in_the_way(path.parent)
    if blocker is not None:
        raise NotADirectoryError(f"log_file_path {path}: {_is_a_file(blocker)}; give a file in a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"log_file_path {path}: its directory cannot be created: {exc.strerror or exc}; give a file "
                      "in a writable directory") from None
    return path


def check_writable(save_dir: Path, *, resuming: bool = False) -> None:
    """Fail now, with the path and the fix, rather than in the agent an hour into training. ``resuming``: this
    node's memory holds snapshots of the job (see :func:`check_object_store`)."""
    if is_url(save_dir):
        check_object_store(save_dir, resuming=resuming)
        return
    blocker = protocol.file_in_the_way(save_dir)
    if blocker is not None:
        raise NotADirectoryError(
            f"save_dir {save_dir}: {_is_a_file(blocker)}. save_dir is the directory that holds the iteration_N "
            "checkpoints (created if missing): give a directory path, or move the file away")
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save_dir, prefix=".easyckpt-write-test-"):
            pass
    except OSError as exc:
        owner = ""
        try:
            info = save_dir.stat()
            owner = f" (owner uid {info.st_uid}, mode {oct(info.st_mode & 0o777)}, we are uid {os.getuid()})"
        except OSError:
            pass
        if exc.errno == errno.EROFS:
            fix = "Choose a directory on a writable file system (or remount this one read-write)."
        elif exc.errno in (errno.EACCES, errno.EPERM):
            fix = "Choose a directory this user can write to, or fix its permissions."
        else:
            fix = "Choose another directory, or repair this one."
        raise PermissionError(f"save_dir {save_dir} is not writable{owner}: {exc.strerror or exc}. {fix}") from None


def check_object_store(save_dir: Path, *, resuming: bool = False) -> None:
    """An ``s3://`` save_dir: the bucket exists and this process may write under the prefix (a missing bucket,
    refused credentials or an unreachable server is said now, with the URL and the fix, not at the first
    persist). Never a credential in the message: the variables to set are named, not their values. An
    unreachable store only warns in a restarted worker (torchrun's restart count, or ``resuming``: this node's
    memory already holds the job's snapshots), which resumes from memory or replicas."""
    try:
        store = open_storage(save_dir)
    except ImportError as exc:
        raise ImportError(f"save_dir {save_dir}: {exc}") from None
    check = getattr(store, "check", None)
    try:
        if check is not None:
            check()
    except OSError as exc:
        endpoint = getattr(store, "endpoint", "?")
        reason = str(exc.strerror or exc).rstrip(".")
        reason += "" if reason.endswith(("?", "!")) else "."
        restart = _restart_count()
        if (restart or resuming) and unavailable(exc):
            # The store answered this job's first workers (they passed this check), so an unreachable one now is
            # an outage, not a wrong setting; refusing to start would end the job, whose state this node's memory
            # (or a replica) still holds. The agent retries its persists until the store is back.
            which = f"restart {restart} of this job's workers" if restart else \
                "a restart of this job's workers (this node's memory holds its snapshots)"
            logger.warning("save_dir %s cannot be reached now (endpoint %s): %s This is %s, so the store answered "
                           "before: going on; the state is loaded from memory or replicas, and persists fail until "
                           "the store is back", save_dir, endpoint, reason, which)
            return
        raise type(exc)(exc.errno, f"save_dir {save_dir} cannot be used (endpoint {endpoint}): {reason} "
                        "The endpoint comes from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (or endpoint_url in "
                        "~/.aws/config), the credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                        "the region from AWS_REGION or AWS_DEFAULT_REGION", str(save_dir)) from None


def _restart_count() -> int:
    """torchrun's count of this worker group's restarts (0: the first start, or no torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    except ValueError:
        return 0


def check_step(step: object, *, rank: int) -> int:
    """``step`` as given to ``save_if_needed``, ``save`` or ``note_step``: the global training step as an int (a numpy
    integer or a one-element integer tensor is taken as its value), from 0 to ``protocol.MAX_STEP``."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)   # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"easyckpt rank {rank}: the step must be an int, the global training step (the number of "
                        f"optimizer steps taken), got {type(step).__name__} {step!r}") from None
    if not 0 <= value <= protocol.MAX_STEP:
        raise ValueError(f"easyckpt rank {rank}: step {value} is out of range: steps count from 0 (at most "
                         f"{protocol.MAX_STEP})")
    return value
