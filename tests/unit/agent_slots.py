"""Real slot files for the agent's unit tests: what a node's ranks leave in shared memory, without the ranks.

:class:`FakeRanks` writes slots the way a rank's stager does (``easyckpt_wire.shm.SlotMap``: WRITING under an
exclusive flock, then the metadata and a COMMITTED header), into a temporary directory, with real tensor bytes
that the persister can write to disk. A rank that is "alive" is this very process (its pid and start time); a
"dead" one names this pid with another start time, which the watcher takes for a recycled pid.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from easyckpt_agent import policy
from easyckpt_agent.server import Agent, AgentConfig
from easyckpt_agent.watcher import SlotInfo, Watcher
from easyckpt_wire import procs, protocol
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import SlotMeta, TensorEntry
from easyckpt_wire.shm import SlotMap, pack_meta, slot_path, slot_size

JOB = "unitjob"
TENSOR = TensorEntry("model/w", "torch", "F32", (4,), 0, 16, "model")
START = procs.start_time()


class FakeRanks:
    def __init__(self, shm_dir: Path, *, ranks: int = 2, slots: int = 3, world_size: int | None = None,
                 first_rank: int = 0) -> None:
        self.shm_dir = shm_dir
        self.ranks = list(range(first_rank, first_rank + ranks))
        self.world_size = world_size or ranks
        self.local_world_size = ranks
        self.slots = slots
        self.pid_start = {rank: START for rank in self.ranks}
        self.generation = {rank: 0 for rank in self.ranks}
        size = slot_size(TENSOR.nbytes, 64 << 10)
        self.maps: dict[tuple[int, int], SlotMap] = {}
        for rank in self.ranks:
            for slot in range(slots):
                path = slot_path(shm_dir, JOB, rank, slot)
                with open(path, "wb") as handle:
                    handle.truncate(size)
                slot_map = SlotMap(path, writable=True)
                slot_map.init_empty(rank=rank, world_size=self.world_size, job_id=JOB)
                self.maps[rank, slot] = slot_map

    def kill(self, rank: int) -> None:
        """From now on the rank's snapshots name a process that is gone (this pid, another start time)."""
        self.pid_start[rank] = 1.0

    def path(self, rank: int, slot: int) -> Path:
        return self.maps[rank, slot].path

    def commit(self, rank: int, slot: int, step: int) -> int:
        """A complete snapshot of ``step`` in the rank's slot; returns its (committed) generation."""
        with self.writing(rank, slot) as slot_map:
            generation = slot_map.generation()
            with slot_map.data(TENSOR.offset, TENSOR.nbytes) as view:
                view[:] = struct.pack("<4f", *(float(step + i) for i in range(4)))
            meta = SlotMeta(job=JOB, rank=rank, world_size=self.world_size, local_rank=rank - self.ranks[0],
                            local_world_size=self.local_world_size, pid=os.getpid(), pid_start=self.pid_start[rank],
                            skeleton_version=1, tensors=(TENSOR,), step=step, skeleton={"step": step}, created=0.0)
            slot_map.commit(generation=generation, step=step, data_len=TENSOR.nbytes, meta=pack_meta(meta.to_wire()),
                            rank=rank, world_size=self.world_size, job_id=JOB)
        return generation + 1

    def commit_all(self, slot: int, step: int) -> None:
        for rank in self.ranks:
            self.commit(rank, slot, step)

    @contextlib.contextmanager
    def writing(self, rank: int, slot: int) -> Iterator[SlotMap]:
        """The rank is rewriting this slot: WRITING, under its exclusive flock, until the block ends."""
        slot_map = self.maps[rank, slot]
        if not slot_map.try_lock(exclusive=True):
            raise AssertionError(f"rank {rank} cannot write its slot {slot}: the agent holds it")
        generation = self.generation[rank] + 1   # odd while writing; the commit makes it the next even one
        self.generation[rank] = generation + 1
        try:
            slot_map.begin_write(generation=generation, rank=rank, world_size=self.world_size, job_id=JOB)
            yield slot_map
        finally:
            slot_map.unlock()

    def writable(self, rank: int, slot: int) -> bool:
        """Whether the rank could take its slot for a snapshot now (nothing holds it)."""
        slot_map = self.maps[rank, slot]
        if not slot_map.try_lock(exclusive=True):
            return False
        slot_map.unlock()
        return True

    def close(self) -> None:
        for slot_map in self.maps.values():
            slot_map.close()


def decode_reply(blob: bytes) -> dict[str, Any]:
    """A reply the agent sends, through the wire format's checks."""
    kind, message = protocol.decode(blob)
    assert kind == Kind.REPLY
    return message


def held(watcher: Watcher) -> tuple[set[int], dict[int, dict[int, SlotInfo]], frozenset[int]]:
    """What the agent's round hands its parts: the local ranks, each one's committed slots, the common steps."""
    ranks = watcher.local_ranks()
    committed = {rank: watcher.committed(rank) for rank in ranks}
    return ranks, committed, policy.common_steps(committed, watcher.local_world_size)


class Harness:
    """A real ``Agent`` (its parts wired as in production) over :class:`FakeRanks`, driven by hand: no loop, no
    socket traffic (replies are decoded into ``sent`` instead of going out on the ROUTER socket)."""

    def __init__(self, tmp_path: Path, *, ranks: int = 2, world_size: int | None = None, slots: int = 3,
                 first_rank: int = 0, **config: Any) -> None:
        self.shm_dir = tmp_path / "shm"
        self.shm_dir.mkdir()
        self.save_dir = tmp_path / "ckpt"
        self.ranks = FakeRanks(self.shm_dir, ranks=ranks, world_size=world_size, slots=slots, first_rank=first_rank)
        self.config = AgentConfig(save_dir=self.save_dir, job_id=JOB, shm_dir=self.shm_dir, job_dir=tmp_path / "run",
                                  **{"save_storage_interval": 5, "persist_threads": 1, **config})
        self.agent = Agent(self.config)
        self.sent: list[tuple[bytes, dict[str, Any]]] = []
        self.agent._send = self._capture   # type: ignore[method-assign]

    def _capture(self, identity: bytes, blob: bytes) -> None:
        self.sent.append((identity, decode_reply(blob)))

    def request(self, identity: bytes, kind: Kind, **fields: Any) -> None:
        """A rank's request, through the wire format's checks, to the agent's dispatch."""
        decoded_kind, message = protocol.decode(protocol.encode(kind, **fields))
        self.agent._handle(identity, decoded_kind, message)

    def scan(self) -> tuple[set[int], dict[int, dict[int, SlotInfo]], frozenset[int]]:
        self.agent.watcher.scan(relist_every=0)
        return held(self.agent.watcher)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait for the persist in flight (if any) to end, and take its outcome."""
        scheduler = self.agent.scheduler
        if scheduler.inflight is not None:
            concurrent.futures.wait([scheduler.inflight[1]], timeout=timeout)
            assert scheduler.inflight[1].done(), f"the persist of step {scheduler.inflight[0]} took over {timeout}s"
            scheduler.finish_inflight()

    def close(self) -> None:
        self.agent._shutdown()
        self.ranks.close()
