"""The contract every recovery tier keeps, run against each of them (own memory, replicas on other nodes,
another world's memory, storage) over real sources in one process (``tiers_sources``): what it offers, how it
fills the caller's template, what a damaged source or a template that does not fit does to a read."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Env, assert_same, seeded_random
from tiers_sources import (
    JOB,
    KINDS,
    UNHEALTHY,
    Agents,
    Source,
    flip_tensor_byte,
    invalidate,
    persist,
    scribble,
    state_at,
    template,
    write_snapshots,
)

from easyckpt.recovery import RETRYABLE, StateMismatchError, Tier, template_targets
from easyckpt.snapshot.state import unflatten
from easyckpt_wire.health import NEUTRAL, RankHealth

TENSOR_BYTES = 4 * 3 * 4 + 3 * 8 + 2 * 8 + 8   # state_at's tensors


@pytest.fixture
def make(env: Env) -> Iterator[Callable[[str, dict[int, RankHealth]], Source]]:
    """Build one tier over a real source holding ``state_at(step)`` for the steps given (with their verdicts),
    read by rank 0 of a one-rank job whose shm directory is ``env.shm_dir``."""
    from easyckpt.recovery.disk import StorageTier
    from easyckpt.recovery.memory import OwnMemoryTier, ReplicaTier
    from easyckpt.recovery.worlds import OtherWorldTier
    from easyckpt.snapshot.slots import RankSlots

    closers: list[Callable[[], None]] = []

    def lost_node() -> Path:
        path = Path(tempfile.mkdtemp(prefix="easyckpt-test-lost-", dir="/dev/shm"))
        closers.append(lambda: shutil.rmtree(path, ignore_errors=True))
        return path

    def own_slots() -> RankSlots:
        slots = RankSlots(env.shm_dir, JOB, 0, 1, 1)
        closers.append(slots.close)
        return slots

    def build(kind: str, steps: dict[int, RankHealth]) -> Source:
        shm, save_dir = env.shm_dir, env.save_dir
        if kind == "memory":
            write_snapshots(shm, 0, 1, steps)
            return Source(kind, OwnMemoryTier(own_slots(), rank=0, timeout=5.0),
                          lambda step, rng: invalidate(shm, 0, step), lambda: scribble([shm]), "memory")
        if kind == "replica":   # rank 0's node is gone; its buddy n0 holds backups of its snapshots
            lost = lost_node()
            write_snapshots(lost, 0, 1, steps)
            agents = Agents()
            closers.append(agents.close)
            agents.back_up(lost)
            shutil.rmtree(lost)
            tier: Tier = ReplicaTier(agents.peers, own_slots(), rank=0, timeout=5.0, peer_timeout=5.0)
            return Source(kind, tier, lambda step, rng: print("corrupted", agents.corrupt(step, rng)),
                          lambda: scribble([shm]), "replica")
        if kind == "reshard":   # a 2-rank world snapshotted; this job has 1 rank
            for old in (0, 1):
                write_snapshots(shm, old, 2, steps)
            tier = OtherWorldTier(shm, JOB, rank=0, world_size=1, timeout=5.0, peer_timeout=5.0)
            closers.append(own_slots().close)   # this world's rank 0 re-attaches to the same slot files
            return Source(kind, tier, lambda step, rng: invalidate(shm, rng.randrange(2), step), lambda: scribble([shm]),
                          "memory")
        assert kind == "disk"
        lost = lost_node()
        write_snapshots(lost, 0, 1, steps)
        persist(lost, save_dir)
        tier = StorageTier(save_dir, rank=0, world_size=1)
        # Iterations are never rewritten in place: a new step is a new directory, rotation unlinks the old one.
        return Source(kind, tier, lambda step, rng: flip_tensor_byte(save_dir, step, rng),
                      lambda: shutil.rmtree(save_dir), "disk")

    yield build
    for close in reversed(closers):
        close()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def loaded_state(source: Source, step: int, into: Any = None) -> tuple[Any, Any]:
    loaded = source.tier.read(step, template_targets(into))
    assert loaded.source == source.loaded_as and loaded.nbytes == TENSOR_BYTES, loaded
    return loaded, unflatten(loaded.skeleton, loaded.values)


def test_an_empty_source_offers_nothing_and_reads_nothing(kind: str, make: Any) -> None:
    source = make(kind, {})
    assert source.tier.offer().items == ()
    assert not source.tier.holds(3)
    with pytest.raises(RETRYABLE) as caught:
        source.tier.read(3, template_targets(template()))
    assert not isinstance(caught.value, StateMismatchError)


def test_every_saved_step_is_offered_newest_first_with_its_verdict(kind: str, make: Any) -> None:
    source = make(kind, {2: NEUTRAL, 3: UNHEALTHY, 5: NEUTRAL})
    offer = source.tier.offer()
    # replicas and another world's memory keep the newest steps only (two, four): all three fit here
    assert offer.steps[:2] == [5, 3] and set(offer.steps) <= {5, 3, 2}, offer
    assert offer.item(5).healthy and not offer.item(3).healthy, offer
    assert source.tier.holds(5) and source.tier.holds(3) and not source.tier.holds(4)
    reasons = offer.item(3).reasons
    # another world's memory agrees on the verdict across ranks, not on the reasons: it names none
    assert any("loss 9.5 > threshold 3.0" in r for r in reasons) or (kind == "reshard" and not reasons), reasons


def test_a_step_fills_the_template_in_place_bit_exact(kind: str, make: Any) -> None:
    source = make(kind, {3: NEUTRAL, 5: NEUTRAL})
    source.tier.offer()
    into = template()
    _, state = loaded_state(source, 5, into)
    assert_same(state_at(5), state)
    for key in ("w", "b", "steps"):
        assert state["model"][key] is into["model"][key], key
    assert state["rng"] is into["rng"]


def test_without_a_template_the_tensors_outlive_their_source(kind: str, make: Any) -> None:
    """Nothing returned is a view of shared memory: the slots it came from are overwritten byte by byte after
    the read (the next snapshots), or its iteration is deleted (rotation), and the state read is unchanged."""
    source = make(kind, {3: NEUTRAL, 5: NEUTRAL})
    source.tier.offer()
    _, state = loaded_state(source, 3)
    source.outlive()
    assert_same(state_at(3), state)


@pytest.mark.parametrize("misfit", ["shape", "dtype"])
def test_a_template_that_does_not_fit_is_refused_before_anything_is_copied(kind: str, make: Any, misfit: str) -> None:
    source = make(kind, {5: NEUTRAL})
    source.tier.offer()
    into = template()
    into["model"]["w"] = torch.zeros(5, 3) if misfit == "shape" else torch.zeros(4, 3, dtype=torch.float16)
    with pytest.raises(StateMismatchError) as caught:
        source.tier.read(5, template_targets(into))
    message = str(caught.value)
    assert "model/w" in message and "step 5" in message and "(4, 3)" in message, message
    assert ("(5, 3)" if misfit == "shape" else "torch.float16") in message, message
    assert_same(template(), {**into, "model": {**into["model"], "w": template()["model"]["w"]}})


def test_a_damaged_step_fails_its_read_and_leaves_the_other_steps_readable(kind: str, make: Any) -> None:
    rng = seeded_random()
    source = make(kind, {3: NEUTRAL, 5: NEUTRAL})
    source.tier.offer()
    source.damage(5, rng)
    with pytest.raises(RETRYABLE) as caught:
        source.tier.read(5, template_targets(template()))
    assert not isinstance(caught.value, StateMismatchError), caught.value
    assert "5" in str(caught.value), caught.value   # the error names the step
    _, state = loaded_state(source, 3, template())
    assert_same(state_at(3), state)
