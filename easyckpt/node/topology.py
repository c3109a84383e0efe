"""Where a rank sits: its rank and world, and its place among the ranks of its node.

The node's agent counts on ``local_world_size``: it persists a step once that many ranks of its node hold it,
and a job is multi-node (replicas, the job-wide agreement) when the world is larger. A count that is too large
is not harmless: the agent waits for ranks that live on other nodes, persists nothing and holds every rank's
``close()`` until ``flush_timeout`` (measured 2026-12-06: 2 nodes x 2 ranks under torchrun with
``LOCAL_WORLD_SIZE`` removed, nothing persisted in 30 steps and the job hung at its end).

torchrun says it in ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; DeepSpeed's launcher in ``LOCAL_RANK`` and
``LOCAL_SIZE``; Open MPI, MPICH and Intel MPI in their own variables. Others say less: Lightning's own launcher
sets ``LOCAL_RANK`` in the ranks it starts and nothing in the first one, Slurm's ``srun`` a count per node in a
compressed list. When no variable gives the count and a process group is up, the ranks ask each other: one
all-gather of each rank's node name (``EASYCKPT_NODE_ID``, else the host name), which is what the agents call
their nodes too.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping

import torch.distributed as dist

from easyckpt.collectives import all_gather_text
from easyckpt_wire.protocol import NODE_ID_ENV, node_id

logger = logging.getLogger(__name__)

# (variable, launcher), first match wins: torchrun's first, the name most tools read
LOCAL_SIZE_VARS = (("LOCAL_WORLD_SIZE", "torchrun"), ("LOCAL_SIZE", "the DeepSpeed launcher"),
                   ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"), ("MPI_LOCALNRANKS", "MPICH or Intel MPI"))
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
NODE_NAME_BYTES = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """A rank's place: ``rank`` of ``world_size``, ``local_rank`` of the ``local_world_size`` ranks of its node;
    ``source`` says where the local figures came from (for the log and for errors)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number: the launcher sets it to this process's place on "
                         "its node; unset it or fix it") from None


def from_environment(environ: Mapping[str, str], rank: int, world_size: int) -> Placement | None:
    """The placement the launcher's variables give, or None when none gives this node's rank count. A value
    that cannot be right (a local rank outside the node, a node larger than the world) is a ValueError naming
    the variable."""
    found = next(((name, who) for name, who in LOCAL_SIZE_VARS if environ.get(name, "").strip()), None)
    if found is None:
        return None
    name, who = found
    local_world = _int(environ, name)
    assert local_world is not None
    rank_var = next((var for var in LOCAL_RANK_VARS if environ.get(var, "").strip()), None)
    local_rank = _int(environ, rank_var) if rank_var is not None else rank % max(1, local_world)
    if not 1 <= local_world <= world_size:
        raise ValueError(f"rank {rank}: {name}={local_world} (set by {who}) is not between 1 and the world size "
                         f"{world_size}: the ranks of one node cannot be more than the job's; fix or unset {name}")
    assert local_rank is not None
    if not 0 <= local_rank < local_world:
        raise ValueError(f"rank {rank}: {rank_var or 'its rank'}={local_rank} is not a rank of a node of "
                         f"{local_world} ({name}, set by {who}); fix or unset the variables")
    return Placement(rank, world_size, local_rank, local_world, f"{name} ({who})")


def from_node_names(names: list[str], rank: int) -> Placement:
    """The placement of ``rank`` among the ranks whose node name is its own (``names`` in rank order)."""
    mine = names[rank]
    together = [other for other, name in enumerate(names) if name == mine]
    return Placement(rank, len(names), together.index(rank), len(together),
                     f"the node names of the process group ({NODE_ID_ENV} or the host name)")


def place(rank: int, world_size: int, environ: Mapping[str, str],
          gather: Callable[[], list[str]] | None) -> Placement:
    """This rank's placement: from the launcher's variables; else, with ``gather`` (every rank's node name, a
    collective), from the node names; else the whole world on this node (a job without a process group)."""
    if world_size <= 1:
        return Placement(rank, world_size, 0, 1, "a job of one rank")
    found = from_environment(environ, rank, world_size)
    if found is not None:
        return found
    if gather is not None:
        placement = from_node_names(gather(), rank)
        if placement.local_rank == 0:
            logger.info("rank %d: no launcher variable names the ranks of this node (%s): the process group says "
                        "%d of the %d ranks are on this node", rank, ", ".join(name for name, _ in LOCAL_SIZE_VARS),
                        placement.local_world_size, world_size)
        return placement
    local_rank = _int(environ, "LOCAL_RANK")
    return Placement(rank, world_size, rank if local_rank is None else local_rank, world_size,
                     "no variable and no process group: every rank taken for one of this node")


def current() -> Placement:
    """This process's placement: rank and world from the process group when one is up (else ``RANK`` and
    ``WORLD_SIZE``), the rest by :func:`place`. A collective when no launcher variable gives the count."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return place(rank, world, os.environ,
                     functools.partial(all_gather_text, node_id(), world, field=NODE_NAME_BYTES))
    return place(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), os.environ, None)
