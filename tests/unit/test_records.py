"""The wire records: round trips through msgpack, and every validation error names its field and origin."""
from __future__ import annotations

import math
import re
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from easyckpt_wire import protocol, shm
from easyckpt_wire.health import RankHealth
from easyckpt_wire.records import (
    MAX_TENSOR_BYTES,
    ByeReply,
    FetchReply,
    FlushReply,
    ListReply,
    ListRow,
    Manifest,
    PeerNode,
    PeerTable,
    PingReply,
    RecordError,
    ResumeReply,
    ShardSpec,
    SlotMeta,
    TensorEntry,
)

WHERE = "/dev/shm/easyckpt-job-r000000-s0"


def through_msgpack(obj: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


names = st.text(min_size=1, max_size=20)
entries = st.builds(TensorEntry, names, st.sampled_from(["torch", "numpy"]), st.sampled_from(["F32", "BF16", "I64"]),
                    st.lists(st.integers(0, 1 << 20), max_size=4).map(tuple), st.integers(0, 1 << 40),
                    st.integers(0, MAX_TENSOR_BYTES), st.sampled_from(["model", "opt"]), st.none())


@st.composite
def sharded_entries(draw: Any) -> TensorEntry:
    """A local shard inside its global tensor (empty shards included: their offset may be the dim's end)."""
    global_shape = tuple(draw(st.lists(st.integers(0, 64), min_size=1, max_size=3)))
    offsets = tuple(draw(st.integers(0, g)) for g in global_shape)
    shape = tuple(draw(st.integers(0, g - o)) for g, o in zip(global_shape, offsets))
    mesh = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=2)))
    placements = tuple(draw(st.sampled_from(["S(0)", "R", "S(1)"])) for _ in mesh)
    coordinate = draw(st.none() | st.tuples(*(st.integers(0, n - 1) for n in mesh)))
    writer = None if coordinate is None else draw(st.integers(0, 1 << 20))
    return TensorEntry(draw(names), "torch", "F32", shape, 0, 4 * math.prod(shape), "model",
                       ShardSpec(global_shape, offsets, placements, mesh, coordinate, writer))
checksum = st.binary(min_size=protocol.CHECKSUM_BYTES, max_size=protocol.CHECKSUM_BYTES)


def slot_meta(tensors: tuple[TensorEntry, ...] = (), **changes: Any) -> SlotMeta:
    fields: dict[str, Any] = dict(job="job", rank=1, world_size=4, local_rank=1, local_world_size=2, pid=1234,
                                  pid_start=1.5, skeleton_version=1, tensors=tensors, step=7,
                                  skeleton=["d", [["k", ["i", 3]]]], created=2.5)
    fields.update(changes)
    return SlotMeta(**fields)


@given(entries)
def test_tensor_entry_round_trip(entry: TensorEntry) -> None:
    wire = through_msgpack(entry.to_wire())
    assert TensorEntry.from_wire(wire, WHERE) == entry
    # A tuple packs as the list it always was: the stager packs entries as they are.
    assert through_msgpack(entry) == wire


@given(sharded_entries())
def test_sharded_tensor_entry_round_trip(entry: TensorEntry) -> None:
    wire = through_msgpack(entry.to_wire())
    assert TensorEntry.from_wire(wire, WHERE) == entry
    assert through_msgpack(entry) == wire
    # A reader of the seven fields before sharded state (it ignores what a newer writer appends) still reads it.
    assert TensorEntry.from_wire(wire[:7], WHERE) == entry._replace(shard=None)
    # A shard of four fields (before replicated-once saves) reads with no coordinate and no writer: its rank
    # writes it, as every rank did then; and a reader of four fields reads a shard of six.
    assert entry.shard is not None
    old = wire[:7] + [wire[7][:4]]
    assert TensorEntry.from_wire(old, WHERE).shard == entry.shard._replace(coordinate=None, writer=None)
    assert TensorEntry.from_wire(old, WHERE).shard.written_by(3)   # type: ignore[union-attr]
    assert TensorEntry.from_wire(wire, WHERE).shard.split == entry.shard.split   # type: ignore[union-attr]


