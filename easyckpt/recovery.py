"""Recovery: agree on one step for all ranks, then load it from the cheapest source that has it.

Every rank reports the steps it holds in memory (every committed slot of its own), the steps it can
pull from replicas on other nodes (multi-node jobs: see ``replica``), and the complete iterations it
sees on disk; the candidates are the steps *every* rank can get, newest first, memory before replica
before disk on a tie (invariant 4). In a memory/replica attempt each rank reads its own slot when it
holds the step and pulls it from the replicas into that slot otherwise. Each attempt is collective: if
any rank fails to read (a torn slot, a corrupted file) all ranks move to the next candidate together; a
state that does not fit the caller's template fails on all ranks at once with the reason.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from easyckpt import memory_reshard, replica, sharding, storage
from easyckpt.collectives import all_gather_ints, all_ok
from easyckpt.slots import RankSlots
from easyckpt.state import flatten_template, torch_dtype, unflatten
from easyckpt_wire import layout
from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.layout import CheckpointFormatError
from easyckpt_wire.records import PeerTable, ShardSpec
from easyckpt_wire.shm import MAX_SLOTS, SlotFormatError, format_bytes

logger = logging.getLogger(__name__)

MAX_DISK_CANDIDATES = 8
_OK, _RETRY, _FATAL = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    step: int | None
    source: str | None          # "memory" | "replica" | "disk" | None (nothing to resume from)
    state: Any
    path: str | None = None     # the iteration directory or slot file it came from
    seconds: float = 0.0
    nbytes: int = 0


class StateMismatchError(ValueError):
    """The caller's state does not fit the checkpoint (shapes or dtypes differ)."""


class LayoutChangedError(StateMismatchError):
    """The state is split differently from the checkpoint (another mesh, tensor-parallel or world size) while
    the global shapes agree: the resharded load from disk can fill it (``load(reshard=True)``)."""


class LoadError(RuntimeError):
    """No candidate step could be loaded by every rank."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Record:
    index: int
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    shard: ShardSpec | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One tensor of the caller's template: what is copied into (a DTensor's local shard) and what the loaded
    state hands back (the DTensor itself, else the same tensor)."""

    into: Any
    value: Any
    shard: ShardSpec | None = None


def template_targets(template: Any) -> dict[str, Target]:
    """The caller's tensors by easyckpt name (the names ``flatten`` gives the saved state)."""
    if template is None:
        return {}
    refs, values, wrappers = flatten_template(template)
    return {ref.name: Target(value, wrappers.get(i, value), ref.shard) for i, (ref, value) in enumerate(zip(refs, values))}


def candidates(mem_steps: list[int], disk_steps: list[int], world_size: int,
               replica_steps: Sequence[int] = ()) -> list[tuple[int, str]]:
    """The same ordered candidate list on every rank: (step, "memory" | "replica" | "disk")."""
    return candidates_with_health(mem_steps, disk_steps, world_size, replica_steps)[0]


