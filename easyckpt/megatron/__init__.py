"""Megatron-LM integration: three lines in a Megatron training loop.

::

    from easyckpt.megatron import initialize_easyckpt, save_checkpoint_if_needed, load_checkpoint
    initialize_easyckpt(save_mem_interval=1, save_storage_interval=5, max_ckpt_num=5, log_file_path=None)
    iteration, num_floating_point_operations_so_far = load_checkpoint(model, optimizer, opt_param_scheduler)
    ...
    save_checkpoint_if_needed(iteration, model, optimizer, opt_param_scheduler)   # after each train_step

``model`` is Megatron's list of model chunks (one per virtual pipeline stage), ``optimizer`` Megatron's
optimizer (or any torch optimizer), ``opt_param_scheduler`` Megatron's OptimizerParamScheduler (or any
object with ``state_dict``/``load_state_dict``). The state is what Megatron itself saves (see
``easyckpt.megatron.snapshot``), snapshotted to shared memory and persisted by the node agent.

Directories: with ``megatron.training`` importable and its args initialised, ``--save`` is the save_dir
and ``--load`` (or the ``load_arg`` of load_checkpoint) where else to look; otherwise the keywords
``save_dir=`` and ``load_dir=`` of initialize_easyckpt. ``load_checkpoint`` resumes this job's own state
first (memory, replicas on other nodes, save_dir); if there is none, it loads the load directory: an
easyckpt save_dir, one of its ``iteration_N`` directories, or a native Megatron legacy checkpoint
(``iter_N/mp_rank_XX/model_optim_rng.pt`` + tracker: the migration path). ``easyckpt convert --to
megatron SRC DST`` goes the other way.

``import easyckpt.megatron.hook`` adds exit handling (SIGTERM, uncaught exceptions): see that module.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from easyckpt.checkpointer import Checkpointer
from easyckpt.collectives import all_ok, barrier
from easyckpt.health import DataSkipper, configure
from easyckpt.logs import notice
from easyckpt.megatron import legacy, skipping, snapshot
from easyckpt.megatron.legacy import LegacyCheckpointError
from easyckpt.recovery import LayoutChangedError
from easyckpt_wire import layout
from easyckpt_wire.storage import as_path, is_url

logger = logging.getLogger(__name__)

__all__ = ["initialize_easyckpt", "save_checkpoint_if_needed", "load_checkpoint", "get_checkpointer",
           "last_load", "finalize_easyckpt", "LegacyCheckpointError"]


@dataclasses.dataclass
class LoadInfo:
    """What the last load_checkpoint did (for logs and tests)."""

    iteration: int
    source: str | None          # "memory" | "replica" | "disk" | "megatron-legacy" | None (fresh start)
    path: str | None = None
    seconds: float = 0.0


@dataclasses.dataclass
class _Context:
    ckpt: Checkpointer
    save_dir: Path
    load_dir: Path | None
    args: Any                   # Megatron's args, or the args= keyword (a Namespace or dict), or None
    megatron_args: bool
    trust_legacy_pickle: bool
    flops: float | int = 0
    last: LoadInfo | None = None
    skipper: DataSkipper | None = None
    health: bool = False
    iteration: int = 0


_ctx: _Context | None = None


def _megatron_args() -> Any:
    """Megatron's global args when megatron.training is importable and they are initialised, else None."""
    try:
        from megatron.training import global_vars
    except Exception:  # not installed (megatron-core alone has no megatron.training), or broken on import
        return None
    # Megatron's own global, read without its get_args(), which asserts when the args are not set yet.
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def initialize_easyckpt(save_mem_interval: int, save_storage_interval: int, max_ckpt_num: int,
                        log_file_path: str | None = None, *, use_skip_data_by_global_norm: bool = False,
                        global_norm_spike_threshold: float | None = None,
                        global_norm_spike_count_threshold: int | None = None,
                        use_checkpoint_health_monitor: bool = False, embedding_local_norm_threshold: float | None = None,
                        **kwargs: Any) -> Checkpointer:
    """Create this rank's Checkpointer (after torch.distributed and Megatron's parallel state are set up).

    Keywords besides the Checkpointer's own (``job_id``, ``shm_dir``, ``copy_threads``, ...): ``save_dir``
    and ``load_dir`` (used when Megatron's args are not available), ``args`` (a Namespace or dict saved
    and restored like Megatron's args when megatron.training is absent), ``trust_legacy_pickle`` (see
    ``easyckpt.megatron.legacy``). A second call returns the existing Checkpointer.

    ``use_skip_data_by_global_norm=True``: an iteration whose global gradient norm (Megatron's optimizer
    computes it, pre-clip) exceeds ``global_norm_spike_threshold`` (default 1.0) is not applied; Megatron
    counts it as a skipped iteration and does not step the LR scheduler. ``global_norm_spike_count_threshold``
    (default 10) consecutive ones make the newest snapshot durable and raise :class:`easyckpt.TrainingAborted`.
    Needs Megatron's optimizer (``get_megatron_optimizer``), whose ``step()`` computes the norm; the wrapping
    happens in load_checkpoint. ``use_checkpoint_health_monitor=True``: each snapshot carries the word
    embedding's local gradient norm (pipeline stage 0) and the ``metrics`` given to save_checkpoint_if_needed
    (say the loss); above ``embedding_local_norm_threshold`` (default 1.0) a snapshot is unhealthy.
    """
    global _ctx
    if _ctx is not None:
        logger.warning("initialize_easyckpt called again: keeping the existing Checkpointer (%s)", _ctx.save_dir)
        return _ctx.ckpt
    save_kw, load_kw = kwargs.pop("save_dir", None), kwargs.pop("load_dir", None)
    user_args = kwargs.pop("args", None)
    trust = bool(kwargs.pop("trust_legacy_pickle", False))
    skipper, thresholds = configure(
        use_skip_data_by_global_norm=use_skip_data_by_global_norm,
        global_norm_spike_threshold=global_norm_spike_threshold,
        global_norm_spike_count_threshold=global_norm_spike_count_threshold,
        use_checkpoint_health_monitor=use_checkpoint_health_monitor,
        embedding_local_norm_threshold=embedding_local_norm_threshold,
        health_thresholds=kwargs.pop("health_thresholds", None), what="initialize_easyckpt")
    if thresholds is not None:
        kwargs["health_thresholds"] = thresholds
    margs = _megatron_args()
    save_dir = getattr(margs, "save", None) if margs is not None else None
    load_dir = getattr(margs, "load", None) if margs is not None else None
    save_dir, load_dir = save_dir or save_kw, load_dir or load_kw
    if save_dir is None:
        raise ValueError("initialize_easyckpt needs a save directory: Megatron's --save, or save_dir=... when "
                         "megatron.training is not used")
    ckpt = Checkpointer(save_dir, save_mem_interval, save_storage_interval, max_ckpt_num,
                        log_file_path=log_file_path, **kwargs)
    _ctx = _Context(ckpt=ckpt, save_dir=ckpt.config.save_dir, load_dir=as_path(load_dir) if load_dir else None,
                    args=margs if margs is not None else user_args, megatron_args=margs is not None,
                    trust_legacy_pickle=trust, skipper=skipper, health=use_checkpoint_health_monitor)
    if skipper is not None:
        skipper.on_abort = ckpt.flush   # the newest snapshot (before the spikes) is durable before the abort
    info = snapshot.parallel_info()
    logger.info("easyckpt megatron rank %d: tp %d/%d, pp %d/%d, dp %d/%d, ep %d/%d: model and optimizer state "
                "is the same on the %d data-parallel ranks of this tensor/pipeline rank, and replicas are found "
                "by content checksum", info["rank"], info["tp_rank"], info["tp_size"], info["pp_rank"],
                info["pp_size"], info["dp_rank"], info["dp_size"], info["ep_rank"], info["ep_size"], info["dp_size"])
    return ckpt