@pytest.mark.parametrize("shard, problem", [
    ([[8], [6], ["S(0)"], [4]], "does not fit in the global shape"),          # 4 rows at 6 overrun 8
    ([[8, 2], [0], ["S(0)"], [4]], "same number of dims"),
    ([[8], [0], ["S(0)", "R"], [4]], "one placement per mesh dim"),
    ([[8], [-1], ["S(0)"], [4]], "outside"),
    ([[8], [0], [0], [4]], "expected a str"),
    ([[8], [0]], "expected [global_shape"),
    ([[8], [0], ["R"], [4], [4], 0], "not a place in the mesh"),
    ([[8], [0], ["R"], [4], [0, 0], 0], "not a place in the mesh"),
    ([[8], [0], ["R"], [4], [1], -1], "outside"),
    ([[8], [0], ["R"], [4], [1], "0"], "expected an int"),
])
def test_shard_spec_names_the_problem(shard: list[Any], problem: str) -> None:
    wire = TensorEntry("w", "torch", "F32", (4,), 0, 16, "model").to_wire()
    wire[7] = shard
    with pytest.raises(RecordError, match=re.escape(problem)) as caught:
        TensorEntry.from_wire(wire, WHERE, 3)
    assert caught.value.field.startswith("shard") and "tensor entry 3" in str(caught.value)


@pytest.mark.parametrize("index, value, field", [
    (0, 5, "name"), (1, "jax", "kind"), (2, None, "dtype"), (3, [2, -1], "shape[1]"), (3, "2x3", "shape"),
    (4, -1, "offset"), (5, MAX_TENSOR_BYTES + 1, "nbytes"), (5, True, "nbytes"), (5, 1.0, "nbytes"),
    (6, 0, "group"),
])
def test_tensor_entry_names_the_bad_field(index: int, value: Any, field: str) -> None:
    wire = TensorEntry("w", "torch", "F32", (2, 3), 0, 24, "model").to_wire()
    wire[index] = value
    with pytest.raises(RecordError) as caught:
        TensorEntry.from_wire(wire, WHERE, 3)
    assert caught.value.field == field and caught.value.where == WHERE
    assert WHERE in str(caught.value) and "tensor entry 3" in str(caught.value) and repr(field) in str(caught.value)


def test_tensor_entry_too_short() -> None:
    with pytest.raises(RecordError, match="expected a list of 7 fields"):
        TensorEntry.from_wire(["w", "torch"], WHERE)


@given(st.lists(entries, max_size=5).map(tuple))
def test_slot_meta_round_trip(tensors: tuple[TensorEntry, ...]) -> None:
    meta = slot_meta(tensors)
    assert SlotMeta.from_wire(through_msgpack(meta.to_wire()), WHERE) == meta
    assert meta.data_len == max((e.offset + e.nbytes for e in tensors), default=0)


def test_slot_meta_as_the_stager_packs_it() -> None:
    """Static keys packed once, dynamic ones per snapshot: the same map as to_wire()."""
    meta = slot_meta((TensorEntry("w", "torch", "F32", (2,), 0, 8, "model"),))
    packer = msgpack.Packer(use_bin_type=True)
    static = SlotMeta.static_fields(job=meta.job, rank=meta.rank, world_size=meta.world_size,
                                    local_rank=meta.local_rank, local_world_size=meta.local_world_size, pid=meta.pid,
                                    pid_start=meta.pid_start, skeleton_version=meta.skeleton_version,
                                    tensors=list(meta.tensors))
    dynamic = SlotMeta.dynamic_fields(step=meta.step, skeleton=meta.skeleton, created=meta.created)
    assert set(dynamic) == set(SlotMeta.DYNAMIC)
    blob = (packer.pack_map_header(len(static) + len(dynamic))
            + b"".join(packer.pack(k) + packer.pack(v) for k, v in {**static, **dynamic}.items()))
    assert SlotMeta.from_wire(msgpack.unpackb(blob, raw=False), WHERE) == meta
    assert "config" not in static


def test_slot_meta_ignores_extra_keys_of_older_writers() -> None:
    wire = slot_meta().to_wire()
    wire["config"] = {"save_storage_interval": 10}
    assert SlotMeta.from_wire(wire, WHERE) == slot_meta()


@pytest.mark.parametrize("key, value, field", [
    ("v", 1, "v"), ("rank", 4, "rank"), ("rank", "1", "rank"), ("world_size", 0, "world_size"),
    ("pid", None, "pid"), ("local_world_size", 5, "local_world_size"), ("step", -1, "step"),
    ("tensors", {}, "tensors"), ("job", 1, "job"), ("created", "now", "created"),
])
def test_slot_meta_names_the_bad_field(key: str, value: Any, field: str) -> None:
    wire = slot_meta().to_wire()
    wire[key] = value
    with pytest.raises(RecordError) as caught:
        SlotMeta.from_wire(wire, WHERE)
    assert caught.value.field == field and WHERE in str(caught.value) and "slot metadata" in str(caught.value)


