"""Where ``train(resume_from_checkpoint=...)`` starts from, and laying that state out for the Trainer.

The newest of easyckpt's states (memory, replicas, ``iteration_N``; chosen collectively by the
Checkpointer) and the complete ``checkpoint-N`` folders wins. An easyckpt state is written as a Trainer
checkpoint directory in the node's shared-memory directory and handed to the Trainer's own resume path,
so that it restores everything at exactly the points it always does.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from easyckpt.checkpointer import Checkpointer
from easyckpt.collectives import all_ok, broadcast_int
from easyckpt.recovery import LoadError, LoadResult
from easyckpt.transformers import fsdp
from easyckpt.transformers.folders import (
    TRAINER_STATE_NAME,
    CheckpointFolders,
    checkpoint_problem,
    complete_checkpoints,
    rng_file_name,
    unhealthy_reasons,
)
from easyckpt.transformers.snapshot import FROZEN_KEY, STATE_FORMAT, base_differs, unwrapped_model
from easyckpt_wire import layout
from easyckpt_wire.shm import format_bytes
from easyckpt_wire.storage import is_url, location

logger = logging.getLogger(__name__)

STAGING_PREFIX = "easyckpt-hf-resume-"
# The Trainer's own logger: run_clm.py-style scripts set its level (INFO on the main process, WARNING on
# the others), and so the resume line lands in the Trainer's log next to "***** Running training *****".
trainer_logger = logging.getLogger("transformers.trainer")


@dataclasses.dataclass(frozen=True)
class ResumeInfo:
    """Where ``train()`` resumed from."""

    step: int | None            # the global step resumed at; None: fresh start
    source: str | None          # "memory" | "replica" | "disk" | "checkpoint" (a complete checkpoint-N) | "path" | None
    path: str | None = None     # the iteration, slot, checkpoint-N or path it came from
    seconds: float = 0.0        # time to get the state (easyckpt sources)
    nbytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def as_asked(resume: str | os.PathLike[str] | bool | None) -> str | os.PathLike[str] | bool | None:
    """``resume_from_checkpoint`` as meant: the string ``"True"`` is True when no such path exists. A command line
    parsed by HfArgumentParser (``run_clm.py --resume_from_checkpoint True``) can only give the string, which a
    plain Trainer takes for a path and fails on."""
    if isinstance(resume, str) and resume.lower() == "true" and not os.path.exists(resume):
        logger.info("resume_from_checkpoint=%r (a string, from a command line) taken as True", resume)
        return True
    return resume


class Resumer:
    """Resolves ``resume_from_checkpoint`` for one ``train()`` call, on every rank."""

    def __init__(self, ckpt: Checkpointer, trainer: Trainer, folders: CheckpointFolders, *, save_dir: Path,
                 staging_dir: Path | None) -> None:
        self.ckpt = ckpt
        self.trainer = trainer
        self.folders = folders
        self.output_dir = folders.output_dir
        self.save_dir = save_dir
        self.staging_dir = staging_dir
        self.staged: Path | None = None    # the staged directory this process removes once the Trainer read it

    def announce(self, info: ResumeInfo, *, asked: bool) -> None:
        """One line in the Trainer's log, on each node's main process, saying where training starts from.

        WARNING for a resume, so that it shows at the Trainer's default level (transformers logs at
        WARNING unless the script asks for more); the fresh start after ``resume_from_checkpoint=True``
        found nothing is INFO (the normal first run).
        """
        if not self.trainer.args.should_log:
            return
        if info.step is None:
            if asked:
                trainer_logger.info("easyckpt: nothing to resume from in memory, %s or %s: fresh start",
                                    self.save_dir, self.output_dir)
            return
        if info.source in ("memory", "replica", "disk"):
            where = "" if info.source != "disk" else f"{info.path}, "
            trainer_logger.warning("easyckpt: resumed at step %d from %s (%s%s, %.2f s)", info.step, info.source,
                                   where, format_bytes(info.nbytes), info.seconds)
        elif info.source == "checkpoint":
            trainer_logger.warning("easyckpt: resuming at step %d from %s (a complete checkpoint-N at least as "
                                   "new as anything easyckpt holds)", info.step, info.path)
        else:
            trainer_logger.warning("easyckpt: resuming at step %d from %s (resume_from_checkpoint)", info.step,
                                   info.path)

    def release(self) -> None:
        """Remove the staged directory (every rank has read it once the first step is done)."""
        if self.staged is not None:
            shutil.rmtree(self.staged, ignore_errors=True)
            self.staged = None

    def resolve(self, resume: str | os.PathLike[str] | bool | None) -> tuple[str | None, ResumeInfo]:
        """The path to hand to ``Trainer.train`` and where it comes from."""
        if resume is None or resume is False:
            self._drop_old_snapshots()
            return None, ResumeInfo(None, None)
        if resume is True:
            return self._resolve_newest()
        if not isinstance(resume, (str, os.PathLike)):
            raise TypeError(f"resume_from_checkpoint must be True, False, None or a path, got {resume!r}")
        path = location(resume, "resume_from_checkpoint")   # a local path, or an s3:// iteration_N of a save_dir
        if not path.exists():
            raise FileNotFoundError(f"resume_from_checkpoint={str(resume)!r} does not exist: pass True to resume from "
                                    f"the newest state of {self.output_dir}, or the path of a checkpoint-N folder")
        if layout.ITERATION_RE.match(path.name):
            result = self.ckpt.load(load_dir=path, announce=False)
            return self._stage(result), self._info(result)
        problem = checkpoint_problem(path, world_size=self.trainer.args.world_size,
                                     need_optimizer=not self.trainer.args.save_only_model, need_rng=False)
        if problem is not None:
            raise ValueError(f"resume_from_checkpoint={str(path)!r} is incomplete: {problem}. It was probably being "
                             "written when a job died; pass True to resume from the newest complete state, or "
                             "another checkpoint-N")
        step = json.loads((path / TRAINER_STATE_NAME).read_text(encoding="utf-8"))["global_step"]
        # An explicit older checkpoint (a rollback; run_clm.py's only way to resume): a new timeline from it, in
        # easyckpt's memory and save_dir and in output_dir's newer checkpoint-N folders alike.
        self.ckpt.resumed_at(step)
        if self.trainer.args.should_save:
            self.folders.set_aside_after(step)
        return str(path), ResumeInfo(step, "path", str(path))

    def _resolve_newest(self) -> tuple[str | None, ResumeInfo]:
        args = self.trainer.args
        newest = -1
        newest_path: Path | None = None
        if self.ckpt.rank == 0:
            try:
                found = complete_checkpoints(self.output_dir, world_size=args.world_size,
                                             need_optimizer=not args.save_only_model,
                                             need_rng=not args.save_only_model)
            except OSError as exc:  # decided with the other ranks below: nobody may hang
                logger.warning("cannot look for checkpoint-N folders in %s (%s): using easyckpt's states only",
                               self.output_dir, exc)
                found = []
            for step, path in found:
                reasons = unhealthy_reasons(path)
                if reasons is None:
                    newest, newest_path = step, path
                    break
                # exported from an unhealthy iteration (invariant 13): as load() passes those over
                logger.warning("passing over %s: unhealthy (%s)", path, "; ".join(reasons) or "no reason recorded")
        newest = broadcast_int(newest)
        if newest >= 0:
            newest_path = self.folders.path(newest)
        try:
            result = self.ckpt.load(announce=False)   # announce(): in the Trainer's log
        except LoadError as exc:
            if newest < 0:
                raise
            logger.warning("easyckpt could not load its newest state (%s); resuming from %s instead", exc, newest_path)
            result = LoadResult(None, None, None)
        if result.step is not None and result.step >= newest:
            return self._stage(result), self._info(result)
        if newest >= 0:
            assert newest_path is not None
            if result.step is not None:
                logger.info("%s (step %d) is newer than easyckpt's step %d (%s): resuming from it", newest_path,
                            newest, result.step, result.source)
            self.ckpt.resumed_at(newest)
            return str(newest_path), ResumeInfo(newest, "checkpoint", str(newest_path))
        return None, ResumeInfo(None, None)

    @staticmethod
    def _info(result: LoadResult) -> ResumeInfo:
        return ResumeInfo(result.step, result.source, result.path, result.seconds, result.nbytes)

    def _check_saved_with(self, result: LoadResult) -> dict[str, Any]:
        """The loaded state, once it is one this Trainer can resume from: written by TrainerWrapper, with this run's
        DeepSpeed setting (and as many DeepSpeed ranks) and FSDP setting."""
        state = result.state
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else None
            raise ValueError(f"the easyckpt state of step {result.step} ({result.source}, {result.path}) was not "
                             f"written by TrainerWrapper (format {found!r}): "
                             f"give the wrapper a save_dir of its own (now {self.save_dir})")
        deepspeed = bool(getattr(self.trainer, "is_deepspeed_enabled", False))
        if ("deepspeed" in state) != deepspeed:
            saved = "with" if "deepspeed" in state else "without"
            raise ValueError(f"the easyckpt state of step {result.step} ({result.source}, {result.path}) was saved "
                             f"{saved} DeepSpeed, and this Trainer runs {'with' if deepspeed else 'without'} it: run "
                             "with the DeepSpeed setting of the saved run, or give the wrapper a new save_dir "
                             f"(now {self.save_dir}) and output_dir")
        if deepspeed:
            info, ranks = state["deepspeed"], self.trainer.args.world_size
            saved_ranks = int(info["dp_world_size"]) * int(info["mp_world_size"])
            if saved_ranks != ranks:
                raise ValueError(f"the easyckpt state of step {result.step} ({result.source}, {result.path}) holds the "
                                 f"ZeRO-{info['stage']} partitions of {saved_ranks} DeepSpeed ranks, and this run has "
                                 f"{ranks}: DeepSpeed loads ZeRO partitions only onto as many ranks as saved them. Run "
                                 f"with {saved_ranks} ranks, or give the wrapper a new save_dir (now {self.save_dir}) "
                                 "and output_dir and start from the model's weights (easyckpt convert --to hf)")
        sharded = fsdp.enabled(self.trainer)
        if (fsdp.STATE_KEY in state) != sharded:
            saved = "with" if fsdp.STATE_KEY in state else "without"
            raise ValueError(f"the easyckpt state of step {result.step} ({result.source}, {result.path}) was saved "
                             f"{saved} FSDP, and this Trainer runs {'with' if sharded else 'without'} it: run with the "
                             "FSDP setting of the saved run, or resume from a checkpoint-N folder "
                             "(resume_from_checkpoint=<output_dir>/checkpoint-N)")
        return state

    def _stage(self, result: LoadResult) -> str | None:
        """Lay the loaded state out as a Trainer checkpoint directory, once per node; each rank adds its RNG."""
        if result.step is None:
            return None
        state = self._check_saved_with(result)
        sharded = fsdp.enabled(self.trainer)
        world_size = self.trainer.args.world_size
        # The FSDP directories are written by every rank (each its shards, one DCP save): they go where every
        # rank sees them, and one process of the whole job creates and removes the directory.
        across_nodes = sharded and self.ckpt.world_size > self.ckpt.local_world_size
        base = self.staging_dir or (self.save_dir if across_nodes else self.ckpt.config.shm_dir)
        assert base is not None
        if is_url(base):
            raise ValueError(f"FSDP across nodes stages its resume files where every rank sees them, and save_dir "
                             f"{base} is an object store: give TrainerWrapper(staging_dir=...) a directory on a file "
                             "system every node mounts")
        creator = self.ckpt.rank == 0 if across_nodes else self.ckpt.local_rank == 0
        directory = Path(base) / f"{STAGING_PREFIX}{self.ckpt.config.job_id}"
        problem = ""
        if creator and FROZEN_KEY in state:
            self._check_frozen_base(state[FROZEN_KEY], result)
        if creator:
            try:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                self.folders.write_files(directory, state, {}, world_size, native=False)
            except OSError as exc:
                problem = f"{directory}: {exc}"
        if not all_ok(not problem):
            raise RuntimeError(f"could not lay out the state of step {result.step} for the Trainer "
                               f"({problem or 'on another node, see its log'}): free space there or pass "
                               "TrainerWrapper(..., staging_dir=<a directory with room for one copy of the state>)")
        try:
            torch.save(state["rng"], directory / rng_file_name(self.ckpt.rank, world_size))
            if "deepspeed" in state:   # each rank its own ZeRO partition, as DeepSpeed's save_checkpoint does
                from easyckpt.transformers import zero
                zero.write_optim_states(directory, result.step, state["optim"], state["deepspeed"])
                if zero.is_partitioned(state["deepspeed"]) and self.ckpt.local_rank != 0:   # ZeRO-3: its own model file
                    zero.write_model_states(directory, result.step, state["model"], state["deepspeed"], latest=False)
        except OSError as exc:
            problem = f"{directory}: {exc}"
        if not all_ok(not problem):
            raise RuntimeError(f"could not write the RNG state of step {result.step} for the Trainer "
                               f"({problem or 'on another rank, see its log'})")
        if sharded:   # collective; a rank that fails raises, and the others' DCP save fails with it
            fsdp.stage(directory, state, world_size, self.ckpt.rank, unwrapped_model(self.trainer))
        self.staged = directory if creator else None
        return str(directory)

    def _check_frozen_base(self, saved: dict[str, list[float] | None], result: LoadResult) -> None:
        """A peft model's snapshot holds what trains, not its frozen base (``snapshot.trained_only``): the resumed
        model is the one that trained only if the script built the same base again. Said, not refused: training can
        go on, as it would from the Trainer's own checkpoint of a peft model (the adapter only)."""
        differ = base_differs(unwrapped_model(self.trainer), saved)
        if differ:
            logger.warning("the frozen base of this peft model is not the one the run that saved step %s trained "
                           "with: %d of its %d frozen parameters differ (%s%s). Snapshots of a peft model hold what "
                           "trains (the adapter), not the base, as the Trainer's own checkpoints of one; this run "
                           "built another base (another base model, or a random initialisation without the seed "
                           "of that run) and goes on with it. To continue that run's model, build the base as it did",
                           result.step, len(differ), len(saved), ", ".join(differ[:3]), ", ..." if len(differ) > 3
                           else "")

    def _drop_old_snapshots(self) -> None:
        if self.ckpt.slots.committed():
            logger.info("rank %d: fresh start: dropping this job's old snapshots from memory", self.ckpt.rank)
            self.ckpt.slots.invalidate_newer_than(-1)
