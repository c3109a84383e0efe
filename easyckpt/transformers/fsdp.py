"""FSDP2 through Accelerate (``TrainingArguments(fsdp=..., fsdp_config={"version": 2})``): the state a
TrainerWrapper snapshots and the layout its resume and its ``checkpoint-N`` folders use.

The snapshot is what Accelerate itself saves (``save_fsdp_model``/``save_fsdp_optimizer`` with the
``SHARDED_STATE_DICT`` that FSDP2 uses by default): ``get_model_state_dict`` and ``get_optimizer_state_dict``,
DTensors keyed by parameter name, which the Checkpointer stores as this rank's local shards. Each
snapshot also records, for every DTensor, its global shape, placements and mesh shape (``STATE_KEY``):
a resume loads plain local shards before the Trainer has sharded its model, and needs them to rebuild
the DTensors.

The Trainer's own FSDP resume (Accelerate's ``load_fsdp_model`` and ``load_fsdp_optimizer``) reads, with
``SHARDED_STATE_DICT`` (FSDP2's default in Accelerate), ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, two
``torch.distributed.checkpoint`` directories; with ``FULL_STATE_DICT`` (the Trainer's default) rank 0 reads
the whole ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` and broadcasts them. Written here:

* for a resume (``stage``): sharded whatever the Trainer saves, by every rank, each its own shards, one
  ``dcp.save`` (so into one directory that every rank sees: the node's shm directory on one node, the
  save_dir's file system across nodes), and the Trainer reads it as sharded (``ShardedResume``); a state
  saved on another number of ranks comes back whole from ``Checkpointer.load`` and rank 0 writes it;
* for a save from the live state (``write_live``): in the Trainer's layout; a full one gathered on rank 0;
* for an exported ``checkpoint-N`` (``write_full``): by the saving process alone, every tensor whole,
  assembled from all ranks' files of the persisted iteration (``easyckpt.dcp``). DCP's load planning reads
  any sharding from the directories, so a plain Trainer resumes from them on any number of ranks.
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from transformers import Trainer

from easyckpt.collectives import all_ok
from easyckpt.snapshot import sharding
from easyckpt.transformers.adapters import fsdp_trainer_state

logger = logging.getLogger(__name__)

STATE_KEY = "fsdp"
SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"
MODEL_DIR = "pytorch_model_fsdp_0"    # accelerate.utils.constants FSDP_MODEL_NAME + "_0"
OPTIM_DIR = "optimizer_0"             # OPTIMIZER_NAME + "_0"
MODEL_FILE = "pytorch_model_fsdp.bin"  # FULL_STATE_DICT: rank 0 loads it and broadcasts
OPTIM_FILE = "optimizer.bin"
DCP_METADATA = ".metadata"


def enabled(trainer: Trainer) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False))


def check(trainer: Trainer) -> None:
    """Refuse the FSDP setups the wrapper does not write: FSDP1 and FSDP2 with a full state dict."""
    plugin = trainer.accelerator.state.fsdp_plugin
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise NotImplementedError(
            f"TrainerWrapper supports FSDP2 (fsdp_config={{'version': 2}}); this Trainer uses FSDP{version}, whose "
            "FlatParameter state the wrapper does not snapshot. Set fsdp_config={'version': 2} (the same "
            "TrainingArguments(fsdp=...) otherwise), or drop the wrapper")
    kind = state_dict_kind(trainer)
    if kind not in (SHARDED, FULL):
        raise NotImplementedError(f"TrainerWrapper writes FSDP2 checkpoints as {SHARDED} or {FULL}; this Trainer asks "
                                  f"for {kind}: set fsdp_config={{'state_dict_type': '{SHARDED}'}}")


def state_dict_kind(trainer: Trainer) -> str:
    """The FSDP state dict type the Trainer's own saves and resume use (what the layouts here follow)."""
    kind = trainer.accelerator.state.fsdp_plugin.state_dict_type
    return str(getattr(kind, "name", kind))


