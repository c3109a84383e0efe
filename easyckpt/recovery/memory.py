"""The tiers that read through this rank's own slots in this node's shared memory.

* **Own memory** (:class:`OwnMemoryTier`): this rank's committed slots (the process died, the node lives). The
  cheapest tier: a read is a copy out of shared memory, every tensor verified against the checksums the node
  agent took of that very snapshot after its commit (a byte changed in the slot since is refused and the ladder
  moves on); unverified, and said so, when the agent has not hashed it (it died, or the kill came within
  milliseconds of the commit, or it did not answer: then no older step asks it again during the load).
* **Replicas** (:class:`ReplicaTier`): this rank's state held by node agents on other nodes (this node lost its
  memory, or the rank came back on another node). A read pulls the snapshot into one of this rank's own slots,
  every tensor checked against its checksum (``easyckpt.node.replicas`` does the pulling), then reads it from there
  like the own-memory tier.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from easyckpt.node import replicas as replica
from easyckpt.node.client import Unanswered
from easyckpt.recovery.template import Template, check_template, place
from easyckpt.recovery.tier import Loaded, Offer
from easyckpt.snapshot.slots import RankSlots
from easyckpt.snapshot.state import torch_dtype
from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.records import PeerTable
from easyckpt_wire.shm import SlotFormatError, format_bytes

logger = logging.getLogger(__name__)

# step -> (slot generation, tensor checksums) the node agent took of this rank's snapshot, or why there are none
Checksums = Callable[[int], "tuple[int, list[bytes]] | str"]


def memory_health(slots: RankSlots, steps: Sequence[int], timeout: float) -> dict[int, RankHealth]:
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


def read_slot(slots: RankSlots, step: int, template: Template, timeout: float,
              expected: tuple[int, list[bytes]] | None, source: str) -> Loaded:
    """Read this rank's slot of ``step``; with ``expected`` (the agent's checksums of that very snapshot) every
    tensor is verified before use. Tensors not in the template are copied out: nothing returned is a view of
    shared memory."""
    with slots.read(step, timeout) as read:
        meta = read.meta
        check_template(meta.tensors, template, step, "memory")
        if expected is not None and expected[0] == read.generation:
            read.verify(expected[1])
        elif expected is not None:
            logger.info("rank %d: step %d read from memory unverified: the agent's checksums are of another write of "
                        "slot %s", meta.rank, step, read.path.name)
        values, nbytes = [], 0
        for entry in meta.tensors:
            if entry.nbytes == 0:
                raw = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
            else:
                raw = torch.frombuffer(read.data(entry), dtype=torch.uint8).view(
                    torch_dtype(entry.dtype)).view(entry.shape)
            values.append(place(entry, raw, template, owned=False))
            nbytes += entry.nbytes
            del raw
        return Loaded(meta.skeleton, values, str(read.path), nbytes, source)


class OwnMemoryTier:
    """This rank's own slots. Local: each rank reads its own."""

    source = "memory"
    collective = False

    def __init__(self, slots: RankSlots, *, rank: int, timeout: float, peers: PeerTable | None = None,
                 peer_timeout: float = 10.0, checksums: Checksums | None = None,
                 silent: replica.Silent | None = None) -> None:
        self.slots, self.rank, self.timeout = slots, rank, timeout
        self.peers, self.peer_timeout, self.checksums = peers, peer_timeout, checksums
        self.silent = {} if silent is None else silent
        self.unanswered: str | None = None   # the node agent did not answer a checksum request in this load

    def offer(self) -> Offer:
        return Offer.of(memory_health(self.slots, list(self.slots.committed()), self.timeout).items())

    def holds(self, step: int) -> bool:
        return step in self.slots.committed()

    def read(self, step: int, template: Template) -> Loaded:
        expected: tuple[int, list[bytes]] | None = None
        if self.checksums is not None and self.unanswered is not None:
            logger.info("rank %d: step %d read from memory unverified: the node agent did not answer earlier in this "
                        "load (%s)", self.rank, step, self.unanswered)
        elif self.checksums is not None:   # from this node's agent over its control socket
            found = self.checksums(step)
            if isinstance(found, Unanswered):
                self.unanswered = found
                logger.warning("rank %d: step %d read from memory unverified: %s; it is not asked again during this "
                               "load", self.rank, step, found)
            elif isinstance(found, str):
                logger.info("rank %d: step %d read from memory unverified: %s", self.rank, step, found)
            else:
                expected = found
        elif self.peers is not None:   # from this node's agent's replica server
            expected = replica.own_checksums(self.peers, self.rank, step, self.peer_timeout, self.silent)
        return read_slot(self.slots, step, template, self.timeout, expected, self.source)


class ReplicaTier:
    """Steps whose every tensor some reachable agent holds for this rank (``replica.plan``), besides the steps
    this rank holds itself. Local: each rank pulls its own."""

    source = "replica"
    collective = False

    def __init__(self, peers: PeerTable, slots: RankSlots, *, rank: int, survey: replica.Survey | None = None,
                 timeout: float = 120.0, peer_timeout: float = 10.0, silent: replica.Silent | None = None) -> None:
        self.peers, self.slots, self.rank = peers, slots, rank
        self.survey, self.timeout, self.peer_timeout = survey, timeout, peer_timeout
        self.silent = {} if silent is None else silent   # agents that did not answer in this load
        self.plans: dict[int, replica.ReplicaPlan] = {}

    def offer(self) -> Offer:
        found = self.survey if self.survey is not None else replica.survey(self.peers, self.peer_timeout)
        for node, problem in sorted(found.unreachable.items()):
            logger.warning("rank %d: agent of node %s is unreachable (%s): its replicas are not used", self.rank, node,
                           problem)
        own = self.slots.committed()
        plans = replica.plan(self.peers, found, self.rank, self.peer_timeout, self.silent)
        # Plans of steps this rank holds itself stay too: pulled if its own copy turns out damaged (the ladder);
        # only the others are offered.
        self.plans = plans
        if not own and not plans and any(found.listings.values()):
            # This node lost the rank's memory and no replica stands in: say what each agent does hold, which
            # tells a backup that never arrived from a survey that did not see it (CI, 2026-11-28, S3 node loss).
            held = {node: {step: sorted(rows[step].ranks) for step in sorted(rows)[-3:]}
                    for node, rows in sorted(found.listings.items())}
            logger.info("rank %d: no agent reached holds a replica of this rank's state (node: {step: ranks} of "
                        "the newest steps each holds: %s)", self.rank, held)
        return Offer.of((step, plan.manifest.meta.health) for step, plan in self.plans.items() if step not in own)

    def holds(self, step: int) -> bool:
        return step in self.plans

    def read(self, step: int, template: Template) -> Loaded:
        plan = self.plans.get(step)
        if plan is None:
            raise replica.ReplicaError(f"rank {self.rank} holds no plan for step {step}")
        moved = replica.fetch(self.peers, plan, self.slots, rank=self.rank, timeout=self.peer_timeout,
                              silent=self.silent)
        logger.info("rank %d pulled step %d from replicas: %s in %.3fs from %s", self.rank, step,
                    format_bytes(moved["bytes"]), moved["seconds"], sorted(moved["peers"]))
        # Verified tensor by tensor as it arrived: no agent checksums to compare again.
        return read_slot(self.slots, step, template, self.timeout, None, self.source)
