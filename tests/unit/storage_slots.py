"""Real committed slot files for the persister's unit tests: laid out as the stager lays them (each file group
from a page boundary, its tensors back to back), so the persister reads exactly what it reads in a job.
Also imported by the child processes that the crash tests kill."""
from __future__ import annotations

from pathlib import Path

import numpy

from easyckpt_agent.rankfiles import RankSnapshot
from easyckpt_wire import layout, shm
from easyckpt_wire.records import SlotMeta, TensorEntry

WORLD = 2


def tensors(rank: int, step: int) -> dict[str, numpy.ndarray]:
    """Rank ``rank``'s state at ``step``: a model tensor of several pages and an odd tail, a complex buffer (a
    rotary embedding's freqs_cis), a small one, and an optimizer tensor (its own file)."""
    rng = numpy.random.default_rng(1000 * step + rank)
    return {"model/w": rng.standard_normal(3000, dtype=numpy.float32),       # 12000 bytes: 2 pages + a tail
            "model/freqs_cis": numpy.exp(1j * numpy.arange(6, dtype=numpy.float32) * (step + 1)).astype(numpy.complex64),
            "model/b": numpy.arange(7, dtype=numpy.int64) + step,
            "optim/m": rng.standard_normal((33, 5), dtype=numpy.float32)}


_DTYPES = {numpy.dtype(numpy.float32): "F32", numpy.dtype(numpy.int64): "I64", numpy.dtype(numpy.complex64): "C64"}


def snapshot(directory: Path, rank: int, step: int) -> RankSnapshot:
    """Write rank ``rank``'s slot file for ``step`` into ``directory`` and map it as the agent does."""
    entries, blob = [], bytearray()
    for group in ("model", "opt"):
        blob += b"\0" * (-len(blob) % shm.PAGE)
        for name, array in tensors(rank, step).items():
            if layout.tensor_group(name) != group:
                continue
            data = array.tobytes()
            entries.append(TensorEntry(name, "numpy", _DTYPES[array.dtype], tuple(array.shape), len(blob), len(data),
                                       group))
            blob += data
    path = directory / f"slot-{rank}-{step}"
    path.write_bytes(b"\0" * shm.slot_size(len(blob), 4096))
    slot = shm.SlotMap(path, writable=True)
    with slot.data(0, len(blob)) as view:
        view[:] = blob
    meta = SlotMeta(job="j", rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD, pid=None,
                    pid_start=None, skeleton_version=1, tensors=tuple(entries), step=step,
                    skeleton={"step": step}, created=0.0)
    return RankSnapshot(rank, slot, meta)


def snapshots(directory: Path, step: int, ranks: range = range(WORLD)) -> list[RankSnapshot]:
    return [snapshot(directory, rank, step) for rank in ranks]


def close(snaps: list[RankSnapshot]) -> None:
    """Unmap the slots: fails (BufferError) if the persister left a view of one alive."""
    for snap in snaps:
        snap.slot.close()