def _layouts(tree: Any, path: tuple[Any, ...], world_size: int, found: list[Any]) -> None:
    if sharding.is_dtensor(tree):
        spec = sharding.shard_spec(tree)
        size = math.prod(spec.mesh_shape)
        if size != world_size:
            raise NotImplementedError(
                f"{'.'.join(map(str, path))}: a DTensor on a mesh of {spec.mesh_shape} ({size} ranks) in a job of "
                f"{world_size}: TrainerWrapper supports FSDP2 over every rank of the job (Accelerate's default "
                "mesh), not a parallelism_config that shards over part of it")
        found.append([list(path), list(spec.global_shape), list(spec.placements), list(spec.mesh_shape)])
    elif isinstance(tree, dict):
        for key, value in tree.items():
            _layouts(value, path + (key,), world_size, found)


def capture(trainer: Trainer, leave_out: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """This rank's model and optimizer state as Accelerate saves them (DTensors, by reference), and the
    layout of each DTensor (``STATE_KEY``); the model's parameters named in ``leave_out`` (a peft model's frozen
    base) are not taken."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # No cpu_offload (Accelerate's sharded default offloads): the Checkpointer copies off the device itself,
    # overlapped with compute.
    options = StateDictOptions()
    module, optimizer = trainer.model, trainer.optimizer
    assert module is not None and optimizer is not None   # capture() checks the optimizer exists
    model = {name: value for name, value in get_model_state_dict(module, options=options).items()
             if name not in leave_out}
    optim = get_optimizer_state_dict(module, optimizer, options=options)
    found: list[Any] = []
    _layouts({"model": model, "optim": optim}, (), trainer.args.world_size, found)
    return model, optim, {"version": 2, "dtensors": found}


@functools.lru_cache(maxsize=8)
def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape)


def _placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    if text == "R":
        return Replicate()
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    raise ValueError(f"placement {text!r} cannot be rebuilt (only Shard and Replicate are saved)")


def rebuild(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of a loaded snapshot (plain local shards) with each DTensor of the
    saved run rebuilt from its shard and recorded layout, on a CPU mesh of the job's ranks (what DCP
    needs to place the shard in the global tensor)."""
    from torch.distributed.tensor import DTensor

    tree = {"model": state["model"], "optim": state["optim"]}
    for path, global_shape, placements, mesh_shape in state[STATE_KEY]["dtensors"]:
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        local = parent[path[-1]]
        shape = torch.Size(global_shape)
        parent[path[-1]] = DTensor.from_local(local, _mesh(tuple(mesh_shape)), [_placement(p) for p in placements],
                                              run_check=False, shape=shape,
                                              stride=torch.empty(shape, device="meta").stride())
    return tree


def _gathered(tree: Any) -> Any:
    """``tree`` with every DTensor whole (a collective per DTensor, in the tree's order, which every rank shares)."""
    if sharding.is_dtensor(tree):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {key: _gathered(value) for key, value in tree.items()}
    return tree


def saved_world(state: dict[str, Any]) -> int | None:
    """The number of ranks a snapshot's DTensors were sharded over (None: it holds none)."""
    for _path, _shape, _placements, mesh_shape in state[STATE_KEY]["dtensors"]:
        return math.prod(mesh_shape)
    return None


def stage(directory: Path, state: dict[str, Any], world_size: int, rank: int, model: Any) -> None:
    """Write a loaded snapshot into the Trainer's sharded FSDP resume layout under ``directory``, which every
    rank must see. Collective: every rank calls it. Saved on as many ranks, each rank holds its own shards and
    writes them (one DCP save). Saved on another number, ``Checkpointer.load`` resharded it and each rank holds
    every tensor whole (a load without a template has no mesh to shard onto): rank 0 writes them, and DCP's
    load planning in the Trainer's resume takes each rank's part. The Trainer reads the layout as sharded
    whatever its own saves use (``ShardedResume``). ``model``: the unwrapped model, whose state goes in as the
    Trainer's own save holds it (``adapters.fsdp_trainer_state``)."""
    saved = saved_world(state)
    if saved is None or saved == world_size:
        tree = rebuild(state)
        save_dirs(directory, model, tree["model"], tree["optim"])
        return
    logger.info("rank %d: the state was saved by %d FSDP ranks and resharded whole for %d: rank 0 stages it",
                rank, saved, world_size)
    failure: BaseException | None = None
    if rank == 0:
        try:
            save_dirs(directory, model, state["model"], state["optim"], no_dist=True)
        except BaseException as exc:   # raised below, after every rank heard of it
            failure = exc
    if not all_ok(failure is None):
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not stage the resharded FSDP state in {directory}; see its log")


class ShardedResume:
    """Let the Trainer's resume read the sharded layout ``stage`` wrote while its saves keep the state dict
    type the user chose (the Trainer's default is FULL_STATE_DICT, whose resume reads a whole state on
    rank 0 and broadcasts it). ``undo()`` puts the plugin back; it runs once the Trainer has loaded (at
    ``on_train_begin``) and again, harmlessly, when ``train()`` ends."""

    def __init__(self, trainer: Trainer) -> None:
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

        self.plugin = trainer.accelerator.state.fsdp_plugin
        self.saved: tuple[Any, Any, Any] | None = (self.plugin.state_dict_type, self.plugin.state_dict_config,
                                                   self.plugin.optim_state_dict_config)
        if state_dict_kind(trainer) != SHARDED:
            self.plugin.state_dict_type = StateDictType.SHARDED_STATE_DICT
            self.plugin.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
            self.plugin.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)

    def undo(self) -> None:
        if self.saved is not None:
            self.plugin.state_dict_type, self.plugin.state_dict_config, self.plugin.optim_state_dict_config = self.saved
            self.saved = None


