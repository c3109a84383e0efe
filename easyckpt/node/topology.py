"""Where a rank sits: its rank and world, and its place among the ranks of its node.

The node's agent counts on ``local_world_size``: it persists a step once that many ranks of its node hold it,
and a job is multi-node (replicas, the job-wide agreement) when the world is larger. A count that is too large
is not harmless: the agent waits for ranks that live on other nodes, persists nothing and holds every rank's
``close()`` (measured 2026-12-06: 2 nodes x 2 ranks under torchrun with ``LOCAL_WORLD_SIZE`` removed, and under
Lightning's own launcher with ``num_nodes=2``: nothing persisted, not a word, the job hung at its end).

torchrun says it in ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, and a torchrun worker takes them as they are (no
collective). Other launchers say it otherwise (DeepSpeed's launcher ``LOCAL_SIZE``; Open MPI, MPICH and Intel MPI
their own variables), say less (Lightning's launcher sets ``LOCAL_RANK`` in the ranks it starts and nothing in the
first one; Slurm's ``srun`` a compressed list), or say it wrong: Accelerate on CPU writes ``LOCAL_WORLD_SIZE=1``
into every rank that the DeepSpeed launcher started with ``LOCAL_SIZE=2``, a value each rank alone cannot tell
from a true one. So outside torchrun, when a process group is up, the ranks all-gather what each one was told
and its node name (``EASYCKPT_NODE_ID``, else the host name: what the agents call their nodes), once: the
launcher's variables when they agree job-wide, else the node names.
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
GATHER_BYTES = 320   # a node name (at most 255 bytes: a host name) and two numbers


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """A rank's place: ``rank`` of ``world_size``, ``local_rank`` of the ``local_world_size`` ranks of its node;
    ``source`` says where the local figures came from (for the log and for errors)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str


@dataclasses.dataclass(frozen=True, slots=True)
class Told:
    """What one rank was told: its node name and the launcher's local rank and count (None when unset)."""

    node: str
    local_rank: int | None
    local_world: int | None

    def encode(self) -> str:
        return "\n".join((self.node, "" if self.local_rank is None else str(self.local_rank),
                          "" if self.local_world is None else str(self.local_world)))

    @classmethod
    def decode(cls, text: str) -> Told:
        node, rank, world = text.rsplit("\n", 2)
        return cls(node, int(rank) if rank else None, int(world) if world else None)


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number: the launcher sets it to this process's place on "
                         "its node; unset it or fix it") from None


def _size_var(environ: Mapping[str, str]) -> tuple[str, str] | None:
    return next(((name, who) for name, who in LOCAL_SIZE_VARS if environ.get(name, "").strip()), None)


def _rank_var(environ: Mapping[str, str]) -> str | None:
    return next((var for var in LOCAL_RANK_VARS if environ.get(var, "").strip()), None)


def told(environ: Mapping[str, str], node: str) -> Told:
    """What the launcher's variables tell this rank (the first of each list that is set). A value that is no
    number counts as unset: this rank must still join the gather, and the job-wide check says what is missing."""
    size, rank = _size_var(environ), _rank_var(environ)

    def number(name: str | None) -> int | None:
        try:
            return _int(environ, name) if name else None
        except ValueError:
            return None
    return Told(node, number(rank), number(size[0] if size else None))


def from_environment(environ: Mapping[str, str], rank: int, world_size: int) -> Placement | None:
    """The placement the launcher's variables give, or None when none gives this node's rank count. A value
    that cannot be right (a local rank outside the node, a node larger than the world) is a ValueError naming
    the variable."""
    found = _size_var(environ)
    if found is None:
        return None
    name, who = found
    local_world = _int(environ, name)
    assert local_world is not None
    rank_var = _rank_var(environ)
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


