"""Resharding from another world's memory, in one process: the planning as pure functions (which step every
new rank can reshard from memory, and from where), then real slots in a real shm directory written by four
stagers of a 4-rank world (DTensors on a mesh built without process groups), read back by ``recovery.load`` as
a 1-rank job (no process group: dcp.load plans alone): the full tensors bitwise, private values by the rule, a
template of other global shapes refused with the disk path's message, a torn slot left to the disk, and the
old world's leftover slots released."""
from __future__ import annotations

import logging
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import seeded_random
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers_sources import JOB, Agents, persist

from easyckpt.recovery import reshard
from easyckpt.recovery import worlds as mr
from easyckpt.recovery.worlds import LOCAL, Candidate, Held
from easyckpt_wire import faults
from easyckpt_wire.shm import list_slots

# planning -----------------------------------------------------------------------------------------------------


def test_complete_steps_needs_every_old_rank_and_skips_this_world() -> None:
    held = [Held(r, 8, 4) for r in range(4)] + [Held(r, 9, 4) for r in (0, 1, 3)] + [Held(0, 10, 2), Held(1, 10, 2)]
    assert mr.complete_steps(held, 2) == [Candidate(8, 4)]          # 9 lacks rank 2; 10 is this world's
    assert mr.complete_steps(held, 3) == [Candidate(10, 2), Candidate(8, 4)]
    sick = held + [Held(2, 8, 4, "node1", healthy=False)]
    assert mr.complete_steps(sick, 2) == [Candidate(8, 4, healthy=False)]


def test_agree_intersects_every_ranks_candidates() -> None:
    a = mr.encode([Candidate(9, 4), Candidate(8, 4)])
    b = mr.encode([Candidate(8, 4, healthy=False), Candidate(5, 4)])
    assert mr.agree([a, b]) == [Candidate(8, 4, healthy=False)]
    assert mr.agree([a, mr.encode([])]) == []
    assert len(a) == 3 * mr.MAX_CANDIDATES


def test_choose_prefers_this_nodes_memory_then_the_cheapest_node() -> None:
    held = [Held(0, 8, 2, "node2"), Held(0, 8, 2), Held(1, 8, 2, "node2"), Held(1, 8, 2, "node1"), Held(1, 7, 2)]
    chosen = mr.choose(held, Candidate(8, 2), ["node0", "node1", "node2"])
    assert chosen == {0: Held(0, 8, 2), 1: Held(1, 8, 2, "node1")}
    assert mr.describe_sources(chosen) == "rank 0 local shm, rank 1 replica from node1"
    assert mr.describe_sources({r: Held(r, 8, 4) for r in range(4)}) == "ranks 0-3 local shm"


def test_merge_orders_by_step_then_tier() -> None:
    ordered = [(8, "memory"), (6, "replica"), (6, "disk"), (4, "disk")]
    merged = mr.merge(ordered, [Candidate(8, 4), Candidate(6, 4), Candidate(7, 4, healthy=False)])
    assert merged == [(8, "memory"), (6, "reshard"), (6, "replica"), (6, "disk"), (4, "disk")]
    assert (7, "reshard") in mr.merge(ordered, [Candidate(7, 4, healthy=False)], allow_unhealthy=True)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 1 << 30))
def test_agreed_step_is_the_newest_every_rank_reaches_whole(old: int, new: int, seed: int) -> None:
    """Random holdings per new rank (each sees a random subset of old ranks' steps locally or on a node): the
    agreed candidates are exactly the (step, M) every rank reaches for all M old ranks, newest first."""
    rng = random.Random(seed)
    steps = [rng.randrange(0, 12) for _ in range(3)]
    views = []
    for _ in range(new):
        views.append([Held(r, s, old, rng.choice([LOCAL, "node1", "node2"]), rng.random() > 0.1)
                      for s in steps for r in range(old) if rng.random() < 0.8])
    rows = [mr.encode(mr.complete_steps(view, new)) for view in views]
    got = mr.agree(rows)
    if old == new:
        assert got == []
        return
    every = set.intersection(*({s for s in steps if {h.rank for h in view if h.step == s} == set(range(old))}
                               for view in views))
    # each rank reports at most MAX_CANDIDATES (3 distinct steps here, so all of them)
    assert [c.step for c in got] == sorted(every, reverse=True)
    for c in got:
        healthy = all(h.healthy for view in views for h in view if h.step == c.step)
        assert c.healthy == healthy
        for view in views:
            assert set(mr.choose(view, c)) == set(range(old))


