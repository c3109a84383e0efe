"""The caller's template: what a loaded step must fit, and how its tensors are filled.

Every tier reads a saved tensor into the template the same way, so the checks and the placement live here
once: :func:`check_template` refuses a state that does not fit (shapes, dtypes, a sharding that differs) before
any byte is copied, :func:`place` copies a tensor into the caller's tensor of the same name (or keeps a copy
that outlives the read), and :func:`dcp_targets` says what ``torch.distributed.checkpoint`` fills when a step is
resharded (from disk or from another world's memory).

A saved tensor is anything with ``name``, ``kind``, ``dtype``, ``shape`` and ``shard``: a slot's
``TensorEntry`` and an iteration's ``storage.TensorRecord`` both are, so neither is copied field by field.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from easyckpt.recovery.results import LayoutChangedError, StateMismatchError
from easyckpt.snapshot import sharding
from easyckpt.snapshot.state import flatten_template, torch_dtype
from easyckpt_wire.records import ShardSpec


class SavedRecord(Protocol):
    """One saved tensor as the template checks see it."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def shard(self) -> ShardSpec | None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One tensor of the caller's template: what is copied into (a DTensor's local shard) and what the loaded
    state hands back (the DTensor itself, else the same tensor)."""

    into: Any
    value: Any
    shard: ShardSpec | None = None


Template = Mapping[str, Target]


def template_targets(template: Any) -> dict[str, Target]:
    """The caller's tensors by easyckpt name (the names ``flatten`` gives the saved state)."""
    if template is None:
        return {}
    refs, values, wrappers = flatten_template(template)
    return {ref.name: Target(value, wrappers.get(i, value), ref.shard) for i, (ref, value) in enumerate(zip(refs, values))}


def left_plain(template: Any, state: Any) -> list[str]:
    """The tensors of a loaded ``state`` that the caller's ``template`` had no place for, when the template holds
    DTensors: a saved DTensor without a target comes back as this rank's local shard, a plain tensor, and an
    optimizer given it fails at its next step ("got mixed torch.Tensor and DTensor"). The usual cause is an
    optimizer's ``state_dict()`` taken before its first step (empty until then). Names as :func:`template_targets`
    gives them; [] when the template has no DTensor (plain tensors are handed back as saved, as they always were)."""
    targets = template_targets(template)
    if not isinstance(template, Mapping) or not any(target.shard is not None for target in targets.values()):
        return []
    # Only under the template's own top-level keys: a template of a part of the state (Lightning's, of the model
    # and optimizers of a whole checkpoint dictionary) leaves the rest to the caller on purpose.
    given = {str(key) for key in template}
    refs, _, _ = flatten_template(state)
    return [ref.name for ref in refs
            if ref.name not in targets and ref.kind == "torch" and ref.name.split("/", 1)[0] in given]


def layout_changed(record: SavedRecord, target: Target | None) -> bool:
    """True when the caller holds ``record``'s tensor split differently (other offsets, placements or mesh, or
    whole where a shard was saved) with the same global shape: only a resharded load can fill it."""
    saved = record.shard
    if saved is None or target is None or not isinstance(target.into, torch.Tensor) or record.kind != "torch":
        return False
    ours = target.shard
    if ours is not None:
        return ours.global_shape == saved.global_shape and ours.split != saved.split
    return tuple(target.into.shape) == saved.global_shape != tuple(record.shape)


def shown(problems: Sequence[str]) -> str:
    """The first five problems, and how many more."""
    return "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")


_ADVICE = {
    "config": "Build the model and optimizer with the same configuration as the run that saved it",
    "layout": "Shard the model as the run that saved it did (the same mesh and placements), or read this "
              "layout with torch.distributed.checkpoint.load(state, storage_reader="
              "easyckpt.dcp.StorageReader(<save_dir>/iteration_N))",
    "unsharded": "Load it into the model before sharding it (plain tensors as the template), then call "
                 "fully_shard",
}


def _problem(record: SavedRecord, target: Target) -> tuple[str, str] | None:
    """(what differs, which advice fixes it) for one tensor of the template, None when it fits."""
    want = torch_dtype(record.dtype)
    saved, ours = record.shard, target.shard
    if ours is not None and saved is not None and (ours.global_shape != saved.global_shape
                                                   or ours.offsets != saved.offsets):
        return (f"{record.name}: checkpoint {sharding.describe(saved, record.shape)}, "
                f"your state {sharding.describe(ours, target.into.shape)}",
                "layout" if ours.global_shape == saved.global_shape else "config")
    if ours is not None and saved is None and tuple(target.into.shape) != tuple(record.shape):
        return (f"{record.name}: checkpoint {tuple(record.shape)} has no sharding metadata (saved from a "
                f"plain tensor, or by an easyckpt before sharded state), your state is a DTensor "
                f"{sharding.describe(ours, target.into.shape)}", "unsharded")
    if tuple(target.into.shape) != tuple(record.shape) or target.into.dtype != want:
        return (f"{record.name}: checkpoint {tuple(record.shape)} {want}, "
                f"your state {tuple(target.into.shape)} {target.into.dtype}", "config")
    return None


