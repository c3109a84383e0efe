"""The export thread: on the process with ``args.should_save``, turns each requested step into a
``checkpoint-N`` folder once the node agent has persisted it as a complete ``iteration_N``.

Off the training path on purpose: the ranks only snapshot to memory; reading the iteration back and
writing the Trainer's files happens here while training goes on.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from easyckpt import storage
from easyckpt.snapshot.state import unflatten
from easyckpt.transformers.folders import CheckpointFolders
from easyckpt_wire import layout
from easyckpt_wire.episode import Episode

logger = logging.getLogger(__name__)

POLL = 0.05               # seconds between looks at the disk for a persisted iteration
# How long a step must stay announced as passed over before its export gives up. The wrapper asks the agent for
# every step it exports, without waiting for an answer: an agent that announced the step passed over a moment
# before the request reached it withdraws it once it does (CI, 2026-11-29: checkpoint-8, the best one, was given
# up while the agent went on to persist step 8).
PASSED_CONFIRM = 1.0


def read_rank_state(iteration_dir: Path, rank: int, world_size: int, only: tuple[str, ...] | None = None) -> Any:
    """One rank's saved state from a complete iteration (checksums verified); with ``only`` (top-level
    keys), only those parts' tensors are read and the rest are None."""
    entry = storage.rank_entry(iteration_dir, rank, world_size)
    wanted = entry.records if only is None else [r for r in entry.records if r.name.split("/", 1)[0] in only]
    values: list[Any] = [None] * len(entry.records)
    for record, tensor in storage.read_tensors(dataclasses.replace(entry, records=wanted)):
        values[record.index] = tensor.numpy() if record.kind == "numpy" else tensor
    return unflatten(entry.skeleton, values)


