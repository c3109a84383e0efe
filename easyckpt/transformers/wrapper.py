"""TrainerWrapper: hooks on the Trainer's save point, snapshots, saves, and ``train()`` with resume.

See the package docstring (``easyckpt.transformers``) for what it does and why this way.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from easyckpt.checkpointer import Checkpointer
from easyckpt.collectives import all_gather_text, all_ok
from easyckpt.config import PERSIST_ON_REQUEST, check_count, check_seconds
from easyckpt.health import configure
from easyckpt.transformers import fsdp, snapshot, zero
from easyckpt.transformers.export import POLL, Exporter
from easyckpt.transformers.folders import CheckpointFolders, best_checkpoint, mark_health, rng_file_name
from easyckpt.transformers.health import STATE_KEY, StepGuard
from easyckpt.transformers.resume import ResumeInfo, Resumer, as_asked
from easyckpt_wire import layout
from easyckpt_wire.health import RankHealth, combine, rank_verdict
from easyckpt_wire.storage import location

logger = logging.getLogger(__name__)

VERDICT_BYTES = 2048       # one rank's verdict as JSON, gathered for a synchronous save
AGENT_CHECK = 1.0          # seconds between looks for a dead node agent while the end of training drains exports


def check_world_size(trainer: Trainer) -> None:
    """Refuse a Trainer that does not see the process group it runs in.

    Under torchrun on a machine without CUDA and without ``use_cpu=True``, transformers runs every process
    as a single-process job (``args.world_size`` 1, each its own rank 0): every process would snapshot,
    persist and export as rank 0 of 1 into the same folders, and the checkpoints would be torn.
    """
    args = trainer.args
    group_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
    env_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    size = group_size if group_size is not None else env_size
    if size == args.world_size:
        return
    rank = torch.distributed.get_rank() if group_size is not None else os.environ.get("RANK", "?")
    raise RuntimeError(
        f"TrainerWrapper: the Trainer's args.world_size is {args.world_size} (parallel_mode "
        f"{getattr(args.parallel_mode, 'value', args.parallel_mode)}) but this process is rank {rank} of a job of "
        f"{size} processes (torchrun's WORLD_SIZE): transformers runs every process as its own single-process "
        "job, so all of them would write the same checkpoint-N and easyckpt iterations. On a machine without "
        "CUDA that happens unless use_cpu=True: pass TrainingArguments(use_cpu=True) (--use_cpu on the command "
        "line), or launch a single process. Nothing was written.")


def check_fsdp(trainer: Trainer) -> None:
    """Refuse the FSDP setups the wrapper does not write (``fsdp.check``: FSDP1, a full state dict); say so
    when the Trainer asked for FSDP and did not get it."""
    if fsdp.enabled(trainer):
        fsdp.check(trainer)
        return
    if getattr(trainer.args, "fsdp_plugin_args", None) is not None:
        # Accelerate keeps the FSDP plugin only for accelerator devices (AcceleratorState: MULTI_GPU, ...),
        # so on CPU the Trainer silently runs DDP: say what is snapshotted, since the user asked for FSDP.
        logger.warning(
            "TrainingArguments(fsdp=%r) asks for FSDP, but Accelerate did not enable it (distributed type %s: "
            "Accelerate enables FSDP only on accelerator devices, never with use_cpu=True); the Trainer trains "
            "unsharded, as DDP, and TrainerWrapper snapshots whole model and optimizer states as for DDP",
            trainer.args.fsdp, getattr(trainer.accelerator.state.distributed_type, "value",
                                       trainer.accelerator.state.distributed_type))


class _OnTrainBegin(TrainerCallback):
    """Calls ``action`` when training begins: after the Trainer has loaded the checkpoint it resumes from."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.action()


