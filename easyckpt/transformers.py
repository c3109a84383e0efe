"""HuggingFace Trainer integration: ``TrainerWrapper(trainer)`` and ``train(resume_from_checkpoint=True)``.

::

    from easyckpt.transformers import TrainerWrapper
    trainer = TrainerWrapper(trainer, save_mem_interval=1)   # honours save_strategy, save_steps, save_total_limit
    trainer.train(resume_from_checkpoint=True)               # memory, replica or disk; fresh start if none

What it does, and why this way:

* **Snapshot at the Trainer's own save point.** The wrapper hooks ``Trainer._maybe_log_save_evaluate``
  (on the instance) and snapshots after it returns, every ``save_mem_interval`` optimizer steps. That is
  the point where the Trainer itself writes a checkpoint: after the step's log, evaluation and save, and
  before the next batch is fetched. The snapshot holds the model, optimizer, LR scheduler, grad scaler
  (when there is one), the Trainer's state (global step, epoch, log history, best metric, the stateful
  callbacks) and every RNG in the Trainer's own layout (python, numpy, torch CPU, CUDA when present).
  The data position needs nothing more: the Trainer derives it from the global step (epochs done and
  batches to skip), and its sampler is seeded by ``seed``/``data_seed`` plus the epoch.

* **Resume through the Trainer's own resume path.** ``train(resume_from_checkpoint=True)`` asks the
  Checkpointer for the newest step every rank can get (memory, else replicas on other nodes, else a
  complete ``iteration_N`` on disk, all chosen collectively), writes that state as a Trainer checkpoint
  directory in the node's shared-memory directory (once per node; each rank adds its own
  ``rng_state_<rank>.pth``) and calls ``Trainer.train(resume_from_checkpoint=<that directory>)``. So the
  Trainer restores everything at exactly the points it always does (the RNGs after skipping the
  consumed batches, the callbacks' states, the scaler) and the loss curve continues exactly, with no
  re-implementation of its resume logic to drift from it across versions. The cost is one write and one
  read of the state through tmpfs (memory bandwidth); the directory is removed after the first step.
  When a complete ``checkpoint-N`` is newer than anything easyckpt holds (e.g. written by a plain
  Trainer), it wins. A path still works as in the Trainer; ``None``/``False`` is a fresh start (and
  drops this job's old snapshots from memory so that they cannot be mistaken for this run's).

* **Persist with the agent, export Trainer-native folders.** With ``save_strategy="steps"`` the
  Checkpointer's ``save_storage_interval`` is ``save_steps``: the node agent persists those snapshots to
  ``<output_dir>/easyckpt/iteration_N`` off the training path, as for any easyckpt job. When such an
  iteration is complete, a thread of the process with ``args.should_save`` exports it to
  ``<output_dir>/checkpoint-N/`` with the Trainer's file names (``model.safetensors`` through the model's
  own ``save_pretrained``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state[_<rank>].pth``,
  ``trainer_state.json``, ``training_args.bin``, the processing class) and applies ``save_total_limit``
  the way the Trainer does (newest and best are never deleted). Calling the Trainer's own
  ``_save_checkpoint`` instead would block every rank on the disk at every save, which is what easyckpt
  exists to avoid. A save the interval cannot express (the final step when ``max_steps`` is not a
  multiple of ``save_steps``, ``save_strategy="epoch"`` or ``"best"``) is written synchronously from the
  live state by the same writer, as the Trainer would. ``save_strategy="no"`` keeps snapshots in memory
  only.

* **A torn checkpoint is never chosen.** Every ``checkpoint-N`` this module writes is assembled in
  ``<output_dir>/.easyckpt-tmp-checkpoint-N``, fsynced, and renamed into place (then the directory is
  fsynced): it is complete or absent. Folders of other writers (a plain Trainer killed mid-save) are
  checked before use: ``trainer_state.json`` must parse and name step N, the weights must be there (a
  safetensors file must open), and so must ``optimizer.pt``, ``scheduler.pt`` and each rank's RNG file;
  ``resume_from_checkpoint=True`` skips a folder that fails, and an explicit path that fails is refused
  with the reason.

Supported: one process or DDP (each rank holds the whole model and optimizer, as the Trainer saves
them). DeepSpeed, FSDP, ``save_on_each_node`` and hyperparameter search are refused with a clear error;
with ``push_to_hub`` the checkpoints are not pushed at each save. A due ``checkpoint-N`` appears when
the agent has persisted the step and the export is done, so a callback's ``on_save`` may run before
the folder exists; training waits for the pending exports before the Trainer's end-of-training work
(``load_best_model_at_end``, the last ``save_total_limit`` pass).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from easyckpt import storage
from easyckpt.checkpointer import Checkpointer
from easyckpt.recovery import LoadError, LoadResult
from easyckpt.state import unflatten
from easyckpt_wire import layout
from easyckpt_wire.faults import fault_point

try:
    from transformers import PreTrainedModel, Trainer
    from transformers.trainer_callback import ExportableState
except ImportError as _exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "easyckpt.transformers needs the transformers package (and accelerate): "
        "pip install 'easyckpt[hf]' or pip install transformers accelerate"
    ) from _exc

logger = logging.getLogger(__name__)

STATE_FORMAT = "easyckpt-hf-1"
CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
EXPORT_TMP_PREFIX = ".easyckpt-tmp-checkpoint-"
EXPORT_TRASH_PREFIX = ".easyckpt-trash-checkpoint-"
STAGING_PREFIX = "easyckpt-hf-resume-"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_NEVER = 1 << 40           # save_storage_interval = save_mem_interval * _NEVER: memory only
_POLL = 0.05               # seconds between looks at the disk for a persisted iteration


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


def rng_file_name(rank: int, world_size: int) -> str:
    """The Trainer's name for a rank's RNG file."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def checkpoint_problem(path: Path, *, world_size: int, need_optimizer: bool = True,
                       need_rng: bool = True) -> str | None:
    """Why the Trainer checkpoint folder ``path`` is not complete, or None when it is.

    Used for folders this module did not write (ours are complete or absent): the Trainer writes
    ``trainer_state.json`` after the weights, optimizer, scheduler and its own RNG file, so a folder
    killed mid-save lacks it or one of the others.
    """
    if not path.is_dir():
        return f"{path} is not a directory"
    state_path = path / TRAINER_STATE_NAME
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        step = state["global_step"]
    except FileNotFoundError:
        return f"{state_path} is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{state_path} is unreadable ({type(exc).__name__}: {exc})"
    match = CHECKPOINT_RE.match(path.name)
    if match is not None and int(match.group(1)) != step:
        return f"{state_path} says global_step {step}, the folder name says {match.group(1)}"
    weights = [name for name in WEIGHTS_FILES if (path / name).is_file()]
    if not weights:
        return f"{path} has no model weights (none of {', '.join(WEIGHTS_FILES)})"
    if SAFE_WEIGHTS_NAME in weights:
        try:
            from safetensors import safe_open
            with safe_open(str(path / SAFE_WEIGHTS_NAME), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own error types for a truncated file
            return f"{path / SAFE_WEIGHTS_NAME} is not a readable safetensors file ({exc})"
    if need_optimizer:
        for name in (OPTIMIZER_NAME, SCHEDULER_NAME):
            if not (path / name).is_file():
                return f"{path / name} is missing"
    if need_rng:
        for rank in range(world_size):
            if not (path / rng_file_name(rank, world_size)).is_file():
                return f"{path / rng_file_name(rank, world_size)} is missing (written by {world_size} ranks?)"
    return None


def complete_checkpoints(output_dir: Path, **checks: Any) -> list[tuple[int, Path]]:
    """Complete ``checkpoint-N`` folders of ``output_dir``, newest first; torn ones are logged and skipped."""
    found = []
    try:
        entries = list(output_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        match = CHECKPOINT_RE.match(entry.name)
        if match is not None and entry.is_dir():
            found.append((int(match.group(1)), entry))
    complete = []
    for step, path in sorted(found, reverse=True):
        problem = checkpoint_problem(path, **checks)
        if problem is None:
            complete.append((step, path))
        else:
            logger.warning("skipping %s: incomplete (%s); it was probably being written when a job died", path, problem)
    return complete


# collectives ------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if not _distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def _all_ok(ok: bool) -> bool:
    """True when every rank says ok; also a barrier."""
    if not _distributed():
        return ok
    tensor = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())


# files -------------------------------------------------------------------------------------------------
def _fsync_tree(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        layout.fsync_dir(Path(root))


def _distinct_storage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors that share memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone().contiguous() if key in seen else tensor.detach().contiguous()
        seen.add(key)
    return out


def _read_rank_state(iteration_dir: Path, rank: int, world_size: int, only: str | None = None) -> Any:
    """One rank's saved state from a complete iteration (checksums verified); with ``only`` (a top-level
    key), only that part's tensors are read and the rest are None."""
    entry = storage.rank_entry(iteration_dir, rank, world_size)
    wanted = entry.records if only is None else [r for r in entry.records if r.name.split("/", 1)[0] == only]
    values: list[Any] = [None] * len(entry.records)
    for record, tensor in storage.read_tensors(dataclasses.replace(entry, records=wanted)):
        values[record.index] = tensor.numpy() if record.kind == "numpy" else tensor
    return unflatten(entry.skeleton, values)


class _Exporter:
    """On the saving process: waits for persisted iterations and exports them as checkpoint-N folders."""

    def __init__(self, wrapper: "TrainerWrapper", save_dir: Path, timeout: float) -> None:
        self.wrapper = wrapper
        self.save_dir = save_dir
        self.timeout = timeout
        self.requests: queue.Queue[int | None] = queue.Queue()
        self.idle = threading.Condition()
        self.outstanding = 0
        self.exported: list[int] = []
        self.failed: dict[int, str] = {}
        self.thread = threading.Thread(target=self._run, name="easyckpt-hf-export", daemon=True)
        self.thread.start()

    def request(self, step: int) -> None:
        with self.idle:
            self.outstanding += 1
        self.requests.put(step)

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
            except Exception as exc:  # one failed export must not stop the next ones
                self.failed[step] = f"{type(exc).__name__}: {exc}"
                logger.exception("export of step %d to checkpoint-%d failed; the easyckpt iteration stays usable",
                                 step, step)
            finally:
                with self.idle:
                    self.outstanding -= 1
                    self.idle.notify_all()

    def _wait_complete(self, step: int) -> Path | None:
        path = self.save_dir / layout.iteration_dirname(step)
        deadline = time.monotonic() + self.timeout
        while True:
            done = dict(layout.complete_iterations(self.save_dir))
            if step in done:
                return path
            if any(s > step for s in done) and not path.exists():
                logger.warning("step %d was never persisted to %s (a newer iteration is complete): no checkpoint-%d",
                               step, self.save_dir, step)
                return None
            if time.monotonic() > deadline:
                logger.warning("step %d not persisted to %s after %.0fs: no checkpoint-%d; is the agent running "
                               "(easyckpt status)?", step, self.save_dir, self.timeout, step)
                return None
            time.sleep(_POLL)  # polling the disk for the agent's commit marker

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
            common = _read_rank_state(path, 0, world_size)
            rngs = {0: common["rng"]}
            for rank in range(1, world_size):
                rngs[rank] = _read_rank_state(path, rank, world_size, only="rng")["rng"]
        except (FileNotFoundError, layout.CheckpointFormatError):
            if not path.exists():
                logger.warning("iteration %s was rotated away before it could be exported: no checkpoint-%d "
                               "(raise max_ckpt_num)", path, step)
                self.failed[step] = "rotated away"
                return
            raise
        self.wrapper._write_checkpoint(step, common, rngs, world_size)
        self.exported.append(step)
        logger.info("exported %s to checkpoint-%d in %.2fs", path, step, time.perf_counter() - started)


class TrainerWrapper:
    """Wraps a ``transformers.Trainer``: easyckpt snapshots, persistence, Trainer-native exports, resume.

    ``save_mem_interval``: snapshot every that many optimizer steps. Further keywords go to
    ``easyckpt.Checkpointer`` (``save_dir`` defaults to ``<output_dir>/easyckpt``, ``max_ckpt_num`` to 2,
    since the Trainer-native ``checkpoint-N`` folders keep the history under ``save_total_limit``), except:
    ``staging_dir`` (where a resumed state is laid out for the Trainer; default: the shm directory) and
    ``export_timeout`` (how long an export waits for its iteration, default 600 s).
    Any other attribute is the wrapped Trainer's (``wrapper.evaluate()``, ``wrapper.state``...).
    """

    def __init__(self, trainer: Trainer, save_mem_interval: int = 1, **checkpointer_kwargs: Any) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(f"TrainerWrapper wraps a transformers.Trainer, got {type(trainer).__qualname__}")
        if not isinstance(save_mem_interval, int) or isinstance(save_mem_interval, bool) or save_mem_interval < 1:
            raise ValueError(f"save_mem_interval must be a positive int, got {save_mem_interval!r}")
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            raise NotImplementedError(
                "TrainerWrapper supports one process or DDP (every rank holds the whole model and optimizer); "
                "this Trainer uses DeepSpeed or FSDP, whose sharded states it does not snapshot yet: "
                "drop the wrapper or use plain DDP")
        if trainer.args.save_on_each_node:
            raise NotImplementedError(
                "TrainerWrapper writes checkpoint-N folders from the process with rank 0 only; "
                "save_on_each_node=True would need one export per node: set save_on_each_node=False "
                "(output_dir on a file system every node sees)")
        if trainer.args.push_to_hub:
            logger.warning("push_to_hub: the checkpoint-N folders TrainerWrapper writes are not pushed at each save; "
                           "call trainer.push_to_hub() when training is done")
        if "save_storage_interval" in checkpointer_kwargs:
            raise ValueError("TrainerWrapper derives save_storage_interval from the Trainer's save_strategy and "
                             "save_steps: set TrainingArguments(save_steps=...) instead")
        self.trainer = trainer
        args = trainer.args
        self.output_dir = Path(args.output_dir).expanduser().resolve()
        self.save_mem_interval = save_mem_interval
        self.strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        self.save_steps = self._save_steps(args)
        self.persist_interval = self.save_steps if self.save_steps else save_mem_interval * _NEVER
        self.save_dir = Path(checkpointer_kwargs.pop("save_dir", self.output_dir / "easyckpt")).expanduser().resolve()
        self.max_ckpt_num = int(checkpointer_kwargs.pop("max_ckpt_num", 2))
        self.log_file_path = checkpointer_kwargs.pop("log_file_path", None)
        staging = checkpointer_kwargs.pop("staging_dir", None)
        self.staging_dir = Path(staging) if staging is not None else None
        self.export_timeout = float(checkpointer_kwargs.pop("export_timeout", 600.0))
        self.options = checkpointer_kwargs
        self.ckpt: Checkpointer | None = None
        self.resumed: ResumeInfo | None = None
        self._exporter: _Exporter | None = None
        self._publish_lock = threading.Lock()
        self._last_step: int | None = None
        self._staged: Path | None = None
        self._original_mlse = trainer._maybe_log_save_evaluate
        self._original_save = trainer._save_checkpoint
        trainer._maybe_log_save_evaluate = self._maybe_log_save_evaluate   # type: ignore[method-assign]
        trainer._save_checkpoint = self._save_checkpoint                   # type: ignore[method-assign]

    def _save_steps(self, args: Any) -> int | None:
        if self.strategy == "no" or self.strategy in ("epoch", "best"):
            return None
        if self.strategy != "steps":
            raise ValueError(f"save_strategy={self.strategy!r} is not supported by TrainerWrapper: "
                             "use 'steps', 'epoch', 'best' or 'no'")
        steps = args.save_steps
        if not float(steps).is_integer() or steps < 1:
            raise ValueError(f"save_steps={steps} is a fraction of the run; TrainerWrapper needs a whole number "
                             "of steps to persist at: set TrainingArguments(save_steps=<int>)")
        steps = int(steps)
        if steps % self.save_mem_interval:
            raise ValueError(f"save_steps={steps} is not a multiple of save_mem_interval={self.save_mem_interval}: "
                             "a persisted step must also be a snapshot step; use e.g. "
                             f"save_mem_interval={self._divisor(steps)}")
        return steps

    def _divisor(self, steps: int) -> int:
        return max(d for d in range(1, self.save_mem_interval + 1) if steps % d == 0)

    def __getattr__(self, name: str) -> Any:
        if name == "trainer":  # not set yet (failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.trainer, name)

    # the public entry point ------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | os.PathLike[str] | bool | None = None, trial: Any = None,
              **kwargs: Any) -> Any:
        """``Trainer.train`` with easyckpt: ``True`` resumes from the newest state (memory, replica, disk,
        or a complete checkpoint-N), a fresh start when there is none; a path as in the Trainer (a
        ``checkpoint-N`` folder or an easyckpt ``iteration_N``); None/False: fresh."""
        if trial is not None:
            raise NotImplementedError("hyperparameter search (trial=...) is not supported by TrainerWrapper: "
                                      "search with the plain Trainer, then train the chosen setup wrapped")
        if self.ckpt is None:
            self.ckpt = Checkpointer(self.save_dir, self.save_mem_interval, self.persist_interval, self.max_ckpt_num,
                                     log_file_path=self.log_file_path, **self.options)
        if self.trainer.args.should_save and self._exporter is None:
            self._exporter = _Exporter(self, self.ckpt.config.save_dir, self.export_timeout)
        try:
            if self.trainer.args.should_save:
                self._clean_stale()
            path, self.resumed = self._resolve(resume_from_checkpoint)
            self._last_step = self.resumed.step
            self._catch_up(self.resumed.step)
            return self.trainer.train(resume_from_checkpoint=path, **kwargs)
        finally:
            self._finish()

    # resume -----------------------------------------------------------------------------------------
    def _resolve(self, resume: str | os.PathLike[str] | bool | None) -> tuple[str | None, ResumeInfo]:
        assert self.ckpt is not None
        if resume is None or resume is False:
            self._drop_old_snapshots()
            return None, ResumeInfo(None, None)
        if resume is True:
            return self._resolve_newest()
        if not isinstance(resume, (str, os.PathLike)):
            raise TypeError(f"resume_from_checkpoint must be True, False, None or a path, got {resume!r}")
        path = Path(resume).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"resume_from_checkpoint={str(resume)!r} does not exist: pass True to resume from "
                                    f"the newest state of {self.output_dir}, or the path of a checkpoint-N folder")
        if layout.ITERATION_RE.match(path.name):
            result = self.ckpt.load(load_dir=path)
            return self._stage(result), self._info(result)
        problem = checkpoint_problem(path, world_size=self.trainer.args.world_size,
                                     need_optimizer=not self.trainer.args.save_only_model, need_rng=False)
        if problem is not None:
            raise ValueError(f"resume_from_checkpoint={str(path)!r} is incomplete: {problem}. It was probably being "
                             "written when a job died; pass True to resume from the newest complete state, or "
                             "another checkpoint-N")
        step = json.loads((path / TRAINER_STATE_NAME).read_text(encoding="utf-8"))["global_step"]
        return str(path), ResumeInfo(step, "path", str(path))

    def _resolve_newest(self) -> tuple[str | None, ResumeInfo]:
        assert self.ckpt is not None
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
            if found:
                newest, newest_path = found[0]
        newest = _broadcast_int(newest)
        if newest >= 0:
            newest_path = self.output_dir / f"{CHECKPOINT_PREFIX}-{newest}"
        try:
            result = self.ckpt.load()
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
            return str(newest_path), ResumeInfo(newest, "checkpoint", str(newest_path))
        logger.info("nothing to resume from in memory, %s or %s: fresh start", self.save_dir, self.output_dir)
        return None, ResumeInfo(None, None)

    def _info(self, result: LoadResult) -> ResumeInfo:
        return ResumeInfo(result.step, result.source, result.path, result.seconds, result.nbytes)

    def _stage(self, result: LoadResult) -> str | None:
        """Lay the loaded state out as a Trainer checkpoint directory, once per node; each rank adds its RNG."""
        assert self.ckpt is not None
        if result.step is None:
            return None
        state = result.state
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"the easyckpt state of step {result.step} ({result.source}, {result.path}) was not "
                             f"written by TrainerWrapper (format {state.get('format') if isinstance(state, dict) else None!r}): "
                             f"give the wrapper a save_dir of its own (now {self.save_dir})")
        base = self.staging_dir or self.ckpt.config.shm_dir
        assert base is not None
        directory = Path(base) / f"{STAGING_PREFIX}{self.ckpt.config.job_id}"
        world_size = self.trainer.args.world_size
        problem = ""
        if self.ckpt.local_rank == 0:
            try:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                self._write_files(directory, state, {}, world_size, native=False)
            except OSError as exc:
                problem = f"{directory}: {exc}"
        if not _all_ok(not problem):
            raise RuntimeError(f"could not lay out the state of step {result.step} for the Trainer "
                               f"({problem or 'on another node, see its log'}): free space there or pass "
                               "TrainerWrapper(..., staging_dir=<a directory with room for one copy of the state>)")
        try:
            torch.save(state["rng"], directory / rng_file_name(self.ckpt.rank, world_size))
        except OSError as exc:
            problem = f"{directory}: {exc}"
        if not _all_ok(not problem):
            raise RuntimeError(f"could not write the RNG state of step {result.step} for the Trainer "
                               f"({problem or 'on another rank, see its log'})")
        self._staged = directory if self.ckpt.local_rank == 0 else None
        return str(directory)

    def _drop_old_snapshots(self) -> None:
        assert self.ckpt is not None
        if self.ckpt.slots.committed():
            logger.info("rank %d: fresh start: dropping this job's old snapshots from memory", self.ckpt.rank)
            self.ckpt.slots.invalidate_newer_than(-1)

    def _catch_up(self, resumed: int | None) -> None:
        """Export persisted due iterations up to the resumed step that have no checkpoint-N yet (a job died
        before or while exporting them). Now, before training: the agent's rotation would soon delete them."""
        if self._exporter is None or resumed is None or not self.save_steps:
            return
        for step, _ in layout.complete_iterations(self.save_dir):
            if step <= resumed and step % self.save_steps == 0 and not (self.output_dir / f"{CHECKPOINT_PREFIX}-{step}").exists():
                logger.info("exporting iteration %d, which has no checkpoint-%d yet", step, step)
                try:
                    self._exporter.export(step)
                except Exception:
                    logger.exception("export of iteration %d to checkpoint-%d failed; training goes on", step, step)

    def _clean_stale(self) -> None:
        try:
            entries = list(self.output_dir.iterdir())
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.startswith((EXPORT_TMP_PREFIX, EXPORT_TRASH_PREFIX)) and entry.is_dir():
                logger.info("removing %s, left by a job that died while writing or deleting a checkpoint", entry)
                shutil.rmtree(entry, ignore_errors=True)

    # hooks on the Trainer ---------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._original_mlse(*args, **kwargs)
        trainer = self.trainer
        step = trainer.state.global_step
        if self._staged is not None:  # every rank has loaded what it needed (they met in the step's all-reduce)
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None
        if step > 0 and step != self._last_step:
            self._last_step = step
            if step % self.save_mem_interval == 0:
                self._snapshot(step)
        if trainer.control.should_training_stop:
            self._drain()

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Replaces ``Trainer._save_checkpoint``: due steps are persisted by the agent and exported
        asynchronously; other saves are written now."""
        trainer = self.trainer
        step = trainer.state.global_step
        if getattr(trainer, "hp_search_backend", None) is None and trial is None:
            trainer.store_flos()
        best = trainer.state.best_global_step
        if best and self.strategy in ("steps", "epoch", "best"):
            best_dir = self.output_dir / f"{CHECKPOINT_PREFIX}-{best}"
            if best_dir.is_dir() or self._due(best) or best == step:
                trainer.state.best_model_checkpoint = str(best_dir)
        if self._due(step):
            if self._exporter is not None:
                self._exporter.request(step)
        else:
            self._save_now(step)

    def _due(self, step: int) -> bool:
        return bool(self.save_steps) and step % self.persist_interval == 0

    # snapshots --------------------------------------------------------------------------------------
    def _unwrapped(self) -> Any:
        accelerator = self.trainer.accelerator
        try:
            return accelerator.unwrap_model(self.trainer.model, keep_torch_compile=False)
        except TypeError:
            return accelerator.unwrap_model(self.trainer.model)

    def _trainer_state_json(self) -> str:
        """The Trainer's state as ``trainer_state.json`` holds it, callbacks' states taken now."""
        trainer = self.trainer
        record = dataclasses.asdict(trainer.state)
        stateful: dict[str, Any] = {}
        for callback in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if name in stateful:
                    if not isinstance(stateful[name], list):
                        stateful[name] = [stateful[name]]
                    stateful[name].append(callback.state())
                else:
                    stateful[name] = callback.state()
        record["stateful_callbacks"] = stateful
        return json.dumps(record, indent=2, sort_keys=True) + "\n"

    def _rng_state(self) -> dict[str, Any]:
        """Every RNG, in the layout of the Trainer's rng_state files."""
        rng: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                               "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            distributed = str(getattr(self.trainer.args.parallel_mode, "value", "")) == "distributed"
            rng["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
        return rng

    def _state(self) -> dict[str, Any]:
        trainer = self.trainer
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "step": trainer.state.global_step,
            "model": self._unwrapped().state_dict(),
            "optim": trainer.optimizer.state_dict(),
            "sched": trainer.lr_scheduler.state_dict(),
            "rng": self._rng_state(),
            "trainer_state": self._trainer_state_json(),
        }
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        return state

    def _snapshot(self, step: int) -> None:
        assert self.ckpt is not None
        state = self._state()
        if self.ckpt.save_if_needed(step, state) or not self.ckpt.config.persist_due(step):
            return
        # A due snapshot found no free slot (the agent still holds the previous due one): the Trainer
        # asked for this save, so wait for a slot rather than lose checkpoint-N.
        started = time.monotonic()
        deadline = started + self.ckpt.config.pin_timeout
        while time.monotonic() < deadline:
            time.sleep(_POLL)  # polling for the agent to release a slot, against a deadline
            if self.ckpt.save_if_needed(step, state):
                logger.warning("rank %d: due snapshot of step %d waited %.2fs for a free slot (persisting is slower "
                               "than save_steps=%s)", self.ckpt.rank, step, time.monotonic() - started, self.save_steps)
                return
        logger.warning("rank %d: no free slot for the due snapshot of step %d after %.0fs: step %d will not be "
                       "persisted and checkpoint-%d not written", self.ckpt.rank, step, self.ckpt.config.pin_timeout,
                       step, step)

    def _save_now(self, step: int) -> None:
        """A save the persist interval does not cover, written now from the live state (all ranks)."""
        args = self.trainer.args
        world_size = args.world_size
        state = self._state()
        tmp = self.output_dir / f"{EXPORT_TMP_PREFIX}{step}"
        problem = ""
        if args.should_save:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as exc:
                problem = str(exc)
        if not _all_ok(not problem):
            raise RuntimeError(f"cannot create {tmp} for checkpoint-{step}: {problem or 'see rank 0'}")
        try:
            if args.should_save:
                self._write_files(tmp, state, {}, world_size, native=True)
            if not args.save_only_model:
                torch.save(state["rng"], tmp / rng_file_name(args.process_index, world_size))
        except OSError as exc:
            problem = str(exc)
        if not _all_ok(not problem):
            raise RuntimeError(f"writing checkpoint-{step} into {tmp} failed: {problem or 'on another rank'}")
        if args.should_save:
            self._publish(tmp, step)

    # checkpoint-N folders ---------------------------------------------------------------------------
    def _write_checkpoint(self, step: int, common: dict[str, Any], rngs: dict[int, Any], world_size: int) -> Path:
        """Export a saved state (all ranks' RNGs) as checkpoint-N, atomically. Runs on the saving process."""
        tmp = self.output_dir / f"{EXPORT_TMP_PREFIX}{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._write_files(tmp, common, rngs, world_size, native=True)
        return self._publish(tmp, step)

    def _write_files(self, directory: Path, common: dict[str, Any], rngs: dict[int, Any], world_size: int,
                     *, native: bool) -> None:
        """The Trainer's files for ``common`` (rank 0's state) and the given ranks' RNG states.

        ``native``: a checkpoint-N folder (model through ``save_pretrained``, config, processing class,
        training args, ``save_only_model`` honoured); else a directory only the Trainer's resume reads.
        """
        args = self.trainer.args
        model_state = common["model"]
        step = common.get("step")
        model = self._unwrapped()
        if native and isinstance(model, PreTrainedModel):
            model.save_pretrained(str(directory), state_dict=self._retie(model, model_state), is_main_process=True)
        else:
            import safetensors.torch
            safetensors.torch.save_file(_distinct_storage(model_state), str(directory / SAFE_WEIGHTS_NAME),
                                        metadata={"format": "pt"})
        if native:
            fault_point("hf.export.mid_write", step=step, rank=args.process_index)
            trainer = self.trainer
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(str(directory))
            elif getattr(trainer.data_collator, "tokenizer", None) is not None:
                trainer.data_collator.tokenizer.save_pretrained(str(directory))
            torch.save(args, directory / TRAINING_ARGS_NAME)
        if not (native and args.save_only_model):
            torch.save(common["optim"], directory / OPTIMIZER_NAME)
            torch.save(common["sched"], directory / SCHEDULER_NAME)
            if "scaler" in common:
                torch.save(common["scaler"], directory / SCALER_NAME)
            for rank, rng in rngs.items():
                torch.save(rng, directory / rng_file_name(rank, world_size))
        (directory / TRAINER_STATE_NAME).write_text(common["trainer_state"], encoding="utf-8")

    @staticmethod
    def _retie(model: Any, model_state: dict[str, Any]) -> dict[str, Any]:
        """A loaded state has its own tensor for each name; where the live model shares one tensor between
        names (tied embeddings), share it here too, so that ``save_pretrained`` writes what it writes for
        the live model."""
        groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
        for name, tensor in model.state_dict().items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            groups.setdefault(key, []).append(name)
        tied = dict(model_state)
        for names in groups.values():
            present = [name for name in names if name in tied]
            for name in present[1:]:
                tied[name] = tied[present[0]]
        return tied

    def _publish(self, tmp: Path, step: int) -> Path:
        """fsync ``tmp`` and rename it to checkpoint-N (replacing an older one), then rotate."""
        final = self.output_dir / f"{CHECKPOINT_PREFIX}-{step}"
        with self._publish_lock:
            _fsync_tree(tmp)
            fault_point("hf.export.before_rename", step=step, rank=self.trainer.args.process_index)
            trash = None
            if final.exists():
                trash = self.output_dir / f"{EXPORT_TRASH_PREFIX}{step}-{os.getpid()}"
                os.rename(final, trash)
            os.rename(tmp, final)
            layout.fsync_dir(self.output_dir)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
            self._rotate()
        logger.info("wrote %s", final)
        return final

    def _rotate(self) -> None:
        """``save_total_limit`` as the Trainer applies it: the newest and the best checkpoint stay."""
        limit = self.trainer.args.save_total_limit
        if not limit or limit <= 0:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.iterdir()
                       if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir())
        if len(found) <= limit:
            return
        protected = {found[-1][1].name}
        best = self.trainer.state.best_model_checkpoint
        if best:
            protected.add(Path(best).name)
        remaining, keep = len(found), max(limit, len(protected))
        for step, path in found:
            if remaining <= keep:
                break
            if path.name in protected:
                continue
            trash = self.output_dir / f"{EXPORT_TRASH_PREFIX}{step}-{os.getpid()}"
            os.rename(path, trash)  # never a half-deleted folder under the checkpoint-N name
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("deleted %s (save_total_limit=%d)", path, limit)
            remaining -= 1

    # end of training --------------------------------------------------------------------------------
    def _drain(self) -> None:
        if self._exporter is not None and not self._exporter.drain(self.export_timeout):
            logger.warning("checkpoint exports still pending after %.0fs", self.export_timeout)

    def _finish(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None
        ckpt, self.ckpt = self.ckpt, None
        if ckpt is not None:
            ckpt.close()
        self._drain()
        if self._exporter is not None:
            self._exporter.stop()
            self._exporter = None


__all__ = ["TrainerWrapper", "ResumeInfo", "checkpoint_problem", "complete_checkpoints", "rng_file_name",
           "STATE_FORMAT"]
