"""``EasyCkpt``: the Lightning callback. See the package docstring (``easyckpt.lightning``) for the design."""
from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from easyckpt.checkpointer import Checkpointer
from easyckpt.collectives import all_ok
from easyckpt.config import PERSIST_ON_REQUEST, check_count, check_seconds
from easyckpt.health import configure, embedding_local_norm
from easyckpt.lightning import connector, data, sampling, sharded
from easyckpt.lightning.export import Exporter
from easyckpt.snapshot.state import flatten
from easyckpt_wire import layout
from easyckpt_wire.shm import format_bytes
from easyckpt_wire.storage import as_path

logger = logging.getLogger(__name__)

POLL = 0.05          # seconds between tries for a free slot (a save waits for the agent to release one)
HPARAMS_KEYS = (pl.LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, pl.LightningModule.CHECKPOINT_HYPER_PARAMS_NAME,
                pl.LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE)
STATE_FORMAT = 1


@dataclass
class _Saves:
    """The current step's state, held until this callback's next hook: its snapshot, when due (taken at
    ``on_train_batch_end``), and Lightning's saves of the step (ModelCheckpoint writes the top-k file, then
    ``last.ckpt`` with ``last_model_path`` updated first; a monitored save comes after validation). One copy
    is taken, of the newest dictionary: a resume from a snapshot taken before the saves would name a stale
    ``last_model_path`` (Lightning then writes ``last-v1.ckpt`` next to ``last.ckpt``), and two copies of
    one step differ in the callbacks' states, so the agent, claiming this rank's copy as soon as another rank
    asks for the step, could persist the older one here: a resume from disk then diverged across ranks
    (ModelCheckpoint's collectives hung; CI, 2026-11-29)."""
    step: int
    checkpoint: dict[str, Any]     # the newest dictionary of the step: what the snapshot holds
    metrics: dict[str, float] | None = None   # this rank's health metrics of the step (the due snapshot's)
    persist: bool = False          # Lightning saved the step: the agent persists it
    files: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)   # path, dict, extras


def check_strategy(trainer: pl.Trainer) -> None:
    """Refuse, before anything is written, what the callback does not snapshot correctly."""
    strategy = trainer.strategy
    name = type(strategy).__name__
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)) and \
            type(strategy).__module__.startswith("lightning.pytorch.strategies"):
        return
    reasons = {
        "FSDPStrategy": "FSDP1 keeps flat parameters whose optimizer state Lightning gathers to rank 0 for every "
                        "save (a collective, seconds per step at scale); easyckpt snapshots FSDP2's DTensor shards: "
                        "use ModelParallelStrategy with fully_shard in configure_model",
        "DeepSpeedStrategy": "DeepSpeed's engine owns the optimizer partitions and writes its own checkpoint "
                             "folders",
    }
    reason = next((text for key, text in reasons.items() if key in name), "it is not one EasyCkpt was built and "
                  "tested with")
    raise NotImplementedError(
        f"EasyCkpt does not support Trainer(strategy={name}): {reason}. Supported: one device (CPU or GPU), DDP "
        "(strategy='ddp', 'ddp_spawn', ...) and ModelParallelStrategy (FSDP2 with fully_shard in configure_model). "
        "Train with one of those, or without EasyCkpt for this strategy. Nothing was written.")


