"""The export thread: on global rank 0, writes each checkpoint file Lightning asked for (``ModelCheckpoint``,
``trainer.save_checkpoint``) once the node agent has persisted its step as a complete ``iteration_N``.

Off the training path on purpose: every rank only snapshots to memory and asks the agent to persist; reading
the iteration back and writing the ``.ckpt`` file happens here while training goes on. The file is the one
Lightning would have written: the model and optimizer tensors come from the persisted iteration (the state
of that very step, whatever training has done since), every other entry (loops, callbacks, schedulers,
hyper-parameters, ...) from the dictionary Lightning built at the save, copied then. It is written to a
temporary name, fsynced and renamed into place: a plain ``Trainer.fit(ckpt_path=...)`` or
``LightningModule.load_from_checkpoint`` reads it, and a reader never sees half a file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from easyckpt.tools.convert import full_state
from easyckpt_wire import layout, procs
from easyckpt_wire.episode import Episode
from easyckpt_wire.storage import posix

logger = logging.getLogger(__name__)

POLL = 0.05          # seconds between looks at save_dir for a persisted iteration
TENSOR_KEYS = ("state_dict", "optimizer_states")   # taken from the persisted iteration, the rest from the save
# ``.<file name>.<writer's pid>.easyckpt-tmp``; before 2026-11-27 without the pid.
TMP_RE = re.compile(r"^\.(?P<name>.+?)(?:\.(?P<pid>\d+))?\.easyckpt-tmp$")
_cleaned: set[Path] = set()       # directories this process has cleared of dead writers' temporary files
_cleaned_lock = threading.Lock()


@dataclasses.dataclass
class _Request:
    step: int
    path: str
    extras: dict[str, Any]


class Exporter:
    """Turns persisted iterations into the ``.ckpt`` files Lightning asked for, in the order asked."""

    def __init__(self, save_dir: Path, timeout: float) -> None:
        self.save_dir = save_dir
        self.timeout = timeout
        self.requests: queue.Queue[_Request | None] = queue.Queue()
        self.lock = threading.Condition()
        self.pending: dict[str, int] = {}     # path -> requests for it not yet written
        self.cancelled: set[str] = set()      # paths removed (ModelCheckpoint's rotation) while pending
        self.outstanding = 0
        self.holds = layout.ExportHolds(save_dir)   # one hold file per step, released with its last request
        self.exported: list[tuple[int, str]] = []
        self.failed: dict[str, str] = {}
        # saves of steps the agent did not persist because a newer iteration was complete (a run that started below
        # an earlier run's steps without resuming): one warning, and the files named once exports resume
        self.unpersisted = Episode(logger)
        self.thread = threading.Thread(target=self._run, name="easyckpt-lightning-export", daemon=True)
        self.thread.start()

    def request(self, step: int, path: str, extras: dict[str, Any]) -> None:
        # The hold first: rotation must not delete the iteration before its export has read it.
        try:
            self.holds.hold(step)
        except OSError as exc:
            logger.warning("cannot hold iteration %d for the export of %s (%s): rotation may delete it first", step,
                           path, exc)
        with self.lock:
            self.outstanding += 1
            self.pending[path] = self.pending.get(path, 0) + 1
            self.cancelled.discard(path)
        self.requests.put(_Request(step, path, extras))

    def forget(self, path: str) -> bool:
        """``ModelCheckpoint`` removes ``path``: True when it was still to be written (now it never is)."""
        with self.lock:
            if not self.pending.get(path):
                return False
            self.cancelled.add(path)
            return True

    def drain(self, timeout: float) -> bool:
        """Wait until every requested file is written (or given up); False on timeout."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
        return True

    def stop(self) -> None:
        self.requests.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            try:
                self._export(request)
            except BaseException as exc:  # one failed export must not stop the next ones
                # BaseException: torch.distributed.checkpoint raises one (CheckpointException), and a dead thread
                # would leave every later request, and the drain at the end of training, waiting out the timeout.
                self.failed[request.path] = f"{type(exc).__name__}: {exc}"
                logger.exception("writing %s from iteration %d failed; the easyckpt iteration stays usable",
                                 request.path, request.step)
            finally:
                try:
                    self.holds.release(request.step)
                except OSError as exc:   # the next run's start releases it (EasyCkpt.setup)
                    logger.warning("cannot release the export hold of iteration %d (%s): rotation keeps it until "
                                   "the next run starts", request.step, exc)
                with self.lock:
                    self.outstanding -= 1
                    self.pending[request.path] -= 1
                    if not self.pending[request.path]:
                        del self.pending[request.path]
                        self.cancelled.discard(request.path)
                    self.lock.notify_all()

    def _wait_complete(self, request: _Request) -> Path | None:
        path = self.save_dir / layout.iteration_dirname(request.step)
        deadline = time.monotonic() + self.timeout
        while True:
            done = dict(layout.complete_iterations(self.save_dir))
            if request.step in done:
                return path
            if any(s > request.step for s in done) and not layout.present(path):
                self.unpersisted.hit("step %d was never persisted to %s (a newer iteration is complete): no %s; later "
                                     "such files are named once exports resume", request.step, self.save_dir,
                                     request.path, item=request.path)
                return None
            if time.monotonic() > deadline:
                logger.warning("step %d not persisted to %s after %.0fs (export_timeout): no %s; is the agent "
                               "running (easyckpt status)?", request.step, self.save_dir, self.timeout, request.path)
                return None
            with self.lock:
                if request.path in self.cancelled:
                    return None
            time.sleep(POLL)  # polling the disk for the agent's commit marker, against a deadline

    def _export(self, request: _Request) -> None:
        iteration = self._wait_complete(request)
        if iteration is None:
            self.failed.setdefault(request.path, "not persisted")
            return
        started = time.perf_counter()
        try:
            state = full_state(iteration)
        except (FileNotFoundError, layout.CheckpointFormatError):
            if not layout.present(iteration):
                logger.warning("iteration %s was rotated away before it could be exported: no %s (raise "
                               "max_ckpt_num)", iteration, request.path)
                self.failed[request.path] = "rotated away"
                return
            raise
        checkpoint = {**state, **{k: v for k, v in request.extras.items() if k not in TENSOR_KEYS}}
        # Renamed into place under the lock: a removal (forget) either comes first and the file is dropped, or
        # after, and then it deletes the written file itself.
        write_checkpoint(checkpoint, request.path, guard=self.lock, wanted=lambda: request.path not in self.cancelled)
        self.exported.append((request.step, request.path))
        logger.info("exported iteration %d to %s in %.2fs", request.step, request.path, time.perf_counter() - started)
        self.unpersisted.end("exports resume at %s; not written, their steps never persisted: %s", request.path,
                             self.unpersisted.items)


