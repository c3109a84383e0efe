"""The stager in one process (no agent): copy consistency, re-planning, skipping, torn slots."""
from __future__ import annotations

import concurrent.futures
import logging
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import ROOT, Env, wait_for

import easyckpt
from easyckpt_wire import layout
from easyckpt_wire.shm import SlotMap

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: runs on a GPU machine")])]


def make(env: Env, **kw: Any) -> easyckpt.Checkpointer:
    return easyckpt.Checkpointer(env.save_dir, 1, 1000, 2, start_agent=False, **kw)


@pytest.mark.parametrize("copy_threads", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_is_the_state_at_save_time_even_if_the_optimizer_steps_at_once(env: Env, device: str,
                                                                              copy_threads: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096).to(device)  # 64 MiB: the copy outlasts the launch, in 4 chunks
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ck = make(env, copy_threads=copy_threads)
    try:
        model(torch.randn(4, 4096, device=device)).sum().backward()
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        assert ck.save_if_needed(1, {"model": model.state_dict()})
        optimizer.step()  # the pre-step hook must wait for the copy before the parameters change
        assert not torch.equal(model.weight.detach().cpu(), expected["weight"])
        result = ck.load()
        assert (result.step, result.source) == (1, "memory")
        for key, value in expected.items():
            assert torch.equal(result.state["model"][key], value), key
    finally:
        ck.close()


@pytest.mark.parametrize("positional", [False, True])
def test_a_step_with_a_closure_waits_after_the_closure_and_before_the_update(env: Env, positional: bool) -> None:
    """PyTorch Lightning runs forward and backward in the closure it hands optimizer.step: the copy overlaps
    the closure (not awaited before it) and is still complete before the parameters change."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    ck = make(env)
    seen: list[bool] = []

    def closure() -> torch.Tensor:
        seen.append(ck.stager.pending is not None)   # the copy is not awaited before the closure runs
        loss = model(torch.randn(4, 2048)).sum()
        loss.backward()
        return loss

    try:
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert ck.save_if_needed(1, {"model": model.state_dict()})
        optimizer.step(closure) if positional else optimizer.step(closure=closure)
        assert seen == [True] and ck.stager.pending is None, "awaited after the closure, before the update"
        assert not torch.equal(model.weight.detach(), expected["weight"])
        result = ck.load()
        for key, value in expected.items():
            assert torch.equal(result.state["model"][key], value), key
    finally:
        ck.close()


def test_structure_change_replans_and_grows_the_slot(env: Env) -> None:
    ck = make(env)
    try:
        assert ck.save_if_needed(1, {"a": torch.ones(10)})
        ck.wait()
        small = ck.slots.maps[0].size
        bigger = {"a": torch.ones(10), "b": torch.arange(200_000, dtype=torch.float64), "c": ("x", 3)}
        last = 1 + ck.slots.count
        for step in range(2, last + 1):  # every slot gets the new layout
            assert ck.save_if_needed(step, bigger)
        result = ck.load()
        assert result.step == last and torch.equal(result.state["b"], bigger["b"]) and result.state["c"] == ("x", 3)
        assert min(m.size for m in ck.slots.maps) > small
    finally:
        ck.close()


def test_snapshot_is_skipped_not_waited_for_when_no_slot_is_free(env: Env) -> None:
    """Two slots (slots=2): one holds the safe step 2, the other a step being read (as the agent persists
    it): step 3 is skipped at once, never waited for."""
    ck = easyckpt.Checkpointer(env.save_dir, 1, 1000, 2, slots=2)   # with the agent that declares step 2 safe
    try:
        assert ck.save_if_needed(1, {"w": torch.full((8,), 1.0)})
        assert ck.save_if_needed(2, {"w": torch.full((8,), 2.0)})
        ck.wait()
        wait_for(lambda: (word := ck.slots.agent_word()) is not None and word.safe == 2, 30, "step 2 to be safe")
        older = next(m for m in ck.slots.maps if m.header().step == 1)
        reader = SlotMap(older.path, writable=False)  # what the agent does while it persists a slot
        assert reader.try_lock(exclusive=False)
        try:
            assert not ck.save_if_needed(3, {"w": torch.full((8,), 3.0)})
            assert ck.stats()["skipped"] == 1
        finally:
            reader.unlock()
            reader.close()
        assert ck.save_if_needed(4, {"w": torch.full((8,), 4.0)})
        result = ck.load()
        assert result.step == 4 and torch.equal(result.state["w"], torch.full((8,), 4.0))
    finally:
        ck.close()


def _skip_step_3(ck: easyckpt.Checkpointer, state: dict[str, Any], *, release: bool = True) -> SlotMap:
    """Steps 1 and 2 snapshotted, step 2 safe (held by the agent), the other slot read as a persist would:
    the snapshot of step 3 is skipped; then the reader lets go, unless ``release`` is False (the caller unlocks
    and closes the reader it returns). (``save`` snapshots whatever the interval.)"""
    for step in (1, 2):
        state["w"].fill_(float(step))
        assert ck.save(step, state)
    ck.wait()
    wait_for(lambda: (word := ck.slots.agent_word()) is not None and word.safe == 2, 30, "step 2 to be safe")
    older = next(m for m in ck.slots.maps if m.header().step == 1)
    reader = SlotMap(older.path, writable=False)
    assert reader.try_lock(exclusive=False)
    try:
        state["w"].fill_(3.0)
        assert not ck.save(3, state)
    finally:
        if release:
            reader.unlock()
            reader.close()
    return reader


def test_close_takes_the_skipped_last_snapshot_so_the_end_of_the_run_is_durable(env: Env) -> None:
    """The run's last snapshot found no free slot (a fast loop while the agent persists): close() takes it
    once a slot is free, and final_persist makes step 3, the end of the run, durable, not step 2."""
    ck = easyckpt.Checkpointer(env.save_dir, 1, 1000, 2, slots=2)
    state = {"w": torch.zeros(8)}
    _skip_step_3(ck, state)
    ck.close()
    assert layout.read_tracker(env.save_dir) == 3
    assert ck.stats()["skipped"] == 1
    loader = easyckpt.Checkpointer(env.save_dir, 1, 1000, 2, slots=2, start_agent=False)
    try:
        result = loader.load({"w": torch.zeros(8)})
        assert result.step == 3 and torch.equal(result.state["w"], torch.full((8,), 3.0))
    finally:
        loader.close()


def test_close_says_once_that_the_skipped_last_snapshot_waits_for_a_slot(env: Env,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The slot stays held as close() begins (a persist that takes long): the wait is said when it begins, not only
    when it ends, so that a rank that seems to hang at the end of the run says what it waits for."""
    ck = easyckpt.Checkpointer(env.save_dir, 1, 1000, 2, slots=2)
    state = {"w": torch.zeros(8)}
    reader = _skip_step_3(ck, state, release=False)
    with caplog.at_level(logging.INFO, logger="easyckpt.snapshot.stager"), \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            closing = pool.submit(ck.close)
            wait_for(lambda: "waits for a free slot" in caplog.text or closing.done(), 30,
                     "close() to say that the skipped snapshot waits")
        finally:
            reader.unlock()
            reader.close()
        closing.result(120)
    assert caplog.text.count("the skipped snapshot of step 3 waits for a free slot at the end of the run") == 1, \
        caplog.text
    assert "took the skipped snapshot of step 3 at the end of the run" in caplog.text
    assert layout.read_tracker(env.save_dir) == 3


@pytest.mark.parametrize("move", ["optimizer", "next-step"])
def test_a_skipped_snapshot_is_not_taken_late_once_the_state_moved_on(env: Env, move: str) -> None:
    """After the skip the state changed (an optimizer step, or the loop reached step 4, not a snapshot step
    with save_mem_interval=3): taking the snapshot of step 3 late would label a later state as step 3.
    close() does not."""
    ck = easyckpt.Checkpointer(env.save_dir, 3 if move == "next-step" else 1, 999, 2, slots=2)
    state = {"w": torch.zeros(8)}
    _skip_step_3(ck, state)
    if move == "next-step":
        assert not ck.save_if_needed(4, state)   # not a snapshot step, but the loop has moved on
    else:
        weight = torch.nn.Parameter(torch.zeros(8))   # any torch optimizer's step: the state may have changed
        weight.grad = torch.ones(8)
        torch.optim.SGD([weight], lr=0.1).step()
    ck.close()
    assert layout.read_tracker(env.save_dir) == 2


def test_a_torn_slot_is_never_loaded(env: Env) -> None:
    ck = make(env)
    try:
        for step in (1, 2):
            assert ck.save_if_needed(step, {"w": torch.full((8,), float(step))})
        ck.wait()
        newest = next(m for m in ck.slots.maps if m.header().step == 2)
        newest.begin_write(generation=ck.slots.next_generation(), rank=0, world_size=1, job_id=ck.config.job_id)
        result = ck.load()
        assert result.step == 1 and torch.equal(result.state["w"], torch.full((8,), 1.0))
    finally:
        ck.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on a GPU machine")
def test_cuda_slots_are_pinned_and_load_fills_cuda_templates_in_place(env: Env) -> None:
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda"), "cpu": torch.ones(3)}
    ck = make(env)
    try:
        assert ck.save_if_needed(1, state)
        ck.wait()
        assert ck.stager._registered, "the slot should have been registered with cudaHostRegister"
        template = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(7, device="cuda")}
        result = ck.load(template)
        assert result.state["w"] is template["w"] and result.state["w"].is_cuda
        assert torch.equal(template["w"], state["w"]) and torch.equal(template["b"], state["b"])
        assert torch.equal(result.state["cpu"], state["cpu"]) and not result.state["cpu"].is_cuda
    finally:
        ck.close()