class EasyCkpt(Callback):
    """easyckpt for a Lightning ``Trainer``: ``Trainer(callbacks=[EasyCkpt(...)])`` and
    ``trainer.fit(model, ckpt_path="last")``.

    ``save_mem_interval``: snapshot into shared memory every that many optimizer steps. ``save_dir`` defaults
    to ``<default_root_dir>/easyckpt``; ``max_ckpt_num`` (default 2) iterations are kept there, the ``.ckpt``
    files of ``ModelCheckpoint`` keep the history under its ``save_top_k``. ``save_storage_interval``: by
    default only what Lightning saves is persisted (``ModelCheckpoint``'s triggers, ``trainer.save_checkpoint``);
    a number also persists every such step. Further keywords go to :class:`easyckpt.Checkpointer`, except
    ``export_timeout`` (how long a ``.ckpt`` export waits for its iteration, default 600 s).

    Data skipping and the health monitor take the keywords of the other integrations
    (``use_skip_data_by_global_norm``, ``global_norm_spike_threshold``, ``global_norm_spike_count_threshold``,
    ``use_checkpoint_health_monitor``, ``embedding_local_norm_threshold``): a step whose global gradient norm
    (before clipping) spikes changes neither the model, the optimizer nor the step-wise LR schedulers;
    ``global_norm_spike_count_threshold`` spikes in a row make the newest snapshot durable and raise
    :class:`easyckpt.TrainingAborted`; each snapshot carries the input embedding's gradient norm and the loss,
    and an unhealthy one is passed over by a resume.
    """

    def __init__(self, save_mem_interval: int = 1, *, save_dir: str | Path | None = None,
                 save_storage_interval: int | None = None, max_ckpt_num: int = 2,
                 use_skip_data_by_global_norm: bool = False, global_norm_spike_threshold: float | None = None,
                 global_norm_spike_count_threshold: int | None = None, use_checkpoint_health_monitor: bool = False,
                 embedding_local_norm_threshold: float | None = None, export_timeout: float = 600.0,
                 **checkpointer_kwargs: Any) -> None:
        super().__init__()
        check_count("EasyCkpt: save_mem_interval", save_mem_interval)
        check_seconds("EasyCkpt: export_timeout", export_timeout)
        self.skipper, thresholds = configure(
            use_skip_data_by_global_norm=use_skip_data_by_global_norm,
            global_norm_spike_threshold=global_norm_spike_threshold,
            global_norm_spike_count_threshold=global_norm_spike_count_threshold,
            use_checkpoint_health_monitor=use_checkpoint_health_monitor,
            embedding_local_norm_threshold=embedding_local_norm_threshold,
            health_thresholds=checkpointer_kwargs.pop("health_thresholds", None), what="EasyCkpt")
        self.health = use_checkpoint_health_monitor
        self.save_mem_interval = save_mem_interval
        self.save_dir = as_path(save_dir) if save_dir is not None else None   # an s3:// URL stays one
        self.save_storage_interval = save_storage_interval
        self.max_ckpt_num = max_ckpt_num
        self.export_timeout = export_timeout
        self.options = {**checkpointer_kwargs, "health_thresholds": thresholds}
        self.ckpt: Checkpointer | None = None
        self.exporter: Exporter | None = None
        self.lightning_last: Any = None       # the file Lightning's own "last" resolved to (connector)
        self.resumed: dict[str, Any] | None = None   # where fit() started from: step, source, path, seconds, bytes
        self._trainer: pl.Trainer | None = None
        self._last_step = -1                  # the newest optimizer step seen at a batch end
        self._persisted = -1                  # the newest step asked to persist
        self._restored: dict[str, Any] | None = None   # this callback's state from the resumed checkpoint
        self._skipped: list[Any] = []         # loaders whose first batches the resumed epoch leaves out
        self._loader_states: list[dict[str, Any]] | None = None   # the stateful loaders' states of a resume
        self._draws: dict[str, sampling.Draws] = {}   # the draws of samplers Lightning wraps (sampling.py)
        self._metrics: tuple[int, dict[str, float]] | None = None
        self._undo: list[Callable[[], None]] = []   # what a skipped step replaced (scheduler steps)
        self._originals: dict[str, Any] = {}  # the strategy's methods this callback wraps during fit
        self._saves: _Saves | None = None     # Lightning's saves of the current step, not snapshotted yet
        self._hparams_ok: bool | None = None
        connector.install()

    # Lightning's hooks -----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_strategy(trainer)
        if self.skipper is not None and not pl_module.automatic_optimization:
            raise NotImplementedError(
                "EasyCkpt(use_skip_data_by_global_norm=True) needs automatic optimization: with "
                "automatic_optimization=False your training_step calls the optimizer itself, so skip a spiky "
                "step there (easyckpt.health.DataSkipper), or drop the keyword")
        self._trainer = trainer
        save_dir = self.save_dir or Path(trainer.default_root_dir) / "easyckpt"
        persist = self.save_storage_interval or self.save_mem_interval * PERSIST_ON_REQUEST
        if self.ckpt is None:
            self.ckpt = Checkpointer(save_dir, self.save_mem_interval, persist, self.max_ckpt_num, **self.options)
        if self.skipper is not None:
            self.skipper.on_abort = self._on_abort
        if trainer.is_global_zero and self.exporter is None:
            for step in layout.export_holds(self.ckpt.config.save_dir):   # a dead run's: nobody exports them now
                logger.warning("the export of iteration %d was cut off by the end of a run; the iteration stays "
                               "resumable by easyckpt", step)
                layout.release_export(self.ckpt.config.save_dir, step)
            self.exporter = Exporter(self.ckpt.config.save_dir, self.export_timeout)
        self._wrap_strategy(trainer)
        self._last_step = -1
        self._persisted = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.resumed is not None and self.resumed.get("source") == "file" and self.ckpt is not None:
            # Lightning restored its own file: from its step on, a new timeline (the newer iterations of an
            # abandoned run are set aside, so that this run's steps are persisted and a resume never takes them)
            self.resumed["step"] = trainer.global_step
            self.ckpt.resumed_at(trainer.global_step)
        data.start_next_epoch_as_uninterrupted(trainer)
        self._continue_data(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_saves()
        if self._draws:   # loaders Lightning created anew (reload_dataloaders_every_n_epochs) are watched too
            self._draws = sampling.watch(data.train_loaders(trainer), resumed=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._take_saves()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._take_saves()   # a save from inside training_step: before the optimizer changes what it holds
        step = trainer.global_step + 1   # the step being taken (Lightning counts it after)
        if self.health and self.ckpt is not None and self.ckpt.due(step):
            norm = embedding_local_norm(pl_module)
            self._metrics = (step, {} if norm is None else {"embedding_local_norm": norm})
        if self.skipper is None:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if hasattr(total, "full_tensor"):   # FSDP2: the norm of the local shards, reduced over the mesh
            total = total.full_tensor()
        if self.skipper.skip(step, total):
            self._skip_step(trainer, pl_module)
            if self._metrics is not None and self._metrics[0] == step:   # the state stays the healthy one
                self._metrics[1].pop("embedding_local_norm", None)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end_skip()
        step = trainer.global_step
        if self._saves is not None and self._saves.step != step:
            self._take_saves()
        if step == self._last_step or self.ckpt is None:   # accumulating gradients: no optimizer step yet
            return
        self._last_step = step
        if not self.ckpt.due(step):
            return
        # Held, not taken: ModelCheckpoint (always the last callback) may save this step next.
        metrics = self._step_metrics(step, outputs)
        if self._saves is None:
            self._saves = _Saves(step, self._capture(trainer), metrics)
        else:   # a save of this step came first (a callback before this one): its dictionary is the snapshot
            self._saves.metrics = metrics

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for loader in self._skipped:
            data.restore(loader)
        self._skipped = []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._take_saves()
            self._finish(failed=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The newest snapshot is made durable (close); the exception goes on, a failed persist is only logged,
        # and the agent keeps this node's memory for the restart (close(failed=True)).
        # The other ranks may not be failing with this one: no collective decides the held saves' way here.
        self._take_saves(agreed=False)
        self._finish(failed=True)

    def state_dict(self) -> dict[str, Any]:
        """This rank's RNGs (Lightning's checkpoint has none: a resume from easyckpt continues them exactly)
        and the data skipper's count, in every snapshot and every ``.ckpt`` Lightning writes."""
        rank = self._trainer.global_rank if self._trainer is not None else 0
        state = {"format": STATE_FORMAT, "rng": {rank: data.portable_rng(_collect_rng_states())},
                 "skipper": self.skipper.state_dict() if self.skipper is not None else None}
        if self._draws:   # the generators of samplers Lightning wraps (easyckpt.lightning.sampling)
            state["sampling"] = {rank: sampling.record(self._draws)}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        if self.skipper is not None and isinstance(state_dict.get("skipper"), dict):
            self.skipper.load_state_dict(state_dict["skipper"])
            logger.info("data skipping resumed: %s", state_dict["skipper"])

    # resume (called by easyckpt.lightning.connector) -------------------------------------------------
    def resume(self, load_dir: Path | None = None) -> tuple[Any, dict[str, Any] | None]:
        """The newest state every rank can get: (where, Lightning's checkpoint dictionary), or (Lightning's own
        last file or None, None) when easyckpt holds nothing; ``load_dir``: that ``iteration_N`` instead,
        whatever its health. A collective: every rank calls it."""
        ckpt = self._require()
        trainer = self._trainer
        assert trainer is not None   # set with the Checkpointer, in setup()
        template, created = sharded.template(trainer.strategy) if sharded.enabled(trainer) else (None, [])
        result = ckpt.load(template, load_dir=load_dir)
        if result.step is None:
            sharded.discard(created)
            if self.lightning_last is not None and ckpt.local_rank == 0:
                logger.warning("easyckpt holds nothing to resume from in memory or %s: resuming from %s",
                               ckpt.config.save_dir, self.lightning_last)
            elif self.lightning_last is None:
                logger.info("easyckpt: nothing to resume from in memory or %s: fresh start", ckpt.config.save_dir)
            return self.lightning_last, None
        state = result.state
        if not isinstance(state, dict) or "loops" not in state or "state_dict" not in state:
            raise ValueError(f"the easyckpt state of step {result.step} ({result.source}, {result.path}) is not a "
                             f"Lightning checkpoint (written by another integration?): give EasyCkpt a save_dir of "
                             f"its own (now {ckpt.config.save_dir})")
        if template is not None:   # the strategy loads no weights from the dictionary: they are in place now
            sharded.load(trainer.strategy, state)
        self._last_step = result.step
        fit_state = state.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        self._loader_states = fit_state.get("combined_loader") if isinstance(fit_state, dict) else None
        self.resumed = {"step": result.step, "source": result.source, "path": result.path,
                        "seconds": result.seconds, "nbytes": result.nbytes}
        where = result.path if result.source == "disk" else f"easyckpt://{result.source}/step={result.step}"
        # Checkpointer.load announced the resume once per node; this is every rank's detail
        logger.debug("rank %d: resumed at step %d from %s (%s, %.2f s)", ckpt.rank, result.step, result.source,
                     format_bytes(result.nbytes), result.seconds)
        return where, state

    def starting(self, path: Any) -> None:
        """fit() starts fresh (``path`` None) or from a file Lightning loads: this job's older snapshots in
        memory must not be taken for this run's by a later resume."""
        ckpt = self._require()
        self.resumed = {"step": None, "source": None if path is None else "file", "path": path}
        if self.skipper is not None and path is None:
            self.skipper.load_state_dict({"consecutive": 0, "skipped_total": 0})
        if ckpt.slots.committed():
            logger.info("rank %d: %s: dropping this job's old snapshots from memory", ckpt.rank,
                        "fresh start" if path is None else f"resuming from {path}")
            ckpt.slots.invalidate_newer_than(-1)

    # snapshots ------------------------------------------------------------------------------------------
    def _capture(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's own checkpoint dictionary, built as ``trainer.save_checkpoint`` builds it: every
        ``state_dict`` and ``on_save_checkpoint`` hook runs, as at each of Lightning's saves."""
        with sharded.local_shards(trainer.strategy):
            return self._portable(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))

    def _portable(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint as a snapshot holds it. Hyper-parameters that are not plain values (an argparse
        Namespace, an OmegaConf container) are left out: a resume does not read them, and exported files take
        them from the live module."""
        if self._hparams_ok is None:
            hparams = {k: checkpoint[k] for k in HPARAMS_KEYS if k in checkpoint}
            try:
                flatten(hparams)
                self._hparams_ok = True
            except TypeError as exc:
                self._hparams_ok = False
                logger.warning("hyper-parameters are left out of easyckpt snapshots (%s); the .ckpt files "
                               "Lightning asks for carry them", exc)
        if self._hparams_ok:
            return checkpoint
        return {k: v for k, v in checkpoint.items() if k not in HPARAMS_KEYS}

    def _step_metrics(self, step: int, outputs: Any) -> dict[str, float] | None:
        if not self.health:
            return None
        metrics = dict(self._metrics[1]) if self._metrics is not None and self._metrics[0] == step else {}
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            metrics["loss"] = float(loss.detach())
        return metrics

    # Lightning's saves, persisted by the agent ----------------------------------------------------------
    def _wrap_strategy(self, trainer: pl.Trainer) -> None:
        """Lightning's saves (ModelCheckpoint, trainer.save_checkpoint) reach ``strategy.save_checkpoint`` on
        every rank with the whole dictionary; removals (``save_top_k``) reach ``strategy.remove_checkpoint``.
        Wrapped on this Trainer's strategy instance for the fit, put back at its end."""
        strategy = trainer.strategy
        if self._originals:
            return
        self._originals = {"save_checkpoint": strategy.save_checkpoint,
                           "remove_checkpoint": strategy.remove_checkpoint}
        strategy.save_checkpoint = self._save_checkpoint        # type: ignore[method-assign]
        strategy.remove_checkpoint = self._remove_checkpoint    # type: ignore[method-assign]

    def _unwrap_strategy(self) -> None:
        if self._trainer is not None:
            for name in self._originals:
                vars(self._trainer.strategy).pop(name, None)
        self._originals = {}

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Instead of ``torch.save`` on rank 0 while every rank waits: the state is snapshotted on every
        rank with a request to persist it, and rank 0's export thread writes ``filepath`` from the persisted
        iteration. Held until the step's saves are over (:class:`_Saves`): taken at the next hook of this
        callback, before anything changes the state. Written synchronously, as Lightning does, only when a
        rank found no free slot in time."""
        ckpt = self.ckpt
        if ckpt is None or ckpt.closed or storage_options is not None:
            return self._originals["save_checkpoint"](checkpoint, filepath, storage_options=storage_options)
        step = int(checkpoint["global_step"])
        if self._saves is not None and self._saves.step != step:
            self._take_saves()
        if self._saves is None:
            self._saves = _Saves(step, checkpoint)
        self._saves.checkpoint = checkpoint
        self._saves.persist = True
        self._saves.files.append((str(filepath), checkpoint, self._extras(checkpoint)))
        return None

    def _take_saves(self, *, agreed: bool = True) -> None:
        """Snapshot the held step (:class:`_Saves`, the newest dictionary): into memory only, or, when
        Lightning saved it, with a request to persist and the files exported from its iteration (written
        synchronously if a rank found no free slot). ``agreed``: every rank is here and decides together (a
        barrier), else this rank decides alone (an exception on its way)."""
        saves, self._saves = self._saves, None
        ckpt = self.ckpt
        if saves is None or ckpt is None or ckpt.closed:
            return
        if not saves.persist:
            ckpt.save_if_needed(saves.step, saves.checkpoint, metrics=saves.metrics)
            return
        started = self._persist(ckpt, saves.step, saves.checkpoint, saves.metrics)
        if all_ok(started) if agreed else started:
            if self.exporter is not None:
                for path, _, extras in saves.files:
                    self.exporter.request(saves.step, path, extras)
            return
        logger.warning("rank %d: no free slot to snapshot step %d within %gs (pin_timeout) on this rank or another "
                       "(the agent is still persisting older steps): writing %s synchronously", ckpt.rank,
                       saves.step, ckpt.config.pin_timeout, ", ".join(path for path, _, _ in saves.files))
        for path, checkpoint, _ in saves.files:
            self._originals["save_checkpoint"](checkpoint, path)

    def _persist(self, ckpt: Checkpointer, step: int, checkpoint: dict[str, Any],
                 metrics: dict[str, float] | None) -> bool:
        if step == self._persisted:   # saves of a step an earlier hook snapshotted already: the same iteration
            return True
        trainer = self._trainer
        state = self._portable(checkpoint)
        if trainer is not None and sharded.enabled(trainer):
            # Under ModelParallelStrategy Lightning's dictionary holds CPU copies (or rank 0's gathered whole state)
            # of the model and optimizers: the snapshot takes every rank's own shards instead, unchanged since the
            # save (the take comes before the optimizer steps again). Everything else (loops, callbacks,
            # schedulers) as the save left it: at an epoch's end the take comes at the next epoch's start, and a
            # resume from that loop state ended the resumed epoch one batch early.
            state = {**state, **sharded.live_state(trainer.strategy)}
        if metrics is None and self.health and self._metrics is not None and self._metrics[0] == step:
            metrics = self._metrics[1]   # a save of a step that is not due: the embedding norm measured for it
        deadline = time.monotonic() + ckpt.config.pin_timeout
        started = ckpt.save(step, state, persist=True, metrics=metrics)
        waited = time.monotonic()
        while not started and time.monotonic() < deadline:
            time.sleep(POLL)   # polling for the agent to release a slot, against a deadline
            started = ckpt.save(step, state, persist=True, metrics=metrics)
        if started:
            if time.monotonic() - waited > POLL:
                logger.warning("rank %d: the save of step %d waited %.2fs for a free slot (persisting is slower "
                               "than the saves)", ckpt.rank, step, time.monotonic() - waited)
            # The persist request goes out once the copy is committed, at the next step's wait for it (or at
            # close()): nothing waits for the copy here.
            self._persisted = step
        return started

    def _extras(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Everything of the save but the model and optimizer tensors, copied now (the export runs later)."""
        try:
            return {k: copy.deepcopy(v) for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        except Exception as exc:   # an entry that cannot be copied: the snapshot's own entries are exported
            logger.warning("the entries of step %s's checkpoint could not be copied (%s): its file carries those of "
                           "the snapshot", checkpoint.get("global_step"), exc)
            return {}

    def _remove_checkpoint(self, filepath: Any) -> None:
        saves = self._saves
        if saves is not None and any(path == str(filepath) for path, _, _ in saves.files):
            saves.files = [entry for entry in saves.files if entry[0] != str(filepath)]
            return   # held, not written yet: now it never is (the step's snapshot is still taken)
        if self.exporter is not None and self.exporter.forget(str(filepath)):
            return   # it was still to be written: now it never is
        self._originals["remove_checkpoint"](filepath)

    # the data position and RNGs of a resume -------------------------------------------------------------
    def _continue_data(self, trainer: pl.Trainer) -> None:
        """After a resume: the resumed epoch leaves out the batches it had consumed, and every RNG continues
        from the snapshot (``easyckpt.lightning.data``)."""
        restored, self._restored = self._restored, None
        loader_states, self._loader_states = self._loader_states, None
        self._draws = sampling.watch(data.train_loaders(trainer), resumed=restored is not None)
        if restored is None:
            return
        rank = trainer.global_rank
        rngs, records = restored.get("rng"), restored.get("sampling")
        rng = rngs.get(rank) if isinstance(rngs, dict) else None
        record = records.get(rank) if isinstance(records, dict) else None
        if rng is None and restored.get("format") == STATE_FORMAT:
            logger.info("rank %d: the resumed checkpoint has no RNG state of this rank (a .ckpt file holds rank "
                        "0's): the RNGs are not restored", rank)
        self._skipped = data.continue_after_resume(trainer, rng, self._draws, record, loader_states)

    # data skipping --------------------------------------------------------------------------------------
    def _skip_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The spiked gradients are dropped, so the optimizer leaves every parameter and its state as they
        are; the step-wise LR schedulers do not step either (Lightning still counts the step)."""
        for param in pl_module.parameters():
            param.grad = None
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and not config.reduce_on_plateau:
                scheduler = config.scheduler
                had = vars(scheduler).get("step")
                scheduler.step = _no_step   # type: ignore[method-assign]
                self._undo.append(functools.partial(_put_back, scheduler, "step", had))

    def _end_skip(self) -> None:
        undo, self._undo = self._undo, []
        for action in undo:
            action()

    def _on_abort(self) -> None:
        """Too many spikes in a row: make the newest snapshot (the last step before them) durable first."""
        if self.ckpt is None:
            return
        result = self.ckpt.flush()
        if result.durable:
            logger.error("training aborted: step %s is durable in %s", result.step, self.ckpt.config.save_dir)
        else:
            logger.error("training aborted; the newest snapshot (step %s) is not durable: %s", result.step,
                         result.error)

    # the end ------------------------------------------------------------------------------------------
    def wait_exports(self, timeout: float | None = None) -> bool:
        """Wait until every ``.ckpt`` file asked for so far is written; False on timeout (rank 0; True elsewhere).
        A save of the current step is asked for at this callback's next hook (``_Saves``), not before."""
        return self.exporter is None or self.exporter.drain(self.export_timeout if timeout is None else timeout)

    def _finish(self, *, failed: bool) -> None:
        self._end_skip()
        for loader in self._skipped:
            data.restore(loader)
        self._skipped = []
        sampling.unwatch(self._draws)
        self._draws = {}
        self._unwrap_strategy()
        ckpt, self.ckpt = self.ckpt, None
        try:
            if ckpt is not None:
                ckpt.close(raise_errors=not failed, failed=failed)
        finally:
            if self.exporter is not None:
                if not self.exporter.drain(self.export_timeout):
                    logger.warning("checkpoint exports still pending after %.0fs", self.export_timeout)
                self.exporter.stop()
                self.exporter = None

    def _require(self) -> Checkpointer:
        if self.ckpt is None:
            raise RuntimeError("EasyCkpt: the Checkpointer is created in the callback's setup(); resume is asked "
                               "before it ran (a Trainer whose fit() skipped the setup hooks?)")
        return self.ckpt


def _no_step(*args: Any, **kwargs: Any) -> None:
    """A skipped step's scheduler step."""


def _put_back(obj: Any, name: str, had: Any) -> None:
    if had is None:
        vars(obj).pop(name, None)
    else:
        setattr(obj, name, had)
