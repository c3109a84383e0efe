"""What a rank knows of the node agent's persists: the newest step on disk and whether persisting fails.

The agent alone sees the disk; it publishes how persisting goes in its control block (``easyckpt_wire.
control``), which ranks read for free. A failure is a state, not an event: the rank logs it at WARNING
once when an episode starts and once when persists succeed again, never once per step, and training goes
on either way (the snapshots stay in memory). ``close()`` turns a final state that could not be made
durable into :class:`PersistError`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from easyckpt.logs import notice
from easyckpt_wire.control import ControlView, PersistFailure
from easyckpt_wire.storage import is_url

logger = logging.getLogger(__name__)


class PersistError(RuntimeError):
    """``close()`` could not make the final snapshot durable: the agent's persist failed (a full or read-only
    disk, say). Nothing is lost: the snapshot stays in shared memory, where a rerun of the job resumes from it.

    Attributes: ``step`` (the snapshot that is not durable), ``save_dir``, ``persisted`` (the newest step on
    disk, or None), ``failure`` (the agent's report: path and error in ``text``, ``errno``, ``needed`` and
    ``free`` bytes when known, or None when the agent gave no details), ``shm_dir`` (where the slots stay).
    """

    def __init__(self, message: str, *, step: int | None, save_dir: Path, persisted: int | None,
                 failure: dict[str, Any] | None, shm_dir: Path | None) -> None:
        super().__init__(message)
        self.step, self.save_dir, self.persisted, self.failure, self.shm_dir = step, save_dir, persisted, failure, shm_dir

    @property
    def errno(self) -> int | None:
        return self.failure.get("errno") if self.failure else None

    @classmethod
    def final(cls, *, rank: int, step: int | None, save_dir: Path, shm_dir: Path | None, job_id: str | None,
              persisted: int | None, failure: dict[str, Any]) -> PersistError:
        """The error of a final snapshot the agent failed to persist, naming the step, the disk, the slots that
        keep it, and the fix."""
        return cls(f"easyckpt rank {rank}: the final snapshot (step {step}) could not be made durable in {save_dir}: "
                   f"{describe_failure(failure)}. Nothing is lost: it stays in shared memory ({shm_dir}/easyckpt-"
                   f"{job_id}-*) and the newest step on disk is {persisted}. {storage_fix(save_dir, start=True)}, then "
                   f"run the job again: it resumes from memory and persists again (`easyckpt status {save_dir}` shows "
                   "the slots and how to remove them)", step=step, save_dir=save_dir, persisted=persisted,
                   failure=failure, shm_dir=shm_dir)


def storage_fix(save_dir: Any, *, start: bool = False) -> str:
    """What the user fixes when a persist to ``save_dir`` fails with an OSError: an object store is brought back
    (its endpoint, credentials or bucket), a directory is given space or repaired. ``start``: as a sentence begins."""
    try:
        remote = is_url(save_dir)
    except ValueError:   # a malformed URL (refused at start-up already): said as given
        remote = True
    if remote:
        fix = (f"bring the object store of save_dir {save_dir} back (the server up, AWS_ENDPOINT_URL_S3, the "
               "credentials and the bucket right)")
    else:
        fix = f"free space on or repair the file system of save_dir {save_dir}"
    return fix[0].upper() + fix[1:] if start else fix


def describe_failure(failure: dict[str, Any] | PersistFailure) -> str:
    """One line from the agent's report (a control-block view or a reply's dict)."""
    if isinstance(failure, dict):
        try:
            failure = PersistFailure(**failure)
        except TypeError:   # a newer agent's fields: say what it said
            return str(failure)
    return failure.describe()


class PersistWatch:
    """Follows the agent's word on persisting, logging failure episodes once; ``stats()`` reports it."""

    def __init__(self, *, rank: int, local_rank: int, save_dir: Path) -> None:
        self.rank = rank
        self.save_dir = save_dir
        # One rank per node says it at WARNING (every rank of the node hears the same agent); the others
        # at INFO, so that eight GPUs do not print it eight times.
        self.level = logging.WARNING if local_rank == 0 else logging.INFO
        self.failure: PersistFailure | None = None
        self.persisted: int | None = None
        self.failures = 0           # failed persists over the agent's life
        self._failures_before = 0   # ... when it last reported none in progress
        self.episodes = 0

    def observe(self, view: ControlView | None) -> None:
        if view is None:
            return
        failure = view.failure
        if failure is not None and self.failure is None:
            self.episodes += 1
            # An OSError is the storage's (a full or read-only disk); anything else (errno 0: a snapshot whose bytes
            # changed since its commit) is not fixed there.
            fix = f"{storage_fix(self.save_dir)}, and persists resume" if failure.errno else "persists go on"
            self._say("rank %d: %s. Training goes on and the snapshots stay in memory (newest step on disk: %s); "
                      "%s at the next due step (said once per episode; the agent log has each failure)",
                      self.rank, failure.describe(), view.persisted, fix)
        elif failure is None and self.failure is not None:
            self._say("rank %d: persists succeed again: step %s is on disk (%d persist(s) failed meanwhile)",
                      self.rank, view.persisted, view.failures - self._failures_before)
        if failure is None:
            self._failures_before = view.failures
        self.failure, self.persisted, self.failures = failure, view.persisted, view.failures

    def _say(self, msg: str, *args: object) -> None:
        # The node's first rank: a notice, printed even with no logging configured; the others log at INFO.
        if self.level >= logging.WARNING:
            notice(logger, self.level, msg, *args)
        else:
            logger.log(self.level, "easyckpt " + msg, *args)

    def stats(self) -> dict[str, Any]:
        return {"persisted_step": self.persisted, "persist_failures": self.failures,
                "persist_failure": None if self.failure is None else self.failure.as_dict()}
