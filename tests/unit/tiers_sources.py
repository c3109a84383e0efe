"""Real sources for the recovery tiers, in one process: slots written by a real Stager in a real shm directory,
iterations written by the agent's own persister, and replicas served by the agent's own replica server (a
thread on 127.0.0.1 with its own holdings). Nothing here fakes a tier's input: only the processes around it
(the agent, the other ranks, the other nodes) are left out."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import zmq

from easyckpt.recovery import Tier
from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.records import PeerNode, PeerTable, SlotMeta
from easyckpt_wire.shm import SlotMap, list_slots

JOB = "tiers"
TOKEN = "t" * 32
UNHEALTHY = RankHealth(True, False, ("loss 9.5 > threshold 3.0",))
KINDS = ("memory", "replica", "reshard", "disk")


def state_at(step: int, rank: int = 0) -> dict[str, Any]:
    """Rank ``rank``'s training state at ``step``: every tensor differs between steps (no checksum is shared
    by two steps), and the non-tensor values round-trip exactly."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"w": torch.randn(4, 3, generator=generator),
                      "b": torch.arange(3, dtype=torch.float64) + step,
                      "steps": torch.full((2,), step, dtype=torch.int64)},
            "rng": torch.full((8,), step % 251, dtype=torch.uint8), "step": step, "who": f"rank {rank}",
            "lr": [0.1 * step, {"warmup": step < 4}]}


def template() -> dict[str, Any]:
    """A template of ``state_at``'s shape, filled with zeros."""
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64),
                      "steps": torch.zeros(2, dtype=torch.int64)},
            "rng": torch.zeros(8, dtype=torch.uint8), "step": -1, "who": "", "lr": []}


