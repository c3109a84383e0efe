"""What a persist shares between one node (``easyckpt_agent.persister``) and several (``easyckpt_agent.stages``): the
space check
before anything is written, the marker that commits an iteration, the one-line failure, and its figures.

The marker (``metadata.json``) is written last, after ``common.json`` and after every rank file is durable
(``Pending.seal``); only then is the iteration published (invariant 3).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import time
import traceback
from typing import Any

from easyckpt_agent.rankfiles import RankSnapshot, SlotChanged, bytes_needed
from easyckpt_wire import layout
from easyckpt_wire.faults import fault_point
from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.shm import format_bytes
from easyckpt_wire.storage import Pending, Storage

# The announcement of every persist, single node or stage, keeps the persister's name: operators and tests
# grep the agent log for "easyckpt_agent.persister: persisting step N".
_announce = logging.getLogger("easyckpt_agent.persister")


class PersistFailed(Exception):
    """A persist that did not reach disk, in one line: the path, the errno, and the space it needed.

    Raised instead of the OSError from deep in a writer thread, whose 40-line traceback says nothing that
    the path and the errno do not, and whose frames would keep views of the slots alive.
    """

    def __init__(self, step: int, path: object, errno_: int, strerror: str, *, needed: int | None = None,
                 free: int | None = None) -> None:
        self.step, self.path, self.errno, self.strerror = step, str(path), errno_, strerror
        self.needed, self.free = needed, free
        super().__init__(self.text())

    def text(self) -> str:
        return f"{self.path}: [Errno {self.errno}] {self.strerror}" if self.errno else f"{self.path}: {self.strerror}"

    def describe(self) -> str:
        space = ""
        if self.needed is not None and self.free is not None:
            space = f" (needs {format_bytes(self.needed)}; {format_bytes(self.free)} were free when it started)"
        return f"persist of step {self.step} failed: {self.text()}{space}"


class StepAbandoned(RuntimeError):
    """A persist finished after a resume abandoned its step: nothing was published."""


@dataclasses.dataclass(frozen=True, slots=True)
class PersistStats:
    step: int
    path: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def describe(stats: PersistStats, ranks: int) -> str:
    return (f"persisted step={stats.step} ranks={ranks} bytes={stats.nbytes} ({format_bytes(stats.nbytes)}) "
            f"seconds={stats.seconds:.4f} GB/s={stats.gbps:.2f} path={stats.path}")


def enough_space(needed: int, free: int | None) -> bool:
    """Whether a persist of ``needed`` bytes may start: a storage that does not say is given the benefit of
    the doubt (the write itself then fails cleanly if it must)."""
    return free is None or needed <= free


def check_space(store: Storage, step: int, snapshots: list[RankSnapshot]) -> tuple[int, int | None]:
    """Say how much a persist needs and how much is free before anything is written; raise PersistFailed
    (ENOSPC) at once when it cannot fit, instead of filling the file system up for nothing."""
    needed, free = bytes_needed(snapshots), store.free_bytes()
    _announce.info("persisting step %d to %s: about %s to write, %s free", step, store.where(), format_bytes(needed),
                "unknown" if free is None else format_bytes(free))
    if not enough_space(needed, free):
        raise PersistFailed(step, store.where(), errno.ENOSPC, "not enough free space for this persist, nothing written",
                            needed=needed, free=free)
    return needed, free


def failure(exc: BaseException, step: int, where: str, needed: int | None, free: int | None) -> PersistFailed | None:
    """An OSError as a one-line PersistFailed (None for anything else, which is a bug worth its traceback).
    The traceback's frames are cleared: they hold views of the slots, which must not outlive the persist."""
    if isinstance(exc, PersistFailed):
        return exc
    if isinstance(exc, SlotChanged):
        return PersistFailed(step, exc.path, 0, str(exc))
    if not isinstance(exc, OSError):
        return None
    traceback.clear_frames(exc.__traceback__)
    return PersistFailed(step, exc.filename or where, exc.errno or 0, exc.strerror or str(exc), needed=needed,
                         free=free)


to_json = layout.dump_json


def seal(pending: Pending, step: int, world_size: int, ranks_meta: dict[str, Any], common: dict[str, Any],
         nbytes: int, verdict: RankHealth = NEUTRAL) -> None:
    """``common.json``, then the commit marker: the iteration is complete (still to be published)."""
    # Before anything of the marker: a replicated shard whose writer's file lacks it fails the persist here.
    layout.link_replicas(ranks_meta, f"step {step} in {pending.where}")
    common_bytes = to_json({"format": layout.METADATA_FORMAT, "step": step, "ranks": common})
    pending.put(layout.COMMON, common_bytes)
    fault_point("agent.persist.before_marker", step=step)
    pending.seal(layout.METADATA, layout.marker_bytes({
        "format": layout.METADATA_FORMAT, "format_version": layout.METADATA_VERSION, "step": step,
        "world_size": world_size, "framework": "pytorch", "created": time.time(),
        "checksum_algo": layout.CHECKSUM_ALGO, "bytes": nbytes, "health": verdict.to_wire(), "ranks": ranks_meta,
        layout.COMMON_CHECKSUM: layout.json_checksum(common_bytes),
    }))