def write_checkpoint(checkpoint: dict[str, Any], path: str, *, guard: Any = None,
                     wanted: Callable[[], bool] | None = None) -> None:
    """Write a Lightning checkpoint file whole or not at all: a temporary file in the same directory,
    fsynced, renamed into place (holding ``guard``, when ``wanted()`` still says so: else it was removed
    meanwhile and the temporary file is dropped), the directory fsynced. A remote URL goes through
    Lightning's own ``TorchCheckpointIO`` (fsspec), which writes the object in one piece."""
    if "://" in path and not path.startswith("file://"):
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        with guard or contextlib.nullcontext():
            if wanted is None or wanted():
                TorchCheckpointIO().save_checkpoint(checkpoint, path)
        return
    final = Path(path.removeprefix("file://"))
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.easyckpt-tmp")
    try:
        with open(tmp, "wb") as handle:
            torch.save(checkpoint, handle)
        posix.fsync_file(tmp)
        with guard or contextlib.nullcontext():
            if wanted is not None and not wanted():
                return
            posix.rename_file(tmp, final)
        posix.fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


def clean_stale(directory: Path) -> None:
    """Remove the temporary files of a writer that died while exporting (a kill -9 of the job mid-write leaves
    ``.<name>.<pid>.easyckpt-tmp`` in the ``ModelCheckpoint`` directory for good). Once per directory and
    process; a file whose writer is still alive on this host is left alone."""
    with _cleaned_lock:
        if directory in _cleaned:
            return
        _cleaned.add(directory)
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        match = TMP_RE.match(entry.name)
        if match is None or not entry.is_file():
            continue
        pid = match.group("pid")
        if pid is not None and int(pid) != os.getpid() and procs.is_alive(int(pid), None):
            continue
        logger.info("removing %s, left by a job that died while writing %s", entry, match.group("name"))
        entry.unlink(missing_ok=True)
