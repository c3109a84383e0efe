"""``easyckpt convert`` and ``easyckpt ranks-needed``: offline tools over a saved iteration.

* ``convert --to megatron SRC DST``: Megatron's native legacy format (``easyckpt.megatron.legacy``).
* ``convert --to hf SRC OUT``: the model's full weights as one safetensors file (``dcp.consolidate_model``); of a
  peft model snapshotted by TrainerWrapper, what trains (its frozen base is not in the snapshot), and it says so.
* ``convert --to dcp SRC OUT``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter``) holding
  every tensor whole (the shards assembled by DCP's planning) and rank 0's other values, in the nesting the
  state had: ``dcp.load`` reads it into any sharding.
* ``convert --from dcp SRC OUT``: a DCP directory into an easyckpt save_dir ``OUT`` as one rank's iteration
  (written by a node agent, like any save), which ``Checkpointer.load(state_dict)`` reads on any world size.
  DCP stores non-tensor values pickled and ``dcp.load`` unpickles them: convert only checkpoints you trust.
* ``ranks-needed SRC --world-size N``: for each rank of an N-rank FSDP2-style job (every tensor split on
  dim 0), the saved files it reads (``dcp.ranks_needed``).

torch is imported inside the commands: ``easyckpt --help`` must answer at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from easyckpt_wire import layout
from easyckpt_wire.storage import UnsupportedLocation, as_path, is_url, open_storage

logger = logging.getLogger(__name__)


def full_state(src: Path, index: Any = None) -> Any:
    """``src`` (a save_dir's newest iteration, or one iteration_N) read whole in this process: rank 0's
    structure with each sharded tensor whole (the shards of every rank assembled by DCP's planning), the
    state as an unsharded run would have saved it. ``index``: its ``easyckpt.dcp.checkpoint_index``, when the
    caller has it already."""
    import torch

    from easyckpt import dcp as edcp
    from easyckpt import storage
    from easyckpt.snapshot.state import torch_dtype, unflatten

    iteration_dir = edcp.iteration_of(src)
    index = index if index is not None else edcp.checkpoint_index(iteration_dir)
    full = {key: torch.empty(saved.global_shape, dtype=torch_dtype(saved.dtype)) for key, saved in index.tensors.items()}
    edcp.load_into(full, iteration_dir, no_dist=True)
    entry = storage.rank_entry(iteration_dir, 0, None)
    keys = index.keys[0]
    values: list[Any] = [None] * len(entry.records)
    rest = []   # rank 0's values DCP did not just load whole (numpy arrays, its own private tensors): read once
    for record in entry.records:
        key = keys.get(record.name)
        if record.kind != "numpy" and key in full and (record.shard is not None
                                                       or tuple(full[key].shape) == tuple(record.shape)):
            values[record.index] = full[key]
        else:
            rest.append(record)
    for record, tensor in storage.read_tensors(dataclasses.replace(entry, records=rest)):
        values[record.index] = tensor.numpy() if record.kind == "numpy" else tensor
    return unflatten(entry.skeleton, values)


def to_dcp(src: Path, out: Path) -> tuple[int, int]:
    """Write ``src`` (a save_dir's newest iteration, or one iteration_N) as a DCP checkpoint in ``out``;
    returns (step, number of tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from easyckpt import dcp as edcp

    index = edcp.checkpoint_index(edcp.iteration_of(src))
    edcp.refuse_deepspeed(index.path, index.values, "a DCP checkpoint of whole tensors")
    state = full_state(src, index)
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=FileSystemWriter(str(out)), no_dist=True)
    return index.step, len(index.tensors)


def read_dcp(src: Path) -> dict[str, Any]:
    """A DCP checkpoint directory read whole in this process, in the nesting it was saved with."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(src))
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, info in metadata.state_dict_metadata.items():
        flat[key] = (torch.empty(info.size, dtype=info.properties.dtype) if isinstance(info, TensorStorageMetadata)
                     else None)   # a value DCP unpickles in place
    dcp.load(flat, storage_reader=reader, no_dist=True)
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
    return unflatten_state_dict(flat, mappings) if mappings else flat


def _as_shards(state: Any) -> Any:
    """Every tensor of ``state`` (not 0-dim) as a DTensor replicated on a one-rank mesh without process groups:
    saved with sharding metadata, so that ``Checkpointer.load`` reshards it onto any world size."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = DeviceMesh("cpu", torch.arange(1), _init_backend=False, _rank=0)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        if isinstance(value, dict):
            for key in value:
                value[key] = walk(value[key])
        elif isinstance(value, list):
            value[:] = [walk(v) for v in value]
        return value

    return walk(state)


def from_dcp(src: Path, out: Path, step: int, timeout: float = 120.0) -> Path:
    """Save the DCP checkpoint ``src`` into the easyckpt save_dir ``out`` as iteration ``step`` of one rank,
    through a Checkpointer and its node agent (the writer of every easyckpt save); returns the iteration."""
    from easyckpt.checkpointer import Checkpointer

    state = _as_shards(read_dcp(src))
    ckpt = Checkpointer(out, 1, 1, 1, close_timeout=timeout)
    try:
        if not ckpt.save(step, state, persist=True):
            raise RuntimeError(f"the snapshot of step {step} could not start (no free slot)")
    finally:
        ckpt.close()
    iteration = out / layout.iteration_dirname(step)
    if not open_storage(out).exists(f"{iteration.name}/{layout.METADATA}"):
        raise layout.CheckpointFormatError(f"{iteration} was not written; see the agent's log")
    return iteration


def _one_process() -> None:
    """These tools read checkpoints in one process by design: DCP's "torch.distributed is disabled ...
    assuming the intent is to load in a single process" UserWarning says what is meant, so it is not shown."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def zero3_model(iteration_dir: Path, index: Any) -> dict[str, Any] | None:
    """The whole weights of a TrainerWrapper snapshot under DeepSpeed ZeRO-3 (None for any other iteration): each rank
    holds a flat, padded slice of every partitioned parameter under the parameter's name, which DCP would take for one
    replicated tensor (rank 0's slice); the slices of every rank are joined and cut to shape (``zero.consolidate``)."""
    from easyckpt import dcp as edcp

    if not any(key.startswith(edcp.DEEPSPEED_PARTITIONED) for key in index.values):
        return None
    from easyckpt.transformers import zero  # transformers only for such an iteration
    from easyckpt.transformers.export import read_rank_state

    states = {rank: read_rank_state(iteration_dir, rank, index.world_size, only=("model",))
              for rank in range(index.world_size)}
    return zero.consolidate({rank: state["model"] for rank, state in states.items()}, states[0]["deepspeed"])


def cmd_convert(args: argparse.Namespace) -> int:
    """easyckpt -> Megatron legacy, HF safetensors or DCP; DCP -> easyckpt."""
    _one_process()
    if (args.to is None) == (args.from_ is None):
        print("convert: give either --to megatron|hf|dcp or --from dcp", file=sys.stderr)
        return 2
    try:
        src, dst = as_path(args.src), as_path(args.dst)
    except UnsupportedLocation as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 2
    # What is read or written through easyckpt's storage may be an s3:// URL: the easyckpt side of either
    # direction. The other side is a local directory: DCP's FileSystemReader/Writer, safetensors and Megatron's
    # torch.save write files (convert locally, then upload with the object store's own tool).
    foreign, side = (src, "source") if args.from_ == "dcp" else (dst, "destination")
    if is_url(foreign):
        what = f"the DCP {side}" if args.from_ == "dcp" or args.to == "dcp" else f"the {args.to} {side}"
        print(f"convert: {what} {foreign} must be a local directory (an s3:// URL is read and written only as an "
              f"easyckpt save_dir): convert into a local directory, then upload it with your object store's tool "
              f"(aws s3 cp --recursive)", file=sys.stderr)
        return 2
    if not src.is_dir():
        print(f"{src} is a file, not a directory" if src.exists() else f"{src}: no such directory", file=sys.stderr)
        return 2
    try:
        if args.from_ == "dcp":
            iteration = from_dcp(src, dst, args.step)
            print(f"wrote the DCP checkpoint {src} as {iteration}; load it with Checkpointer.load(state_dict) "
                  f"(load_dir={iteration}) on any number of ranks")
            return 0
        if args.to == "dcp":
            step, count = to_dcp(src, dst)
            print(f"wrote step {step} of {src} ({count} tensors, whole) as a torch.distributed.checkpoint directory "
                  f"{dst}; load it with dcp.load(state_dict, checkpoint_id='{dst}')")
            return 0
        if args.to == "hf":
            from easyckpt.dcp import consolidate_model

            out = dst / "model.safetensors" if dst.is_dir() or not dst.suffix else dst
            done = consolidate_model(src, out, assemble=zero3_model)
            wrappers = {"module.": "DDP's 'module.'", "_orig_mod.": "torch.compile's '_orig_mod.'"}
            unwrapped = (f"; named as the unwrapped model: {' and '.join(wrappers[part] for part in done.removed)} "
                         "taken out" if done.removed else "")
            if done.frozen_left_out:
                print(f"wrote what trains of the peft model at step {done.step} ({len(done.shapes)} tensors: the "
                      f"adapter and the base's buffers{unwrapped}) to {out}; its {done.frozen_left_out} frozen base "
                      "parameters are not in easyckpt's snapshots of a peft model: load the file with "
                      "safetensors.torch.load_file into load_state_dict(strict=False) of the peft model built on its "
                      "base (get_peft_model), or take the adapter's own files from the Trainer's checkpoint-N")
            else:
                print(f"wrote the full model weights of step {done.step} ({len(done.shapes)} tensors{unwrapped}) to "
                      f"{out}; load them with safetensors.torch.load_file into an unsharded model's load_state_dict")
            return 0
        from easyckpt.megatron.legacy import convert_to_megatron

        step, files = convert_to_megatron(src, dst, no_optim=args.no_optim)
    except (layout.CheckpointFormatError, OSError, RuntimeError, ValueError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    print(f"wrote iteration {step} of {src} as a Megatron checkpoint in {dst} ({len(files)} file(s)); "
          f"load it with Megatron's --load {dst} --ckpt-format torch")
    return 0


def cmd_ranks_needed(args: argparse.Namespace) -> int:
    from easyckpt.dcp import checkpoint_index, iteration_of, ranks_needed, refuse_deepspeed

    _one_process()

    try:
        index = checkpoint_index(iteration_of(as_path(args.src)))
        refuse_deepspeed(index.path, index.values, "a plan of dim-0 shards")
        index, plans = ranks_needed(as_path(args.src), args.world_size)
    except (layout.CheckpointFormatError, OSError, ValueError) as exc:
        print(f"ranks-needed: {exc}", file=sys.stderr)
        return 1
    print(f"{index.path} (step {index.step}, saved by {index.world_size} ranks) read by {args.world_size} ranks "
          "sharding every tensor on dim 0:")
    for rank, files in plans.items():
        print(f"rank {rank}: {' '.join(sorted(files))}")
        if args.verbose:
            for name in sorted(files):
                print(f"    {name}: {', '.join(files[name])}")
    return 0


def add_parsers(sub: Any, formatter_class: Any = argparse.HelpFormatter,
                epilogs: tuple[str | None, str | None] = (None, None)) -> None:
    """The two commands' parsers, with the CLI's help formatter and each one's epilog (convert, ranks-needed)."""
    convert = sub.add_parser("convert", help="write a checkpoint in another framework's format, or read a DCP one",
                             description="Exactly one of --to (from an easyckpt save_dir or iteration_N to Megatron, "
                                         "HF safetensors or DCP) or --from dcp (a DCP directory into an easyckpt "
                                         "save_dir). Exit 0 when written, 1 on an unreadable source, 2 on bad "
                                         "arguments.", formatter_class=formatter_class, epilog=epilogs[0])
    convert.add_argument("--to", choices=["megatron", "hf", "dcp"],
                         help="target format (hf: the model's full weights as one safetensors file; dcp: a "
                         "torch.distributed.checkpoint directory)")
    convert.add_argument("--from", dest="from_", choices=["dcp"],
                         help="read a torch.distributed.checkpoint directory SRC into the easyckpt save_dir DST")
    convert.add_argument("src", help="an easyckpt save_dir (its newest complete iteration) or one iteration_N "
                         "directory; with --from dcp a DCP checkpoint directory")
    convert.add_argument("dst", help="the Megatron checkpoint directory to write (its --load); for hf a .safetensors "
                         "file, or a directory to hold model.safetensors; for dcp the DCP directory; with --from "
                         "dcp the easyckpt save_dir")
    convert.add_argument("--no-optim", action="store_true",
                         help="leave optimizer and scheduler out (resume Megatron with --no-load-optim)")
    convert.add_argument("--step", type=int, default=0, help="--from dcp: the step of the iteration written")
    convert.set_defaults(func=cmd_convert)
    needed = sub.add_parser("ranks-needed", help="for each rank of another world size, the saved files it reads",
                            description="For each rank of a --world-size job whose ranks split every tensor on dim 0 "
                                        "(FSDP2), the saved files it reads, planned by DCP's own load planner. Exit 0, "
                                        "or 1 on an unreadable source.",
                            formatter_class=formatter_class, epilog=epilogs[1])
    needed.add_argument("src", help="an easyckpt save_dir (its newest complete iteration) or one iteration_N directory")
    needed.add_argument("--world-size", type=int, required=True, help="ranks of the job that will load it, each "
                        "sharding every tensor on dim 0 (FSDP2's fully_shard)")
    needed.add_argument("--verbose", "-v", action="store_true", help="also the tensors read from each file")
    needed.set_defaults(func=cmd_ranks_needed)