def _require() -> _Context:
    if _ctx is None:
        raise RuntimeError("easyckpt.megatron: call initialize_easyckpt(...) before saving or loading")
    return _ctx


def get_checkpointer() -> Checkpointer | None:
    return _ctx.ckpt if _ctx is not None else None


def last_load() -> LoadInfo | None:
    return _ctx.last if _ctx is not None else None


def _args(ctx: _Context) -> Any:
    return _megatron_args() if ctx.megatron_args else ctx.args


_said_private = False


def save_checkpoint_if_needed(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                              num_floating_point_operations_so_far: float | int | None = None, *,
                              metrics: Mapping[str, float] | None = None) -> bool:
    """Snapshot Megatron's state when ``iteration % save_mem_interval == 0``; returns at once.

    Pass ``num_floating_point_operations_so_far`` to keep Megatron's counter exact; without it the value
    returned by the last load_checkpoint is saved. ``metrics`` (with the health monitor; say
    ``{"loss": loss_dict["lm loss"]}``) go with the snapshot besides the embedding's gradient norm.
    """
    global _said_private
    ctx = _require()
    ctx.iteration = iteration
    guard = skipping.guard_of(optimizer)
    if guard is not None:
        guard.iteration = iteration
    if num_floating_point_operations_so_far is not None:
        ctx.flops = num_floating_point_operations_so_far
    if not ctx.ckpt.due(iteration):
        ctx.ckpt.note_step(iteration)   # no state to build: the agent is still kept running and watched
        return False
    chunks = model if isinstance(model, (list, tuple)) else [model]
    state = snapshot.build(iteration, list(chunks), optimizer, opt_param_scheduler, args=_args(ctx), flops=ctx.flops)
    if ctx.skipper is not None:
        state[snapshot.META_KEY]["data_skipper"] = ctx.skipper.state_dict()
    health: dict[str, float] | None = None
    if ctx.health:
        health = dict(metrics or {})
        if guard is not None:
            health.update(guard.metrics_for(iteration))
        else:   # a torch optimizer: the gradients of this step are still there
            embedding = skipping.embedding_local_norm(list(chunks))
            if embedding is not None:
                health["embedding_local_norm"] = embedding
    if "optimizer_param_state" in state and not _said_private:
        _said_private = True
        info = state[snapshot.META_KEY]["parallel"]
        logger.info("easyckpt megatron rank %d: distributed optimizer: its optimizer shards (dp rank %d of %d) "
                    "are rank-private; no other rank of this job holds them, so only a replica on another node "
                    "(replicate_unique) or disk can restore them if this node is lost",
                    info["rank"], info["dp_rank"], info["dp_size"])
    return ctx.ckpt.save_if_needed(iteration, state, metrics=health)


