"""``recovery.load``, the ladder over the tiers, for a one-rank job in one process over real sources: the order
of the tiers, a failed read moving on to the next candidate, a template that does not fit stopping the load,
health before recency, an explicit ``load_dir``, and a rank whose memory is gone pulling its step from a
replica."""
from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Env, assert_same, s3_endpoint_down, seeded_random
from tiers_sources import (
    JOB,
    UNHEALTHY,
    Agents,
    committed_slots,
    corrupt_meta,
    flip_tensor_byte,
    no_health,
    persist,
    state_at,
    template,
    write_snapshots,
)

from easyckpt import recovery
from easyckpt.recovery import LoadError, StateMismatchError
from easyckpt.snapshot.slots import RankSlots
from easyckpt_wire import faults, layout
from easyckpt_wire.health import NEUTRAL
from easyckpt_wire.storage import location

Opener = Callable[[], RankSlots]


@pytest.fixture
def slots(env: Env) -> Iterator[Opener]:
    """Opens rank 0's slots of a one-rank job (called by the test once its snapshots are written)."""
    opened: list[RankSlots] = []

    def open_slots() -> RankSlots:
        opened.append(RankSlots(env.shm_dir, JOB, 0, 1, 1))
        return opened[-1]

    yield open_slots
    for s in opened:
        s.close()


def load(env: Env, slots: RankSlots, into: Any = None, **options: Any) -> recovery.LoadResult:
    return recovery.load(slots=slots, save_dir=env.save_dir, rank=0, world_size=1, template=into, timeout=5.0,
                         peer_timeout=5.0, **options)


