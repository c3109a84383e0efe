"""``RankSlots.choose`` against a real control block and real flocks: the word the rank reads can lag the agent's
flocks by a round of the agent's loop (a persist claim is published at the end of it)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tiers_sources import JOB, write_snapshots

from easyckpt.snapshot.slots import RankSlots
from easyckpt_wire.control import ControlWriter, control_path
from easyckpt_wire.health import NEUTRAL
from easyckpt_wire.shm import SlotMap, list_slots


def test_a_slot_flocked_before_the_agent_publishes_why_is_waited_for_not_skipped(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Safe step 3 published, held []; the agent has flocked the slots of steps 1 (a claim it is about to
    publish) and 2 (let go of in the same round). The rank waits for the next word instead of skipping (CI: "all 3
    slots hold steps the agent keeps (safe step 16, held [])" in a plain loop)."""
    monkeypatch.setattr("easyckpt.snapshot.slots.MOVE_WAIT", 30.0)   # the agent's next round comes however busy CI is
    write_snapshots(tmp_path, 0, 1, {1: NEUTRAL, 2: NEUTRAL, 3: NEUTRAL})
    agent_maps = {}
    for (_, index), path in sorted(list_slots(tmp_path, JOB).items()):
        slot = SlotMap(path, writable=False)
        agent_maps[slot.header().step] = (index, slot)
    control = ControlWriter(control_path(tmp_path, JOB))
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3)
    try:
        for step in (1, 2, 3):
            assert agent_maps[step][1].try_lock(exclusive=False)
        control.publish(3, frozenset())

        def next_round() -> None:
            agent_maps[2][1].unlock()               # let go of step 2
            control.publish(3, frozenset({1}))      # and say that step 1 is held

        timer = threading.Timer(0.01, next_round)
        timer.start()
        chosen = slots.choose()
        timer.join()
        assert chosen == agent_maps[2][0], (chosen, {step: index for step, (index, _) in agent_maps.items()})
    finally:
        slots.close()
        control.close()
        for _, slot in agent_maps.values():
            slot.close()