# real slots -----------------------------------------------------------------------------------------------------
ROWS, COLS = 7, 3   # 7 rows over 4 ranks: shards of 2, 2, 2, 1


def world_state(rank: int, world: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state of a ``world``-rank FSDP-style save: two dim-0 sharded DTensors, a private tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from easyckpt.dcp import CheckpointIndex, SavedTensor, fsdp_template

    full = full_tensors(step)
    saved = {k: SavedTensor(tuple(v.shape), "F32", True, []) for k, v in full.items()}
    model = {}
    for key, dtensor in fsdp_template(CheckpointIndex(Path("-"), step, world, saved, {}, {}), rank, world).items():
        spec = dtensor._spec
        shape, offsets = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
        local = full[key][tuple(slice(o, o + n) for o, n in zip(offsets, shape))].clone()
        model[key.split(".", 1)[1]] = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                                         shape=spec.shape, stride=spec.stride)
    return {"model": model, "rng": torch.full((4,), rank, dtype=torch.uint8), "step": step, "who": rank}


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"model.w": torch.randn(ROWS, COLS, generator=generator), "model.b": torch.randn(ROWS, generator=generator)}


def save_world(shm: Path, job: str, world: int, steps: list[int]) -> None:
    from easyckpt.config import CheckpointerConfig
    from easyckpt.snapshot import sharding
    from easyckpt.snapshot.slots import RankSlots
    from easyckpt.snapshot.stager import Stager

    for rank in range(world):
        # Each rank of a real world is its own process; here the meshes of the 4 ranks differ only in their
        # (unhashed) own rank, so the shard-spec cache of the previous rank would answer for this one.
        sharding._spec_of.cache_clear()
        config = CheckpointerConfig(save_dir=shm / "unused-save-dir", save_mem_interval=1, save_storage_interval=1,
                                    max_ckpt_num=1, job_id=job, shm_dir=shm, start_agent=False)
        slots = RankSlots(shm, job, rank, world, world, 3)
        stager = Stager(config, slots, rank=rank, world_size=world, local_rank=rank, local_world_size=world)
        try:
            for step in steps:
                assert stager.snapshot(step, world_state(rank, world, step))
                stager.wait()
        finally:
            stager.close()
            slots.close()


def load_as_one_rank(tmp_path: Path, shm: Path, job: str, template: Any) -> Any:
    from easyckpt import recovery
    from easyckpt.snapshot.slots import RankSlots

    slots = RankSlots(shm, job, 0, 1, 1)
    try:
        return recovery.load(slots=slots, save_dir=tmp_path / "save", rank=0, world_size=1, template=template)
    finally:
        slots.close()


@pytest.fixture
def shm() -> Any:
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="easyckpt-test-mr-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_4_rank_worlds_slots_reshard_onto_1_rank(tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    job = "mr-test"
    save_world(shm, job, 4, [3, 4])
    caplog.set_level(logging.INFO)
    template = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS)}, "rng": torch.zeros(4, dtype=torch.uint8),
                "step": -1, "who": -1}
    result = load_as_one_rank(tmp_path, shm, job, template)
    assert (result.step, result.source) == (4, "memory"), result
    full = full_tensors(4)
    assert torch.equal(result.state["model"]["w"], full["model.w"]) and torch.equal(result.state["model"]["b"],
                                                                                    full["model.b"])
    assert result.state["model"]["w"] is template["model"]["w"]     # filled in place
    assert result.state["who"] == 0 and torch.equal(result.state["rng"], torch.zeros(4, dtype=torch.uint8))
    assert "step 4 resharded from memory, 4 -> 1 ranks: ranks 0-3 local shm" in caplog.text
    assert "private values of saved ranks 1-3 were dropped" in caplog.text

    without = load_as_one_rank(tmp_path, shm, job, None)   # no template: whole tensors
    assert torch.equal(without.state["model"]["w"], full["model.w"]) and without.source == "memory"


