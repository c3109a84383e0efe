"""Recovery: agree on one step for all ranks, then load it from the cheapest tier that has it.

``load()`` (``ladder``) is the ladder over the tiers, each a ``Tier`` (``tier``): this rank's own memory and
replicas on other nodes (both read through this rank's slots: ``memory``), another world's memory (``reshard``,
planned in ``worlds``) and storage (``disk``). The ranks agree on the candidates in ``candidates``; every tier checks and
fills the caller's template through ``template``. What ``load()`` returns and raises is in ``results``.
"""
from __future__ import annotations

from easyckpt.recovery.candidates import (
    MAX_DISK_CANDIDATES,
    candidates,
    candidates_with_health,
    pass_over_unhealthy,
)
from easyckpt.recovery.ladder import build_tiers, load
from easyckpt.recovery.results import LayoutChangedError, LoadError, LoadResult, StateMismatchError
from easyckpt.recovery.template import Target, dcp_targets, layout_changed, shown, template_targets
from easyckpt.recovery.tier import RETRYABLE, Loaded, Offer, Offered, Tier

__all__ = [
    "MAX_DISK_CANDIDATES",
    "RETRYABLE",
    "LayoutChangedError",
    "LoadError",
    "LoadResult",
    "Loaded",
    "Offer",
    "Offered",
    "StateMismatchError",
    "Target",
    "Tier",
    "build_tiers",
    "candidates",
    "candidates_with_health",
    "dcp_targets",
    "layout_changed",
    "load",
    "pass_over_unhealthy",
    "shown",
    "template_targets",
]
