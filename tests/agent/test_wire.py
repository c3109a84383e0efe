"""The shared wire package: slot header seqlock, message validation, fault-point parsing, layout rules."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from conftest import ROOT, wait_for

from easyckpt_wire import faults, layout, protocol, shm
from easyckpt_wire.protocol import Kind, ProtocolError


def new_slot(tmp_path: Path, size: int = 1 << 16) -> shm.SlotMap:
    path = tmp_path / "slot"
    with open(path, "wb") as handle:
        handle.truncate(size)
    slot = shm.SlotMap(path, writable=True)
    slot.init_empty(rank=3, world_size=4, job_id="job")
    return slot


def test_slot_is_visible_only_after_commit(tmp_path: Path) -> None:
    slot = new_slot(tmp_path)
    assert slot.header().state == shm.SlotState.EMPTY and not slot.header().committed
    slot.begin_write(generation=1, rank=3, world_size=4, job_id="job")
    writing = slot.header()
    assert writing.state == shm.SlotState.WRITING and not writing.committed and writing.generation % 2 == 1
    meta = shm.pack_meta({"v": shm.FORMAT_VERSION, "step": 9})
    slot.commit(generation=1, step=9, data_len=100, meta=meta, rank=3, world_size=4, job_id="job")
    header = slot.header()
    assert header.committed and (header.step, header.generation, header.rank, header.job_id) == (9, 2, 3, "job")
    assert slot.read_meta(header)["step"] == 9
    reader = shm.SlotMap(slot.path, writable=False)
    assert reader.header() == header
    reader.close()
    slot.close()


def test_a_byte_flipped_anywhere_in_a_committed_header_is_never_read_as_another_committed_slot(tmp_path: Path) -> None:
    """Every byte of the header's fields, each of eight masks: the header reads as the committed one it was (it
    cannot), as not committed (damaged: its checksum fails), or is refused (magic, version, state). A soak flipped
    the top byte of the step and a rank resumed "step 2089670227099910147" from memory (slot format 1)."""
    slot = new_slot(tmp_path)
    slot.begin_write(generation=5, rank=3, world_size=4, job_id="job")
    meta = shm.pack_meta({"v": shm.FORMAT_VERSION, "step": 9})
    slot.commit(generation=5, step=9, data_len=100, meta=meta, rank=3, world_size=4, job_id="job")
    good = slot.header()
    assert good.committed and not good.damaged and shm.HEADER_BYTES == 160
    outcomes: dict[str, int] = {}
    for offset in range(shm.HEADER_BYTES):
        for mask in (0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80):
            slot.mm[offset] ^= mask
            try:
                header = slot.header()
            except shm.SlotFormatError:
                outcome = "refused"
            else:
                assert not header.committed, (offset, mask, header)
                outcome = "damaged" if header.damaged else "not committed"
            finally:
                slot.mm[offset] ^= mask
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert slot.header() == good
    assert outcomes["damaged"] > outcomes["refused"] > 0, outcomes
    # A header and metadata that disagree on the step (each checksummed: only a writer's bug) are refused.
    slot.begin_write(generation=7, rank=3, world_size=4, job_id="job")
    slot.commit(generation=7, step=10, data_len=100, meta=meta, rank=3, world_size=4, job_id="job")
    with pytest.raises(shm.SlotFormatError, match="the header says step 10, its metadata step 9"):
        slot.read_meta(slot.header())
    slot.invalidate()   # an abandoned timeline's slot: EMPTY, never damaged
    assert not slot.header().committed and not slot.header().damaged
    slot.close()


def test_damaged_metadata_and_foreign_files_are_rejected(tmp_path: Path) -> None:
    slot = new_slot(tmp_path)
    slot.begin_write(generation=1, rank=3, world_size=4, job_id="job")
    slot.commit(generation=1, step=1, data_len=0, meta=shm.pack_meta({"v": shm.FORMAT_VERSION}), rank=3, world_size=4,
                job_id="job")
    header = slot.header()
    slot.mm[header.meta_offset] ^= 0xFF
    with pytest.raises(shm.SlotFormatError, match="checksum"):
        slot.read_meta(header)
    slot.mm[0:8] = b"NOTASLOT"
    with pytest.raises(shm.SlotFormatError, match="not an easyckpt slot"):
        slot.header()
    with pytest.raises(shm.SlotFormatError, match="out of bounds"):
        slot.data(1 << 20, 10)
    slot.close()


def test_flock_excludes_writer_while_reader_holds_the_slot(tmp_path: Path) -> None:
    writer = new_slot(tmp_path)
    reader = shm.SlotMap(writer.path, writable=False)
    assert reader.try_lock(exclusive=False)
    assert not writer.try_lock(exclusive=True)  # a separate open file description: real exclusion
    reader.unlock()
    assert writer.try_lock(exclusive=True)
    with pytest.raises(TimeoutError, match="slot read lock"):
        reader.lock_shared(timeout=0.05)
    writer.close()
    reader.close()


def test_slot_names_are_per_job_and_rank(tmp_path: Path) -> None:
    for name in ("easyckpt-a-r000001-s0", "easyckpt-a-r000001-s1", "easyckpt-b-r000000-s0", "other"):
        (tmp_path / name).touch()
    assert set(shm.list_slots(tmp_path, "a")) == {(1, 0), (1, 1)}
    with pytest.raises(ValueError, match="EASYCKPT_JOB_ID"):
        shm.check_job_id("../etc")


def test_protocol_round_trip_and_rejections() -> None:
    kind, message = protocol.decode(protocol.encode(Kind.BYE, rank=1, pid=2, wait=True, id=5))
    assert kind == Kind.BYE and message["id"] == 5
    bad = {
        b"\xc1garbage": "not valid msgpack",
        msgpack.packb([1, 2]): "expected a map",
        msgpack.packb({"v": 99, "kind": 4}): "protocol version 99",
        msgpack.packb({"v": 1, "kind": 77}): "unknown message kind",
        msgpack.packb({"v": 1, "kind": 2, "rank": "0", "pid": 1, "wait": True}): "field 'rank'",
        msgpack.packb({"v": 1, "kind": 2, "rank": True, "pid": 1, "wait": True}): "field 'rank'",
        b"x" * (protocol.MAX_MESSAGE_BYTES + 1): "exceeds",
    }
    for blob, reason in bad.items():
        with pytest.raises(ProtocolError, match=reason):
            protocol.decode(blob)
    with pytest.raises(ProtocolError):
        protocol.encode(Kind.HELLO, rank=0)


def test_fault_spec_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert faults._parse("stager.mid_copy@7#1") == ("stager.mid_copy", 7, 1, "kill")
    assert faults._parse("agent.persist.after_file") == ("agent.persist.after_file", None, None, "kill")
    assert faults._parse("agent.replica.fetch:stop") == ("agent.replica.fetch", None, None, "stop")
    monkeypatch.delenv(faults.ARM_ENV, raising=False)
    with pytest.raises(ValueError, match=f"':hold' holds the thread while the file {faults.ARM_ENV} names exists"):
        faults._parse("agent.persist.after_file@3:hold")   # a hold nothing could end
    monkeypatch.setenv(faults.ARM_ENV, str(tmp_path / "arm"))
    assert faults._parse("agent.persist.after_file@3:hold") == ("agent.persist.after_file", 3, None, "hold")
    with pytest.raises(ValueError, match="malformed"):
        faults._parse("bad point!")
    with pytest.raises(ValueError, match="names no fault point.*stager.mid_copy"):
        faults._parse("stager.mid_cpy@7")   # a typo fails loudly instead of never firing


_FIRE = """
import os, sys
from easyckpt_wire import faults
faults.fault_point("agent.persist.after_file", step=4)    # other step
faults.fault_point("stager.mid_copy", step=3)             # other point
os.environ[faults.ONCE_ENV] = sys.argv[1]
faults.fault_point("agent.persist.after_file", step=3)    # fired once before
del os.environ[faults.ONCE_ENV]
os.environ[faults.ARM_ENV] = sys.argv[2]
faults.fault_point("agent.persist.after_file", step=3)    # not armed
del os.environ[faults.ARM_ENV]
print("survived", flush=True)
faults.fault_point("agent.persist.after_file", step=3)    # this one kills
print("not killed", flush=True)
"""


def test_fault_point_fires_only_where_named(tmp_path: Path) -> None:
    """In a real process: the non-matching, already-fired and unarmed cases pass; the named one is SIGKILL."""
    once = tmp_path / "fired"
    once.touch()
    env = {**os.environ, faults.ENV: "agent.persist.after_file@3", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _FIRE, str(once), str(tmp_path / "not-armed")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "survived\n" and "fault point agent.persist.after_file reached" in proc.stderr


_HOLD = """
import sys, threading
from easyckpt_wire import faults
held = threading.Thread(target=faults.fault_point, args=("agent.persist.after_file",), kwargs={"step": 3})
held.start()
open(sys.argv[1], "w").close()   # the main thread goes on while the other one is held
held.join()
print("released", flush=True)
"""


def test_a_held_fault_point_stops_only_its_thread_until_the_arm_file_goes(tmp_path: Path) -> None:
    """In a real process: the thread that reaches a ':hold' point waits while the arm file exists, the main thread
    goes on; removing the file lets the held thread go on, and the process ends by itself."""
    arm, going_on = tmp_path / "arm", tmp_path / "main-goes-on"
    arm.touch()
    env = {**os.environ, faults.ENV: "agent.persist.after_file@3:hold", faults.ARM_ENV: str(arm), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(going_on)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: going_on.exists() or proc.poll() is not None, 60, "the main thread to go on past the hold")
        assert proc.poll() is None, proc.communicate()
        arm.unlink()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == "released\n", (proc.returncode, out, err)
    assert "holds this thread while" in err and "removed, the thread goes on" in err, err


def test_misspelled_fault_point_stops_the_process_at_import(tmp_path: Path) -> None:
    env = {**os.environ, faults.ENV: "agent.persist.befor_marker@10", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", "import easyckpt_wire.faults"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "names no fault point" in proc.stderr, proc.stderr


def test_every_registered_fault_point_is_fired_in_the_code_and_by_a_test() -> None:
    root = ROOT
    packages = ("easyckpt", "easyckpt_agent", "easyckpt_wire")
    code = "\n".join(p.read_text() for d in packages for p in (root / d).rglob("*.py"))
    fired = set(re.findall(r'fault_point\("([A-Za-z0-9_.]+)"', code))
    assert fired == set(faults.POINTS), (fired ^ set(faults.POINTS))
    tests = "\n".join(p.read_text() for p in (root / "tests").rglob("test_*.py") if p.name != "test_wire.py")
    untested = [point for point in faults.POINTS if point not in tests]
    assert not untested, f"fault points no test fires: {untested}"


def test_layout_completeness(tmp_path: Path) -> None:
    complete = tmp_path / layout.iteration_dirname(20)
    complete.mkdir()
    (complete / layout.METADATA).write_text(json.dumps({"format": layout.METADATA_FORMAT, "format_version": 1, "step": 20}))
    (tmp_path / layout.iteration_dirname(30)).mkdir()                      # no marker
    foreign = tmp_path / layout.iteration_dirname(40)
    foreign.mkdir()
    (foreign / layout.METADATA).write_text(json.dumps({"format": "something-else"}))
    lying = tmp_path / layout.iteration_dirname(50)
    lying.mkdir()
    (lying / layout.METADATA).write_text(json.dumps({"format": layout.METADATA_FORMAT, "format_version": 1, "step": 7}))
    assert [step for step, _ in layout.complete_iterations(tmp_path)] == [20]
    assert [(s, c) for s, _, c in layout.list_iterations(tmp_path)] == [(20, True), (30, False), (40, True), (50, True)]
    with pytest.raises(layout.CheckpointFormatError, match="not an easyckpt checkpoint"):
        layout.read_metadata(foreign)
    assert layout.tensor_group("optim/state/0/exp_avg") == "opt" and layout.tensor_group("model/w") == "model"
