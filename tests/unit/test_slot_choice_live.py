"""``RankSlots.choose`` against a real control block and real flocks: the word the rank reads can lag the agent's
flocks by a round of the agent's loop (a persist claim is published at the end of it)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tiers_sources import JOB, write_snapshots

from easyckpt.config import CheckpointerConfig
from easyckpt.snapshot.slots import RankSlots
from easyckpt.snapshot.stager import Stager
from easyckpt_wire.control import ControlWriter, control_path
from easyckpt_wire.health import NEUTRAL
from easyckpt_wire.shm import SlotMap, list_slots


def test_a_slot_flocked_before_the_agent_publishes_why_is_a_quiet_skip(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Safe step 3 published, held []; the agent has flocked the slots of steps 1 and 2 too (a claim it publishes at
    the end of its round). The rank skips, keeping its own newest snapshot, but it says so at INFO, not as a WARNING
    that all slots hold steps the agent keeps (CI: "all 3 slots hold steps the agent keeps (safe step 16, held [])"
    printed by a plain loop with no logging configured)."""
    write_snapshots(tmp_path, 0, 1, {1: NEUTRAL, 2: NEUTRAL, 3: NEUTRAL})
    agent_maps = [SlotMap(path, writable=False) for path in sorted(list_slots(tmp_path, JOB).values())]
    control = ControlWriter(control_path(tmp_path, JOB))
    config = CheckpointerConfig(save_dir=tmp_path / "unused-save-dir", save_mem_interval=1, save_storage_interval=5,
                                max_ckpt_num=1, job_id=JOB, shm_dir=tmp_path, start_agent=False)
    slots = RankSlots(tmp_path, JOB, 0, 1, 1, 3)
    stager = Stager(config, slots, rank=0, world_size=1, local_rank=0, local_world_size=1)
    caplog.set_level(logging.INFO, logger="easyckpt.snapshot.stager")
    try:
        for slot in agent_maps:
            assert slot.try_lock(exclusive=False)
        control.publish(3, frozenset())
        assert slots.choose() is None and slots.raced
        assert not stager.snapshot(4, {"w": torch.ones(3)})
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "skipped" in r.getMessage()]
        assert said == [(logging.INFO, "rank 0: snapshot of step 4 skipped: the agent was taking a slot for a persist "
                                       "as the rank chose one (it says which at the end of its round)")], said
        control.publish(3, frozenset({1, 2}))   # its word now: every slot kept, a real shortage
        assert slots.choose() is None and not slots.raced
        agent_maps[0].unlock()
        control.publish(3, frozenset({2}))
        assert slots.choose() == 0 and not slots.raced
    finally:
        stager.close()
        slots.close()
        control.close()
        for slot in agent_maps:
            slot.close()