def write_snapshots(shm: Path, rank: int, world: int, steps: Mapping[int, RankHealth]) -> None:
    """Rank ``rank`` of a ``world``-rank job snapshots ``state_at(step, rank)`` for each step, in order, with the
    verdict given, through a real Stager into its slots in ``shm``."""
    from easyckpt.config import CheckpointerConfig
    from easyckpt.snapshot.slots import RankSlots
    from easyckpt.snapshot.stager import Stager

    config = CheckpointerConfig(save_dir=shm / "unused-save-dir", save_mem_interval=1, save_storage_interval=1,
                                max_ckpt_num=1, job_id=JOB, shm_dir=shm, start_agent=False)
    slots = RankSlots(shm, JOB, rank, world, world, 3)
    stager = Stager(config, slots, rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    try:
        for step, health in steps.items():
            assert stager.snapshot(step, state_at(step, rank), health=health), f"snapshot of step {step} skipped"
            stager.wait()
    finally:
        stager.close()
        slots.close()


@contextmanager
def committed_slots(shm: Path, rank: int | None = None) -> Iterator[list[tuple[SlotMap, SlotMeta, int]]]:
    """Every committed slot of the job in ``shm`` (of ``rank``, or of every rank): (map, metadata, generation)."""
    opened = []
    try:
        for (slot_rank, _), path in sorted(list_slots(shm, JOB).items()):
            if rank is not None and slot_rank != rank:
                continue
            slot = SlotMap(path, writable=True)
            header = slot.header()
            if header.committed:
                opened.append((slot, SlotMeta.from_wire(slot.read_meta(header), str(path)), header.generation))
            else:
                slot.close()
        yield opened
    finally:
        for slot, _, _ in opened:
            slot.close(drop_exported=True)


def persist(shm: Path, save_dir: Path) -> None:
    """The agent's persister writes every committed slot of rank 0 in ``shm`` to ``save_dir`` (one rank's job)."""
    from easyckpt_agent.persister import AuditLog, RankSnapshot
    from easyckpt_agent.persister import persist as write_iteration

    save_dir.mkdir(parents=True, exist_ok=True)
    with committed_slots(shm, 0) as slots:
        for slot, meta, _ in sorted(slots, key=lambda s: s[1].step):
            write_iteration(save_dir, meta.step, [RankSnapshot(0, slot, meta)], AuditLog(save_dir))


class Agents:
    """Two nodes' replica servers in this process: ``n1`` is the reading rank's node (it holds nothing: its
    memory is gone), ``n0`` its buddy, holding backups of rank 0's snapshots (manifest and every tensor's bytes)
    exactly as a buddy keeps what was pushed to it."""

    def __init__(self) -> None:
        from easyckpt_agent.replica import Holdings, ReplicaServer

        self.ctx = zmq.Context()
        self.holdings = {node: Holdings(node) for node in ("n0", "n1")}
        self.servers = {node: ReplicaServer(h, self.ctx, "127.0.0.1", 0, lambda m: None, lambda k, m: None)
                        for node, h in self.holdings.items()}
        for server in self.servers.values():
            server.token = TOKEN
            server.start()
        self.peers = PeerTable(TOKEN, "n1", "n0", {n: PeerNode(s.endpoint, (0,) if n == "n1" else ())
                                                  for n, s in self.servers.items()}, world_size=1)

    def back_up(self, shm: Path, rank: int = 0) -> None:
        """Hash every committed slot of ``rank`` in ``shm`` (the lost node's memory) and give ``n0`` the backup."""
        from easyckpt_agent.replica import build_manifest

        holdings = self.holdings["n0"]
        with committed_slots(shm, rank) as slots:
            for slot, meta, generation in slots:
                entry = build_manifest(slot, meta, generation, "lost")
                assert entry is not None
                holdings.add_backup(entry.manifest)
                for checksum, (offset, nbytes) in entry.where.items():
                    with slot.data(offset, nbytes) as view:
                        holdings.add_blob(checksum, bytearray(view))

    def corrupt(self, step: int, rng: random.Random) -> str:
        """Flip one byte of one tensor of ``step`` in every copy ``n0`` holds; returns the tensor's name."""
        holdings = self.holdings["n0"]
        manifest = holdings.manifest(0, step)
        assert manifest is not None
        choices = [(e.name, c) for e, c in zip(manifest.tensors, manifest.checksums) if e.nbytes]
        name, checksum = rng.choice(choices)
        blob = holdings.blobs[checksum]
        blob[rng.randrange(len(blob))] ^= 0xFF
        return name

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.ctx.term()


@dataclasses.dataclass
class Source:
    """One tier over a real source holding ``state_at`` of some steps, and how to break one step of it."""

    kind: str
    tier: Tier
    damage: Callable[[int, random.Random], None]   # make this step's read fail (its source torn or corrupt)
    outlive: Callable[[], None]                    # what the source's own life does to it after a read
    loaded_as: str                                 # what Loaded.source says for this tier


def invalidate(shm: Path, rank: int, step: int) -> None:
    """Tear rank ``rank``'s committed slot of ``step`` (its header no longer says COMMITTED)."""
    with committed_slots(shm, rank) as slots:
        torn = [slot for slot, meta, _ in slots if meta.step == step]
        assert torn, f"no committed slot of rank {rank} at step {step} in {shm}"
        for slot in torn:
            slot.invalidate()


def corrupt_meta(shm: Path, rank: int, step: int) -> None:
    """Rank ``rank``'s slot of ``step`` still says COMMITTED (its header intact), but a byte of its metadata
    changed, so that it no longer matches the header's checksum: it is offered (its verdict unknown) and fails
    when read."""
    with committed_slots(shm, rank) as slots:
        for slot, meta, _ in slots:
            if meta.step == step:
                assert slot.mm is not None
                slot.mm[slot.header().meta_offset] ^= 0xFF


def flip_tensor_byte(save_dir: Path, step: int, rng: random.Random) -> None:
    """Flip one byte inside the tensor data of one safetensors file of iteration ``step``."""
    import json

    from easyckpt_wire import layout

    files = sorted((save_dir / layout.iteration_dirname(step)).glob("*.safetensors"))
    path = rng.choice([f for f in files if f.stat().st_size > 8 + int.from_bytes(f.read_bytes()[:8], "little")])
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    spans = [v["data_offsets"] for k, v in json.loads(raw[8:8 + header]).items() if k != "__metadata__"]
    begin, end = rng.choice([s for s in spans if s[1] > s[0]])
    raw[8 + header + rng.randrange(begin, end)] ^= 0xFF
    path.write_bytes(bytes(raw))


def scribble(paths: list[Path]) -> None:
    """Overwrite every byte of every file under ``paths`` in place (a mapping of them sees it at once)."""
    for root in paths:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            size = path.stat().st_size
            with open(path, "r+b") as handle:
                handle.write(b"\xa5" * size)


def no_health(steps: list[int]) -> dict[int, RankHealth]:
    return dict.fromkeys(steps, NEUTRAL)
