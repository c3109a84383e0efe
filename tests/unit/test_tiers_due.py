"""``Checkpointer.due(step)``: the one place that says which steps are snapshotted (integrations ask it instead
of re-deriving ``save_mem_interval``), and ``note_step``: a step passed without building any state. In one
process, without an agent."""
from __future__ import annotations

import pytest
import torch
from conftest import Env, seeded_random

import easyckpt


def test_due_says_exactly_which_steps_save_if_needed_snapshots(env: Env) -> None:
    rng = seeded_random()
    interval = rng.randrange(2, 5)
    ck = easyckpt.Checkpointer(env.save_dir, interval, interval * 10, 2, start_agent=False)
    try:
        # At least one due step among them (a draw of 12 steps may hold no multiple of 4: seed 955465936 in CI)
        steps = sorted({*rng.sample(range(1, 40), 11), interval * rng.randrange(1, 40 // interval)})
        taken = []
        for step in steps:
            if ck.save_if_needed(step, {"w": torch.full((3,), float(step))}):
                taken.append(step)
            ck.wait()
        assert taken == [s for s in steps if ck.due(s)] == [s for s in steps if s % interval == 0], (interval, steps)
        committed = ck.stats()["committed"]
        ck.note_step(steps[-1] + 1)   # no state built, nothing snapshotted
        assert ck.stats()["committed"] == committed == len(taken)
        result = ck.load()
        assert result.step == taken[-1] and torch.equal(result.state["w"], torch.full((3,), float(taken[-1])))
    finally:
        ck.close()
    with pytest.raises(RuntimeError, match=r"note_step\(step=99\) after close\(\)"):
        ck.note_step(99)