def candidates_with_health(mem_steps: list[int], disk_steps: list[int], world_size: int,
                           replica_steps: Sequence[int] = (), unhealthy: Collection[int] = (),
                           unhealthy_disk: Collection[int] = ()) -> tuple[list[tuple[int, str]], dict[int, list[int]]]:
    """``candidates``, and the steps some rank holds an unhealthy snapshot of: {step: [ranks saying so]}.

    ``unhealthy``: this rank's memory/replica steps whose snapshot (its own) is unhealthy; ``unhealthy_disk``:
    disk steps whose iteration says so (every rank reads the same). A memory/replica step is unhealthy when
    any rank's snapshot is; a disk step when its iteration is. Every rank gets the same answer."""
    # Every slot's step: the safe step need not be among a rank's two newest (a persist may hold a third).
    mem = (sorted(mem_steps, reverse=True) + [-1] * MAX_SLOTS)[:MAX_SLOTS]
    rep = (sorted(set(replica_steps) - set(mem_steps), reverse=True) + [-1, -1])[:2]
    disk = (disk_steps[:MAX_DISK_CANDIDATES] + [-1] * MAX_DISK_CANDIDATES)[:MAX_DISK_CANDIDATES]
    n_local = MAX_SLOTS + 2
    flags = [int(s >= 0 and s in unhealthy) for s in mem + rep] + [int(s >= 0 and s in unhealthy_disk) for s in disk]
    both = all_gather_ints(mem + rep + disk + flags, world_size)
    width = len(mem + rep + disk)
    rows = [row[:width] for row in both]
    bad_mem: dict[int, list[int]] = {}
    bad_disk: dict[int, list[int]] = {}
    for r, row in enumerate(both):
        for i, (step, flag) in enumerate(zip(row[:width], row[width:])):
            if step >= 0 and flag:
                (bad_mem if i < n_local else bad_disk).setdefault(step, []).append(r)
    local, anywhere = MAX_SLOTS, MAX_SLOTS + 2
    common_mem = set.intersection(*({s for s in row[:local] if s >= 0} for row in rows))
    common_any = set.intersection(*({s for s in row[:anywhere] if s >= 0} for row in rows))
    common_disk = set.intersection(*({s for s in row[anywhere:] if s >= 0} for row in rows))
    ordered = ([(s, "memory" if s in common_mem else "replica") for s in common_any]
               + [(s, "disk") for s in common_disk])
    rank_of = {"memory": 0, "replica": 1, "disk": 2}
    ordered = sorted(ordered, key=lambda c: (-c[0], rank_of[c[1]]))
    bad = {step: sorted(set(bad_mem.get(step, [])) | set(bad_disk.get(step, [])))
           for step in {s for s, _ in ordered} if step in bad_mem or step in bad_disk}
    return ordered, bad


def pass_over_unhealthy(ordered: list[tuple[int, str]], bad: Mapping[int, object]) -> list[tuple[int, str]]:
    """The candidates left once every unhealthy step is passed over (pure: the same on every rank)."""
    return [c for c in ordered if c[0] not in bad]


def _memory_health(slots: RankSlots, steps: Sequence[int], timeout: float) -> dict[int, RankHealth]:
    """This rank's verdict on each of its committed snapshots (an unreadable slot: neutral here; reading it
    for the load fails the same way and moves every rank on)."""
    found = {}
    for step in steps:
        try:
            with slots.read(step, timeout) as read:
                found[step] = read.meta.health
        except (SlotFormatError, TimeoutError, KeyError, OSError) as exc:
            logger.debug("health of step %d in memory unknown: %s", step, exc)
            found[step] = NEUTRAL
    return found


def _outcomes(code: int, world_size: int) -> list[int]:
    return [row[0] for row in all_gather_ints([code], world_size)]


def layout_changed(record: _Record, target: Target | None) -> bool:
    """True when the caller holds ``record``'s tensor split differently (other offsets, placements or mesh, or
    whole where a shard was saved) with the same global shape: only a resharded load can fill it."""
    saved = record.shard
    if saved is None or target is None or not isinstance(target.into, torch.Tensor) or record.kind != "torch":
        return False
    ours = target.shard
    if ours is not None:
        return ours.global_shape == saved.global_shape and ours.split != saved.split
    return tuple(target.into.shape) == saved.global_shape != record.shape