class Exporter:
    """On the saving process: waits for persisted iterations and exports them as checkpoint-N folders."""

    def __init__(self, folders: CheckpointFolders, save_dir: Path, timeout: float,
                 passed_over: Callable[[], frozenset[int]] = frozenset,
                 persist_failed: Callable[[int], bool] = lambda step: False) -> None:
        self.folders = folders
        self.passed_over = passed_over   # due steps the agent announced it will never persist
        self.persist_failed = persist_failed   # whether the agent's persist of a step (or a newer one) failed
        self.save_dir = save_dir
        self.timeout = timeout
        self.requests: queue.Queue[int | None] = queue.Queue()
        self.idle = threading.Condition()
        self.outstanding = 0
        self.abandoned: str | None = None  # why no export waits any more for a step to be persisted
        self.exported: list[int] = []
        self.failed: dict[int, str] = {}
        self.cancelled: set[int] = set()   # requested steps that will never be persisted (no snapshot was taken)
        self.passed: set[int] = set()      # exports given up because the agent passed their due step over
        self.holds = layout.ExportHolds(save_dir)   # one per request not done (nor given up) yet, by step
        # save steps the agent did not persist because a newer iteration was complete (a run that started below an
        # earlier run's steps without resuming): one warning, and the steps named once exports resume
        self.unpersisted = Episode(logger)
        self.thread = threading.Thread(target=self._run, name="easyckpt-hf-export", daemon=True)
        self.thread.start()

    def request(self, step: int) -> None:
        # The hold first: rotation must not delete the iteration before its export is done, even if this
        # process dies in between (the next run's catch-up exports it and lets the hold go).
        self.hold(step)
        with self.idle:
            self.outstanding += 1
        self.requests.put(step)

    def hold(self, step: int) -> None:
        try:
            self.holds.hold(step)
        except OSError as exc:   # rotation may then delete the iteration first: the export says so if it does
            logger.warning("cannot hold iteration %d for its export (%s): rotation may delete it first", step, exc)

    def release(self, step: int) -> None:
        try:
            self.holds.release(step)
        except OSError as exc:   # the next run's start releases it (TrainerWrapper's catch-up)
            logger.warning("cannot release the export hold of iteration %d (%s): rotation keeps it until the next "
                           "run starts", step, exc)

    def cancel(self, step: int) -> None:
        """A requested step some rank could not snapshot: the agent will never persist it, so the export stops
        waiting for it (it would otherwise wait ``timeout``, holding up the end of training)."""
        self.cancelled.add(step)

    def ask_again_if_persisted(self) -> list[int]:
        """The exports given up because the agent passed their due step over, whose iteration is complete now
        (the end of training persists the newest snapshot whatever its step: the last save step, as often as not),
        asked for again; returns their steps. Without it a run whose last save step was passed over ended with
        that step on disk and no checkpoint-N of it, where a plain Trainer writes one (CI, 2026-11-27)."""
        with self.idle:
            passed, self.passed = sorted(self.passed), set()
        if not passed:
            return []
        try:
            done = {step for step, _ in layout.complete_iterations(self.save_dir)}
        except OSError as exc:
            logger.warning("cannot list %s for the iterations of %s (%s): no checkpoint of them", self.save_dir,
                           ", ".join(f"checkpoint-{s}" for s in passed), exc)
            return []
        again = [step for step in passed if step in done]
        for step in again:
            logger.info("checkpoint-%d: the end of training made step %d durable after all: exporting it", step, step)
            self.request(step)
        return again

    def waiting(self) -> list[int]:
        """The requested steps whose export is not done yet, oldest first."""
        return sorted(self.holds.held())

    def abandon(self, why: str) -> None:
        """Nothing will persist the steps still waited for (``why``): every export that waits, or will, for its
        iteration to be complete gives up at once."""
        self.abandoned = why

    def drain(self, timeout: float) -> bool:
        """Wait until every requested export is done (or given up); False on timeout."""
        deadline = time.monotonic() + timeout
        with self.idle:
            while self.outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        return True

    def stop(self) -> None:
        self.requests.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            step = self.requests.get()
            if step is None:
                return
            try:
                self.export(step)
            except BaseException as exc:  # one failed export must not stop the next ones
                # BaseException: torch.distributed.checkpoint raises one (CheckpointException), and a dead thread
                # would leave every later export, and the drain at the end of training, waiting out the timeout.
                self.failed[step] = f"{type(exc).__name__}: {exc}"
                logger.exception("export of step %d to checkpoint-%d failed; the easyckpt iteration stays usable",
                                 step, step)
            finally:
                self.release(step)
                with self.idle:
                    self.outstanding -= 1
                    self.idle.notify_all()

    def _wait_complete(self, step: int) -> Path | None:
        path = self.save_dir / layout.iteration_dirname(step)
        deadline = time.monotonic() + self.timeout
        passed_since: float | None = None
        while True:
            done = dict(layout.complete_iterations(self.save_dir))
            if step in done:
                return path
            if step in self.cancelled:
                logger.warning("no checkpoint-%d: step %d was not snapshotted on every rank, so it is not persisted",
                               step, step)
                return None
            if step not in self.passed_over():
                passed_since = None
            elif passed_since is None:
                passed_since = time.monotonic()
            elif time.monotonic() - passed_since >= PASSED_CONFIRM:
                logger.warning("no checkpoint-%d: the node agent passed over due step %d (a persist was still running; "
                               "see its log) and will not persist it", step, step)
                with self.idle:
                    self.passed.add(step)
                return None
            if self.persist_failed(step):
                # not retried: waiting out the timeout for every such step held up the end of training for
                # export_timeout each on a full disk (fault soak, seed 101, fault 19)
                logger.warning("no checkpoint-%d: the node agent could not persist step %d (see easyckpt status and "
                               "the agent log: a full disk?)", step, step)
                return None
            if self.abandoned is not None:
                # waiting out the timeout for a step nothing will persist held up the end of training for
                # export_timeout (fault soak, seed 101, fault 99: the agent killed late in a short run)
                logger.warning("no checkpoint-%d: step %d is not persisted and will not be: %s", step, step,
                               self.abandoned)
                return None
            if any(s > step for s in done) and not layout.present(path):
                self.unpersisted.hit("step %d was never persisted to %s (a newer iteration is complete): no "
                                     "checkpoint-%d; later such steps are named once exports resume", step,
                                     self.save_dir, step, item=step)
                return None
            if time.monotonic() > deadline:
                logger.warning("step %d not persisted to %s after %.0fs: no checkpoint-%d; is the agent running "
                               "(easyckpt status)?", step, self.save_dir, self.timeout, step)
                return None
            time.sleep(POLL)  # polling the disk for the agent's commit marker

    def export(self, step: int) -> None:
        """Export iteration ``step`` (waiting for it to be complete) in the calling thread."""
        path = self._wait_complete(step)
        if path is None:
            self.failed[step] = "not persisted"
            return
        started = time.perf_counter()
        meta = layout.read_metadata(path)
        world_size = int(meta["world_size"])
        try:
            common = read_rank_state(path, 0, world_size)
            rngs = {0: common["rng"]}
            deepspeed = "deepspeed" in common
            # Under DeepSpeed ZeRO every rank's optimizer partition goes into the checkpoint too.
            zero_optims = {0: (common["optim"], common["deepspeed"])} if deepspeed else {}
            # Under ZeRO-3 every rank's parameter partitions too: its model state file and the whole weights.
            partitioned = deepspeed and bool(common["deepspeed"].get("partitioned"))
            zero_models = {0: common["model"]} if partitioned else {}
            parts = ("rng", "optim", "model") if partitioned else ("rng", "optim") if deepspeed else ("rng",)
            for rank in range(1, world_size):
                part = read_rank_state(path, rank, world_size, only=parts)
                rngs[rank] = part["rng"]
                if deepspeed:
                    zero_optims[rank] = (part["optim"], part["deepspeed"])
                if partitioned:
                    zero_models[rank] = part["model"]
        except (FileNotFoundError, layout.CheckpointFormatError):
            if not layout.present(path):
                logger.warning("iteration %s was rotated away before it could be exported: no checkpoint-%d "
                               "(raise max_ckpt_num)", path, step)
                self.failed[step] = "rotated away"
                return
            raise
        self.folders.write_checkpoint(step, common, rngs, world_size, health=meta.get("health"), zero_optims=zero_optims,
                                     zero_models=zero_models, iteration_dir=path)
        self.exported.append(step)
        logger.info("exported %s to checkpoint-%d in %.2fs", path, step, time.perf_counter() - started)
        self.unpersisted.end("exports resume at checkpoint-%d; steps never persisted, without a checkpoint: %s", step,
                             self.unpersisted.items)