def _refuse_gated(chunks: list[Any]) -> None:
    """Megatron keeps a gated MLP's two halves (SwiGLU's gate and up projections) side by side inside each
    tensor-parallel shard of ``linear_fc1``, so the shards are not contiguous slices of one global tensor:
    joining or splitting them as such would load wrong weights without any error. Refused up front."""
    from easyckpt.megatron.snapshot import unwrap

    for chunk in chunks:
        config = getattr(unwrap(chunk), "config", None)
        if getattr(config, "gated_linear_unit", False):
            raise NotImplementedError(
                "load_checkpoint(concat=True) does not support gated MLPs yet (gated_linear_unit=True, e.g. SwiGLU): "
                "each tensor-parallel shard of linear_fc1 holds its own part of both halves, so the shards cannot be "
                "resharded as contiguous slices. Resume with the tensor-parallel size of the saving run and without "
                "concat=True")


def _check_concat(state: dict[str, Any], where: Path) -> None:
    """What a resharded resume cannot change: the pipeline layout (layers would move between stages) and a
    distributed optimizer's shards (laid out by data-parallel rank in Megatron's own buffers)."""
    saved = (state.get(snapshot.META_KEY) or {}).get("parallel") or {}
    here = snapshot.parallel_info()
    changed = [k for k in ("tp_size", "dp_size", "pp_size", "vp_size", "ep_size") if k in saved and saved[k] != here[k]]
    refused = [k for k in changed if k in ("pp_size", "vp_size", "ep_size")]
    if refused:
        raise ValueError(f"load_checkpoint(concat=True): the checkpoint in {where} was saved with "
                         f"{', '.join(f'{k} {saved[k]}' for k in refused)}, this job has "
                         f"{', '.join(f'{k} {here[k]}' for k in refused)}: concat=True changes the tensor- and "
                         "data-parallel sizes only; keep the pipeline and expert-parallel sizes of the saving run")
    if changed and "optimizer_param_state" in state:
        raise NotImplementedError(
            f"load_checkpoint(concat=True): the checkpoint in {where} holds distributed-optimizer shards and the "
            f"layout changed ({', '.join(f'{k} {saved[k]} -> {here[k]}' for k in changed)}): they cannot be "
            "resharded yet; resume with the same layout, or with --no-load-optim")
    if changed and here["rank"] == 0:
        logger.info("easyckpt megatron: concat=True: resumed a checkpoint of %s on %s: tensor-parallel shards and "
                    "their optimizer moments were resharded; RNG states and other rank-private values come from the "
                    "saved rank of the same number (rank 0's for new ranks)",
                    {k: saved[k] for k in changed}, {k: here[k] for k in changed})