def _check_template(records: list[_Record], template: dict[str, Target], step: int, source: str) -> None:
    problems, fixes, moved = [], set(), []
    for record in records:
        target = template.get(record.name)
        if target is None or not isinstance(target.into, torch.Tensor) or record.kind != "torch":
            continue
        if layout_changed(record, target):
            moved.append(f"{record.name}: checkpoint {sharding.describe(record.shard, record.shape)}, your state "
                         f"{sharding.describe(target.shard, target.into.shape)}")
            continue
        want = torch_dtype(record.dtype)
        saved, ours = record.shard, target.shard
        if ours is not None and saved is not None and (ours.global_shape != saved.global_shape
                                                       or ours.offsets != saved.offsets):
            fixes.add("layout" if ours.global_shape == saved.global_shape else "config")
            problems.append(f"{record.name}: checkpoint {sharding.describe(saved, record.shape)}, "
                            f"your state {sharding.describe(ours, target.into.shape)}")
        elif ours is not None and saved is None and tuple(target.into.shape) != record.shape:
            problems.append(f"{record.name}: checkpoint {tuple(record.shape)} has no sharding metadata (saved from a "
                            f"plain tensor, or by an easyckpt before sharded state), your state is a DTensor "
                            f"{sharding.describe(ours, target.into.shape)}")
            fixes.add("unsharded")
        elif tuple(target.into.shape) != record.shape or target.into.dtype != want:
            problems.append(f"{record.name}: checkpoint {tuple(record.shape)} {want}, "
                            f"your state {tuple(target.into.shape)} {target.into.dtype}")
            fixes.add("config")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        advice = {
            "config": "Build the model and optimizer with the same configuration as the run that saved it",
            "layout": "Shard the model as the run that saved it did (the same mesh and placements), or read this "
                      "layout with torch.distributed.checkpoint.load(state, storage_reader="
                      "easyckpt.dcp.StorageReader(<save_dir>/iteration_N))",
            "unsharded": "Load it into the model before sharding it (plain tensors as the template), then call "
                         "fully_shard",
        }
        fix = "; or ".join(advice[k] for k in ("config", "layout", "unsharded") if k in fixes)
        raise StateMismatchError(
            f"the state passed to load() does not match the checkpoint of step {step} ({source}): {shown}. "
            f"{fix}; or call load() without a state to inspect what was saved"
        )
    if moved:
        raise LayoutChangedError(
            f"step {step} ({source}) is split differently from the state passed to load() ({len(moved)} tensors, "
            f"e.g. {moved[0]}): only a resharded load from disk fills it (load(reshard=True))")


def _place(record: _Record, source: torch.Tensor, template: dict[str, Target], *, owned: bool) -> Any:
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


def _read_memory(slots: RankSlots, step: int, template: dict[str, Target], timeout: float,
                 expected: tuple[int, list[bytes]] | None = None) -> tuple[Any, list[Any], str, int]:
    """Read this rank's slot of ``step``; with ``expected`` (the agent's checksums of that very
    snapshot) every tensor is verified before use."""
    with slots.read(step, timeout) as read:
        meta = read.meta
        records = [_Record(i, e.name, e.kind, e.dtype, e.shape, e.shard) for i, e in enumerate(meta.tensors)]
        _check_template(records, template, step, "memory")
        if expected is not None and expected[0] == read.generation:
            read.verify(expected[1])
        values, nbytes = [], 0
        for record, entry in zip(records, meta.tensors):
            if entry.nbytes == 0:
                raw = torch.empty(record.shape, dtype=torch_dtype(record.dtype))
            else:
                raw = torch.frombuffer(read.data(entry), dtype=torch.uint8).view(
                    torch_dtype(record.dtype)).view(record.shape)
            values.append(_place(record, raw, template, owned=False))
            nbytes += entry.nbytes
            del raw
        return meta.skeleton, values, str(read.path), nbytes


def _read_disk(iteration_dir: Path, rank: int, world_size: int, template: dict[str, Target],
               reshard: bool = True) -> tuple[Any, list[Any], str, int]:
    """Collective: every rank calls it for the same iteration."""
    saved_world = layout.read_metadata(iteration_dir).get("world_size")
    changed, entry, failure = saved_world != world_size and type(saved_world) is int, None, None
    if not changed:
        # The same world may hold the tensors split otherwise (Megatron: another tensor-parallel size on as
        # many ranks): every rank votes, since the resharded read is collective.
        mine = False
        try:
            entry = storage.rank_entry(iteration_dir, rank, world_size)
            mine = any(layout_changed(_Record(r.index, r.name, r.kind, r.dtype, r.shape, r.shard),
                                      template.get(r.name)) for r in entry.records)
        except Exception as exc:  # raised after the vote: no rank may be left waiting in it
            failure = exc
        votes = all_gather_ints([int(mine), int(failure is not None)], world_size)
        if failure is not None:
            raise failure
        if any(v[1] for v in votes):
            raise storage.CheckpointCorruptError(f"{iteration_dir}: another rank could not read its files; see its log")
        changed = any(v[0] for v in votes)
    if changed:
        if not reshard:
            what = (f"was saved by {saved_world} ranks, this job has {world_size}" if saved_world != world_size
                    else "holds tensors split differently from this job's (ranks "
                    f"{[r for r, v in enumerate(votes) if v[0]]})")
            raise LayoutChangedError(f"{iteration_dir} {what}: load it with a resharded load (reshard=True)")
        return _read_resharded(iteration_dir, rank, world_size, template)
    entry = entry or storage.rank_entry(iteration_dir, rank, world_size)
    records = [_Record(r.index, r.name, r.kind, r.dtype, r.shape, r.shard) for r in entry.records]
    if [r.index for r in records] != list(range(len(records))):
        raise storage.CheckpointCorruptError(f"{iteration_dir}: tensor index of rank {rank} has gaps")
    _check_template(records, template, entry.step, f"disk {iteration_dir}")
    values: list[Any] = [None] * len(records)
    nbytes = 0
    for record, tensor in storage.read_tensors(entry):  # file by file, not in index order
        values[record.index] = _place(records[record.index], tensor, template, owned=True)
        nbytes += record.nbytes
    return entry.skeleton, values, str(iteration_dir), nbytes


