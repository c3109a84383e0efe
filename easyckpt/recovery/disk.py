"""The storage tier: complete iterations in ``save_dir`` (or the one ``load_dir`` names), read through the
functions of ``easyckpt.storage`` (every tensor checked against metadata.json and its checksum).

A read is collective: an iteration saved by another world size, or split otherwise on as many ranks, is
resharded through ``torch.distributed.checkpoint``'s load planning (``easyckpt.dcp``), which every rank
enters together; DTensors come from the saved ranges DCP plans, every other value from one saved rank
(``sharding.source_rank``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from easyckpt import storage
from easyckpt.collectives import all_gather_ints, all_ok
from easyckpt.recovery.results import LayoutChangedError, StateMismatchError
from easyckpt.recovery.template import Template, check_template, dcp_targets, layout_changed, place, resharded_mismatch
from easyckpt.recovery.tier import Loaded, Offer
from easyckpt.snapshot import sharding
from easyckpt_wire import layout
from easyckpt_wire.health import NEUTRAL
from easyckpt_wire.layout import CheckpointFormatError

logger = logging.getLogger(__name__)


class StorageTier:
    """The iterations of ``save_dir`` an automatic load tries (``storage.newest_first``), with the health their
    index or metadata gives; or, with ``load_dir``, that one iteration whatever its health."""

    source = "disk"
    collective = True

    def __init__(self, save_dir: Path, *, rank: int, world_size: int, load_dir: Path | None = None,
                 reshard: bool = True) -> None:
        self.save_dir, self.load_dir, self.rank, self.world_size = save_dir, load_dir, rank, world_size
        self.reshard = reshard
        self.base = load_dir.parent if load_dir is not None else save_dir
        self.steps: list[int] = []
        self.unreadable = ""   # why load_dir, or save_dir's listing, cannot be read here (said when nothing loads)

    def offer(self) -> Offer:
        if self.load_dir is None:
            try:
                self.steps = storage.newest_first(self.save_dir)
                return Offer.of(storage.disk_health(self.save_dir, self.steps).items())
            except OSError as exc:
                # An object store down (or a file system failing) must not take the memory tiers with it: a
                # worker that torchrun restarts during an outage resumes from memory. ``load`` refuses to start
                # from scratch when no other tier has a step either (the checkpoints may be there, unseen).
                self.steps, self.unreadable = [], f"save_dir {self.save_dir} cannot be listed: {exc}"
                logger.warning("rank %d: %s; only memory and replicas are looked at", self.rank, self.unreadable)
                return Offer()
        try:
            self.steps = [storage.iteration_step(self.load_dir)]
        except CheckpointFormatError as exc:  # decided with the other ranks in the agreement: nobody may hang
            self.steps, self.unreadable = [], str(exc)
        return Offer.of((step, NEUTRAL) for step in self.steps)   # an explicit choice: loaded whatever its health

    def holds(self, step: int) -> bool:
        return step in self.steps

    def read(self, step: int, template: Template) -> Loaded:
        return read_iteration(self.base / layout.iteration_dirname(step), self.rank, self.world_size, template,
                              self.reshard)


def _split_differs(iteration_dir: Path, rank: int, world_size: int, template: Template
                   ) -> tuple[storage.RankEntry | None, list[int]]:
    """Collective, for an iteration saved by as many ranks: this rank's entry, and the ranks whose template holds
    some tensor split otherwise (Megatron: another tensor-parallel size on as many ranks). Every rank votes,
    since the resharded read that follows is collective; a rank that cannot read its entry fails them all."""
    mine, entry, failure = False, None, None
    try:
        entry = storage.rank_entry(iteration_dir, rank, world_size)
        mine = any(layout_changed(r, template.get(r.name)) for r in entry.records)
    except Exception as exc:  # raised after the vote: no rank may be left waiting in it
        failure = exc
    votes = all_gather_ints([int(mine), int(failure is not None)], world_size)
    if failure is not None:
        raise failure
    if any(v[1] for v in votes):
        raise storage.CheckpointCorruptError(f"{iteration_dir}: another rank could not read its files; see its log")
    return entry, [r for r, v in enumerate(votes) if v[0]]


def read_iteration(iteration_dir: Path, rank: int, world_size: int, template: Template,
                   reshard: bool = True) -> Loaded:
    """Collective: every rank calls it for the same iteration."""
    saved_world = layout.read_metadata(iteration_dir).get("world_size")
    changed = saved_world != world_size and type(saved_world) is int
    entry: storage.RankEntry | None = None
    moved: list[int] = []
    if not changed:
        entry, moved = _split_differs(iteration_dir, rank, world_size, template)
        changed = bool(moved)
    if changed:
        if not reshard:
            what = (f"was saved by {saved_world} ranks, this job has {world_size}" if saved_world != world_size
                    else f"holds tensors split differently from this job's (ranks {moved})")
            raise LayoutChangedError(f"{iteration_dir} {what}: load it with a resharded load (reshard=True)")
        return read_resharded(iteration_dir, rank, world_size, template)
    entry = entry or storage.rank_entry(iteration_dir, rank, world_size)
    if [r.index for r in entry.records] != list(range(len(entry.records))):
        raise storage.CheckpointCorruptError(f"{iteration_dir}: tensor index of rank {rank} has gaps")
    check_template(entry.records, template, entry.step, f"disk {iteration_dir}")
    values: list[Any] = [None] * len(entry.records)
    nbytes = 0
    for record, tensor in storage.read_tensors(entry):  # file by file, not in index order
        values[record.index] = place(record, tensor, template, owned=True)
        nbytes += record.nbytes
    return Loaded(entry.skeleton, values, str(iteration_dir), nbytes, "disk")


def read_resharded(iteration_dir: Path, rank: int, world_size: int, template: Template) -> Loaded:
    """A step saved by another number of ranks: its DTensors through ``dcp.load`` (DCP's planning decides which
    saved ranges this rank reads), every other value from one saved rank (``sharding.source_rank``).

    Collective: every rank of the job calls it for the same iteration. A template that does not fit fails on
    every rank before any rank starts reading."""
    from easyckpt import dcp  # torch.distributed.checkpoint only for a resharded load

    index = dcp.checkpoint_index(iteration_dir)
    source = sharding.source_rank(rank, index.world_size)
    entry = storage.rank_entry(iteration_dir, source, None)
    into, handed, problems = dcp_targets(((r.index, r.name, r.dtype, r.shape, r.shard) for r in entry.records),
                                         index.keys[source], template, f"{iteration_dir} (rank {source})",
                                         storage.CheckpointCorruptError)
    agreed = all_ok(not problems)   # before any rank raises: the others would wait in dcp.load
    if problems:
        raise resharded_mismatch(index.step, f"{iteration_dir}, saved by {index.world_size} ranks", problems)
    if not agreed:
        raise StateMismatchError(f"another rank's state does not fit step {index.step} of {iteration_dir}; see its log")
    if into:   # the same on every rank: every rank saved the same structure
        dcp.load_into(into, iteration_dir)
    private = storage.RankEntry(entry.path, entry.step, source, entry.skeleton,
                                [r for r in entry.records if r.shard is None])
    check_template(private.records, template, index.step, f"disk {iteration_dir}")
    values: list[Any] = [None] * len(entry.records)
    nbytes = 0
    for position, value in handed.items():
        values[position] = value
        nbytes += value.numel() * value.element_size()
    for record, tensor in storage.read_tensors(private):
        values[record.index] = place(record, tensor, template, owned=True)
        nbytes += record.nbytes
    replicated = sum(1 for r in entry.records if r.shard is not None and r.shard.replicated)
    logger.info("rank %d: step %d was saved by %d ranks, this job has %d%s: %d sharded tensors resharded through "
                "torch.distributed.checkpoint's load planning%s; private values from rank %d (%s)", rank, index.step,
                index.world_size, world_size, " (split otherwise)" if index.world_size == world_size else "", len(into),
                f" ({replicated} replicated: their writer's copy)" if replicated else "", source,
                sharding.private_rule(world_size, index.world_size))
    return Loaded(entry.skeleton, values, str(iteration_dir), nbytes, "disk")
