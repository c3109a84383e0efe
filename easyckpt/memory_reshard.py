"""Resume on another world size straight from the saved world's memory: moved into the recovery package.

The planning, discovery and tier are ``easyckpt.recovery.worlds``, the reading
``easyckpt.recovery.reshard``; this module keeps the names it always had importable.
"""
from __future__ import annotations

import warnings

from easyckpt.recovery.reshard import (
    LocalSnapshot,
    MemoryReader,
    OldSnapshot,
    ReplicaSnapshot,
    load_into,
    memory_index,
    open_sources,
    private_records,
    read,
    summary,
)
from easyckpt.recovery.worlds import (
    LOCAL,
    MAX_CANDIDATES,
    SOURCE,
    Candidate,
    Held,
    LocalSlot,
    MemoryReshardError,
    OtherWorldTier,
    Reachable,
    add_replicas,
    agree,
    agreed,
    choose,
    complete_steps,
    describe_sources,
    discover,
    encode,
    local_snapshots,
    merge,
    pick,
    release_old_world,
    this_nodes_agent,
)

__all__ = [
    "LOCAL", "MAX_CANDIDATES", "SOURCE", "Candidate", "Held", "LocalSlot", "LocalSnapshot", "MemoryReader",
    "MemoryReshardError", "OldSnapshot", "OtherWorldTier", "Reachable", "ReplicaSnapshot", "add_replicas", "agree",
    "agreed", "choose", "complete_steps", "describe_sources", "discover", "encode", "load_into", "local_snapshots",
    "memory_index", "merge", "open_sources", "pick", "private_records", "read", "release_old_world",
    "summary", "this_nodes_agent",
]

warnings.warn("easyckpt.memory_reshard moved: import its planning and discovery from easyckpt.recovery.worlds and its "
              "reading (MemoryReader, read) from easyckpt.recovery.reshard", DeprecationWarning,
              stacklevel=2)