def dcp_targets(sharded: Iterable[tuple[int, str, str, tuple[int, ...], ShardSpec | None]], keys: Mapping[str, str],
                template: Mapping[str, Target], where: str, error: type[Exception]
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


def shown(problems: Sequence[str]) -> str:
    """The first five problems, and how many more."""
    return "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")


def _read_resharded(iteration_dir: Path, rank: int, world_size: int,
                    template: dict[str, Target]) -> tuple[Any, list[Any], str, int]:
    """A step saved by another number of ranks: its DTensors through ``dcp.load`` (DCP's planning decides which
    saved ranges this rank reads), every other value from one saved rank (``sharding.source_rank``).

    Collective: every rank of the job calls it for the same iteration. A template that does not fit fails on
    every rank before any rank starts reading."""
    from easyckpt import dcp  # torch.distributed.checkpoint only for a resharded load

    index = dcp.checkpoint_index(iteration_dir)
    source = sharding.source_rank(rank, index.world_size)
    entry = storage.rank_entry(iteration_dir, source, None)
    keys = index.keys[source]
    into, handed, problems = dcp_targets(((r.index, r.name, r.dtype, r.shape, r.shard) for r in entry.records),
                                         keys, template, f"{iteration_dir} (rank {source})",
                                         storage.CheckpointCorruptError)
    agreed = all_ok(not problems)   # before any rank raises: the others would wait in dcp.load
    if problems:
        raise StateMismatchError(
            f"the state passed to load() does not match the checkpoint of step {index.step} ({iteration_dir}, saved "
            f"by {index.world_size} ranks): {shown(problems)}. A resharded load changes how tensors are split, not their "
            "global shapes: build the model and optimizer with the configuration of the run that saved it")
    if not agreed:
        raise StateMismatchError(f"another rank's state does not fit step {index.step} of {iteration_dir}; see its log")
    if into:   # the same on every rank: every rank saved the same structure
        dcp.load_into(into, iteration_dir)
    records = [_Record(r.index, r.name, r.kind, r.dtype, r.shape, r.shard) for r in entry.records]
    private = storage.RankEntry(entry.path, entry.step, source, entry.skeleton,
                                [r for r in entry.records if r.shard is None])
    _check_template([records[r.index] for r in private.records], template, index.step, f"disk {iteration_dir}")
    values: list[Any] = [None] * len(records)
    nbytes = 0
    for position, value in handed.items():
        values[position] = value
        nbytes += value.numel() * value.element_size()
    for record, tensor in storage.read_tensors(private):
        values[record.index] = _place(records[record.index], tensor, template, owned=True)
        nbytes += record.nbytes
    replicated = sum(1 for r in entry.records if r.shard is not None and r.shard.replicated)
    logger.info("rank %d: step %d was saved by %d ranks, this job has %d%s: %d sharded tensors resharded through "
                "torch.distributed.checkpoint's load planning%s; private values from rank %d (%s)", rank, index.step,
                index.world_size, world_size, " (split otherwise)" if index.world_size == world_size else "", len(into),
                f" ({replicated} replicated: their writer's copy)" if replicated else "", source,
                sharding.private_rule(world_size, index.world_size))
    return entry.skeleton, values, str(iteration_dir), nbytes


