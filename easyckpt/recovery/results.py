"""What ``load()`` returns and raises: the result of a resume and the three ways it fails.

They are defined here, below every tier, so that the tiers and the ladder share them without importing each
other; ``easyckpt.recovery`` re-exports them, and their ``__module__`` says so: reprs, pickles and
``easyckpt.LoadError.__module__`` name the path users import them from.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from easyckpt_wire.shm import format_bytes

PUBLIC_MODULE = "easyckpt.recovery"


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    __module__ = PUBLIC_MODULE

    step: int | None
    source: str | None          # "memory" | "replica" | "disk" | None (nothing to resume from)
    state: Any
    path: str | None = None     # the iteration directory or slot file it came from
    seconds: float = 0.0
    nbytes: int = 0

    def describe(self) -> str:
        """``step 33 from memory (50.3 MiB, 7.1 ms)``: where a resume came from, for its one log line."""
        where = f"{self.path}, " if self.source == "disk" else ""
        took = f"{self.seconds:.2f} s" if self.seconds >= 0.1 else f"{self.seconds * 1000:.1f} ms"
        return f"step {self.step} from {self.source} ({where}{format_bytes(self.nbytes)}, {took})"


class StateMismatchError(ValueError):
    """The caller's state does not fit the checkpoint (shapes or dtypes differ)."""

    __module__ = PUBLIC_MODULE


class LayoutChangedError(StateMismatchError):
    """The state is split differently from the checkpoint (another mesh, tensor-parallel or world size) while
    the global shapes agree: the resharded load from disk can fill it (``load(reshard=True)``)."""

    __module__ = PUBLIC_MODULE


class LoadError(RuntimeError):
    """No candidate step could be loaded by every rank."""

    __module__ = PUBLIC_MODULE
