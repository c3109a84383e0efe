"""Megatron ``load_checkpoint(..., concat=True)`` under real torchrun on CPU (gloo): a save resumes on another
tensor-parallel and data-parallel size.

One save_dir, five jobs of examples/megatron_gpt.py in a row: TP2xDP1 trains; a TP1xDP2 job without
concat=True is refused with the error that names it; TP1xDP2 with concat=True resumes and trains one
iteration; TP2xDP1 with concat=True resumes that save; one rank (TP1xDP1) resumes the TP2 save. After
every resume the state gathered over the tensor-parallel group by Megatron's own collectives
(``--dump-full``: every parameter and its AdamW moments) equals the one the saving job gathered before it
ended, bitwise, and so does the loss on a fixed batch (no dropout).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from conftest import Env  # noqa: E402
from megatron_job import Job  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _run(env: Env, out: Path, *, iters: int, tp: int, nproc: int, concat: bool) -> Job:
    extra = ("--tp", str(tp), "--dump-full") + (("--concat",) if concat else ())
    job = Job(env, out, save_dir=env.save_dir, iters=iters, storage_interval=2, extra=extra, nproc=nproc, idle="0")
    job.wait(timeout=120)
    return job


def _assert_resumed_as_saved(saved: Job, resumed: Job, iteration: int, what: str) -> None:
    assert resumed.proc.returncode == 0, f"{what}: the job failed:\n{resumed.log()[-3000:]}"
    assert resumed.resumes(0)[-1]["iteration"] == iteration and resumed.resumes(0)[-1]["source"] == "disk"
    before = load_file(str(saved.out / "full-end.safetensors"))
    after = load_file(str(resumed.out / "full-load.safetensors"))
    assert sorted(before) == sorted(after), f"{what}: tensors differ: {sorted(set(before) ^ set(after))}"
    moments = [k for k in before if k.endswith(".exp_avg")]
    assert moments, f"{what}: the dump holds no optimizer moments"
    differ = [k for k in before if before[k].shape != after[k].shape or not torch.equal(before[k], after[k])]
    assert not differ, f"{what}: {len(differ)} of {len(before)} gathered tensors differ, e.g. {differ[:3]}"
    loss_before = json.loads((saved.out / "eval-end.json").read_text())
    loss_after = json.loads((resumed.out / "eval-load.json").read_text())
    print(f"{what}: {len(before)} gathered tensors ({len(moments)} exp_avg) bitwise equal; fixed-batch loss "
          f"tp{loss_before['tp']} {loss_before['loss']!r} -> tp{loss_after['tp']} {loss_after['loss']!r}")
    # Another tensor-parallel size sums the row-parallel products in another order: equal here on CPU, but
    # only closeness is a property of the load.
    assert math.isclose(loss_after["loss"], loss_before["loss"], rel_tol=1e-6), (loss_before, loss_after)


def test_megatron_concat_resumes_tp2_on_tp1_and_back_and_on_one_rank(env: Env, tmp_path: Path) -> None:
    tp2 = _run(env, tmp_path / "tp2", iters=4, tp=2, nproc=2, concat=False)
    assert tp2.proc.returncode == 0, tp2.log()[-3000:]

    refused = _run(env, tmp_path / "refused", iters=4, tp=1, nproc=2, concat=False)
    assert refused.proc.returncode != 0, "a TP2 save resumed on TP1 without concat=True"
    assert "LayoutChangedError" in refused.log() and "concat=True" in refused.log(), refused.log()[-3000:]

    tp1 = _run(env, tmp_path / "tp1", iters=5, tp=1, nproc=2, concat=True)
    _assert_resumed_as_saved(tp2, tp1, 4, "TP2xDP1 -> TP1xDP2")
    assert "resharded through torch.distributed.checkpoint" in tp1.log()

    back = _run(env, tmp_path / "back", iters=6, tp=2, nproc=2, concat=True)
    _assert_resumed_as_saved(tp1, back, 5, "TP1xDP2 -> TP2xDP1")
    assert sorted(back.losses(0)) == [6], "the resumed TP2 job did not train on"

    one = _run(env, tmp_path / "one", iters=7, tp=1, nproc=1, concat=True)
    _assert_resumed_as_saved(back, one, 6, "TP2xDP1 -> TP1xDP1 (one rank)")
    assert sorted(one.losses(0)) == [7]
