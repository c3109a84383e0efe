"""easyckpt: near-free checkpoints for PyTorch training.

Each rank snapshots its full training state into shared memory every ``save_mem_interval`` steps; a
per-node agent persists every ``save_storage_interval``-th snapshot; a restarted job resumes from
memory when it can and from disk otherwise. See ``Checkpointer``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from easyckpt.checkpointer import Checkpointer, FlushResult
    from easyckpt.config import CheckpointerConfig
    from easyckpt.health import DataSkipper, TrainingAborted
    from easyckpt.node.client import AgentElsewhereError
    from easyckpt.node.persist_watch import PersistError
    from easyckpt.recovery import LoadError, LoadResult, StateMismatchError
    from easyckpt.snapshot.shm_space import ShmSpaceError
    from easyckpt.storage import CheckpointCorruptError
    from easyckpt_wire.layout import CheckpointFormatError
    from easyckpt_wire.owner import SaveDirInUseError

__all__ = [
    "AgentElsewhereError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "Checkpointer",
    "CheckpointerConfig",
    "DataSkipper",
    "FlushResult",
    "LoadError",
    "LoadResult",
    "PersistError",
    "SaveDirInUseError",
    "ShmSpaceError",
    "StateMismatchError",
    "TrainingAborted",
]
__version__ = "0.1.0"

# Imported on first use (PEP 562): most of these pull in torch (~1.5 s), which the ``easyckpt`` CLI and
# the agent's helpers must not pay for just by importing a submodule of this package.
_LAZY = {
    "Checkpointer": "easyckpt.checkpointer", "FlushResult": "easyckpt.checkpointer",
    "CheckpointerConfig": "easyckpt.config",
    "DataSkipper": "easyckpt.health", "TrainingAborted": "easyckpt.health",
    "LoadResult": "easyckpt.recovery", "LoadError": "easyckpt.recovery", "StateMismatchError": "easyckpt.recovery",
    "ShmSpaceError": "easyckpt.snapshot.shm_space",
    "PersistError": "easyckpt.node.persist_watch", "AgentElsewhereError": "easyckpt.node.client",
    "CheckpointCorruptError": "easyckpt.storage",
    "CheckpointFormatError": "easyckpt_wire.layout",
    "SaveDirInUseError": "easyckpt_wire.owner",
}
# An eager ``import easyckpt`` used to load these submodules as a side effect, and user code relies on
# it (``import easyckpt; easyckpt.state.flatten(...)``); ``megatron`` and ``transformers`` were never
# among them: they need optional packages, which a mere attribute probe must not import. ``health`` is
# reached the same way (``easyckpt.health.embedding_local_norm``, as the README shows). Several of them
# have since moved into box packages (``snapshot``, ``node``): the old attribute names still reach them.
_EAGER_BEFORE = {"agent_client": "node.client", "checkpointer": "checkpointer", "config": "config", "health": "health",
                 "recovery": "recovery", "replica": "node.replicas", "slots": "snapshot.slots",
                 "stager": "snapshot.stager", "state": "snapshot.state", "storage": "storage"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name in _EAGER_BEFORE:
        return importlib.import_module(f"{__name__}.{_EAGER_BEFORE[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