# A DataLoader worker's start (torch.set_num_threads(1)) while another thread holds glibc's atexit lock: the thread
# calls __cxa_finalize with a handle no exit handler has, which takes the lock and runs nothing.
FORKS_UNDER_ATEXIT_LOCK = """
import ctypes, os, signal, sys, threading, time
import torch, easyckpt
ck = easyckpt.Checkpointer(sys.argv[1], 1, 1000, 2, start_agent=False)
libc, handle, stop = ctypes.CDLL(None), ctypes.create_string_buffer(8), threading.Event()
def hold_atexit_lock():
    while not stop.is_set():
        libc.__cxa_finalize(handle)
threading.Thread(target=hold_atexit_lock, daemon=True).start()
hung = 0
for forked in range(1, 31):
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        os._exit(0)
    deadline = time.monotonic() + 10
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.002)
    if hung:
        break
stop.set()
ck.close()
print(f"forked {forked}, hung {hung}")
"""


@pytest.mark.timeout(120)
def test_a_process_forked_while_another_thread_holds_the_atexit_lock_starts(env: Env) -> None:
    """pytorch/pytorch#130610, which hung a Lightning job's loader worker in CI: a child forked while any thread
    held glibc's atexit lock used to wait for it forever in torch.set_num_threads (the first or second did, here). A
    Checkpointer constructs torch's thread pool at once, so the child has nothing to register."""
    proc = subprocess.run([sys.executable, "-c", FORKS_UNDER_ATEXIT_LOCK, str(env.save_dir)], check=False,
                          capture_output=True, text=True, timeout=100, env=env.environ(), cwd=str(ROOT))
    assert proc.returncode == 0 and "forked 30, hung 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