def test_wrong_global_shape_is_refused_like_the_disk_path(tmp_path: Path, shm: Path) -> None:
    from easyckpt import StateMismatchError

    save_world(shm, "mr-bad", 4, [2])
    template = {"model": {"w": torch.zeros(ROWS + 1, COLS), "b": torch.zeros(ROWS)},
                "rng": torch.zeros(4, dtype=torch.uint8), "step": -1, "who": -1}
    with pytest.raises(StateMismatchError) as caught:
        load_as_one_rank(tmp_path, shm, "mr-bad", template)
    message = str(caught.value)
    assert "model/w" in message and f"({ROWS}, {COLS})" in message and f"({ROWS + 1}, {COLS})" in message, message
    assert "global shapes" in message and "configuration of the run that saved it" in message, message


def test_a_torn_or_missing_old_rank_leaves_the_step_to_disk(tmp_path: Path, shm: Path) -> None:
    """Old rank 2's slot of the newest step is gone (or torn): that step is no candidate; the older step that
    every old rank still holds is read instead, and nothing in memory means nothing to resume."""
    from easyckpt_wire.shm import SlotMap, list_slots

    save_world(shm, "mr-torn", 4, [5, 6])
    rng = seeded_random()
    for (rank, _), path in list_slots(shm, "mr-torn").items():
        slot = SlotMap(path, writable=True)
        try:
            if rank == 2 and slot.header().step == 6:
                if rng.random() < 0.5:
                    slot.invalidate()
                else:   # still COMMITTED, but its metadata no longer matches the header's checksum
                    assert slot.mm is not None
                    slot.mm[64:72] = b"\xff" * 8
        finally:
            slot.close()
    template = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS)},
                "rng": torch.zeros(4, dtype=torch.uint8), "step": -1, "who": -1}
    result = load_as_one_rank(tmp_path, shm, "mr-torn", template)
    assert (result.step, result.source) == (5, "memory"), result
    assert torch.equal(result.state["model"]["w"], full_tensors(5)["model.w"])


def test_release_old_world_unlinks_only_ranks_past_the_new_world(shm: Path) -> None:
    from easyckpt_wire.shm import SlotMap, list_slots

    save_world(shm, "mr-rel", 4, [1])
    before = list_slots(shm, "mr-rel")
    locked = SlotMap(before[(3, 0)], writable=False)
    try:
        assert locked.try_lock(exclusive=False)   # a reader still at it: left for the agent's cleanup
        removed = mr.release_old_world(shm, "mr-rel", 2)
    finally:
        locked.close()
    after = list_slots(shm, "mr-rel")
    assert {k for k in after if k[0] < 2} == {k for k in before if k[0] < 2}
    assert (3, 0) in after and before[(2, 0)] in removed and all(k[0] >= 2 for k, p in before.items() if p in removed)


