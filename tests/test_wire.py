"""The shared wire package: slot header seqlock, message validation, fault-point parsing, layout rules."""
from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import pytest

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


def test_damaged_metadata_and_foreign_files_are_rejected(tmp_path: Path) -> None:
    slot = new_slot(tmp_path)
    slot.begin_write(generation=1, rank=3, world_size=4, job_id="job")
    slot.commit(generation=1, step=1, data_len=0, meta=shm.pack_meta({"v": 1}), rank=3, world_size=4, job_id="job")
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


def test_fault_spec_parsing_and_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert faults._parse("stager.mid_copy@7#1") == ("stager.mid_copy", 7, 1, "kill")
    assert faults._parse("agent.persist.after_file") == ("agent.persist.after_file", None, None, "kill")
    assert faults._parse("agent.replica.fetch:stop") == ("agent.replica.fetch", None, None, "stop")
    with pytest.raises(ValueError, match="malformed"):
        faults._parse("bad point!")
    monkeypatch.setenv(faults.ENV, "x.y@3")
    faults.fault_point("x.y", step=4)      # other step: no kill
    faults.fault_point("x.z", step=3)      # other point: no kill
    once = tmp_path / "fired"
    once.touch()
    monkeypatch.setenv(faults.ONCE_ENV, str(once))
    faults.fault_point("x.y", step=3)      # already fired once: no kill
    monkeypatch.delenv(faults.ONCE_ENV)
    monkeypatch.setenv(faults.ARM_ENV, str(tmp_path / "not-armed"))
    faults.fault_point("x.y", step=3)      # not armed: no kill
    assert os.getpid() > 0                 # still alive


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