def test_slot_meta_missing_field() -> None:
    wire = slot_meta().to_wire()
    del wire["skeleton"]
    with pytest.raises(RecordError, match="'skeleton' is missing"):
        SlotMeta.from_wire(wire, WHERE)
    with pytest.raises(RecordError, match="expected a map"):
        SlotMeta.from_wire([1, 2], WHERE)


def test_slot_meta_names_the_bad_tensor() -> None:
    wire = slot_meta((TensorEntry("w", "torch", "F32", (2,), 0, 8, "model"),) * 3).to_wire()
    wire["tensors"][2][4] = -8
    with pytest.raises(RecordError, match="tensor entry 2 field 'offset'"):
        SlotMeta.from_wire(wire, WHERE)


@given(st.lists(st.tuples(entries, checksum), max_size=5), st.integers(0, 1 << 40))
def test_manifest_round_trip(pairs: list[tuple[TensorEntry, bytes]], generation: int) -> None:
    meta = slot_meta(tuple(e for e, _ in pairs))
    manifest = Manifest.of(meta, [c for _, c in pairs], "node-a", generation)
    wire = manifest.to_wire()
    assert "pid" not in wire and "pid_start" not in wire and wire["generation"] == generation
    back = Manifest.from_wire(through_msgpack(wire), "tcp://peer:1")
    assert back == manifest and back.rank == 1 and back.step == 7 and back.meta.pid is None


def test_manifest_carries_the_health_verdict() -> None:
    """Replicas answer load()'s health question from the manifest: the verdict must survive the wire."""
    verdict = RankHealth(reporting=True, healthy=False, reasons=("embedding_local_norm 300 > 270",))
    manifest = Manifest.of(slot_meta(health=verdict), [], "node-a", 3)
    assert Manifest.from_wire(through_msgpack(manifest.to_wire()), "tcp://peer:1").meta.health == verdict


def test_manifest_validation() -> None:
    meta = slot_meta((TensorEntry("w", "torch", "F32", (2,), 0, 8, "model"),))
    wire = Manifest.of(meta, [b"\0" * protocol.CHECKSUM_BYTES], "a", 2).to_wire()
    for key, value, field in (("checksums", [b"short"], "checksums[0]"), ("checksums", [], "checksums"),
                              ("node", None, "node"), ("generation", -2, "generation")):
        bad = dict(wire, **{key: value})
        with pytest.raises(RecordError) as caught:
            Manifest.from_wire(bad, "PUSH from node 'b'")
        assert caught.value.field == field and "PUSH from node 'b'" in str(caught.value)


def peer_table(**changes: Any) -> PeerTable:
    fields: dict[str, Any] = dict(token="t" * 32, node="b", leader="a",
                                  nodes={"a": PeerNode("tcp://a:1", (0, 1)), "b": PeerNode("tcp://b:1", (2, 3)),
                                         "c": PeerNode("tcp://c:1", (4, 5))}, world_size=6, replicate_unique=False)
    fields.update(changes)
    return PeerTable(**fields)


def test_peer_table_round_trip_and_ring() -> None:
    table = peer_table()
    wire = table.to_wire()
    protocol.decode(protocol.encode(protocol.Kind.PEERS, id=1, **wire))   # valid PEERS fields as they are
    assert PeerTable.from_wire(through_msgpack(wire), "PEERS") == table
    assert table.ordered() == ["b", "a", "c"] and table.buddy() == "c" and table.predecessor() == "a"
    assert not table.is_leader and table.endpoint("c") == "tcp://c:1" and table.same_job(peer_table())
    alone = peer_table(nodes={"b": PeerNode("tcp://b:1", ())}, leader="b")
    assert alone.buddy() is None and alone.predecessor() is None and alone.is_leader