def _replica_plans(peers: PeerTable | None, rank: int, mem_steps: list[int],
                   timeout: float, found: replica.Survey | None = None) -> dict[int, replica.ReplicaPlan]:
    if peers is None:
        return {}
    found = found or replica.survey(peers, timeout)
    for node, problem in sorted(found.unreachable.items()):
        logger.warning("rank %d: agent of node %s is unreachable (%s): its replicas are not used", rank, node, problem)
    plans = replica.plan(peers, found, rank, timeout)
    if not plans and not mem_steps:
        logger.warning("rank %d: no agent holds a replica of rank %d's state and its memory is empty: "
                       "only disk can bring it back", rank, rank)
    return {step: plan for step, plan in plans.items() if step not in mem_steps}


def load(*, slots: RankSlots, save_dir: Path, rank: int, world_size: int, template: Any = None,
         load_dir: Path | None = None, timeout: float = 120.0, peers: PeerTable | None = None,
         peer_timeout: float = 10.0, allow_unhealthy: bool = False, reshard: bool = True) -> LoadResult:
    started = time.perf_counter()
    template_map = template_targets(template)
    unreadable = ""
    if load_dir is not None:
        base, mem_steps = load_dir.parent, []
        try:
            disk_steps = [storage.iteration_step(load_dir)]
        except CheckpointFormatError as exc:  # decided with the other ranks below: nobody may hang
            disk_steps, unreadable = [], str(exc)
    else:
        disk_steps, base, mem_steps = storage.newest_first(save_dir), save_dir, list(slots.committed())
    found = replica.survey(peers, peer_timeout) if peers is not None and load_dir is None else None
    plans = _replica_plans(peers, rank, mem_steps, peer_timeout, found) if load_dir is None else {}
    # Another world's snapshots of this job (a job restarted on another number of ranks): collective.
    other_worlds = memory_reshard.Reachable()
    if load_dir is None and reshard:
        other_worlds = memory_reshard.discover(slots.directory, slots.job_id, world_size, peers, found, peer_timeout)
    resharding = memory_reshard.agreed(other_worlds, world_size) if load_dir is None and reshard else []
    tried = []
    # Health (invariant 13): every rank's verdicts on its snapshots, and each iteration's on disk.
    mine = _memory_health(slots, mem_steps, timeout)
    mine.update({step: p.manifest.meta.health for step, p in plans.items()})
    on_disk = storage.disk_health(base, disk_steps) if load_dir is None else {}
    ordered, bad = candidates_with_health(mem_steps, disk_steps, world_size, list(plans),
                                          unhealthy={s for s, v in mine.items() if not v.healthy},
                                          unhealthy_disk={s for s, v in on_disk.items() if not v.healthy})
    why = {step: (on_disk[step].reasons if step in on_disk and not on_disk[step].healthy
                  else tuple(f"rank {rank}: {r}" for r in mine[step].reasons) if step in mine else ())
           for step in bad}

    def describe(step: int) -> str:
        return (f"step {step} (unhealthy on ranks {bad[step]}"
                + (f": {'; '.join(why[step])}" if why[step] else "") + ")")

    if bad and load_dir is None:
        newer = [s for s in sorted({s for s, _ in ordered}, reverse=True) if s in bad]
        healthy = pass_over_unhealthy(ordered, bad)
        if allow_unhealthy:
            logger.warning("rank %d: allow_unhealthy=True: unhealthy snapshots may be loaded: %s", rank,
                           ", ".join(describe(s) for s in newer))
        elif not healthy:
            raise LoadError(
                f"no healthy checkpoint to resume from in memory or in save_dir {save_dir} (this is rank {rank}): "
                f"every one is unhealthy: {', '.join(describe(s) for s in newer)}. Either retrain from scratch "
                "(remove or move save_dir), or raise the threshold in health_thresholds, or load a chosen iteration "
                "with load(load_dir=<save_dir>/iteration_N), or load the newest anyway with "
                "load(allow_unhealthy=True)")
        else:
            passed = [s for s in newer if s > healthy[0][0]]
            if passed:
                logger.warning("rank %d: passing over unhealthy snapshots newer than step %d: %s", rank,
                               healthy[0][0], ", ".join(describe(s) for s in passed))
            ordered = healthy
    ordered = memory_reshard.merge(ordered, resharding, rank=rank, allow_unhealthy=allow_unhealthy)
    if mem_steps and (not ordered or ordered[0][1] == "disk"):
        logger.warning("rank %d holds steps %s in memory, but no step that every rank can get from memory or from "
                       "replicas on other nodes (a rank whose node lost its memory gets only a step another node "
                       "backed up): resuming from disk", rank, sorted(mem_steps, reverse=True))
    for step, source in ordered:
        code, problem, result = _OK, "", None
        fatal: type[StateMismatchError] = StateMismatchError
        try:
            resharded = None
            if source == memory_reshard.SOURCE:
                source, resharded = memory_reshard.read(other_worlds, memory_reshard.pick(resharding, step), rank=rank,
                                                        world_size=world_size, template=template_map, peers=peers,
                                                        timeout=timeout, peer_timeout=peer_timeout)
            elif source != "disk" and step not in slots.committed():
                if step not in plans:
                    raise replica.ReplicaError(f"rank {rank} holds no plan for step {step}")
                assert peers is not None
                moved = replica.fetch(peers, plans[step], slots, rank=rank, timeout=peer_timeout)
                logger.info("rank %d pulled step %d from replicas: %s in %.3fs from %s", rank, step,
                            format_bytes(moved["bytes"]), moved["seconds"], sorted(moved["peers"]))
                source = "replica"
            elif source == "replica":
                source = "memory"  # this rank has it; others pull theirs
            if resharded is not None:
                skeleton, values, path, nbytes = resharded
            elif source != "disk":
                expected = replica.own_checksums(peers, rank, step, peer_timeout) if source == "memory" and peers else None
                skeleton, values, path, nbytes = _read_memory(slots, step, template_map, timeout, expected)
            else:
                skeleton, values, path, nbytes = _read_disk(base / f"iteration_{step:07d}", rank, world_size, template_map,
                                                             reshard)
            result = (unflatten(skeleton, values), path, nbytes)
        except LayoutChangedError as exc:   # memory holds only this rank's own split: disk can reshard
            code, problem = (_RETRY if reshard and source != "disk" else _FATAL), str(exc)
            fatal = LayoutChangedError
        except StateMismatchError as exc:
            code, problem = _FATAL, str(exc)
        except (SlotFormatError, CheckpointFormatError, TimeoutError, ValueError, KeyError, TypeError,
                replica.ReplicaError, OSError) as exc:
            code, problem = _RETRY, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # unexpected, but raising here alone would leave the other ranks waiting
            logger.exception("rank %d: unexpected error loading step %d from %s", rank, step, source)
            code, problem = _RETRY, f"{type(exc).__name__}: {exc}"
        codes = _outcomes(code, world_size)
        if code != _OK:
            logger.warning("rank %d could not load step %d from %s: %s", rank, step, source, problem)
        if max(codes) == _FATAL:
            raise fatal(problem or f"rank(s) {[r for r, c in enumerate(codes) if c == _FATAL]} "
                                     f"could not fit step {step} into their state; see their logs")
        if max(codes) == _OK and result is not None:
            state, path, nbytes = result
            seconds = time.perf_counter() - started
            slots.invalidate_newer_than(step)
            # DEBUG: each node's first rank announces the resume (Checkpointer.load); this is every rank's detail.
            logger.debug("rank %d resumed at step %d from %s (%s) in %.3fs (%s, %.2f GB/s)", rank, step, source,
                         path, seconds, format_bytes(nbytes), nbytes / seconds / 1e9 if seconds else 0.0)
            return LoadResult(step, source, state, path, seconds, nbytes)
        failed = [r for r, c in enumerate(codes) if c]
        tried.append(f"step {step} from {source}: " + (problem if code else f"failed on ranks {failed}, see their logs"))
    if tried:
        where = f"load_dir {load_dir}" if load_dir is not None else f"save_dir {save_dir}"
        raise LoadError(f"no checkpoint in {where} could be loaded by every rank (this is rank {rank}); tried "
                        + "; ".join(tried) + ". Repair or remove the damaged files (easyckpt verify shows them)")
    if load_dir is not None:
        raise LoadError(f"load_dir {load_dir} cannot be loaded by every rank: "
                        f"{unreadable or 'another rank cannot read it, see its log'}")
    # No "fresh start" here: a caller may resume from elsewhere (TrainerWrapper: a checkpoint-N folder).
    logger.info("rank %d: nothing to resume from in memory or in %s (load() returns step None)", rank, save_dir)
    return LoadResult(None, None, None)
