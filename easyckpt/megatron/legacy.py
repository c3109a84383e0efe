"""Megatron's native "legacy" checkpoint format (``--ckpt-format torch``), both ways.

Layout, as ``megatron.training.checkpointing`` writes and reads it::

    save_dir/
      latest_checkpointed_iteration.txt            # "N" or "release"
      iter_000000N/                                # or release/
        mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt  # tensor rank TT, pipeline rank PPP (when PP > 1),
                                                   # expert rank EEE (when EP > 1); written by DP rank 0
        mp_rank_TT.../distrib_optim.pt             # distributed optimizer only (gathered "dp_zero" format)

Trust boundary: these files are pickles written by Megatron itself (``torch.save`` of a dict with an
``argparse.Namespace``). They are read with ``torch.load(weights_only=True)``, which rebuilds only tensors,
containers, numpy arrays and the classes megatron-core registers as safe (Namespace, its enums); a file
that needs anything else is refused with an error, unless the caller opts in with
``trust_legacy_pickle=True`` (full unpickling: only for files from a Megatron run you trust). Nothing
easyckpt writes to its own layout is ever a pickle; ``convert_to_megatron`` writes pickles because that
is the format Megatron's loader reads.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import types
from pathlib import Path
from typing import Any

import numpy
import torch

from easyckpt import storage
from easyckpt.megatron.snapshot import META_KEY, model_keys, plain_args
from easyckpt.snapshot.state import unflatten
from easyckpt_wire import layout
from easyckpt_wire.layout import CheckpointFormatError
from easyckpt_wire.storage import posix

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
DIST_OPTIM_FILE = "distrib_optim.pt"
_KEPT = ("checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state",
         "num_floating_point_operations_so_far")


class LegacyCheckpointError(RuntimeError):
    """A native Megatron checkpoint that cannot be read or written; the message says why and what to do."""


def find(load_dir: Path) -> tuple[int, bool, Path] | None:
    """(iteration, release, directory) when ``load_dir`` holds a native legacy Megatron checkpoint."""
    try:
        text = (load_dir / TRACKER).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if text == "release":
        iteration, release, directory = 0, True, load_dir / "release"
    elif text.isdigit():
        iteration, release, directory = int(text), False, load_dir / f"iter_{int(text):07d}"
    else:
        return None
    if directory.is_dir() and any(p.name.startswith("mp_rank_") for p in directory.iterdir()):
        return iteration, release, directory
    return None


def other_format(load_dir: Path) -> str | None:
    """A message when ``load_dir`` holds a Megatron checkpoint in a format other than legacy (torch_dist,
    torch_dcp, ...): loading nothing from it would silently restart training from scratch."""
    try:
        text = (load_dir / TRACKER).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    directory = load_dir / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else "")
    if not text or directory == load_dir or not directory.is_dir() or find(load_dir) is not None:
        return None
    return (f"{directory} is a Megatron checkpoint in another format than legacy (--ckpt-format torch), e.g. "
            "torch_dist: easyckpt reads only the legacy format. Save it once with Megatron's --ckpt-format torch "
            "(or load it with Megatron's own load_checkpoint before initialize_easyckpt's first save)")


def rank_dir_name(info: dict[str, int]) -> str:
    name = f"mp_rank_{info['tp_rank']:02d}"
    if info["pp_size"] > 1:
        name += f"_{info['pp_rank']:03d}"
    if info["ep_size"] > 1:
        name += f"_{info['ep_rank']:03d}"
    return name


def _safe_globals() -> list[Any]:
    found: list[Any] = [argparse.Namespace, types.SimpleNamespace, Path, type(Path()), numpy.ndarray, numpy.dtype]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            found.append(__import__(module, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    found += [getattr(numpy.dtypes, name) for name in ("UInt32DType", "Float64DType", "Int64DType")
              if hasattr(numpy, "dtypes") and hasattr(numpy.dtypes, name)]
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
        found += list(SAFE_GLOBALS)
    except ImportError:
        pass
    return found


def read_file(path: Path, *, trust_pickle: bool = False) -> dict[str, Any]:
    """One ``model_optim_rng.pt``, with ``args`` turned into plain values."""
    try:
        if trust_pickle:
            state = torch.load(path, map_location="cpu", weights_only=False)
        else:
            with torch.serialization.safe_globals(_safe_globals()):
                state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LegacyCheckpointError(f"{path} is missing: this rank's shard of the Megatron checkpoint is not "
                                    "there (was it saved with the same tensor/pipeline parallel sizes?)") from None
    except pickle.UnpicklingError as exc:
        raise LegacyCheckpointError(
            f"{path}: torch.load(weights_only=True) refused it ({str(exc).splitlines()[0]}). Legacy Megatron "
            "files are pickles; if this file was written by a Megatron run you trust, pass "
            "trust_legacy_pickle=True to initialize_easyckpt to unpickle it fully") from None
    if not isinstance(state, dict):
        raise LegacyCheckpointError(f"{path} holds a {type(state).__name__}, not Megatron's checkpoint dict")
    if "args" in state:
        state["args"] = plain_args(state["args"])
    return state


def read(load_dir: Path, info: dict[str, int], *, trust_pickle: bool = False) -> tuple[dict[str, Any], bool, Path]:
    """This rank's state from the native checkpoint in ``load_dir``: (state, release, file)."""
    found = find(load_dir)
    if found is None:
        raise LegacyCheckpointError(f"{load_dir} holds no native Megatron checkpoint ({TRACKER} and its iter_ directory)")
    iteration, release, directory = found
    path = directory / rank_dir_name(info) / FILE
    state = read_file(path, trust_pickle=trust_pickle)
    if not release and state.get("iteration", iteration) != iteration:
        raise LegacyCheckpointError(f"{path} says iteration {state.get('iteration')}, {load_dir / TRACKER} says {iteration}")
    return state, release, path