def write_live(directory: Path, tree: dict[str, Any], kind: str, rank: int, model: Any) -> None:
    """``{"model": ..., "optim": ...}`` of DTensors in the Trainer's FSDP layout ``kind``. Collective."""
    if kind == SHARDED:
        save_dirs(directory, model, tree["model"], tree["optim"])
        return
    whole = _gathered(tree)
    if rank == 0:
        save_files(directory, model, whole["model"], whole["optim"])


def save_dirs(directory: Path, module: Any, model: dict[str, Any], optim: dict[str, Any], *,
              no_dist: bool = False) -> None:
    """SHARDED_STATE_DICT: ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` under ``directory``, with the keys
    Accelerate loads; ``model`` (the state of the unwrapped ``module``) as the Trainer's own save holds it
    (``adapters.fsdp_trainer_state``: of a peft model the adapter only)."""
    model = fsdp_trainer_state(module, model, full=False)
    dcp.save({"model": model}, storage_writer=FileSystemWriter(str(directory / MODEL_DIR)), no_dist=no_dist)
    dcp.save({"optimizer": optim}, storage_writer=FileSystemWriter(str(directory / OPTIM_DIR)), no_dist=no_dist)


def save_files(directory: Path, module: Any, model: dict[str, Any], optim: dict[str, Any]) -> None:
    """FULL_STATE_DICT: whole model and optimizer states, as Accelerate's rank 0 saves them (``module`` as for
    ``save_dirs``)."""
    torch.save(fsdp_trainer_state(module, model, full=True), directory / MODEL_FILE)
    torch.save(optim, directory / OPTIM_FILE)


def write_full(directory: Path, iteration_dir: Path, kind: str, model: Any) -> None:
    """The FSDP layout ``kind`` of a persisted iteration, every tensor whole (rank 0's structure), written
    by this process alone; ``model`` as for ``stage``."""
    from easyckpt.tools.convert import full_state

    state = full_state(iteration_dir)
    if kind == SHARDED:
        save_dirs(directory, model, state["model"], state["optim"], no_dist=True)
    else:
        save_files(directory, model, state["model"], state["optim"])


def has_layout(path: Path) -> tuple[bool, bool]:
    """Whether the checkpoint folder ``path`` holds an FSDP model and optimizer state (a DCP directory has its
    metadata, which its writer puts last)."""
    return ((path / MODEL_DIR / DCP_METADATA).is_file() or (path / MODEL_FILE).is_file(),
            (path / OPTIM_DIR / DCP_METADATA).is_file() or (path / OPTIM_FILE).is_file())
