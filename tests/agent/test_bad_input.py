"""Bad input gets a clear error (or a fallback to the previous good checkpoint), never a crash from deep
inside and never data loss (design invariant 8).

Every test runs real processes (the agent is spawned by the Checkpointer) on real files; nothing is
mocked. Synchronisation is by ``wait_for`` against a deadline.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import msgpack
import numpy
import pytest
import torch
import zmq
from conftest import Env, assert_same, run_cli, save_and_persist, state_at, wait_for

import easyckpt
from easyckpt_wire import layout, protocol, timeline
from easyckpt_wire.protocol import Kind
from easyckpt_wire.shm import format_bytes

MODEL_FILE = "easyckpt-model-0000000-0000001.safetensors"
OPT_FILE = "easyckpt-opt-0000000-0000001.safetensors"


# helpers -----------------------------------------------------------------------------------------------
def make_ck(env: Env, save_dir: Path | None = None, **overrides: Any) -> easyckpt.Checkpointer:
    kwargs: dict[str, Any] = dict(save_mem_interval=2, save_storage_interval=2, max_ckpt_num=5,
                                  agent_idle_timeout=30.0)
    kwargs.update(overrides)
    return easyckpt.Checkpointer(save_dir if save_dir is not None else env.save_dir, **kwargs)


def iteration(save_dir: Path, step: int) -> Path:
    return save_dir / layout.iteration_dirname(step)


def wait_persisted(save_dir: Path, step: int) -> Path:
    path = iteration(save_dir, step)
    wait_for(lambda: (path / layout.METADATA).is_file(), 60, f"{path}/{layout.METADATA} (persist of step {step})")
    return path


def persist_steps(env: Env, steps: list[int]) -> dict[int, dict[str, Any]]:
    """Put ``steps`` on disk through a real Checkpointer + agent; return what was saved at each.

    Afterwards no agent runs and shared memory is empty, so the next Checkpointer loads from disk.
    """
    saved = {}
    ck = make_ck(env)
    try:
        for step in steps:
            saved[step] = state_at(step)
            save_and_persist(ck, env, step, saved[step])
    finally:
        ck.close()
    env.wait_agent_gone()
    assert env.shm_files() == [], "a clean close must unlink the job's shm files"
    return saved


@pytest.fixture
def two_on_disk(env: Env) -> dict[int, dict[str, Any]]:
    """Steps 2 and 4 durable in env.save_dir, nothing in memory, no agent running."""
    return persist_steps(env, [2, 4])


def flip_data_bytes(path: Path) -> None:
    """Invert 8 bytes in the tensor-data part of a safetensors file, leaving its JSON header intact."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    start = 8 + header_len
    assert len(raw) >= start + 24, f"{path} has too little data ({len(raw)} bytes, header {header_len})"
    with open(path, "r+b") as handle:
        handle.seek(start + 8)
        chunk = handle.read(8)
        handle.seek(start + 8)
        handle.write(bytes(b ^ 0xFF for b in chunk))
    assert path.read_bytes() != raw


