"""``<output_dir>/checkpoint-N`` folders: whether one is complete, writing one with the Trainer's file
names, publishing it atomically and applying ``save_total_limit`` as the Trainer does.

Every folder written here is assembled under a temporary name, fsynced and renamed into place, so it is
complete or absent; folders of other writers (a plain Trainer killed mid-save) are checked before use.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer

from easyckpt.transformers import fsdp
from easyckpt.transformers.adapters import is_peft_model
from easyckpt.transformers.snapshot import unwrapped_model, with_frozen
from easyckpt_wire.faults import fault_point
from easyckpt_wire.storage import posix
from easyckpt_wire.timeline import abandoned_dirname

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
EXPORT_TMP_PREFIX = ".easyckpt-tmp-checkpoint-"
EXPORT_TRASH_PREFIX = ".easyckpt-trash-checkpoint-"
EXPORT_ASIDE_PREFIX = ".easyckpt-aside-checkpoint-"   # replace_dir's old copy: put back if checkpoint-N is missing
EXPORT_ASIDE_RE = re.compile(rf"^{re.escape(EXPORT_ASIDE_PREFIX)}(\d+)-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
# In a checkpoint-N exported from an iteration marked unhealthy (invariant 13): its metadata.json "health"
# entry. The Trainer ignores the file; TrainerWrapper's resume passes such a folder over (the iteration's
# own entry leaves health_ckpts.json when rotation deletes it, the folder stays).
HEALTH_NAME = "easyckpt_health.json"
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


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
    fsdp_model, fsdp_optim = fsdp.has_layout(path)
    if not weights and not fsdp_model:
        return (f"{path} has no model weights (none of {', '.join(WEIGHTS_FILES)}, nor a complete FSDP "
                f"{fsdp.MODEL_DIR}/)")
    for name in (name for name in weights if name.endswith(".safetensors")):
        try:
            from safetensors import safe_open
            with safe_open(str(path / name), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own error types for a truncated file
            return f"{path / name} is not a readable safetensors file ({exc})"
    if need_optimizer:
        # A DeepSpeed checkpoint holds the optimizer in global_stepN/ (named by ``latest``), not optimizer.pt.
        if not (path / OPTIMIZER_NAME).is_file() and not has_deepspeed_layout(path) and not fsdp_optim:
            return (f"{path / OPTIMIZER_NAME} is missing (and there is no DeepSpeed 'latest' naming a global_step "
                    f"folder, nor a complete FSDP {fsdp.OPTIM_DIR}/)")
        if not (path / SCHEDULER_NAME).is_file() and not has_deepspeed_layout(path):
            return f"{path / SCHEDULER_NAME} is missing"
    if need_rng:
        for rank in range(world_size):
            if not (path / rng_file_name(rank, world_size)).is_file():
                return f"{path / rng_file_name(rank, world_size)} is missing (written by {world_size} ranks?)"
    return None


def best_checkpoint(resume_path: str | None) -> str | None:
    """The ``best_model_checkpoint`` that the trainer state in ``resume_path`` names, if any."""
    if resume_path is None:
        return None
    try:
        best = json.loads((Path(resume_path) / TRAINER_STATE_NAME).read_text(encoding="utf-8")).get("best_model_checkpoint")
    except (OSError, ValueError, AttributeError):
        return None   # the Trainer reads it next and says what is wrong with it
    return best if isinstance(best, str) else None


def has_deepspeed_layout(path: Path) -> bool:
    """Whether ``path`` holds a DeepSpeed checkpoint (``latest`` names an existing ``global_stepN`` folder)."""
    try:
        name = (path / "latest").read_text(encoding="utf-8").strip()
    except OSError:
        return False
    return bool(name) and (path / name).is_dir()


def unhealthy_reasons(path: Path) -> list[str] | None:
    """Why checkpoint-N folder ``path`` is unhealthy (it has a HEALTH_NAME file), or None."""
    try:
        health = json.loads((path / HEALTH_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return [f"{path / HEALTH_NAME} is not readable ({exc})"]
    reasons = health.get("reasons") if isinstance(health, dict) else None
    return [str(r) for r in reasons] if isinstance(reasons, list) else []


def mark_health(directory: Path, health: dict[str, Any] | None) -> None:
    """Record an unhealthy verdict (``RankHealth.to_wire()``, the job's) in a checkpoint folder being written."""
    if isinstance(health, dict) and health.get("healthy") is False:
        (directory / HEALTH_NAME).write_text(json.dumps(health), encoding="utf-8")


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


def _distinct_storage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors that share memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone().contiguous() if key in seen else tensor.detach().contiguous()
        seen.add(key)
    return out


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


class CheckpointFolders:
    """The checkpoint-N folders of one Trainer's ``output_dir``; used by the training thread (saves now,
    resume staging) and the export thread."""

    def __init__(self, trainer: Trainer, output_dir: Path) -> None:
        self.trainer = trainer
        self.output_dir = output_dir
        # Both threads publish and rotate: one rename-and-rotate at a time keeps the listing consistent.
        self._publish_lock = threading.Lock()
        # The best checkpoint that the resumed state names, for rotations before Trainer.train has loaded that state
        # (its fresh TrainerState names none): a catch-up export deleted the best folder of a save_total_limit run.
        self.resumed_best: str | None = None

    def path(self, step: int) -> Path:
        return self.output_dir / f"{CHECKPOINT_PREFIX}-{step}"

    def tmp_path(self, step: int) -> Path:
        return self.output_dir / f"{EXPORT_TMP_PREFIX}{step}"

    def existing(self) -> list[tuple[int, Path]]:
        """The checkpoint-N folders there are, oldest first."""
        try:
            entries = list(self.output_dir.iterdir())
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)), p) for p in entries if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir())

    def clean_stale(self) -> None:
        """Remove the temporary and trash folders of a writer that died."""
        try:
            entries = list(self.output_dir.iterdir())
        except FileNotFoundError:
            return
        for entry in entries:
            if (aside := EXPORT_ASIDE_RE.match(entry.name)) and entry.is_dir():
                step, pid = aside.groups()
                if posix.settle_aside(entry, self.path(int(step)),
                                       self.output_dir / f"{EXPORT_TRASH_PREFIX}{step}-{pid}"):
                    logger.warning("put %s back as %s: a job died while replacing it", entry, self.path(int(step)))
            elif entry.name.startswith((EXPORT_TMP_PREFIX, EXPORT_TRASH_PREFIX)) and entry.is_dir():
                logger.info("removing %s, left by a job that died while writing or deleting a checkpoint", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def write_checkpoint(self, step: int, common: dict[str, Any], rngs: dict[int, Any], world_size: int,
                         health: dict[str, Any] | None = None,
                         zero_optims: dict[int, tuple[Any, dict[str, Any]]] | None = None,
                         zero_models: dict[int, Any] | None = None, iteration_dir: Path | None = None) -> Path:
        """Export a saved state (all ranks' RNGs) as checkpoint-N, atomically. Runs on the saving process.
        ``health``: the iteration's verdict (metadata.json); an unhealthy one is recorded in the folder.
        ``iteration_dir``: the persisted iteration, whose every rank's shards an FSDP2 export assembles."""
        tmp = self.tmp_path(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.write_files(tmp, common, rngs, world_size, native=True, zero_optims=zero_optims, zero_models=zero_models)
        if fsdp.STATE_KEY in common:
            if iteration_dir is None:
                raise ValueError(f"checkpoint-{step} of an FSDP2 state needs the iteration it was persisted as")
            fsdp.write_full(tmp, iteration_dir, fsdp.state_dict_kind(self.trainer), unwrapped_model(self.trainer))
        mark_health(tmp, health)
        return self.publish(tmp, step)

    def write_files(self, directory: Path, common: dict[str, Any], rngs: dict[int, Any], world_size: int,
                    *, native: bool, zero_optims: dict[int, tuple[Any, dict[str, Any]]] | None = None,
                    zero_models: dict[int, Any] | None = None, weights: dict[str, Any] | None = None) -> None:
        """The Trainer's files for ``common`` (rank 0's state) and the given ranks' RNG states.

        ``native``: a checkpoint-N folder (model through ``save_pretrained``, config, processing class,
        training args, ``save_only_model`` honoured); else a directory only the Trainer's resume reads.
        Under FSDP2 (``common`` has ``fsdp.STATE_KEY``) model and optimizer are DCP directories its callers
        write (``fsdp``); a native folder gets the model's config.
        Under DeepSpeed (``common`` has ``zero.STATE_KEY``) the optimizer goes into DeepSpeed's layout:
        the model states and ``latest`` from ``common``, one optimizer file per rank of ``zero_optims``
        (rank -> (its optimizer state, its engine info)). Under ZeRO-3 ``common["model"]`` holds partitions:
        ``zero_models`` (rank -> its model state) adds those ranks' model state files, and the weights
        (``native``) are ``weights`` or else consolidated from ``zero_models``, which must then hold every rank.
        """
        args = self.trainer.args
        if common.get("deepspeed") is not None:
            weights = self._write_deepspeed(directory, common, native=native, zero_optims=zero_optims,
                                            zero_models=zero_models, weights=weights)
        self._write_model(directory, common, native=native, weights=weights)
        if native:
            fault_point("hf.export.mid_write", step=common.get("step"), rank=args.process_index)
            self._write_native_extras(directory)
        if not (native and args.save_only_model):
            self._write_training_state(directory, common, rngs, world_size)
        (directory / TRAINER_STATE_NAME).write_text(common["trainer_state"], encoding="utf-8")

    @staticmethod
    def _write_deepspeed(directory: Path, common: dict[str, Any], *, native: bool,
                         zero_optims: dict[int, tuple[Any, dict[str, Any]]] | None,
                         zero_models: dict[int, Any] | None, weights: dict[str, Any] | None) -> dict[str, Any] | None:
        """DeepSpeed's layout: the model states and ``latest``, every rank's optimizer file and, under ZeRO-3,
        every rank's model state file; returns the whole weights a native folder gets (ZeRO-3: consolidated)."""
        from easyckpt.transformers import zero

        info, model_state, step = common["deepspeed"], common["model"], common.get("step")
        assert isinstance(step, int)
        zero.write_model_states(directory, step, model_state, info)
        for optim, rank_info in (zero_optims or {}).values():
            zero.write_optim_states(directory, step, optim, rank_info)
        if zero.is_partitioned(info):
            for rank, rank_model in (zero_models or {}).items():
                if rank_model is not model_state:
                    zero.write_model_states(directory, step, rank_model, (zero_optims or {})[rank][1], latest=False)
            if native:
                weights = weights if weights is not None else zero.consolidate(zero_models or {}, info)
        return weights

    def _write_model(self, directory: Path, common: dict[str, Any], *, native: bool,
                     weights: dict[str, Any] | None) -> None:
        """The model: its config only under FSDP2 (the callers write the DCP directories), else its weights.
        A native folder of a peft model (LoRA ...) holds what the Trainer writes for one, the adapter only
        (``adapter_config.json``, ``adapter_model.safetensors``): ``PeftModel.from_pretrained`` and
        ``load_best_model_at_end`` look for those; a folder only the Trainer's resume reads keeps every weight."""
        model = unwrapped_model(self.trainer)
        pretrained = native and isinstance(model, PreTrainedModel)
        if native and fsdp.STATE_KEY not in common and is_peft_model(model):
            model.save_pretrained(str(directory), state_dict=weights if weights is not None else
                                  with_frozen(model, common["model"]), is_main_process=True)
            return
        if fsdp.STATE_KEY in common:
            if pretrained:
                model.config.save_pretrained(str(directory))
                if getattr(model, "generation_config", None) is not None and model.can_generate():
                    model.generation_config.save_pretrained(str(directory))
        elif weights is not None and pretrained:
            # whole weights of a ZeRO-3 model, tied names already sharing one tensor (the live model's
            # parameters are empty placeholders, so _retie cannot find its ties)
            model.save_pretrained(str(directory), state_dict=weights, is_main_process=True)
        elif common.get("deepspeed") is not None and not native:
            pass  # the Trainer's DeepSpeed resume reads the weights from mp_rank_00_model_states.pt
        elif pretrained:
            model.save_pretrained(str(directory), state_dict=_retie(model, common["model"]), is_main_process=True)
        else:
            import safetensors.torch
            # a peft model's snapshot lacks its frozen base (snapshot.trained_only): the Trainer's resume loads this
            # file into the whole model and warns of every key it lacks
            whole = weights if weights is not None else with_frozen(model, common["model"])
            safetensors.torch.save_file(_distinct_storage(whole),
                                        str(directory / SAFE_WEIGHTS_NAME),
                                        metadata={"format": "pt"})

    def _write_native_extras(self, directory: Path) -> None:
        """What a checkpoint-N folder has besides the state: the processing class and the training args."""
        trainer = self.trainer
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(directory))
        elif (tokenizer := getattr(trainer.data_collator, "tokenizer", None)) is not None:
            tokenizer.save_pretrained(str(directory))
        torch.save(trainer.args, directory / TRAINING_ARGS_NAME)

    @staticmethod
    def _write_training_state(directory: Path, common: dict[str, Any], rngs: dict[int, Any], world_size: int) -> None:
        """Optimizer (unless DeepSpeed's or FSDP2's layout holds it), scheduler, scaler and the ranks' RNGs."""
        if common.get("deepspeed") is None and fsdp.STATE_KEY not in common:
            torch.save(common["optim"], directory / OPTIMIZER_NAME)
        torch.save(common["sched"], directory / SCHEDULER_NAME)
        if "scaler" in common:
            torch.save(common["scaler"], directory / SCALER_NAME)
        for rank, rng in rngs.items():
            torch.save(rng, directory / rng_file_name(rank, world_size))

    def publish(self, tmp: Path, step: int) -> Path:
        """fsync ``tmp`` and rename it to checkpoint-N (replacing an older one), then rotate."""
        final = self.path(step)
        with self._publish_lock:
            posix.fsync_tree(tmp)
            fault_point("hf.export.before_rename", step=step, rank=self.trainer.args.process_index)
            pid = os.getpid()
            trash = posix.replace_dir(tmp, final, aside=self.output_dir / f"{EXPORT_ASIDE_PREFIX}{step}-{pid}",
                                       trash=self.output_dir / f"{EXPORT_TRASH_PREFIX}{step}-{pid}")
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
            self._rotate()
        logger.info("wrote %s", final)
        return final

    def set_aside_after(self, step: int) -> list[Path]:
        """Move the checkpoint-N folders newer than ``step`` (a timeline the resume from ``step`` abandons) into
        ``output_dir/.abandoned-<UTC time>/``, one rename each, as the agent moves easyckpt's iterations: a later
        ``resume_from_checkpoint=True`` (or the Trainer's own ``get_last_checkpoint``) must not take them, and
        ``save_total_limit`` must not count them. Returns where they went."""
        with self._publish_lock:
            newer = [path for found, path in self.existing() if found > step]
            if not newer:
                return []
            aside = self.output_dir / abandoned_dirname()
            moved = posix.move_into(newer, aside)
        logger.warning("resumed at step %d: %s of the abandoned timeline moved to %s (remove it when you do not need "
                       "it)", step, ", ".join(p.name for p in newer), aside)
        return moved

    def _rotate(self) -> None:
        """``save_total_limit`` as the Trainer applies it: the newest and the best checkpoint stay."""
        limit = self.trainer.args.save_total_limit
        if not limit or limit <= 0:
            return
        found = self.existing()
        if len(found) <= limit:
            return
        protected = {found[-1][1].name}
        protected.update(Path(best).name for best in (self.trainer.state.best_model_checkpoint, self.resumed_best)
                         if best)
        remaining, keep = len(found), max(limit, len(protected))
        for step, path in found:
            if remaining <= keep:
                break
            if path.name in protected:
                continue
            trash = self.output_dir / f"{EXPORT_TRASH_PREFIX}{step}-{os.getpid()}"
            posix.rename_to_trash(path, trash)  # never a half-deleted folder under the checkpoint-N name
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("deleted %s (save_total_limit=%d)", path, limit)
            remaining -= 1