def check_template(records: Iterable[SavedRecord], template: Template, step: int, source: str) -> None:
    """Raise StateMismatchError (LayoutChangedError when only the split differs) unless every saved tensor fits
    the caller's tensor of its name; nothing is copied before this passes."""
    problems, fixes, moved = [], set(), []
    for record in records:
        target = template.get(record.name)
        if target is None or not isinstance(target.into, torch.Tensor) or record.kind != "torch":
            continue
        if layout_changed(record, target):
            moved.append(f"{record.name}: checkpoint {sharding.describe(record.shard, record.shape)}, your state "
                         f"{sharding.describe(target.shard, target.into.shape)}")
            continue
        found = _problem(record, target)
        if found is not None:
            problems.append(found[0])
            fixes.add(found[1])
    if problems:
        fix = "; or ".join(_ADVICE[k] for k in ("config", "layout", "unsharded") if k in fixes)
        raise StateMismatchError(
            f"the state passed to load() does not match the checkpoint of step {step} ({source}): {shown(problems)}. "
            f"{fix}; or call load() without a state to inspect what was saved"
        )
    if moved:
        raise LayoutChangedError(
            f"step {step} ({source}) is split differently from the state passed to load() ({len(moved)} tensors, "
            f"e.g. {moved[0]}): only a resharded load from disk fills it (load(reshard=True))")


def place(record: SavedRecord, source: torch.Tensor, template: Template, *, owned: bool) -> Any:
    """Copy into the caller's tensor when it has one of that name, else keep ``source`` (cloned unless
    ``owned``: a view of shared memory must not outlive the read)."""
    target = template.get(record.name)
    if record.kind == "numpy":
        return source.numpy() if owned else source.numpy().copy()
    if target is not None and isinstance(target.into, torch.Tensor):
        with torch.no_grad():
            target.into.copy_(source)
        return target.value
    return source if owned else source.clone()


def dcp_targets(sharded: Iterable[tuple[int, str, str, tuple[int, ...], ShardSpec | None]], keys: Mapping[str, str],
                template: Template, where: str, error: type[Exception]
                ) -> tuple[dict[str, Any], dict[int, Any], list[str]]:
    """For a resharded load (from disk or from the saved world's memory): what ``dcp.load`` fills for each
    sharded tensor of the source rank, given as (position, name, dtype, local shape, shard). Returns ``into``
    (DCP key -> the template's tensor, or a new plain one holding the whole tensor where the template has
    none: a DTensor needs a mesh to live on), ``handed`` (position -> what the loaded state holds) and the
    template's mismatches (global shape, dtype), one line each. A tensor DCP cannot address raises ``error``
    naming ``where`` (the source rank's snapshot)."""
    into: dict[str, Any] = {}
    handed: dict[int, Any] = {}
    problems: list[str] = []
    for position, name, dtype, shape, saved in sharded:
        if saved is None:
            continue
        key, target = keys.get(name), template.get(name)
        if key is None:
            raise error(f"{where}: sharded tensor {name!r} has no key that torch.distributed.checkpoint can address")
        if target is None or not isinstance(target.into, torch.Tensor):
            into[key] = handed[position] = torch.empty(saved.global_shape, dtype=torch_dtype(dtype))
            continue
        ours = target.shard.global_shape if target.shard is not None else tuple(target.into.shape)
        if ours != saved.global_shape or target.into.dtype != torch_dtype(dtype):
            problems.append(f"{name}: checkpoint {sharding.describe(saved, shape)} {torch_dtype(dtype)}, "
                            f"your state global {ours} {target.into.dtype}")
        into[key] = handed[position] = target.value
    return into, handed, problems


def resharded_mismatch(step: int, where: str, problems: Sequence[str]) -> StateMismatchError:
    """The error of a resharded load whose template has other global shapes or dtypes (``dcp_targets``)."""
    return StateMismatchError(
        f"the state passed to load() does not match the checkpoint of step {step} ({where}): {shown(problems)}. "
        "A resharded load changes how tensors are split, not their global shapes: build the model and optimizer "
        "with the configuration of the run that saved it")