def _load_elsewhere(ctx: _Context, load_dir: Path, template: dict[str, Any],
                    concat: bool = False) -> tuple[dict[str, Any] | None, LoadInfo, bool]:
    """Nothing of this job's own: load ``load_dir`` (easyckpt iteration / save_dir, or Megatron legacy)."""
    if layout.ITERATION_RE.match(load_dir.name):
        result = ctx.ckpt.load(template, load_dir=load_dir, reshard=concat, announce=False)
        return result.state, LoadInfo(result.step or 0, result.source, result.path, result.seconds), False
    complete = layout.complete_iterations(load_dir) if load_dir.resolve() != ctx.save_dir else []
    bucket = is_url(load_dir)   # Megatron's own legacy files are local (torch.load): in a bucket only easyckpt's
    found = None if bucket else legacy.find(load_dir)
    if complete and found is None:
        result = ctx.ckpt.load(template, load_dir=complete[-1][1], reshard=concat, announce=False)
        return result.state, LoadInfo(result.step or 0, result.source, result.path, result.seconds), False
    if found is None:
        other = None if bucket else legacy.other_format(load_dir)
        if other is not None:
            raise LegacyCheckpointError(other)
        return None, LoadInfo(0, None), False
    problem, state, release, path = "", None, False, None
    try:
        state, release, path = legacy.read(load_dir, snapshot.parallel_info(), trust_pickle=ctx.trust_legacy_pickle)
    except (LegacyCheckpointError, OSError, RuntimeError, ValueError) as exc:
        problem = str(exc)
    if not all_ok(not problem):
        raise LegacyCheckpointError(
            problem or f"another rank could not read the Megatron checkpoint in {load_dir}; see its log")
    if load_dir.resolve() == ctx.save_dir:
        logger.warning("%s holds a native Megatron checkpoint and is also easyckpt's save_dir: easyckpt's "
                       "persists will replace its %s; use another --save to keep it intact", load_dir, legacy.TRACKER)
    return state, LoadInfo(found[0], "megatron-legacy", str(path)), release


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, concat: bool = False) -> tuple[int, float | int]:
    """Resume: returns (iteration, num_floating_point_operations_so_far), (0, 0) for a fresh start.

    Collective: every rank calls it. This job's memory, replicas and save_dir come first (all ranks agree
    on one iteration); then the load directory (``--load``, ``getattr(args, load_arg)``, or load_dir=).

    ``concat=True``: the checkpoint may come from another tensor-parallel or data-parallel size; its
    tensor-parallel shards and their optimizer moments are resharded from disk (``easyckpt.megatron.tp``).
    Without it such a checkpoint raises ``LayoutChangedError`` naming ``concat=True``.
    """
    ctx = _require()
    args = _args(ctx)
    load_dir = ctx.load_dir
    if ctx.megatron_args and args is not None:
        load_dir = as_path(getattr(args, load_arg)) if getattr(args, load_arg, None) else None
    elif load_arg != "load" and args is not None and snapshot.get_arg(args, load_arg):
        load_dir = as_path(snapshot.get_arg(args, load_arg))
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if concat:
        _refuse_gated(chunks)
    _guard(ctx, chunks, optimizer)
    template = snapshot.model_template(chunks)
    try:
        result = ctx.ckpt.load(template, reshard=concat, announce=False)
        state, release = result.state, False
        info = LoadInfo(result.step or 0, result.source, result.path, result.seconds)
        if result.step is None and load_dir is not None and load_dir.exists():
            state, info, release = _load_elsewhere(ctx, load_dir, template, concat)
    except LayoutChangedError as exc:
        if concat:
            raise
        here = snapshot.parallel_info()
        raise LayoutChangedError(
            f"the checkpoint was saved with another parallel layout than this job's (tensor-parallel {here['tp_size']}, "
            f"data-parallel {here['dp_size']}, {here['world_size']} ranks): {exc}. To resume it on this layout, call "
            "load_checkpoint(model, optimizer, opt_param_scheduler, concat=True); or restart with the layout that "
            "saved it") from None
    if concat and state is not None:
        _check_concat(state, ctx.save_dir)
    if ctx.skipper is not None:
        saved = (state or {}).get(snapshot.META_KEY, {}).get("data_skipper")
        ctx.skipper.load_state_dict(saved or {"consecutive": 0, "skipped_total": 0})
    if state is None:
        _started(ctx, optimizer, 0)
        ctx.last, ctx.flops = LoadInfo(0, None), 0
        if _rank() == 0:
            logger.info("easyckpt megatron: nothing to resume from (memory, %s%s): starting at iteration 0",
                        ctx.save_dir, f", {load_dir}" if load_dir else "")
        return 0, 0
    iteration, flops = snapshot.apply(state, chunks, optimizer, opt_param_scheduler, args=args, strict=strict,
                                      release=release)
    if (info.source == "megatron-legacy" and not release and snapshot.distributed_optimizers(optimizer)
            and not snapshot.get_arg(args, "no_load_optim", False) and not snapshot.get_arg(args, "finetune", False)):
        legacy.load_distributed_optimizer(optimizer, Path(info.path or ""))
    info.iteration = iteration
    _started(ctx, optimizer, iteration)
    ctx.last, ctx.flops = info, flops
    if _rank() == 0:
        # The one resume line (on stderr when logging is not configured), with Megatron's iteration and a legacy source.
        notice(logger, logging.INFO, "resumed at iteration %d from %s (%s) in %.3fs", iteration, info.source,
               info.path, info.seconds)
    barrier()
    return iteration, flops