def load_distributed_optimizer(optimizer: Any, rank_file: Path) -> bool:
    """Megatron's distrib_optim.pt beside ``rank_file`` into ``optimizer`` (as Megatron's loader does it:
    ``optimizer.load_parameter_state``, which reads the file with megatron-core's own code)."""
    path = rank_file.parent / DIST_OPTIM_FILE
    loader = getattr(optimizer, "load_parameter_state", None)
    if not path.is_file() or loader is None:
        return False
    loader(str(path), update_legacy_format=False)
    return True

# easyckpt -> Megatron ---------------------------------------------------------------------------------
def _iteration_dir(src: Path) -> Path:
    if layout.ITERATION_RE.match(src.name):
        layout.read_metadata(src)  # complete, or CheckpointFormatError
        return src
    complete = layout.complete_iterations(src)
    if not complete:
        raise LegacyCheckpointError(f"{src} has no complete easyckpt iteration to convert")
    return complete[-1][1]


def _rank_state(iteration_dir: Path, rank: int, world_size: int, *, tensors: bool) -> dict[str, Any]:
    entry = storage.rank_entry(iteration_dir, rank, world_size)
    values: list[Any] = [None] * len(entry.records)
    if tensors:
        for record, tensor in storage.read_tensors(entry):
            values[record.index] = tensor.numpy() if record.kind == "numpy" else tensor
    state = unflatten(entry.skeleton, values)
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{iteration_dir}: rank {rank}'s state is a {type(state).__name__}, not a dict")
    return state


def convert_to_megatron(src: Path, dst: Path, *, no_optim: bool = False) -> tuple[int, list[Path]]:
    """Write the newest complete iteration of ``src`` (or ``src`` itself, an ``iteration_N`` directory)
    as a native legacy Megatron checkpoint under ``dst``; returns (iteration, files written)."""
    iteration_dir = _iteration_dir(src)
    meta = layout.read_metadata(iteration_dir)
    world, step = meta["world_size"], meta["step"]
    plain = {rank: _rank_state(iteration_dir, rank, world, tensors=False) for rank in range(world)}
    chosen: dict[str, int] = {}
    for rank, state in plain.items():
        extra = state.get(META_KEY) if isinstance(state, dict) else None
        if not extra:
            raise LegacyCheckpointError(f"{iteration_dir}: rank {rank}'s state was not saved by easyckpt.megatron "
                                        f"(no {META_KEY!r} entry): nothing to convert to Megatron's format")
        if extra["distributed_optimizer"] and not no_optim:
            raise LegacyCheckpointError(
                f"{iteration_dir}: rank {rank} used Megatron's distributed optimizer, whose legacy format "
                "(distrib_optim.pt, gathered over data-parallel ranks) this converter does not write; "
                "convert with --no-optim and resume Megatron with --no-load-optim, or keep resuming with easyckpt")
        info = extra["parallel"]
        if info["dp_rank"] == 0:
            chosen.setdefault(rank_dir_name(info), rank)
    target = dst / f"iter_{step:07d}"
    if target.exists():
        raise LegacyCheckpointError(f"{target} exists already: choose another destination or remove it")
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f".tmp-iter_{step:07d}-{os.getpid()}"
    written = []
    for name, rank in sorted(chosen.items()):
        state = _rank_state(iteration_dir, rank, world, tensors=True)
        extra = state[META_KEY]
        out: dict[str, Any] = {"args": argparse.Namespace(**state.get("args", {}))}
        out.update({key: state[key] for key in model_keys([None] * extra["chunks"]) if key in state})
        out.update({key: state[key] for key in _KEPT if key in state})
        if no_optim:
            out.pop("optimizer", None)
            out.pop("opt_param_scheduler", None)
        if state.get("args", {}).get("data_parallel_random_init") and "rng_state" in out:
            peers = sorted((p for p, s in plain.items() if rank_dir_name(s[META_KEY]["parallel"]) == name),
                           key=lambda p: plain[p][META_KEY]["parallel"]["dp_rank"])
            out["rng_state"] = [_rank_state(iteration_dir, p, world, tensors=True)["rng_state"][0] for p in peers]
        if "rng_state" in out and "cuda_rng_state" not in out["rng_state"][0]:
            logger.warning("%s: rank %d was saved without CUDA, so its rng_state has no cuda_rng_state: "
                           "Megatron's loader needs --no-load-rng for it", iteration_dir, rank)
        path = tmp / name / FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            torch.save(out, handle)
        posix.fsync_file(path)
        written.append(target / name / FILE)
    layout.replace_dir(tmp, target)   # no aside name: a target that exists after all is refused
    layout.write_file_atomic(dst / TRACKER, str(step))
    return step, written
