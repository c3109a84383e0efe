"""The ``Tier`` protocol: one source a rank can get a step's state from, and what it offers and reads.

The ladder (``easyckpt.recovery.ladder``) calls, on every rank, in this order:

1. ``offer()`` of each tier, cheapest first (own memory, replicas on other nodes, another world's memory,
   storage): the steps this rank can get from it, newest first, with this rank's health verdict on each.
   Local and cheap, except where noted on the tier (another world's memory agrees with the other ranks
   there: what a rank can read depends on every rank reaching every old rank).
2. the agreement (``easyckpt.recovery.candidates``, collective): the steps every rank can get, ordered.
3. for each candidate until one loads on every rank: ``holds(step)`` and ``read(step, template)``. A
   ``collective`` tier is read by every rank for the same step; a local one (own memory, replicas) is read
   by each rank from the first local tier that ``holds`` the step, so one rank may read its own memory while
   another pulls the same step from a replica. A read raises StateMismatchError when the template does not
   fit (every rank stops), or one of ``RETRYABLE`` when the source failed (every rank moves on together).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

from easyckpt.node.replicas import ReplicaError
from easyckpt.recovery.template import Template
from easyckpt_wire.health import RankHealth
from easyckpt_wire.layout import CheckpointFormatError
from easyckpt_wire.shm import SlotFormatError

# What a read raises when its source failed (torn, overwritten, corrupt, unreachable, gone): the ladder moves
# every rank on to the next candidate. (StateMismatchError is a ValueError too: the ladder checks it first.)
RETRYABLE: tuple[type[BaseException], ...] = (SlotFormatError, CheckpointFormatError, TimeoutError, ValueError,
                                              KeyError, TypeError, ReplicaError, OSError)


@dataclasses.dataclass(frozen=True, slots=True)
class Offered:
    """One step a tier can give this rank, and this rank's verdict on it."""

    step: int
    healthy: bool = True
    reasons: tuple[str, ...] = ()
    note: str = ""      # where it comes from, for messages ("of the 4-rank world")


@dataclasses.dataclass(frozen=True, slots=True)
class Offer:
    """What one tier can give this rank, newest step first."""

    items: tuple[Offered, ...] = ()

    @classmethod
    def of(cls, verdicts: Iterable[tuple[int, RankHealth]]) -> Offer:
        return cls(tuple(Offered(step, v.healthy, v.reasons) for step, v in sorted(verdicts, key=lambda sv: -sv[0])))

    @property
    def steps(self) -> list[int]:
        return [item.step for item in self.items]

    def item(self, step: int) -> Offered | None:
        return next((item for item in self.items if item.step == step), None)

    def unhealthy(self) -> dict[int, tuple[str, ...]]:
        """{step: reasons} of the steps this rank judges unhealthy."""
        return {item.step: item.reasons for item in self.items if not item.healthy}


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    """One rank's state of a step as a tier read it: ``state.unflatten(skeleton, values)`` rebuilds it."""

    skeleton: Any
    values: list[Any]
    path: str          # where it came from, for the log and LoadResult.path
    nbytes: int
    source: str        # what LoadResult.source says: "memory" | "replica" | "disk"


class Tier(Protocol):
    """A source of a step's state for this rank (see the module docstring for the call order)."""

    source: str        # the candidate label: "memory" | "replica" | "reshard" | "disk"
    collective: bool   # read() is collective: every rank reads this tier for the same step

    def offer(self) -> Offer:
        """The steps this rank can get here, newest first, with its verdict on each."""
        ...

    def holds(self, step: int) -> bool:
        """Whether this rank can read ``step`` here now."""
        ...

    def read(self, step: int, template: Template) -> Loaded:
        """``step`` into the caller's tensors (``template``, by easyckpt name); raises StateMismatchError when it
        does not fit, one of ``RETRYABLE`` when the source failed."""
        ...