def _guard(ctx: _Context, chunks: list[Any], optimizer: Any) -> None:
    """Wrap the optimizer for data skipping and the health metrics (once per optimizer)."""
    if ctx.skipper is None and not ctx.health:
        return
    if skipping.guard_of(optimizer) is not None:
        return
    if skipping.is_megatron_optimizer(optimizer):
        skipping.OptimizerGuard(optimizer, chunks, ctx.skipper, health=ctx.health,
                                due=ctx.ckpt.due, iteration=0)
    elif ctx.skipper is not None:
        raise NotImplementedError(
            f"use_skip_data_by_global_norm needs Megatron's optimizer (get_megatron_optimizer), whose step() computes "
            f"the global gradient norm; this is a {type(optimizer).__qualname__}. In a loop of your own, call "
            "easyckpt.DataSkipper.skip(step, grad_norm) before optimizer.step() instead")


def _started(ctx: _Context, optimizer: Any, iteration: int) -> None:
    ctx.iteration = iteration
    guard = skipping.guard_of(optimizer)
    if guard is not None:
        guard.iteration = iteration


def finalize_easyckpt() -> None:
    """The end of training: close the Checkpointer, which makes the newest snapshot durable (``final_persist``,
    bounded by ``close_timeout``) and raises ``easyckpt.PersistError`` when the disk refused it (the snapshot
    then stays in shared memory for a rerun). A process that ends without calling this persists its newest
    snapshot at exit as well, bounded by ``flush_timeout``, and only logs a failure."""
    global _ctx
    if _ctx is not None:
        ctx, _ctx = _ctx, None
        ctx.ckpt.close()