@pytest.mark.parametrize("change, field", [
    ({"leader": "z"}, "leader"), ({"nodes": [{"node": "a", "endpoint": 1, "ranks": []}]}, "nodes[0].endpoint"),
    ({"nodes": [{"node": "a", "endpoint": "e", "ranks": [-1]}]}, "nodes[0].ranks[0]"), ({"nodes": ["a"]}, "nodes[0]"),
    ({"token": None}, "token"), ({"replicate_unique": 1}, "replicate_unique"),
])
def test_peer_table_names_the_bad_field(change: dict[str, Any], field: str) -> None:
    wire = {**peer_table().to_wire(), **change}
    with pytest.raises(RecordError) as caught:
        PeerTable.from_wire(wire, "PEERS from rank 3")
    assert caught.value.field == field and "PEERS from rank 3" in str(caught.value)


@given(st.integers(0, 1 << 62), st.frozensets(st.integers(0, 1 << 20), max_size=8),
       st.frozensets(checksum, max_size=20))
def test_list_row_round_trip(step: int, ranks: frozenset[int], checksums: frozenset[bytes]) -> None:
    row = ListRow(step, ranks, checksums)
    assert ListRow.from_wire(through_msgpack(row.to_wire()), "tcp://peer:1") == row
    reply = ListReply("node-a", (row,))
    assert ListReply.from_wire(through_msgpack(reply.to_wire()), "x").by_step() == {step: row}


def test_list_row_validation() -> None:
    with pytest.raises(RecordError, match=f"multiple of {protocol.CHECKSUM_BYTES}") as caught:
        ListRow.from_wire([1, [0], b"\0" * (protocol.CHECKSUM_BYTES + 1)], "tcp://peer:1")
    assert caught.value.field == "checksums" and "tcp://peer:1" in str(caught.value)
    with pytest.raises(RecordError) as caught:
        ListRow.from_wire([1, ["0"], b""], "tcp://peer:1")
    assert caught.value.field == "ranks[0]"
    with pytest.raises(RecordError, match="expected \\[step, ranks, checksums\\]"):
        ListRow.from_wire([1, [0]], "tcp://peer:1")


def test_replies() -> None:
    ping = PingReply(42, "node-a", "tcp://a:1")
    assert PingReply.from_wire(through_msgpack(ping.to_wire()), "ipc") == ping
    assert PingReply.from_wire({"pid": 42}, "ipc") == PingReply(42)
    with pytest.raises(RecordError, match="'endpoint'"):
        PingReply.from_wire({"pid": 42, "endpoint": 5}, "ipc")
    keyed = PingReply(42, "node-a", "tcp://a:1", "f" * 32)   # the job token, once a PEERS set one
    assert PingReply.from_wire(through_msgpack(keyed.to_wire()), "ipc") == keyed
    assert "token" not in ping.to_wire()   # absent until set: what older builds sent
    assert ByeReply.from_wire(ByeReply(9, {"step": 3}).to_wire(), "ipc") == ByeReply(9, {"step": 3})
    assert FetchReply.from_wire(FetchReply((1 << 64) - 1).to_wire(), "tcp").xxh64 == (1 << 64) - 1
    with pytest.raises(RecordError, match="'xxh64' is missing"):
        FetchReply.from_wire({}, "tcp")
    # every reply's fields make a valid REPLY message
    for reply in (ping, ByeReply(9), FetchReply(1), ListReply("a", ())):
        protocol.decode(protocol.reply(True, id=1, **reply.to_wire()))


def test_page_is_the_slot_header_size() -> None:
    assert shm.PAGE == shm.HEADER_SIZE == 4096


def test_flush_and_resume_replies_read_refusals_from_the_envelope() -> None:
    """A program tells a refused FLUSH or RESUME by its ``error``, whatever the agent put in the fields."""
    ok = FlushReply.from_wire({"ok": True, "id": 3, **FlushReply(7, True).to_wire()}, "ipc")
    assert ok == FlushReply(7, True)
    refused = FlushReply.from_wire({"ok": False, "id": 3, **FlushReply(5, error="disk full",
                                                                        failure={"errno": 28}).to_wire()}, "ipc")
    assert (refused.error, refused.persisted, refused.failure) == ("disk full", 5, {"errno": 28})
    assert FlushReply.from_wire({"ok": False, "id": 3}, "ipc").error == "FLUSH reply: refused without a reason"
    resume = ResumeReply.from_wire({"ok": True, **ResumeReply([30, 40], 20, 20).to_wire()}, "ipc")
    assert resume == ResumeReply([30, 40], 20, 20)
    with pytest.raises(RecordError, match=r"'moved\[0\]'"):
        ResumeReply.from_wire({"ok": True, "moved": ["x"]}, "ipc")