def test_a_slot_rewritten_after_planning_fails_the_read_not_the_state(shm: Path) -> None:
    """Planned from old rank 1's slot, which is invalidated before the read opens it: the read fails with a
    MemoryReshardError (a SlotFormatError: recovery moves every rank to the next candidate), never with bytes
    of another snapshot."""
    from easyckpt.recovery import template_targets
    from easyckpt_wire.shm import SlotFormatError, SlotMap

    save_world(shm, "mr-race", 4, [7])
    found = mr.discover(shm, "mr-race", 1, None, None, 5.0, {})
    (candidate,) = mr.agreed(found, 1)
    slot = SlotMap(found.local[(1, 7, 4)].path, writable=True)
    try:
        slot.invalidate()
    finally:
        slot.close()
    template = template_targets({"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS)}})
    with pytest.raises(SlotFormatError, match="rank 1's snapshot of step 7 changed"):
        reshard.read(found, candidate, rank=0, world_size=1, template=template, peers=None, timeout=5.0, peer_timeout=5.0,
                     silent={})
    assert torch.equal(template["model/w"].into, torch.zeros(ROWS, COLS))   # nothing was copied in


def test_an_agent_that_does_not_answer_costs_one_timeout_per_resharded_load(
        tmp_path: Path, shm: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-rank world saved steps 4 and 6 and the job came back with one rank: this node still holds old rank 0's
    slots, old rank 1's node is gone and its buddy n0 holds its backups but hangs on every FETCH (a ':hold' fault
    point in its serving thread); disk holds step 2. The resharded read of step 6 waits out one peer_timeout, that of
    step 4 does not ask n0 again, and the load ends on disk at 2. Before 2026-12-07 the reshard tier asked the hung
    agent again for each step (the replica tier had stopped doing so the day before)."""
    from easyckpt import recovery
    from easyckpt.snapshot.slots import RankSlots

    lost, disk = (Path(tempfile.mkdtemp(prefix=f"easyckpt-test-{what}-", dir="/dev/shm")) for what in ("lost", "disk"))
    armed = tmp_path / "armed"
    agents = Agents()
    try:
        save_world(lost, JOB, 2, [4, 6])
        agents.back_up(lost, rank=1)
        save_world(shm, JOB, 2, [4, 6])
        for (rank, _), path in list_slots(shm, JOB).items():
            if rank == 1:
                path.unlink()   # old rank 1's node is gone: only its backup on n0 is left
        save_world(disk, JOB, 1, [2])
        persist(disk, tmp_path / "save")
        armed.touch()
        monkeypatch.setenv(faults.ENV, "agent.replica.fetch:hold")
        monkeypatch.setenv(faults.ARM_ENV, str(armed))
        template = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(ROWS)},
                    "rng": torch.zeros(4, dtype=torch.uint8), "step": -1, "who": -1}
        slots = RankSlots(shm, JOB, 0, 1, 1)
        try:
            with caplog.at_level(logging.INFO):
                result = recovery.load(slots=slots, save_dir=tmp_path / "save", rank=0, world_size=1, template=template,
                                       timeout=5.0, peer_timeout=0.5, peers=agents.peers)
        finally:
            slots.close()
        assert (result.step, result.source) == (2, "disk"), result
        assert torch.equal(result.state["model"]["w"], full_tensors(2)["model.w"])
        waited = re.findall(r"of rank 1 step (\d+) from node n0 failed \(FETCH [^)]*no reply within", caplog.text)
        assert waited == ["6"], f"the hung agent should be waited for once, at step 6: {waited}"
        assert "saved rank 1: the agent of node n0 did not answer" in caplog.text
        assert "did not answer earlier in this load" in caplog.text, "step 4 was not tried without n0"
    finally:
        armed.unlink(missing_ok=True)   # the held serving thread goes on, and the server can stop
        for folder in (lost, disk):
            shutil.rmtree(folder, ignore_errors=True)
        agents.close()


def test_the_old_module_name_still_forwards_and_says_where_the_names_went() -> None:
    """``easyckpt.memory_reshard`` moved into ``easyckpt.recovery``; code that imports the old name keeps working and
    is told where to import from."""
    import importlib
    import sys

    sys.modules.pop("easyckpt.memory_reshard", None)
    with pytest.warns(DeprecationWarning, match="easyckpt.recovery.worlds"):
        old = importlib.import_module("easyckpt.memory_reshard")
    assert old.Candidate is Candidate and old.read is reshard.read and old.MemoryReader is reshard.MemoryReader