def test_memory_comes_before_disk_and_a_failed_read_moves_on_to_the_next_tier(env: Env, slots: Opener,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    write_snapshots(env.shm_dir, 0, 1, no_health([3, 5]))
    persist(env.shm_dir, env.save_dir)
    result = load(env, slots(), template())
    assert (result.step, result.source) == (5, "memory")
    corrupt_meta(env.shm_dir, 0, 5)   # still offered (it says COMMITTED), fails when read
    into = template()
    with caplog.at_level(logging.WARNING, logger="easyckpt.recovery"):
        result = load(env, slots(), into)
    assert (result.step, result.source) == (5, "disk"), result
    assert result.path == str(env.save_dir / layout.iteration_dirname(5))
    assert_same(state_at(5), result.state)
    assert result.state["model"]["w"] is into["model"]["w"]
    assert "could not load step 5 from memory" in caplog.text, caplog.text


def test_a_snapshot_whose_header_changed_in_memory_is_passed_over_with_a_warning(
        env: Env, slots: Opener, caplog: pytest.LogCaptureFixture) -> None:
    """A soak flipped the top byte of a committed slot's step (slot format 1 had no checksum over its header): the
    rank resumed "step 2089670227099910147" from memory and the job hung at its end. The header's checksum now
    passes that slot over: the older step in memory is loaded, and the warning names the file."""
    write_snapshots(env.shm_dir, 0, 1, no_health([3, 5]))
    with committed_slots(env.shm_dir, 0) as found:
        (damaged,) = [slot for slot, meta, _ in found if meta.step == 5]
        assert damaged.mm is not None
        damaged.mm[23] ^= 0x1D   # the byte and mask the soak drew (seed 325356583, fault 12)
        path = damaged.path
    with caplog.at_level(logging.WARNING, logger="easyckpt_wire.shm"):
        result = load(env, slots(), template())
    assert (result.step, result.source) == (3, "memory"), result
    assert_same(state_at(3), result.state)
    assert caplog.text.count(f"the header of {path} fails its checksum") == 1, caplog.text   # once, not per read


def test_a_template_that_does_not_fit_stops_the_load_without_trying_other_tiers(env: Env, slots: Opener) -> None:
    write_snapshots(env.shm_dir, 0, 1, no_health([3, 5]))
    persist(env.shm_dir, env.save_dir)
    into = template()
    into["model"]["b"] = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(StateMismatchError, match=r"step 5 \(memory\).*model/b"):
        load(env, slots(), into)
    assert_same(template()["model"]["w"], into["model"]["w"])   # nothing was copied in


def test_health_before_recency_in_every_tier(env: Env, slots: Opener, caplog: pytest.LogCaptureFixture) -> None:
    write_snapshots(env.shm_dir, 0, 1, {3: NEUTRAL, 5: UNHEALTHY})
    persist(env.shm_dir, env.save_dir)
    opened = slots()
    result = load(env, opened, allow_unhealthy=True)
    assert (result.step, result.source) == (5, "memory")
    with caplog.at_level(logging.WARNING, logger="easyckpt.recovery"):
        result = load(env, opened)
    assert (result.step, result.source) == (3, "memory")
    assert_same(state_at(3), result.state)
    assert "passing over unhealthy snapshots newer than step 3: step 5 (unhealthy on ranks [0]: " in caplog.text
    assert 5 not in opened.committed()   # a resume from 3 abandons the newer snapshots


def test_nothing_healthy_is_a_clear_error(env: Env, slots: Opener) -> None:
    write_snapshots(env.shm_dir, 0, 1, {5: UNHEALTHY})
    persist(env.shm_dir, env.save_dir)
    with pytest.raises(LoadError) as caught:
        load(env, slots())
    message = str(caught.value)
    assert "no healthy checkpoint" in message and "step 5" in message and "loss 9.5 > threshold 3.0" in message
    assert "allow_unhealthy=True" in message and "load_dir=" in message


def test_an_explicit_load_dir_is_loaded_whatever_memory_holds(env: Env, slots: Opener) -> None:
    write_snapshots(env.shm_dir, 0, 1, {3: UNHEALTHY, 5: NEUTRAL})
    persist(env.shm_dir, env.save_dir)
    result = load(env, slots(), template(), load_dir=env.save_dir / layout.iteration_dirname(3))
    assert (result.step, result.source) == (3, "disk")
    assert_same(state_at(3), result.state)
    with pytest.raises(LoadError, match="cannot be loaded by every rank: .*iteration_0000004"):
        load(env, slots(), load_dir=env.save_dir / layout.iteration_dirname(4))


def test_every_candidate_damaged_is_one_error_naming_each_try(env: Env, slots: Opener) -> None:
    rng = seeded_random()
    write_snapshots(env.shm_dir, 0, 1, no_health([5]))
    persist(env.shm_dir, env.save_dir)
    corrupt_meta(env.shm_dir, 0, 5)
    flip_tensor_byte(env.save_dir, 5, rng)
    with pytest.raises(LoadError) as caught:
        load(env, slots(), template())
    message = str(caught.value)
    assert "tried step 5 from memory: SlotFormatError" in message, message
    assert "step 5 from disk: CheckpointCorruptError" in message and "checksum" in message, message
    assert "easyckpt verify" in message


def test_nothing_anywhere_is_a_fresh_start(env: Env, slots: Opener) -> None:
    result = load(env, slots(), template())
    assert (result.step, result.source, result.state) == (None, None, None)


def test_a_rank_whose_memory_is_gone_pulls_its_step_from_a_replica(env: Env, slots: Opener) -> None:
    """Rank 0's node is gone with its memory; the buddy node holds its two newest snapshots, disk an older one.
    The newest comes from the replica, into rank 0's own slot (the step it resumes from is in its memory)."""
    lost = Path(tempfile.mkdtemp(prefix="easyckpt-test-lost-", dir="/dev/shm"))
    agents = Agents()
    try:
        write_snapshots(lost, 0, 1, no_health([2, 4, 6]))
        persist(lost, env.save_dir)
        agents.back_up(lost)   # keeps the newest two: 4 and 6
        shutil.rmtree(lost)
        opened = slots()
        result = load(env, opened, template(), peers=agents.peers)
        assert (result.step, result.source) == (6, "replica"), result
        assert_same(state_at(6), result.state)
        assert 6 in opened.committed()
    finally:
        shutil.rmtree(lost, ignore_errors=True)
        agents.close()


def test_an_agent_that_does_not_answer_costs_one_timeout_per_load_not_one_per_step(
        env: Env, slots: Opener, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's memory is gone; the buddy holds its steps 4 and 6 but hangs on every FETCH (a ':hold' fault point
    in its serving thread), disk holds step 2. Step 6 waits out one peer_timeout, step 4 does not ask the buddy
    again, and the load ends on disk at 2. Until 2026-12-07 each older step waited for the hung agent once more
    (test_multinode.py's hung peer: steps 14, 13 and 12, three timeouts, before the disk)."""
    lost, backup = (Path(tempfile.mkdtemp(prefix=f"easyckpt-test-{what}-", dir="/dev/shm")) for what in ("lost", "buddy"))
    armed = env.tmp_path / "armed"
    agents = Agents()
    try:
        write_snapshots(lost, 0, 1, no_health([2]))
        persist(lost, env.save_dir)
        write_snapshots(backup, 0, 1, no_health([4, 6]))
        agents.back_up(backup)
        armed.touch()
        monkeypatch.setenv(faults.ENV, "agent.replica.fetch:hold")
        monkeypatch.setenv(faults.ARM_ENV, str(armed))
        with caplog.at_level(logging.INFO):
            result = recovery.load(slots=slots(), save_dir=env.save_dir, rank=0, world_size=1, template=template(),
                                   timeout=5.0, peer_timeout=0.5, peers=agents.peers)
        assert (result.step, result.source) == (2, "disk"), result
        waited = re.findall(r"step (\d+) from node n0 failed \(FETCH [^)]*no reply within", caplog.text)
        assert waited == ["6"], f"the hung agent should be waited for once, at step 6: {waited}"
        assert "it is not asked again during this load" in caplog.text
        assert "could not load step 4 from replica" in caplog.text and "did not answer earlier in this load" in caplog.text
    finally:
        armed.unlink(missing_ok=True)   # the held serving thread goes on, and the server can stop
        for folder in (lost, backup):
            shutil.rmtree(folder, ignore_errors=True)
        agents.close()



def test_a_rank_whose_own_copy_is_damaged_pulls_the_same_step_from_a_replica(
        env: Env, slots: Opener, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 holds steps 2, 4 and 6, but its copy of 6 is damaged; the buddy holds a backup of 4 and 6. Step 6
    comes from the replica, not step 4 from memory (nor, with nothing on disk, no resume at all: a stress run of
    2026-11-29 flipped rank 0's every slot before any step reached disk, and the job could not start again)."""
    backup = Path(tempfile.mkdtemp(prefix="easyckpt-test-buddy-", dir="/dev/shm"))
    agents = Agents()
    try:
        write_snapshots(backup, 0, 1, no_health([4, 6]))
        agents.back_up(backup)
        write_snapshots(env.shm_dir, 0, 1, no_health([2, 4, 6]))
        corrupt_meta(env.shm_dir, 0, 6)   # still offered (it says COMMITTED), fails when read
        opened = slots()
        with caplog.at_level(logging.WARNING, logger="easyckpt.recovery"):
            result = load(env, opened, template(), peers=agents.peers)
        assert (result.step, result.source) == (6, "replica"), result
        assert_same(state_at(6), result.state)
        assert "could not load step 6 from memory: SlotFormatError" in caplog.text and "; trying replica" in caplog.text
        assert 6 in opened.committed()   # the pulled copy, in one of its own slots
    finally:
        shutil.rmtree(backup, ignore_errors=True)
        agents.close()


def test_a_save_dir_that_cannot_be_listed_leaves_memory_and_never_starts_from_scratch(
        env: Env, slots: Opener, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object store down while torchrun restarts the workers (here: an endpoint nobody listens on): memory
    still resumes, with a warning naming save_dir; with nothing in memory either the load refuses rather than
    return step None, which would train from scratch over checkpoints it could not see."""
    pytest.importorskip("boto3")
    s3_endpoint_down(monkeypatch)
    down = location("s3://bucket/runs/a")
    with caplog.at_level(logging.WARNING, logger="easyckpt.recovery"):
        with pytest.raises(LoadError, match=r"nothing to resume from in memory or replicas, and save_dir "
                                            r"s3://bucket/runs/a cannot be listed: .*Not starting from scratch"):
            recovery.load(slots=slots(), save_dir=down, rank=0, world_size=1, timeout=5.0, peer_timeout=5.0)
    write_snapshots(env.shm_dir, 0, 1, no_health([3, 5]))
    with caplog.at_level(logging.WARNING, logger="easyckpt.recovery"):
        result = recovery.load(slots=slots(), save_dir=down, rank=0, world_size=1, template=template(),
                               timeout=5.0, peer_timeout=5.0)
    assert (result.step, result.source) == (5, "memory")
    assert_same(state_at(5), result.state)
    assert "rank 0: save_dir s3://bucket/runs/a cannot be listed" in caplog.text, caplog.text
