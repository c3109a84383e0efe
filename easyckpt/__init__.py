"""easyckpt: near-free checkpoints for PyTorch training.

Each rank snapshots its full training state into shared memory every ``save_mem_interval`` steps; a
per-node agent persists every ``save_storage_interval``-th snapshot; a restarted job resumes from
memory when it can and from disk otherwise. See ``Checkpointer``.
"""
from easyckpt.checkpointer import Checkpointer, FlushResult
from easyckpt.config import CheckpointerConfig
from easyckpt.recovery import LoadError, LoadResult, StateMismatchError
from easyckpt.slots import ShmSpaceError
from easyckpt.storage import CheckpointCorruptError
from easyckpt_wire.layout import CheckpointFormatError

__all__ = ["Checkpointer", "FlushResult", "CheckpointerConfig", "LoadResult", "LoadError", "StateMismatchError",
           "ShmSpaceError", "CheckpointCorruptError", "CheckpointFormatError"]
__version__ = "0.1.0"