class TrainerWrapper:
    """Wraps a ``transformers.Trainer``: easyckpt snapshots, persistence, Trainer-native exports, resume.

    ``save_mem_interval``: snapshot every that many optimizer steps. Further keywords go to
    ``easyckpt.Checkpointer`` (``save_dir`` defaults to ``<output_dir>/easyckpt``, ``max_ckpt_num`` to 2,
    since the Trainer-native ``checkpoint-N`` folders keep the history under ``save_total_limit``), except:
    ``staging_dir`` (where a resumed state is laid out for the Trainer; default: the shm directory) and
    ``export_timeout`` (how long an export waits for its iteration, default 600 s).

    Data skipping (``use_skip_data_by_global_norm=True``): a step whose global gradient norm (the
    Trainer's, computed when it clips or logs) exceeds ``global_norm_spike_threshold`` (default 1.0) is
    not applied (model, optimizer, scheduler, scaler unchanged; the Trainer still counts and logs it);
    ``global_norm_spike_count_threshold`` (default 10) consecutive ones make the newest snapshot durable
    and raise :class:`easyckpt.TrainingAborted`. Checkpoint health (``use_checkpoint_health_monitor=True``):
    each snapshot carries the input embedding's local gradient norm and the step's loss, and a snapshot
    whose norm exceeds ``embedding_local_norm_threshold`` (default 1.0) is unhealthy (resume passes it over).
    Any other attribute is the wrapped Trainer's (``wrapper.evaluate()``, ``wrapper.state``...).
    """

    def __init__(self, trainer: Trainer, save_mem_interval: int = 1, *, use_skip_data_by_global_norm: bool = False,
                 global_norm_spike_threshold: float | None = None, global_norm_spike_count_threshold: int | None = None,
                 use_checkpoint_health_monitor: bool = False, embedding_local_norm_threshold: float | None = None,
                 **checkpointer_kwargs: Any) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(f"TrainerWrapper wraps a transformers.Trainer, got {type(trainer).__qualname__}")
        check_count("save_mem_interval", save_mem_interval)
        # Before anything is created or written: a misconfigured job must not touch output_dir or save_dir.
        check_world_size(trainer)
        self.zero_stage = zero.check_config(trainer) if getattr(trainer, "is_deepspeed_enabled", False) else None
        if self.zero_stage is not None and (use_skip_data_by_global_norm or use_checkpoint_health_monitor):
            raise NotImplementedError(
                "TrainerWrapper(use_skip_data_by_global_norm=True or use_checkpoint_health_monitor=True) does not work "
                "with DeepSpeed: accelerate runs DeepSpeed's engine.step() inside accelerator.backward(), so the "
                "Trainer gets the global gradient norm (engine.get_global_grad_norm()) only after the step changed the "
                "weights, and a spiky step cannot be skipped; and ZeRO keeps the gradients as reduced partitions, not "
                "in param.grad, so the embedding's local gradient norm is not there to read. Drop those keywords "
                "(DeepSpeed's gradient_clipping bounds a spike's step), or train with DDP")
        check_fsdp(trainer)
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
        self.skipper, thresholds = configure(
            use_skip_data_by_global_norm=use_skip_data_by_global_norm,
            global_norm_spike_threshold=global_norm_spike_threshold,
            global_norm_spike_count_threshold=global_norm_spike_count_threshold,
            use_checkpoint_health_monitor=use_checkpoint_health_monitor,
            embedding_local_norm_threshold=embedding_local_norm_threshold,
            health_thresholds=checkpointer_kwargs.pop("health_thresholds", None), what="TrainerWrapper")
        if thresholds is not None:
            checkpointer_kwargs["health_thresholds"] = thresholds
        self.trainer = trainer
        args = trainer.args
        self.output_dir = Path(args.output_dir or "trainer_output").expanduser().resolve()
        self.save_mem_interval = save_mem_interval
        self.strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        self.save_steps = self._save_steps(args)
        self.persist_interval = self.save_steps if self.save_steps else save_mem_interval * PERSIST_ON_REQUEST
        # location(): an s3:// URL stays one (Path() would make it the local folder "s3:/bucket/prefix")
        self.save_dir = location(checkpointer_kwargs.pop("save_dir", self.output_dir / "easyckpt"), "save_dir")
        self.max_ckpt_num = check_count("TrainerWrapper: max_ckpt_num", checkpointer_kwargs.pop("max_ckpt_num", 2))
        self.log_file_path = checkpointer_kwargs.pop("log_file_path", None)
        staging = checkpointer_kwargs.pop("staging_dir", None)
        self.staging_dir = Path(staging) if staging is not None else None
        self.export_timeout = check_seconds("TrainerWrapper: export_timeout",
                                            checkpointer_kwargs.pop("export_timeout", 600.0))
        self.options = checkpointer_kwargs
        self.ckpt: Checkpointer | None = None
        self.resumed: ResumeInfo | None = None
        self.folders = CheckpointFolders(trainer, self.output_dir)
        self._exporter: Exporter | None = None
        self._resumer: Resumer | None = None
        self._last_step: int | None = None    # the last step the post-save-point snapshot was handled for
        self._checkpoint_steps: set[int] = set()   # checkpoint-N this run has written or asked for
        # The Trainer has no public hook at its save point (a TrainerCallback cannot replace the save), so
        # the wrapper takes over these two methods of this one Trainer; transformers is pinned (pyproject).
        self._original_mlse = trainer._maybe_log_save_evaluate
        trainer._maybe_log_save_evaluate = self._maybe_log_save_evaluate   # type: ignore[method-assign]
        trainer._save_checkpoint = self._save_checkpoint                   # type: ignore[method-assign]
        # The Trainer checks max_steps only after a step: resumed at its last step (max_steps not a multiple
        # of the steps per epoch) it fast-forwards into the unfinished epoch and trains one more. With no
        # batch handed out there, it trains none (fault soak, seed 101, fault 19: restarted after close()
        # failed, an HF job trained steps 21 and 22 of max_steps=20).
        self._original_batches = trainer.get_batch_samples
        trainer.get_batch_samples = self._get_batch_samples                # type: ignore[method-assign]
        self._trained_out = False   # this train() resumed at (or past) max_steps: nothing is left to train
        self._history = snapshot.LogHistoryJson()   # log_history's entries encoded by the snapshots before
        self._frozen = snapshot.FrozenBase()   # a peft model's frozen base, summed once
        self.guard: StepGuard | None = None
        if self.skipper is not None or use_checkpoint_health_monitor:
            self.guard = StepGuard(trainer, self.skipper, health=use_checkpoint_health_monitor,
                                   snapshot_step=lambda step: self.ckpt is not None and self.ckpt.due(step))

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
        or a complete checkpoint-N), a fresh start when there is none (the string ``"True"`` of a command line
        too, unless such a path exists); a path as in the Trainer (a ``checkpoint-N`` folder, from which a new
        timeline begins: easyckpt's newer states are set aside, or an easyckpt ``iteration_N``); None/False:
        fresh."""
        if trial is not None:
            raise NotImplementedError("hyperparameter search (trial=...) is not supported by TrainerWrapper: "
                                      "search with the plain Trainer, then train the chosen setup wrapped")
        if self.ckpt is None:
            self.ckpt = Checkpointer(self.save_dir, self.save_mem_interval, self.persist_interval, self.max_ckpt_num,
                                     log_file_path=self.log_file_path, **self.options)
        if self.skipper is not None:
            self.skipper.on_abort = self._on_abort
        if self.guard is not None:
            self.guard.start()
        if self.trainer.args.should_save and self._exporter is None:
            self._exporter = Exporter(self.folders, self.ckpt.config.save_dir, self.export_timeout,
                                      passed_over=self.ckpt.passed_over, persist_failed=self.ckpt.persist_failed)
        self._resumer = Resumer(self.ckpt, self.trainer, self.folders, save_dir=self.save_dir,
                                staging_dir=self.staging_dir)
        finished = False
        undo: fsdp.ShardedResume | None = None
        loaded: _OnTrainBegin | None = None
        at_end = _OnTrainBegin(self._stop_if_trained_out)
        self.trainer.add_callback(at_end)
        try:
            if self.trainer.args.should_save:
                self.folders.clean_stale()
            resume_from_checkpoint = as_asked(resume_from_checkpoint)
            path, self.resumed = self._resumer.resolve(resume_from_checkpoint)
            self._resumer.announce(self.resumed, asked=resume_from_checkpoint is True)
            self._last_step = self.resumed.step
            self._checkpoint_steps.clear()
            self._catch_up(self.resumed.step, path)
            if fsdp.enabled(self.trainer) and self.resumed.source in ("memory", "replica", "disk"):
                # staged sharded: the Trainer reads it so, and saves as the user chose from its first step on
                undo = fsdp.ShardedResume(self.trainer)
                loaded = _OnTrainBegin(undo.undo)
                self.trainer.add_callback(loaded)
            output = self.trainer.train(resume_from_checkpoint=path, **kwargs)
            finished = True
            return output
        finally:
            if undo is not None:
                undo.undo()
            if loaded is not None:
                self.trainer.remove_callback(loaded)
            self.trainer.remove_callback(at_end)
            self._trained_out = False
            # The end of training: close() makes the newest snapshot durable (final_persist) and raises
            # PersistError when the disk refused it, unless training itself failed: that error goes on, and
            # the agent keeps this node's memory for the restart.
            self._finish(failed=not finished)

    def _stop_if_trained_out(self) -> None:
        """At the start of training, with the resumed state loaded: at (or past) max_steps there is nothing
        left to train, as the Trainer itself sees when max_steps is a multiple of the steps per epoch."""
        trainer = self.trainer
        state = trainer.state
        self._trained_out = 0 < state.max_steps <= state.global_step
        if self._trained_out:
            trainer.control.should_training_stop = True
            logger.warning("resumed at step %d, and max_steps is %d: nothing left to train", state.global_step,
                           state.max_steps)

    def _get_batch_samples(self, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
        if self._trained_out:
            return [], None   # no batch, so no step; every rank alike (each resumed at the same step)
        return self._original_batches(*args, **kwargs)

    def _on_abort(self) -> None:
        """Too many spikes in a row: make the newest snapshot (the last step before them) durable first."""
        if self.ckpt is None:
            return
        result = self.ckpt.flush()
        if result.durable:
            logger.error("training aborted: step %s is durable in %s", result.step, self.save_dir)
        else:
            logger.error("training aborted; the newest snapshot (step %s) is not durable: %s", result.step,
                         result.error)

    def _capture(self) -> dict[str, Any]:
        extra = {STATE_KEY: self.guard.state()} if self.guard is not None and self.skipper is not None else None
        return snapshot.capture(self.trainer, extra, self._history, self._frozen)

    def _metrics(self, step: int) -> dict[str, float] | None:
        return self.guard.metrics_for(step) if self.guard is not None else None

    def _catch_up(self, resumed: int | None, path: str | None) -> None:
        """Export persisted due iterations up to the resumed step that have no checkpoint-N yet (a job died
        before or while exporting them). Now, before training: the agent's rotation would soon delete them.

        Only those newer than the newest checkpoint-N, or whose export a dead run still holds: an older one
        missing was deleted by save_total_limit, and exporting it again made its rotation delete the best
        checkpoint instead, which the Trainer's state does not name until ``Trainer.train`` loads it."""
        if self._exporter is None:
            return
        owed = layout.export_holds(self.save_dir)
        if resumed is not None and self.save_steps:
            existing = self.folders.existing()
            newest = existing[-1][0] if existing else -1
            self.folders.resumed_best = best_checkpoint(path)
            try:
                for step, _ in layout.complete_iterations(self.save_dir):
                    if (step <= resumed and step % self.save_steps == 0 and (step > newest or step in owed)
                            and not self.folders.path(step).exists()):
                        logger.info("exporting iteration %d, which has no checkpoint-%d yet", step, step)
                        try:
                            self._exporter.export(step)
                        except Exception:
                            logger.exception("export of iteration %d to checkpoint-%d failed; training goes on", step,
                                             step)
            finally:
                self.folders.resumed_best = None
        # Every hold a dead run left is settled now (exported above, on disk already, or of an abandoned
        # timeline): none may keep rotation from deleting its iteration for ever.
        for step in owed:
            self._exporter.release(step)

    # hooks on the Trainer ---------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        if self._trained_out:
            return   # the epoch's end with no step trained in it: nothing to log, save or evaluate
        if self.guard is not None:
            self.guard.end_of_step()
        self._original_mlse(*args, **kwargs)
        trainer = self.trainer
        step = trainer.state.global_step
        if self._resumer is not None:  # every rank has loaded what it needed (they met in the step's all-reduce)
            self._resumer.release()
        if step > 0 and step != self._last_step:
            self._last_step = step
            if self.ckpt is not None and self.ckpt.due(step):
                self._snapshot(step)
        if trainer.control.should_training_stop:
            self._drain()

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Replaces ``Trainer._save_checkpoint``: the step is persisted by the agent (a due one by the
        interval, any other on request) and exported asynchronously; written now only as a fallback."""
        trainer = self.trainer
        step = trainer.state.global_step
        if getattr(trainer, "hp_search_backend", None) is None and trial is None:
            trainer.store_flos()
        best = trainer.state.best_global_step
        if best and self.strategy in ("steps", "epoch", "best"):
            best_dir = self.folders.path(best)
            # The best folder may still be on its way (exported after training went on): name it anyway,
            # so that rotation keeps it and load_best_model_at_end finds it once the exports are drained.
            if best_dir.is_dir() or self._due(best) or best in self._checkpoint_steps or best == step:
                trainer.state.best_model_checkpoint = str(best_dir)
        metrics = None if self._due(step) else self._metrics(step)
        if self._due(step) or self._persist_now(step, metrics):
            if self._exporter is not None:
                self._exporter.request(step)
        else:
            self._save_now(step, metrics)
        self._checkpoint_steps.add(step)

    def _due(self, step: int) -> bool:
        return bool(self.save_steps) and self.ckpt is not None and self.ckpt.config.persist_due(step)

    # snapshots and saves ----------------------------------------------------------------------------
    def _snapshot(self, step: int) -> None:
        """The snapshot after the Trainer's save point; a due one waits for a free slot."""
        ckpt = self.ckpt
        assert ckpt is not None
        state = self._capture()
        if not ckpt.config.persist_due(step):
            ckpt.save_if_needed(step, state, metrics=self._metrics(step))
            return
        # The Trainer asked for checkpoint-N: the step is requested like an explicit save, so the agent
        # persists it even when it arrives while an older one is still being written (a plain due step
        # would then be passed over); a snapshot that finds no free slot waits for one.
        metrics = self._metrics(step)
        started = ckpt.save(step, state, persist=True, metrics=metrics) or \
            self._until_slot(step, lambda: ckpt.save(step, state, persist=True, metrics=metrics),
                             f"save_steps={self.save_steps}")
        if started:
            ckpt.wait()   # the request goes out once the copy is committed: now, not at the next step (the
                          # Trainer may next wait for checkpoint-N itself, at the end of training)
        else:
            logger.warning("rank %d: no free slot for the due snapshot of step %d after %.0fs: step %d will not be "
                           "persisted and checkpoint-%d not written", ckpt.rank, step, ckpt.config.pin_timeout,
                           step, step)
        if not all_ok(started) and self._exporter is not None:
            self._exporter.cancel(step)

    def _persist_now(self, step: int, metrics: dict[str, float] | None) -> bool:
        """A save the interval does not cover: snapshot the live state now and ask the agent to persist
        it, as for a due step. False, on every rank alike, when it must be written synchronously instead."""
        ckpt = self.ckpt
        assert ckpt is not None
        # The step may be in memory already (the snapshot after the last step of an epoch, taken before
        # the epoch-end evaluation and save). The agent claims a rank's copy of a requested step as soon as any
        # rank asks, and takes the newer of two: so every rank commits this copy before any rank asks.
        state = self._capture()
        started = ckpt.save(step, state, metrics=metrics) or \
            self._until_slot(step, lambda: ckpt.save(step, state, metrics=metrics), "this save")
        if started:
            self._last_step = step  # the snapshot after the Trainer's save point is this one
            ckpt.wait()
        if all_ok(started):
            ckpt.persist(step)
            return True
        logger.warning("rank %d: no free slot to snapshot step %d within %gs (pin_timeout) on this rank or "
                       "another (the agent is still persisting older steps): writing checkpoint-%d synchronously, "
                       "all ranks blocking on the disk", ckpt.rank, step, ckpt.config.pin_timeout, step)
        return False

    def _until_slot(self, step: int, attempt: Callable[[], bool], pace: str) -> bool:
        """Retry a snapshot that found no free slot until it starts (True) or ``pin_timeout`` passes."""
        assert self.ckpt is not None
        started = time.monotonic()
        deadline = started + self.ckpt.config.pin_timeout
        while time.monotonic() < deadline:
            time.sleep(POLL)  # polling for the agent to release a slot, against a deadline
            if attempt():
                logger.warning("rank %d: snapshot of step %d waited %.2fs for a free slot (persisting is slower "
                               "than %s)", self.ckpt.rank, step, time.monotonic() - started, pace)
                return True
        return False

    def _job_verdict(self, metrics: dict[str, float] | None) -> RankHealth:
        """Every rank's verdict on the live state combined, as the agent combines them for a persisted step
        (a collective: every rank calls it, with the health monitor on or off alike)."""
        assert self.ckpt is not None
        if not self.ckpt.config.health_thresholds:
            return RankHealth()
        mine = rank_verdict(metrics, self.ckpt.config.health_thresholds)
        text = json.dumps(mine.to_wire())
        if len(text.encode()) > VERDICT_BYTES:   # only a flood of reasons; the verdict itself must get through
            text = json.dumps(RankHealth(True, mine.healthy, mine.reasons[:1]).to_wire())[:VERDICT_BYTES]
        texts = all_gather_text(text, self.trainer.args.world_size, field=VERDICT_BYTES)
        return combine({rank: RankHealth.from_wire(json.loads(t), f"rank {rank}'s verdict on the live state")
                        for rank, t in enumerate(texts)})

    def _save_now(self, step: int, metrics: dict[str, float] | None) -> None:
        """A save written now from the live state, every rank blocking on the disk: the fallback when
        the step could not be snapshotted for the agent to persist. It carries the step's health verdict
        as an exported checkpoint-N does, so that a resume passes an unhealthy one over."""
        args = self.trainer.args
        world_size = args.world_size
        verdict = self._job_verdict(metrics)
        state = self._capture()
        partitioned = "deepspeed" in state and zero.is_partitioned(state["deepspeed"])
        weights = zero.gathered_weights(self.trainer) if partitioned else None   # ZeRO-3: a collective
        tmp = self.folders.tmp_path(step)
        problem = ""
        if args.should_save:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as exc:
                problem = str(exc)
        if not all_ok(not problem):
            raise RuntimeError(f"cannot create {tmp} for checkpoint-{step}: {problem or 'see rank 0'}")
        try:
            if args.should_save:
                self.folders.write_files(tmp, state, {}, world_size, native=True, weights=weights)
                mark_health(tmp, verdict.to_wire())
            if not args.save_only_model:
                torch.save(state["rng"], tmp / rng_file_name(args.process_index, world_size))
            if "deepspeed" in state:   # each rank its own ZeRO partition
                zero.write_optim_states(tmp, step, state["optim"], state["deepspeed"])
                if partitioned and not args.should_save:   # ZeRO-3: each rank its own model state file too
                    zero.write_model_states(tmp, step, state["model"], state["deepspeed"], latest=False)
        except OSError as exc:
            problem = str(exc)
        if not all_ok(not problem):
            raise RuntimeError(f"writing checkpoint-{step} into {tmp} failed: {problem or 'on another rank'}")
        if fsdp.STATE_KEY in state:   # collective, from the live DTensors
            fsdp.write_live(tmp, {"model": state["model"], "optim": state["optim"]}, fsdp.state_dict_kind(self.trainer),
                            args.process_index, snapshot.unwrapped_model(self.trainer))
        if args.should_save:
            self.folders.publish(tmp, step)

    # end of training --------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Wait (``export_timeout``) for the exports asked for. Before ``close()`` no snapshot will come to
        replace a node agent that died (the ranks do that at a snapshot, at most once a second), so this wait
        does, once a second: without that it waited export_timeout for an agent that never came (fault soak,
        seed 101, fault 99: the agent killed at step 7 of a run that ended within that second)."""
        ckpt, exporter = self.ckpt, self._exporter
        if ckpt is not None:
            ckpt.wait()   # a save's persist request goes out when its copy is committed: now, not never
        if exporter is None:
            return
        deadline = time.monotonic() + self.export_timeout
        while not exporter.drain(min(AGENT_CHECK, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                logger.warning("checkpoint exports still pending after %.0fs (export_timeout): %s",
                               self.export_timeout, ", ".join(f"checkpoint-{s}" for s in exporter.waiting()))
                return
            if ckpt is not None and exporter.abandoned is None and not ckpt.revive_agent(exporter.waiting()):
                exporter.abandon(f"no easyckpt agent runs for job {ckpt.config.job_id} and none could be started "
                                 f"(see {ckpt.agent.job_dir / 'agent.log'}); the snapshots stay in shared memory, "
                                 "and close() tries once more to persist the newest")

    def _finish(self, *, failed: bool = False) -> None:
        if self._resumer is not None:
            self._resumer.release()
            self._resumer = None
        ckpt, self.ckpt = self.ckpt, None
        try:
            if ckpt is not None:
                ckpt.close(raise_errors=not failed, failed=failed)
        finally:
            if self._exporter is not None:
                self._exporter.ask_again_if_persisted()
            self._drain()
            if self._exporter is not None:
                self._exporter.stop()
                self._exporter = None