# 1. /dev/shm too small ------------------------------------------------------------------------------------
def test_shm_with_room_for_two_slots_only_uses_two_and_says_so_once(env: Env, tmpfs: Any, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A 10 MiB tmpfs holds two 4 MiB slots, not three: two slots, one warning naming the freshness bound and
    the --shm-size that gives three; snapshots and a load from memory still work."""
    shm = tmpfs("size=10m")
    monkeypatch.setenv("EASYCKPT_SHM_DIR", str(shm))
    state = {"model": {"weight": torch.ones(1024, 1024)}}  # 4 MiB
    ck = make_ck(env, save_storage_interval=1000)
    try:
        with caplog.at_level(logging.WARNING, logger="easyckpt.snapshot.shm_space"):
            for step in (2, 4, 6):
                assert ck.save_if_needed(step, state)
                ck.wait()
        warnings = [r.getMessage() for r in caplog.records if "using 2 slots" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "3 slots per rank need 12.2 MiB" in warnings[0] and "--shm-size=" in warnings[0], warnings[0]
        assert "persist plus two snapshot intervals" in warnings[0]
        assert ck.slots.count == 2 and len(list(shm.glob("easyckpt-*-s[0-9]"))) == 2
        assert ck.load().step == 6
    finally:
        ck.close()


def snapshots_what_fits(ck: easyckpt.Checkpointer, step: int) -> None:
    """After a refused snapshot: a small state at ``step`` is snapshotted and loads back from memory."""
    small = state_at(step)
    assert ck.save_if_needed(step, small) is True
    ck.wait()
    result = ck.load()
    assert (result.step, result.source) == (step, "memory")
    assert_same(small, result.state)


@pytest.mark.parametrize("value", ["1", "9", "three"])
def test_bad_slot_counts_are_refused_naming_the_range(env: Env, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("EASYCKPT_SLOTS", value)
    with pytest.raises(ValueError) as info:
        make_ck(env)
    assert "EASYCKPT_SLOTS" in str(info.value) or "slots must be an int from 2 to 8" in str(info.value)


def test_shm_too_small_for_a_huge_state_raises_shm_space_error(env: Env) -> None:
    stats = os.statvfs(env.shm_dir)
    numel = 10**10 if stats.f_bavail * stats.f_frsize < 7 * 10**10 else 10**12  # must not fit twice
    huge = {"model": {"weight": torch.zeros(1).expand(numel)}}  # 40 GB logical, 4 bytes real
    ck = make_ck(env)
    try:
        with pytest.raises(easyckpt.ShmSpaceError) as info:
            ck.save_if_needed(0, huge)
        message = str(info.value)
        assert str(env.shm_dir) in message
        assert "rank 0" in message
        assert format_bytes(numel * 4) in message  # the slot size: 10**10 float32 = 37.3 GiB
        assert "--shm-size=" in message and "EASYCKPT_SHM_DIR" in message
        assert env.slot_files() == [], "a failed free-space check must not leave slot files behind"
        snapshots_what_fits(ck, 2)   # the same Checkpointer still snapshots a state that fits
    finally:
        ck.close()
    env.wait_agent_gone()

    # Nothing half-created breaks a new Checkpointer of the same job.
    ck = make_ck(env)
    try:
        with pytest.raises(easyckpt.ShmSpaceError):
            ck.save_if_needed(0, huge)
        snapshots_what_fits(ck, 4)
    finally:
        ck.close()


def test_one_mib_tmpfs_as_shm_dir_raises_shm_space_error(env: Env, tmpfs: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    shm = tmpfs("size=1m")
    monkeypatch.setenv("EASYCKPT_SHM_DIR", str(shm))
    state = {"model": {"weight": torch.ones(1024, 1024)}}  # 4 MiB
    ck = make_ck(env)
    try:
        assert ck.config.shm_dir == shm
        with pytest.raises(easyckpt.ShmSpaceError) as info:
            ck.save_if_needed(0, state)
        message = str(info.value)
        assert str(shm) in message and "rank 0" in message
        # Not even 2 slots of 4 MiB fit: one message, for the default 3 (plus header/meta); the agent's 4 KiB
        # control block is there too
        free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
        assert f"{format_bytes(free)} free" in message and "needs 12.2 MiB" in message, message
        assert "--shm-size=" in message and "EASYCKPT_SHM_DIR" in message
        assert [p.name for p in shm.iterdir() if not p.name.endswith("-control")] == []
    finally:
        ck.close()
    env.wait_agent_gone()


def test_state_that_outgrows_the_tmpfs_keeps_the_previous_snapshot(env: Env, tmpfs: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A later, larger snapshot that no longer fits fails loudly; the last good snapshot stays loadable."""
    shm = tmpfs("size=1m")
    monkeypatch.setenv("EASYCKPT_SHM_DIR", str(shm))
    ck = make_ck(env, save_storage_interval=100)  # nothing due for disk: memory only
    try:
        first = {"w": torch.arange(100 * 256, dtype=torch.float32)}     # 100 KiB: both slots fit
        assert ck.save_if_needed(2, first) is True
        ck.wait()
        bigger = {"w": torch.arange(150 * 1024, dtype=torch.float32)}   # 600 KiB: one slot grows
        assert ck.save_if_needed(4, bigger) is True
        ck.wait()
        with pytest.raises(easyckpt.ShmSpaceError) as info:            # the other slot cannot grow
            ck.save_if_needed(6, {"w": bigger["w"] + 1})
        message = str(info.value)
        assert str(shm) in message and "rank 0" in message and "EASYCKPT_SHM_DIR" in message
        result = ck.load()
        assert (result.step, result.source) == (4, "memory")
        assert_same(bigger, result.state)
    finally:
        ck.close()
    env.wait_agent_gone()


# 2. save_dir not writable ---------------------------------------------------------------------------------
@pytest.mark.parametrize("below", [True, False], ids=["below-a-file", "is-a-file"])
def test_save_dir_that_is_or_is_below_a_regular_file_raises_not_a_directory(env: Env, below: bool) -> None:
    """The real cause (issue 28): a file where a directory is wanted, not a permission problem."""
    blocker = env.tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    save_dir = blocker / "ckpt" if below else blocker
    with pytest.raises(NotADirectoryError) as info:
        make_ck(env, save_dir=save_dir)
    message = str(info.value)
    assert str(save_dir) in message and f"{blocker} is a file, not a directory" in message, message
    assert "give a directory path" in message and "permission" not in message, message
    assert blocker.read_text() == "not a directory\n"
    assert not env.agent_alive() and list(env.runtime_dir.iterdir()) == [], \
        "no agent may be started for a save_dir that cannot be written"


def test_read_only_tmpfs_save_dir_raises_permission_error(env: Env, tmpfs: Any) -> None:
    readonly = tmpfs("ro,size=1m")
    for save_dir in (readonly, readonly / "ckpt"):
        with pytest.raises(PermissionError) as info:
            make_ck(env, save_dir=save_dir)
        message = str(info.value)
        assert str(save_dir) in message and "not writable" in message
        assert "Read-only file system" in message
        assert "Choose a directory" in message or "fix its permissions" in message
    assert not env.agent_alive() and list(env.runtime_dir.iterdir()) == []


# 3. state that does not match the checkpoint --------------------------------------------------------------
def _linear_state(out_features: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(8, out_features).to(dtype).state_dict(), "step": 7}


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_shape_and_dtype_mismatch_raise_state_mismatch_error_and_change_nothing(env: Env, source: str) -> None:
    saved = _linear_state(4)
    ck = make_ck(env)
    try:
        assert ck.save_if_needed(2, saved) is True
        ck.wait()
        wait_persisted(env.save_dir, 2)
        if source == "disk":
            ck.close()
            env.wait_agent_gone()
            ck = make_ck(env)
        for template, want_shape, want_dtype in (
                (_linear_state(5, seed=1), "(5, 8)", "torch.float32"),
                (_linear_state(4, torch.float64, seed=2), "(4, 8)", "torch.float64")):
            before = {k: v.clone() for k, v in template["model"].items()}
            with pytest.raises(easyckpt.StateMismatchError) as info:
                ck.load(template)
            message = str(info.value)
            assert "model/weight" in message
            assert "(4, 8)" in message and want_shape in message and want_dtype in message
            assert "step 2" in message and source in message
            assert "same configuration" in message  # says what to do
            for key, value in template["model"].items():
                assert torch.equal(value, before[key]) and value.dtype == before[key].dtype, \
                    f"load() changed template tensor {key} although it raised"
        # The checkpoint itself is intact: a matching template loads it.
        result = ck.load(_linear_state(4, seed=3))
        assert (result.step, result.source) == (2, source)
        assert_same(saved, result.state)
    finally:
        ck.close()


# 4. corrupted safetensors ---------------------------------------------------------------------------------
def assert_loads_from_disk_warning(env: Env, caplog: Any, step: int, state: dict, damaged: Path, reason: str) -> None:
    """A load resumes from ``step`` on disk (``state``) and warns naming ``damaged`` and ``reason``."""
    ck = make_ck(env)
    try:
        with caplog.at_level(logging.WARNING):
            result = ck.load()
        assert (result.step, result.source) == (step, "disk")
        assert_same(state, result.state)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(str(damaged.resolve()) in w and reason in w for w in warnings), warnings
    finally:
        ck.close()


def assert_falls_back_to_step_2(env: Env, two_on_disk: dict, caplog: Any, damaged: Path, reason: str) -> None:
    assert_loads_from_disk_warning(env, caplog, 2, two_on_disk[2], damaged, reason)
    # The resume from 2 abandoned the damaged iteration (invariant 10): it was moved aside, not deleted, and
    # is still there for a human to look at; the tracker names 2.
    assert not damaged.exists() and layout.read_tracker(env.save_dir) == 2
    moved = [path for _, step, path in timeline.abandoned_iterations(env.save_dir) if step == 4]
    assert len(moved) == 1 and (moved[0] / damaged.name).is_file()
    verify = run_cli("verify", str(moved[0].parent), env=env)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "iteration_0000004: DAMAGED" in verify.stdout and damaged.name in verify.stdout
    verify = run_cli("verify", str(env.save_dir), env=env)
    assert verify.returncode == 0 and "iteration_0000002: OK" in verify.stdout, verify.stdout + verify.stderr


def test_flipped_bytes_fall_back_to_previous_iteration(env: Env, two_on_disk: dict, caplog: Any) -> None:
    damaged = iteration(env.save_dir, 4) / MODEL_FILE
    flip_data_bytes(damaged)
    assert_falls_back_to_step_2(env, two_on_disk, caplog, damaged, "checksum")
    good = run_cli("verify", str(iteration(env.save_dir, 2)), env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "iteration_0000002: OK" in good.stdout and "iteration_0000004" not in good.stdout


def test_load_dir_of_a_corrupted_iteration_names_the_file(env: Env, two_on_disk: dict) -> None:
    damaged_dir = iteration(env.save_dir, 4)
    flip_data_bytes(damaged_dir / MODEL_FILE)
    ck = make_ck(env)
    try:
        with pytest.raises((easyckpt.LoadError, easyckpt.CheckpointCorruptError)) as info:
            ck.load(load_dir=damaged_dir)
        message = str(info.value)
        assert "step 4" in message and MODEL_FILE in message and str(damaged_dir) in message
    finally:
        ck.close()


def test_load_dir_picks_that_iteration_and_rejects_a_non_iteration(env: Env, two_on_disk: dict) -> None:
    ck = make_ck(env)
    try:
        result = ck.load(load_dir=iteration(env.save_dir, 2))  # older than the newest (4): asked for
        assert (result.step, result.source) == (2, "disk")
        assert_same(two_on_disk[2], result.state)
        incomplete = env.save_dir / "iteration_0000009"
        incomplete.mkdir()
        for bad in (incomplete, env.save_dir / "iteration_0000077", env.save_dir):
            with pytest.raises(easyckpt.LoadError) as info:
                ck.load(load_dir=bad)
            assert str(bad) in str(info.value), str(info.value)
    finally:
        ck.close()


@pytest.mark.parametrize("victim", [MODEL_FILE, OPT_FILE])
def test_truncated_file_falls_back_to_previous_iteration(env: Env, two_on_disk: dict, caplog: Any,
                                                         victim: str) -> None:
    damaged = iteration(env.save_dir, 4) / victim
    os.truncate(damaged, damaged.stat().st_size // 2)
    assert_falls_back_to_step_2(env, two_on_disk, caplog, damaged, "step 4")


def test_every_iteration_corrupted_raises_load_error_not_fresh_start(env: Env, two_on_disk: dict) -> None:
    """Never data loss: when every checkpoint is damaged, load() must not pretend there is nothing."""
    for step in (2, 4):
        flip_data_bytes(iteration(env.save_dir, step) / MODEL_FILE)
    ck = make_ck(env)
    try:
        with pytest.raises(easyckpt.LoadError) as info:
            ck.load()
        message = str(info.value)
        assert "step 4" in message and "step 2" in message and str(env.save_dir.resolve()) in message
    finally:
        ck.close()


# 5. tracker names a missing iteration ---------------------------------------------------------------------
def test_tracker_naming_a_missing_iteration_uses_the_newest_complete_one(env: Env, two_on_disk: dict,
                                                                         caplog: Any) -> None:
    tracker = env.save_dir / layout.TRACKER
    assert tracker.read_text().strip() == "4"
    tracker.write_text("999\n")
    assert_loads_from_disk_warning(env, caplog, 4, two_on_disk[4], tracker, "999")


def test_garbage_tracker_is_ignored(env: Env, two_on_disk: dict) -> None:
    (env.save_dir / layout.TRACKER).write_text("not a number\n")
    ck = make_ck(env)
    try:
        result = ck.load()
        assert (result.step, result.source) == (4, "disk")
    finally:
        ck.close()


# 6. incomplete iteration directory ------------------------------------------------------------------------
def test_incomplete_iteration_is_never_loaded_and_listed_incomplete(env: Env, two_on_disk: dict) -> None:
    incomplete = iteration(env.save_dir, 99)
    ck = make_ck(env)
    try:
        # Made after the agent started (its start-up clean-up has run), so load() does see it.
        shutil.copytree(iteration(env.save_dir, 4), incomplete)
        (incomplete / layout.METADATA).unlink()
        result = ck.load()
        assert (result.step, result.source) == (4, "disk")
        assert_same(two_on_disk[4], result.state)
        listing = run_cli("ls", str(env.save_dir), env=env)
        assert listing.returncode == 0, listing.stderr
        line = next(row for row in listing.stdout.splitlines() if row.startswith("iteration_0000099"))
        assert "INCOMPLETE" in line and "complete" not in line.replace("INCOMPLETE", "")
        line4 = next(row for row in listing.stdout.splitlines() if row.startswith("iteration_0000004"))
        assert "complete" in line4 and "INCOMPLETE" not in line4
        # Not damage: a persist under way or one that failed, never loaded (an object store writes in place)
        verify = run_cli("verify", str(env.save_dir), env=env)
        assert verify.returncode == 0 and "iteration_0000099: INCOMPLETE" in verify.stdout, verify.stdout
    finally:
        ck.close()
    env.wait_agent_gone()
    # A new agent cleans the directory up at start-up (invariant 3), and says so in the audit log.
    ck = make_ck(env)
    try:
        wait_for(lambda: not incomplete.exists(), 30, f"the agent to remove {incomplete}")
        audit = (env.save_dir / layout.AUDIT_LOG).read_text()
        assert str(incomplete) in audit and "incomplete" in audit
        assert (iteration(env.save_dir, 4) / layout.METADATA).is_file()
        assert (iteration(env.save_dir, 2) / layout.METADATA).is_file()
    finally:
        ck.close()


# 7. garbage on the agent's socket -------------------------------------------------------------------------
def test_agent_survives_garbage_on_its_socket(env: Env) -> None:
    ck = make_ck(env)
    ctx = zmq.Context()
    sockets = []

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(protocol.agent_endpoint(env.job_dir()))
        sockets.append(sock)
        return sock

    def status(sock: zmq.Socket, request_id: int) -> dict[str, Any]:
        sock.send(protocol.encode(Kind.STATUS, id=request_id))
        assert sock.poll(20_000), f"no reply to STATUS id={request_id} within 20s: the agent died or hangs"
        kind, message = protocol.decode(sock.recv())
        assert kind == Kind.REPLY
        return message

    try:
        agent_pid = env.agent_pid()
        assert agent_pid is not None
        # Oversized first, on its own socket: ZeroMQ drops the connection of a peer that exceeds MAXMSGSIZE.
        big = dealer()
        big.send(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1024))
        sock = dealer()
        rng = random.Random(1234)
        sock.send(bytes(rng.randrange(256) for _ in range(512)))                    # random bytes
        sock.send(b"")                                                               # empty frame
        sock.send(msgpack.packb({"v": 99, "kind": int(Kind.STATUS), "id": 1}))       # wrong version
        sock.send(msgpack.packb({"v": 1, "kind": 42, "id": 2}))                      # unknown kind
        sock.send(msgpack.packb([1, 2, 3]))                                          # not a map
        sock.send(msgpack.packb({1: 1, 2: 3}))                                       # non-str keys
        sock.send(msgpack.packb({"v": 1, "kind": int(Kind.HELLO), "rank": "zero", "pid": os.getpid(),
                                 "world_size": 1, "local_world_size": 1, "save_storage_interval": 2,
                                 "max_ckpt_num": 5, "log_file_path": None}))         # HELLO with a str rank
        sock.send(msgpack.packb({"v": 1, "kind": int(Kind.BYE), "rank": True, "pid": 1, "wait": True}))
        sock.send(msgpack.packb({"v": 1, "kind": int(Kind.REPLY), "ok": True}))      # not a request
        # The ROUTER prepends the peer identity: 2 frames sent arrive as 3, 3 as 4.
        sock.send_multipart([b"one", protocol.encode(Kind.STATUS, id=3)])            # 3 frames at the agent
        sock.send_multipart([b"one", b"two", b"three"])                              # 4 frames at the agent
        reply = status(sock, 7)
        assert reply["ok"] is True and reply["id"] == 7
        assert reply["pid"] == agent_pid
        assert env.agent_pid() == agent_pid, "the agent was replaced: the garbage killed it"
        assert [r["rank"] for r in reply["ranks"]] == [0], reply["ranks"]
        assert reply["save_storage_interval"] == 2 and reply["max_ckpt_num"] == 5

        # Training goes on, and the agent still persists.
        state = state_at(2)
        assert ck.save_if_needed(2, state) is True
        ck.wait()
        wait_persisted(env.save_dir, 2)
        watcher = dealer()
        wait_for(lambda: status(watcher, 8)["persisted_step"] == 2, 30, "the agent to report step 2 persisted")

        log = env.job_dir() / "agent.log"
        wait_for(lambda: "dropped a message of 4 frames" in log.read_text(), 10, "the 4-frame drop in the agent log")
        text = log.read_text()
        assert "dropped a message of 3 frames" in text
        assert text.count("dropped a malformed message") >= 7, text
        assert "dropped a REPLY message" in text
        assert "protocol version 99" in text and "unknown message kind 42" in text
        assert "field 'rank' is 'zero'" in text
        assert "Traceback" not in text, text
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
        ck.close()
    result_dir = wait_persisted(env.save_dir, 2)
    assert result_dir.is_dir()


# 8. bad Checkpointer arguments and unsupported state ------------------------------------------------------
@pytest.mark.parametrize("overrides, names", [
    ({"save_mem_interval": 0}, ["save_mem_interval", "positive", "0"]),
    ({"save_mem_interval": -3}, ["save_mem_interval", "positive", "-3"]),
    ({"save_mem_interval": 2.5}, ["save_mem_interval", "int"]),
    ({"save_mem_interval": 3, "save_storage_interval": 10}, ["save_storage_interval=10", "save_mem_interval=3",
                                                             "multiple", "save_storage_interval=9"]),
    ({"max_ckpt_num": 0}, ["max_ckpt_num", "positive", "0"]),
    ({"agent_idle_timeout": 0}, ["agent_idle_timeout", "positive"]),
])
def test_bad_arguments_raise_value_error_naming_the_argument(env: Env, overrides: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        make_ck(env, **overrides)
    for name in names:
        assert name in str(info.value), str(info.value)
    assert list(env.runtime_dir.iterdir()) == [], "bad arguments must be refused before an agent is started"


def test_unsupported_value_in_state_raises_type_error_naming_the_key(env: Env) -> None:
    ck = make_ck(env)
    try:
        bad = {"model": {"weight": torch.ones(2)}, "extra": {"schedule": [1, lambda step: step * 0.5]}}
        with pytest.raises(TypeError) as info:
            ck.save_if_needed(2, bad)
        message = str(info.value)
        assert "state['extra']['schedule'][1]" in message and "function" in message
        assert "supported" in message  # says what can be saved
        assert env.slot_files() == []
        # The error does not wedge the Checkpointer: a good state snapshots fine afterwards.
        good = state_at(4)
        assert ck.save_if_needed(4, good) is True
        ck.wait()
        result = ck.load()
        assert (result.step, result.source) == (4, "memory")
        assert_same(good, result.state)
    finally:
        ck.close()


def test_empty_save_dir_is_refused_before_anything_is_written(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty save_dir (a setting read from an unset environment variable) used to mean the working directory."""
    work = env.tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(ValueError) as info:
        make_ck(env, save_dir="")   # type: ignore[arg-type]
    assert "save_dir is empty" in str(info.value), str(info.value)
    assert list(work.iterdir()) == [] and list(env.runtime_dir.iterdir()) == [], "nothing may be written or started"


def test_steps_that_are_not_ints_are_refused_and_steps_that_go_back_are_said_once(env: Env, caplog: Any) -> None:
    """A float or a string as the step used to fail in the copy thread or at the agent (or pass unnoticed); a numpy
    integer or an integer tensor is its value. A per-epoch batch index passed as the step goes back to 0 each epoch,
    and a resume would then take the old numbers' snapshots for the newer state: said once, naming both steps, with
    the fix (not refused: a script that did it ran before), and said again when it ends."""
    caplog.set_level(logging.INFO, logger="easyckpt")
    ck = make_ck(env)
    try:
        assert ck.save_if_needed(torch.tensor(2), state_at(2)) is True   # type: ignore[arg-type]
        ck.wait()
        assert ck.save(numpy.int64(4), state_at(4)) is True   # type: ignore[arg-type]
        ck.wait()
        with pytest.raises(TypeError, match="got float 6.0"):
            ck.save_if_needed(6.0, state_at(6))   # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step -1 is out of range"):
            ck.note_step(-1)
        for step in (1, 3):
            ck.note_step(step)
        back = [r for r in caplog.records if "after step 4" in r.getMessage()]
        assert len(back) == 1 and back[0].levelno == logging.WARNING, [r.getMessage() for r in back]
        message = back[0].getMessage()
        assert "step 1 after step 4" in message and "global step" in message and "load() it first" in message
        ck.note_step(5)
        assert any("steps pass step 4 again at 5" in r.getMessage() for r in caplog.records)
        result = ck.load()
        assert (result.step, result.source) == (4, "memory") and type(result.step) is int, "nothing of 6.0 was kept"
        assert_same(state_at(4), result.state)
        assert ck.save_if_needed(4, state_at(4)) is True, "the run goes on from the step it loaded"
        ck.wait()
    finally:
        ck.close()


def test_save_after_close_raises_clear_error(env: Env) -> None:
    ck = make_ck(env)
    ck.close()
    with pytest.raises(RuntimeError) as info:
        ck.save_if_needed(2, state_at(2))
    assert "step=2" in str(info.value) and "close()" in str(info.value) and "new Checkpointer" in str(info.value)


def test_agent_drops_well_typed_hello_with_absurd_values(env: Env) -> None:
    ck = make_ck(env, close_timeout=5.0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(protocol.agent_endpoint(env.job_dir()))
        absurd = {"v": protocol.PROTOCOL_VERSION, "kind": int(Kind.HELLO), "id": 1, "rank": 0, "pid": os.getpid(),
                  "world_size": 1, "save_storage_interval": 2, "max_ckpt_num": 5, "log_file_path": None}
        for field, value in (("local_world_size", 10**6), ("pid", 0), ("world_size", 0)):
            sock.send(msgpack.packb({**absurd, "local_world_size": 1, field: value}))
        sock.send(protocol.encode(Kind.STATUS, id=2))
        assert sock.poll(20_000), "the agent did not answer at all"
        kind, reply = protocol.decode(sock.recv())
        assert reply["id"] == 2, "the absurd HELLOs should have been dropped without a reply"
        assert ck.save_if_needed(2, state_at(2)) is True
        ck.wait()
        wait_for(lambda: (iteration(env.save_dir, 2) / layout.METADATA).is_file(), 10,
                 "step 2 to be persisted after a bogus HELLO")
    finally:
        sock.close(linger=0)
        ctx.term()
        ck.close()