def disagreement(rows: list[Told]) -> str | None:
    """Why the launcher's variables of the whole job cannot be taken (None when they can): one count for every
    rank, dividing the world, and every local rank inside it, each count of local ranks met once per node."""
    if any(row.local_world is None for row in rows):
        missing = [rank for rank, row in enumerate(rows) if row.local_world is None]
        return f"no variable counts the ranks of the node of rank(s) {missing[:8]}"
    counts = {row.local_world for row in rows}
    if len(counts) > 1:
        return f"the ranks were told different counts of local ranks ({sorted(c for c in counts if c)})"
    count = counts.pop()
    assert count is not None
    if count < 1 or len(rows) % count:
        return f"{count} local ranks per node do not divide the world of {len(rows)}"
    told_ranks = [row.local_rank if row.local_rank is not None else rank % count for rank, row in enumerate(rows)]
    outside = [rank for rank, local in enumerate(told_ranks) if not 0 <= local < count]
    if outside:
        return f"rank {outside[0]} was told local rank {told_ranks[outside[0]]} of a node of {count}"
    if sorted(told_ranks) != sorted(list(range(count)) * (len(rows) // count)):
        return f"the local ranks told do not make nodes of {count} (each 0 to {count - 1} once per node)"
    return None


def decide(rows: list[Told], rank: int) -> tuple[Placement, str | None]:
    """This rank's placement from what every rank was told: the launcher's variables when they agree job-wide,
    else the node names; with the reason the variables were not taken, when some rank was told a count."""
    why = disagreement(rows)
    if why is None:
        count, mine = rows[rank].local_world, rows[rank].local_rank
        assert count is not None
        return Placement(rank, len(rows), rank % count if mine is None else mine, count,
                         "the launcher's variables, the same on every rank"), None
    # a local rank without a count anywhere (Lightning's launcher) is no disagreement: the names are all there is
    counted = any(row.local_world is not None for row in rows)
    return from_node_names([row.node for row in rows], rank), (why if counted else None)


def place(rank: int, world_size: int, environ: Mapping[str, str],
          gather: Callable[[str], list[str]] | None, node: str = "") -> Placement:
    """This rank's placement. A torchrun worker: its variables. Else, with ``gather`` (every rank's text, a
    collective): :func:`decide` over what every rank was told. Else (no process group) this rank's variables,
    or the whole world on this node."""
    if world_size <= 1:
        return Placement(rank, world_size, 0, 1, "a job of one rank")
    if "TORCHELASTIC_RUN_ID" in environ and _size_var(environ) == ("LOCAL_WORLD_SIZE", "torchrun"):
        found = from_environment(environ, rank, world_size)
        assert found is not None
        return found
    if gather is not None:
        rows = [Told.decode(text) for text in gather(told(environ, node).encode())]
        placement, why = decide(rows, rank)
        if placement.local_rank == 0:
            if why is not None:
                logger.warning("rank %d: the launcher's variables (%s) cannot say which ranks share a node: %s. "
                               "The node names decide (%s, else the host name): %d of the %d ranks are on this node", rank,
                               ", ".join(name for name, _ in LOCAL_SIZE_VARS), why, NODE_ID_ENV,
                               placement.local_world_size, world_size)
            else:
                logger.info("rank %d: %d of the %d ranks are on this node (%s)", rank, placement.local_world_size,
                            world_size, placement.source)
        return placement
    found = from_environment(environ, rank, world_size)
    if found is not None:
        return found
    local_rank = _int(environ, "LOCAL_RANK")
    return Placement(rank, world_size, rank if local_rank is None else local_rank, world_size,
                     "no variable and no process group: every rank taken for one of this node")


def restart_hazard(environ: Mapping[str, str]) -> str | None:
    """Why torchrun's next restart of this worker's group would not come up, or None.

    torchrun shares its rendezvous store with the workers' process group (``TORCHELASTIC_USE_AGENT_STORE=True``)
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. The store outlives an attempt, and the restarted workers are
    handed the previous attempt's addresses (pytorch/pytorch#135712): measured on 2026-12-06 with torch 2.13.0 and
    gloo, DDP workers restarted after a ``kill -9`` (``examples/plain_ddp.py``, nanoGPT's ``train.py``, a bare DDP
    loop) hung in ``init_process_group`` for minutes, with nothing logged, and never resumed. A restarted worker
    cannot say it (it hangs before easyckpt runs), so the first attempt does, while a restart is still to come."""
    if "TORCHELASTIC_RUN_ID" not in environ or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restarts, done = (environ.get(name, "0").strip() for name in ("TORCHELASTIC_MAX_RESTARTS",
                                                                   "TORCHELASTIC_RESTART_COUNT"))
    if not (restarts.isdigit() and done.isdigit() and int(restarts) > int(done)):
        return None   # no restart to come (a count torchrun did not write is not ours to judge)
    return (f"torchrun will restart this job's workers (--max-restarts={restarts}, {done} used) with its rendezvous "
            "store shared with their process group (TORCHELASTIC_USE_AGENT_STORE=True): with it, restarted workers "
            "are handed the previous attempt's addresses and hang in init_process_group (pytorch/pytorch#135712), "
            "so a failure would not resume from memory. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...)")


def current() -> Placement:
    """This process's placement: rank and world from the process group when one is up (else ``RANK`` and
    ``WORLD_SIZE``), the rest by :func:`place` (a collective outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return place(rank, world, os.environ, functools.partial(all_gather_text, world_size=world, field=GATHER_BYTES),
                     node_id())
    return place(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), os.environ, None)
