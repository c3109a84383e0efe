"""``trainer_state.json`` as TrainerWrapper encodes it each snapshot (``easyckpt.transformers.snapshot``): the very
text the Trainer writes (``TrainerState.save_to_json``), with ``log_history`` encoded once per entry across calls."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import seeded_random

pytest.importorskip("transformers", reason="TrainerWrapper needs transformers: pip install -e '.[hf]'")

from transformers import TrainerControl, TrainerState  # noqa: E402

from easyckpt.transformers.snapshot import LogHistoryJson, trainer_state_json  # noqa: E402


def trainer_with(state: TrainerState) -> Any:
    """What trainer_state_json reads of a Trainer: its state, callbacks (none stateful here) and control."""
    return SimpleNamespace(state=state, callback_handler=SimpleNamespace(callbacks=[]), control=TrainerControl())


def as_the_trainer_writes(trainer: Any) -> str:
    state = copy.copy(trainer.state)
    state.stateful_callbacks = {"TrainerControl": trainer.control.state()}
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def entry(rng: random.Random, step: int) -> Any:
    """A log_history entry: the Trainer's loss lines, eval lines with nested values, odd floats and strings."""
    kind = rng.randrange(5)
    if kind == 0:
        return {"loss": rng.random() * 4, "grad_norm": rng.choice([rng.random(), math.inf, math.nan]),
                "learning_rate": 3e-4 * rng.random(), "epoch": step / 97, "step": step}
    if kind == 1:
        return {"eval_loss": rng.random(), "eval_runtime": 0.5, "eval_samples_per_second": 12.5,
                "eval_confusion": [[1, 2], [3, 4]], "eval_note": "ünïcode \"quoted\"\nline", "step": step}
    if kind == 2:
        return {}
    if kind == 3:
        return {"train_runtime": 10.0, "total_flos": 1.2e18, "nested": {"a": [], "b": {"c": None}}, "step": step}
    return {"custom": [True, False, None, -1, 2**40, "x"], "step": step}


def test_the_state_is_the_text_the_trainer_writes_at_every_length_and_after_every_kind_of_change() -> None:
    rng = seeded_random()
    state = TrainerState(global_step=0, max_steps=500, logging_steps=1, best_metric=0.25, trial_params={"lr": 1e-3})
    trainer, history = trainer_with(state), LogHistoryJson()
    assert trainer_state_json(trainer, history=history) == as_the_trainer_writes(trainer)   # empty: "[]"
    for step in range(1, 120):
        state.global_step = step
        state.log_history.extend(entry(rng, step) for _ in range(rng.randrange(3)))
        change = rng.randrange(40)
        if change == 0:    # a resume: the Trainer loads a new TrainerState, with a new list
            state.log_history = [dict(e) for e in state.log_history]
        elif change == 1 and state.log_history:   # a history cut short
            del state.log_history[rng.randrange(len(state.log_history)):]
        elif change == 2 and state.log_history:   # the last entry replaced by another object
            state.log_history[-1] = entry(rng, step)
        text = trainer_state_json(trainer, history=history)
        assert text == as_the_trainer_writes(trainer), f"step {step}, {len(state.log_history)} entries"
        assert json.loads(text)["log_history"] == json.loads(as_the_trainer_writes(trainer))["log_history"]
    assert history.count == len(state.log_history)


def test_an_entry_is_encoded_once_across_snapshots() -> None:
    """The point of the encoder: a snapshot encodes only the entries appended since the one before. The Trainer never
    changes an entry once logged (each is a new dict); one changed here shows that it is not read again."""
    entries = [{"loss": 1.0, "step": step} for step in range(3)]
    history = LogHistoryJson()
    history(entries)
    entries[0]["loss"] = 9.0
    entries.append({"loss": 0.5, "step": 3})
    encoded = json.loads(history(entries))
    assert encoded == [{"loss": 1.0, "step": 0}, {"loss": 1.0, "step": 1}, {"loss": 1.0, "step": 2},
                       {"loss": 0.5, "step": 3}]
