"""The agent's replica server on real tcp sockets: token holders get verified tensor bytes, everyone
else gets a refusal and nothing more, garbage never takes it down, and corrupted memory is never
served as good bytes.

One real agent process per test (spawned by a real Checkpointer that committed step 1 to shared
memory), told its peers with a PEERS message over its ipc socket, as a multi-node job's rank would.
Nothing is mocked; synchronisation is by ``wait_for`` against a deadline, or by a sentinel request
answered after everything sent before it on the same connection.
"""
from __future__ import annotations

import dataclasses
import os
import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import xxhash
import zmq
from conftest import Env, wait_for
from zmq.utils.monitor import recv_monitor_message

import easyckpt
from easyckpt_wire import protocol, shm
from easyckpt_wire.protocol import Kind, ProtocolError
from easyckpt_wire.records import ListReply, ListRow, Manifest, TensorEntry
from easyckpt_wire.transfer import FetchError, NoCopyError, PeerClient, PeerError

TOKEN = "replica-wire-test-token-0123456789abcdef"
REFUSAL_KEYS = {"v", "kind", "ok", "id", "error"}


@dataclasses.dataclass
class Replica:
    ck: easyckpt.Checkpointer
    env: Env
    endpoint: str
    state: dict[str, Any]
    manifest: dict[str, Any]

    def tensor(self, name: str) -> tuple[TensorEntry, bytes]:
        """(manifest entry, checksum) of the tensor called ``name``."""
        manifest = Manifest.from_wire(self.manifest, self.endpoint)
        for entry, checksum in zip(manifest.tensors, manifest.checksums):
            if entry.name == name:
                return entry, checksum
        raise KeyError(name)

    def status(self) -> dict[str, Any]:
        return self.ck.agent.request(Kind.STATUS, 10.0)


def saved_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def listed_steps(endpoint: str, token: str = TOKEN) -> list[ListRow]:
    client = PeerClient(endpoint, token, timeout=10.0)
    try:
        return list(ListReply.from_wire(client.call(Kind.LIST), endpoint).rows)
    finally:
        client.close()


def fetch(endpoint: str, entry: TensorEntry, checksum: bytes, token: str = TOKEN, **options: Any) -> bytearray:
    buffer = bytearray(entry.nbytes)
    client = PeerClient(endpoint, token, timeout=10.0)
    try:
        client.fetch_into(1, checksum, memoryview(buffer), **options)
    finally:
        client.close()
    return buffer


@pytest.fixture
def replica(env: Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[Replica]:
    """A real agent holding rank 0's committed step 1, its replica server listening on 127.0.0.1."""
    monkeypatch.setenv(protocol.AGENT_ADDR_ENV, "127.0.0.1")
    monkeypatch.delenv(protocol.AGENT_PORT_ENV, raising=False)
    gen = torch.Generator().manual_seed(4)
    state = {"model": {"w": torch.randn(256, 1024, generator=gen),            # 1 MiB: several chunks
                       "b": torch.arange(1000, dtype=torch.int64)},
             "rng": torch.get_rng_state()}
    ck = easyckpt.Checkpointer(env.save_dir, save_mem_interval=1, save_storage_interval=1000, max_ckpt_num=2,
                               agent_idle_timeout=30.0)
    try:
        assert ck.save_if_needed(1, state) is True
        ck.wait()
        node = protocol.node_id()
        reply = ck.agent.request(Kind.PEERS, 10.0, token=TOKEN, node=node, leader=node,
                                 nodes=[{"node": node, "endpoint": "tcp://127.0.0.1:1", "ranks": [0]}],
                                 world_size=1, replicate_unique=True)
        assert reply["ok"] is True, reply
        endpoint = ck.agent.request(Kind.PING, 10.0)["endpoint"]
        assert endpoint and endpoint.startswith("tcp://127.0.0.1:"), endpoint
        wait_for(lambda: any(row.step == 1 for row in listed_steps(endpoint)), 30, "the replica server to list step 1")
        client = PeerClient(endpoint, TOKEN, timeout=10.0)
        try:
            manifest = client.call(Kind.MANIFEST, rank=0, step=1)["manifest"]
        finally:
            client.close()
        yield Replica(ck, env, endpoint, state, manifest)
    finally:
        ck.close()


# 1. a token holder lists, gets the manifest, fetches verified bytes ---------------------------------------
def test_token_holder_lists_gets_manifest_and_fetches_the_saved_bytes(replica: Replica) -> None:
    steps = listed_steps(replica.endpoint)
    assert [row.step for row in steps] == [1] and steps[0].ranks == {0}, steps
    held = steps[0].checksums
    manifest = Manifest.from_wire(replica.manifest, replica.endpoint)
    assert manifest.rank == 0 and manifest.step == 1
    names = [entry.name for entry in manifest.tensors]
    assert sorted(names) == ["model/b", "model/w", "rng"], names
    assert len(manifest.checksums) == len(names) and set(manifest.checksums) == held

    expected = {"model/w": replica.state["model"]["w"], "model/b": replica.state["model"]["b"],
                "rng": replica.state["rng"]}
    before = replica.status()["served_bytes"]
    fetched = 0
    for name, tensor in expected.items():
        entry, checksum = replica.tensor(name)
        assert entry.nbytes == tensor.numel() * tensor.element_size() and list(entry.shape) == list(tensor.shape)
        assert checksum == xxhash.xxh3_128_digest(saved_bytes(tensor))
        assert bytes(fetch(replica.endpoint, entry, checksum)) == saved_bytes(tensor), name
        fetched += entry.nbytes
    # Many small chunks, a window of 3 in flight: the same bytes.
    entry, checksum = replica.tensor("model/w")
    assert bytes(fetch(replica.endpoint, entry, checksum, chunk=40_000, window=3)) == saved_bytes(expected["model/w"])
    fetched += entry.nbytes
    assert replica.status()["served_bytes"] - before == fetched


def test_a_copy_the_agent_does_not_hold_is_a_typed_refusal(replica: Replica) -> None:
    """The rank moves on to the next holder on NoCopyError, without reading the error text."""
    entry, checksum = replica.tensor("model/w")
    client = PeerClient(replica.endpoint, TOKEN, timeout=10.0)
    try:
        with pytest.raises(NoCopyError, match="refused"):
            client.fetch_into(1, checksum, memoryview(bytearray(entry.nbytes)), copy=63)
        with pytest.raises(PeerError) as other:   # another refusal is not NoCopyError
            client.fetch_into(1, checksum, memoryview(bytearray(entry.nbytes + 1)))
        assert not isinstance(other.value, NoCopyError)
    finally:
        client.close()


# 2. no token, wrong token: a refusal and nothing else ----------------------------------------------------
def peer_requests(replica: Replica) -> dict[Kind, dict[str, Any]]:
    entry, checksum = replica.tensor("model/w")
    push_manifest = dict(replica.manifest, step=7)
    return {Kind.LIST: {},
            Kind.MANIFEST: {"rank": 0, "step": 1},
            Kind.FETCH: {"step": 1, "checksum": checksum, "offset": 0, "length": 4096},
            Kind.PUSH: {"node": "intruder", "step": 7, "manifests": [push_manifest]}}


BAD_TOKENS = ["", "x", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "y" * len(TOKEN), TOKEN[::-1]]


@pytest.mark.parametrize("token", BAD_TOKENS, ids=["empty", "short", "prefix", "longer", "upper", "same-length",
                                                   "reversed"])
def test_wrong_or_missing_token_is_refused_for_every_peer_kind(replica: Replica, token: str) -> None:
    entry, checksum = replica.tensor("model/w")
    refused_before = replica.status()["refused"]
    for kind, fields in peer_requests(replica).items():
        client = PeerClient(replica.endpoint, token, timeout=10.0)
        try:
            with pytest.raises(PeerError) as info:
                if kind == Kind.FETCH:
                    client.fetch_into(1, checksum, memoryview(bytearray(entry.nbytes)))
                else:
                    client.call(kind, **fields)
        finally:
            client.close()
        message = str(info.value)
        assert "token" in message and "refused" in message and kind.name in message, message
        assert not isinstance(info.value, FetchError), "a refusal is not a corrupted transfer"
    status = replica.status()
    assert status["refused"] - refused_before == len(peer_requests(replica))
    # The refused PUSH left nothing behind: the server still holds step 1 only, of rank 0 only.
    assert [(row.step, row.ranks) for row in listed_steps(replica.endpoint)] == [(1, {0})]


def test_refusal_reveals_nothing_and_tokenless_requests_get_no_data(replica: Replica) -> None:
    """On the raw socket: a refusal carries only ok/id/error (no steps, manifest, checksum or bytes)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replica.endpoint)
    request_id = 100
    try:
        def exchange(blobs: list[bytes], sentinel: int) -> dict[int, list[Any]]:
            """Send ``blobs`` then a valid LIST ``sentinel``; every reply received up to the sentinel's."""
            for blob in blobs:
                sock.send(blob)
            sock.send(protocol.encode(Kind.LIST, limit=protocol.MAX_PEER_MESSAGE_BYTES, id=sentinel, token=TOKEN))
            replies: dict[int, list[Any]] = {}
            while True:
                assert sock.poll(20_000), "no reply to the sentinel LIST within 20s"
                frames = sock.recv_multipart()
                _, header = protocol.decode(frames[0], limit=protocol.MAX_PEER_MESSAGE_BYTES)
                replies[header["id"]] = [header, *frames[1:]]
                if header["id"] == sentinel:
                    return replies

        for token in ("", "wrong-token-of-some-length", TOKEN[:-1]):
            blobs, ids = [], {}
            for kind, fields in peer_requests(replica).items():
                request_id += 1
                ids[request_id] = kind
                blobs.append(protocol.encode(kind, limit=protocol.MAX_PEER_MESSAGE_BYTES, id=request_id, token=token,
                                             **fields))
            request_id += 1
            replies = exchange(blobs, request_id)
            assert replies.pop(request_id)[0]["ok"] is True
            assert set(replies) == set(ids), (token, replies)
            for rid, (header, *data) in replies.items():
                assert data == [], f"{ids[rid].name} refusal came with a data frame"
                assert header["ok"] is False and set(header) <= REFUSAL_KEYS, header
                assert "token" in header["error"], header

        # No token field at all: the message is malformed, dropped unanswered (or, at most, refused).
        blobs, ids = [], {}
        for kind, fields in peer_requests(replica).items():
            request_id += 1
            ids[request_id] = kind
            blobs.append(msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": int(kind), "id": request_id, **fields},
                                       use_bin_type=True))
        request_id += 1
        malformed_before = replica.status()["malformed"]
        replies = exchange(blobs, request_id)
        replies.pop(request_id)
        for rid, (header, *data) in replies.items():
            assert rid in ids and data == [] and header["ok"] is False and set(header) <= REFUSAL_KEYS, header
        if not replies:
            assert replica.status()["malformed"] - malformed_before == len(ids)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_peers_sent_over_tcp_cannot_change_the_token(replica: Replica) -> None:
    """PEERS (and HELLO, BYE) are ipc-only: over tcp they are dropped, whatever they carry."""
    intruder = "intruder-token-0123456789abcdef"
    node = protocol.node_id()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replica.endpoint)
    try:
        sock.send(protocol.encode(Kind.PEERS, id=1, token=intruder, node=node, leader=node,
                                  nodes=[{"node": node, "endpoint": "tcp://127.0.0.1:2", "ranks": [0]}],
                                  world_size=1, replicate_unique=True))
        sock.send(protocol.encode(Kind.HELLO, id=2, rank=5, pid=os.getpid(), world_size=8, local_world_size=8,
                                  save_storage_interval=1, max_ckpt_num=1, log_file_path=None))
        sock.send(protocol.encode(Kind.BYE, id=3, rank=0, pid=os.getpid(), wait=False))
        sock.send(protocol.encode(Kind.LIST, limit=protocol.MAX_PEER_MESSAGE_BYTES, id=4, token=TOKEN))
        assert sock.poll(20_000), "no reply to LIST within 20s"
        _, header = protocol.decode(sock.recv(), limit=protocol.MAX_PEER_MESSAGE_BYTES)
        assert header["id"] == 4 and header["ok"] is True, "PEERS/HELLO/BYE over tcp must not be answered"
    finally:
        sock.close(linger=0)
        ctx.term()
    with pytest.raises(PeerError, match="token"):
        listed_steps(replica.endpoint, intruder)
    assert listed_steps(replica.endpoint)[0].step == 1
    status = replica.status()
    assert [r["rank"] for r in status["ranks"]] == [0] and status["ranks"][0]["finished"] is False
    assert status["nodes"] == {node: "tcp://127.0.0.1:1"} and status["max_ckpt_num"] == 2


# 3. fuzzing the tcp port ------------------------------------------------------------------------------------
class Fuzzer:
    """Builds fuzzed messages (lists of frames), each with an id where it has a map to carry one."""

    def __init__(self, replica: Replica, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = iter(range(1_000_000, 10**9))
        self.big, self.big_sum = replica.tensor("model/w")
        self.small, self.small_sum = replica.tensor("rng")
        self.manifest = replica.manifest

    def token(self) -> Any:
        r = self.rng
        return r.choice([TOKEN, TOKEN, TOKEN, "", TOKEN[:-1], TOKEN + "\0", "z" * len(TOKEN), TOKEN.encode(),
                         None, 0, [TOKEN], {"token": TOKEN}, "\u00e9" * 20, "MISSING"])

    def weird(self) -> Any:
        r = self.rng
        return r.choice([None, True, False, -1, 0, 1, 2**31, -2**63, 2**64 - 1, 1.5, float("nan"), float("inf"), "",
                         "1", "x" * 300, b"", b"\xff" * 40, [], [1, 2], {}, {"a": 1}, msgpack.ExtType(5, b"ext")])

    def bad_int(self) -> Any:
        r = self.rng
        return r.choice([-1, -2**63, 2**63 - 1, 2**64 - 1, 1 << 50, (1 << 50) + 1, 1 << 62, (1 << 62) + 1,
                         protocol.MAX_CHUNK_BYTES + 1, 0, True, "0", 3.0, None])

    def checksum(self) -> Any:
        r = self.rng
        return r.choice([self.big_sum, self.small_sum, self.big_sum, bytes(16), r.randbytes(16), b"",
                         self.big_sum[:15], self.big_sum + b"\0", self.big_sum * 2, self.big_sum.hex(), 16, None])

    def well_formed(self) -> dict[str, Any]:
        """A peer request the protocol accepts (any token, in-range fields that may still name nothing held)."""
        r = self.rng
        kind = r.choice([Kind.LIST, Kind.MANIFEST, Kind.FETCH, Kind.FETCH, Kind.FETCH, Kind.PUSH])
        fields: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "kind": int(kind), "id": next(self.ids),
                                  "token": r.choice([TOKEN, TOKEN, "", TOKEN[:-1], "z" * len(TOKEN), "\u00e9" * 9])}
        if kind == Kind.MANIFEST:
            fields.update(rank=r.choice([0, 0, 1, (1 << 20) - 1]), step=r.choice([1, 1, 0, 2, 1 << 62]))
        elif kind == Kind.FETCH:
            entry = r.choice([self.big, self.small])
            nbytes = entry.nbytes
            offset, length = r.choice([
                (0, min(nbytes, 4096)), (r.randrange(nbytes), 1), (nbytes - 1, 1), (0, nbytes),  # in range
                (nbytes, 1), (nbytes - 10, 11), (0, nbytes + 1), (r.randrange(nbytes), nbytes),  # past the end
                (0, protocol.MAX_CHUNK_BYTES), (1 << 50, protocol.MAX_CHUNK_BYTES), (1 << 50, 1)])
            fields.update(step=r.choice([1, 1, 1, 0, 2, 1 << 62]), offset=offset, length=length,
                          checksum=r.choice([self.big_sum, self.small_sum, bytes(16), r.randbytes(16)]))
            if r.random() < 0.3:
                fields["copy"] = r.choice([0, 1, 63, 64, -1, 10**9, 2**63 - 1, -2**63, "0", None, 1.0, True, []])
        elif kind == Kind.PUSH:
            step = r.choice([1, 9])
            good = dict(self.manifest, step=step)
            broken = r.choice([None, 5, {}, {"rank": 0}, dict(good, rank="0"), dict(good, step=step + 1),
                               dict(good, tensors="all"), dict(good, checksums=good["checksums"][:-1]),
                               dict(good, checksums=[c[:8] for c in good["checksums"]])])
            fields.update(node=r.choice(["intruder", protocol.node_id()]), step=step,
                          manifests=r.choice([[broken], [good, broken], [broken, good]]))
        return fields

    def request(self) -> dict[str, Any]:
        """A peer request with a random mix of good, absurd and wrongly typed fields."""
        r = self.rng
        if r.random() < 0.6:
            return self.well_formed()
        kind = r.choice([Kind.LIST, Kind.MANIFEST, Kind.FETCH, Kind.FETCH, Kind.FETCH, Kind.PUSH])
        fields: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "kind": int(kind), "id": next(self.ids)}
        token = self.token()
        if token != "MISSING":
            fields["token"] = token
        if kind == Kind.MANIFEST:
            fields["rank"] = r.choice([0, 0, 1, 7, -1, 1 << 20, 1 << 40, "0", None, False])
            fields["step"] = r.choice([1, 1, 0, 2, -1, 1 << 62, (1 << 62) + 1, "1", 1.0])
        elif kind == Kind.FETCH:
            entry = r.choice([self.big, self.small])
            nbytes = entry.nbytes
            fields["step"] = r.choice([1, 1, 1, 0, 2, -5, 1 << 62, None])
            fields["checksum"] = self.checksum()
            offset, length = r.choice([
                (0, min(nbytes, 4096)), (r.randrange(nbytes), 1), (nbytes - 1, 1),  # in range
                (nbytes, 1), (nbytes - 10, 11), (0, nbytes + 1), (r.randrange(nbytes), nbytes),  # past the end
                (-1, 10), (-(1 << 40), 16), (0, 0), (0, -1), (0, protocol.MAX_CHUNK_BYTES + 1),  # absurd
                (0, protocol.MAX_CHUNK_BYTES), (1 << 50, protocol.MAX_CHUNK_BYTES), ((1 << 50) + 1, 1),
                (2**63 - 1, 1), (self.bad_int(), self.bad_int())])
            fields["offset"], fields["length"] = offset, length
            if r.random() < 0.4:
                fields["copy"] = r.choice([0, 1, 63, 64, 65, -1, 10**9, 2**63 - 1, -2**63, "0", None, 1.0, True, []])
        elif kind == Kind.PUSH:
            fields["node"] = r.choice(["intruder", "", protocol.node_id(), None, 5])
            fields["step"] = r.choice([1, 9, -1, "9", None])
            good = dict(self.manifest, step=fields["step"])
            broken = r.choice([
                None, 5, "manifest", [], {}, {"rank": 0}, dict(good, rank="0"), dict(good, rank=None),
                dict(good, step=fields["step"] + 1 if isinstance(fields["step"], int) else 0),
                dict(good, tensors="all"), dict(good, checksums=good["checksums"][:-1]),
                dict(good, checksums=[c[:8] for c in good["checksums"]]), dict(good, checksums=None),
                dict(good, checksums=[c.hex() for c in good["checksums"]])])
            # Always one broken manifest in the list: a PUSH must never install a fuzzed backup.
            fields["manifests"] = r.choice([[broken], [good, broken], [broken, good, good], broken])
        # Now and then one field gets a value of a wrong type.
        if r.random() < 0.2:
            key = r.choice([k for k in fields if k not in ("v", "kind", "id")] or ["extra"])
            fields[key] = self.weird()
        if r.random() < 0.1:
            fields["extra-" + str(r.randrange(5))] = self.weird()  # unknown fields are ignored
        return fields

    def message(self) -> list[bytes]:
        r = self.rng
        roll = r.random()
        if roll < 0.45:
            return [self.pack(self.request())]
        if roll < 0.55:                                                   # random bytes
            return [r.randbytes(r.choice([0, 1, 2, 7, 64, 300, 2048]))]
        if roll < 0.65:                                                   # a truncated request
            blob = self.pack(self.request())
            return [blob[:r.randrange(len(blob))]]
        if roll < 0.70:                                                   # bit flips in a request
            blob = bytearray(self.pack(self.request()))
            for _ in range(r.randint(1, 4)):
                blob[r.randrange(len(blob))] ^= 1 << r.randrange(8)
            return [bytes(blob)]
        if roll < 0.75:                                                   # another version
            fields = self.request()
            fields["v"] = r.choice([0, 2, 99, -1, 2**32, "1", None, 1.5, [1], b"\x01"])
            return [self.pack(fields)]
        if roll < 0.80:                                                   # another kind
            fields = self.request()
            fields["kind"] = r.choice([0, 6, 9, 14, 99, 101, -1, 2**40, "LIST", None, [10], {"k": 10},
                                       int(Kind.REPLY), int(Kind.STATUS), int(Kind.PING)])
            return [self.pack(fields)]
        if roll < 0.85:                                                   # ipc-only kinds, well formed
            return [self.ipc_only()]
        if roll < 0.90:                                                   # not a map / not a request
            return [r.choice([
                msgpack.packb([1, 2, 3]), msgpack.packb(None), msgpack.packb(10), msgpack.packb("LIST"),
                msgpack.packb(b"\x00" * 100), msgpack.packb({1: 1, 2: 3}), msgpack.packb({b"v": 1, b"kind": 10}),
                msgpack.packb({"v": 1, "kind": 10, "token": TOKEN, "nested": {5: 1}}),
                msgpack.packb(msgpack.ExtType(1, b"abc")), b"\x91" * 5000 + b"\xc0",  # 5000 nested arrays
                b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xf0abc",  # huge declared sizes
                msgpack.packb({"v": 1, "kind": 10, "token": TOKEN}) + b"trailing"])]
        # multi-frame garbage, or a good request with an extra frame around it
        good = self.pack({"v": 1, "kind": int(Kind.LIST), "id": next(self.ids), "token": TOKEN})
        return r.choice([[r.randbytes(10), r.randbytes(10)], [good, b""], [b"", good], [good, good],
                         [r.randbytes(100) for _ in range(r.randint(3, 6))],
                         [good, self.pack(self.request()), r.randbytes(5)]])

    def ipc_only(self) -> bytes:
        r, node, pid = self.rng, protocol.node_id(), os.getpid()
        return r.choice([
            protocol.encode(Kind.HELLO, id=next(self.ids), rank=r.randrange(8), pid=pid, world_size=8,
                            local_world_size=8, save_storage_interval=1, max_ckpt_num=1, log_file_path="/tmp/x"),
            protocol.encode(Kind.BYE, id=next(self.ids), rank=0, pid=pid, wait=r.random() < 0.5),
            protocol.encode(Kind.PEERS, id=next(self.ids), token=r.choice([TOKEN, "intruder-token-0123456789"]),
                            node=node, leader=node, world_size=1, replicate_unique=False,
                            nodes=[{"node": node, "endpoint": "tcp://127.0.0.1:3", "ranks": [0]}]),
            protocol.encode(Kind.STATUS, id=next(self.ids), token=TOKEN),
            protocol.encode(Kind.PING, id=next(self.ids)),
            protocol.encode(Kind.REPLY, id=next(self.ids), ok=True, steps=[[99, [0], b""]])])

    @staticmethod
    def pack(fields: dict[str, Any]) -> bytes:
        return msgpack.packb(fields, use_bin_type=True)


def expected_outcome(frames: list[bytes]) -> tuple[str, Any]:
    """What the protocol says the server does with a message: ("malformed"|"refused"|"served", id)."""
    if len(frames) != 1:
        return "malformed", None
    try:
        kind, message = protocol.decode(frames[0], limit=protocol.MAX_PEER_MESSAGE_BYTES)
    except ProtocolError:
        return "malformed", None
    if kind not in protocol.PEER_KINDS:
        return "malformed", None
    return ("served" if protocol.token_ok(message, TOKEN) else "refused"), message.get("id")


def zmtp_huge_frame() -> bytes:
    """A ZMTP 3.0 NULL handshake as a DEALER, then a frame header announcing 2**62 bytes (none follow)."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
    properties = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + properties
    return greeting + b"\x04" + bytes([len(ready)]) + ready + b"\x02" + struct.pack(">Q", 1 << 62) + b"\0" * 64


def raw_tcp_garbage(endpoint: str, rng: random.Random) -> None:
    """Bytes that are not ZMTP at all, or announce an absurd frame: ZeroMQ drops such connections."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    payloads = [rng.randbytes(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\xff" + b"\0" * 8 + b"\x7f\x01",
                b"\xff" * 64 + rng.randbytes(1000), zmtp_huge_frame(), b""]
    for payload in payloads:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            try:
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(5)
                while conn.recv(65536):  # the server's greeting, then its close
                    pass
            except OSError:
                pass  # a reset is how ZeroMQ refuses a bad peer


# one branch per message kind it fuzzes: complexity 21, kept in one piece so that a failure names the kind
def test_agent_survives_ten_thousand_fuzzed_messages_on_its_tcp_port(replica: Replica) -> None:  # noqa: C901
    started = time.monotonic()
    agent_pid = replica.env.agent_pid()
    assert agent_pid is not None
    before = replica.status()
    fuzzer = Fuzzer(replica, seed=20261121)
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(replica.endpoint)
        sockets.append(sock)
        return sock

    counts = {"malformed": 0, "refused": 0, "served": 0}
    outcome_of: dict[Any, str] = {}
    replies: list[tuple[dict[str, Any], list[bytes]]] = []

    def drain(sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, header = protocol.decode(frames[0], limit=protocol.MAX_PEER_MESSAGE_BYTES)
            assert kind == Kind.REPLY, header
            replies.append((header, frames[1:]))

    try:
        # Oversized frames first, each on its own socket: ZeroMQ drops the connection of such a peer.
        oversized = [b"\0" * (protocol.MAX_PEER_MESSAGE_BYTES + 1),
                     msgpack.packb({"v": 1, "kind": int(Kind.LIST), "id": 1, "token": TOKEN,
                                    "pad": b"p" * protocol.MAX_PEER_MESSAGE_BYTES}, use_bin_type=True)]
        monitors = []
        for blob in oversized:
            sock = dealer()
            monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            sock.send(blob, copy=False)
        raw_tcp_garbage(replica.endpoint, fuzzer.rng)
        for sock, monitor in zip(sockets, monitors):
            assert monitor.poll(30_000), "the agent kept the connection of a peer that sent an oversized frame"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            sock.disable_monitor()
            monitor.close(linger=0)

        fuzz = [dealer() for _ in range(4)]
        total, batch = 12_000, 400
        sent = 0
        while sent < total:
            for _ in range(batch):
                while True:  # a bit flip may yield a valid request whose id is not fresh: draw again
                    frames = fuzzer.message()
                    outcome, request_id = expected_outcome(frames)
                    if outcome == "malformed" or (type(request_id) is int and request_id not in outcome_of):
                        break
                counts[outcome] += 1
                if outcome != "malformed":
                    outcome_of[request_id] = outcome
                fuzz[sent % len(fuzz)].send_multipart(frames)
                sent += 1
            for sock in fuzz:
                drain(sock)
        # One sentinel per connection: the server answers a connection's requests in order, so once every
        # sentinel is answered, every fuzzed message before it has been handled.
        sentinels = {}
        for number, sock in enumerate(fuzz):
            sentinel = f"sentinel-{number}"  # no fuzzed request has a str id
            sentinels[sentinel] = sock
            sock.send(protocol.encode(Kind.LIST, limit=protocol.MAX_PEER_MESSAGE_BYTES, id=sentinel, token=TOKEN))

        def sentinels_answered() -> bool:
            for sock in fuzz:
                drain(sock)
            return set(sentinels) <= {header.get("id") for header, _ in replies}

        wait_for(sentinels_answered, 30, "the replica server to answer every connection's sentinel LIST")
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()

    assert sent >= 10_000 and min(counts.values()) > 500, counts
    # Every reply answers a refused or served request; refusals say why and carry nothing else.
    answered = {"refused": 0, "served": 0}
    for header, data in replies:
        if header.get("id") in sentinels:
            assert header["ok"] is True
            continue
        outcome = outcome_of.get(header.get("id"))
        assert outcome is not None, f"a reply to a message the server should have dropped: {header}"
        answered[outcome] += 1
        if outcome == "refused":
            assert header["ok"] is False and set(header) <= REFUSAL_KEYS and "token" in header["error"], header
            assert data == [], "a refusal with tensor bytes"
        elif header["ok"] and data:
            assert len(data) == 1 and xxhash.xxh3_64_intdigest(data[0]) == header["xxh64"], header
    assert answered["refused"] == counts["refused"], (answered, counts)
    assert answered["served"] > 0

    # The agent is the same process, alive, and still serves correct bytes to a token holder.
    assert replica.env.agent_pid() == agent_pid, "the agent was replaced: the fuzzing killed it"
    listed = [(row.step, row.ranks) for row in listed_steps(replica.endpoint)]
    assert listed == [(1, {0})], "a fuzzed PUSH installed a backup"
    entry, checksum = replica.tensor("model/w")
    assert bytes(fetch(replica.endpoint, entry, checksum)) == saved_bytes(replica.state["model"]["w"])
    with pytest.raises(PeerError, match="token"):
        listed_steps(replica.endpoint, "intruder-token-0123456789")  # a PEERS over tcp did not change the token
    after = replica.status()
    assert after["pid"] == agent_pid and [r["rank"] for r in after["ranks"]] == [0]
    refused = counts["refused"] + 1  # and the intruder's LIST just now
    assert after["refused"] - before["refused"] == refused, (after["refused"], before["refused"], counts)
    grew = after["malformed"] - before["malformed"]
    assert counts["malformed"] <= grew <= counts["malformed"] + counts["served"], (grew, counts)
    log = replica.env.job_dir() / "agent.log"
    text = log.read_text()
    assert "Traceback" not in text, text[-5000:]
    assert time.monotonic() - started < 120, "fuzzing took too long"


# 4. corrupted memory is never served as good bytes ---------------------------------------------------------
def slot_holding(env: Env, step: int) -> Path:
    for path in env.slot_files():
        if "-r000000-" not in path.name:
            continue
        slot = shm.SlotMap(path, writable=False)
        try:
            header = slot.header()
        finally:
            slot.close()
        if header.committed and header.step == step:
            return path
    raise AssertionError(f"no committed slot of rank 0 holds step {step}: {env.slot_files()}")


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
def test_fetch_of_a_corrupted_copy_raises_fetch_error(replica: Replica, where: str) -> None:
    entry, checksum = replica.tensor("model/w")
    offset, nbytes = entry.offset, entry.nbytes
    position = {"first byte": 0, "middle": nbytes // 2 + 123, "last byte": nbytes - 1}[where]
    path = slot_holding(replica.env, 1)
    slot = shm.SlotMap(path, writable=True)
    try:
        at = shm.DATA_OFFSET + offset + position
        slot.mm[at] ^= 0x5A
    finally:
        slot.close()
    for options in ({}, {"chunk": 64 << 10, "window": 2}):
        with pytest.raises(FetchError, match="does not match its checksum"):
            fetch(replica.endpoint, entry, checksum, **options)
    # (The server computes each chunk's xxh3-64 from the bytes it sends, so every chunk passes that check:
    # the tensor's xxh3-128 from the manifest is what catches it.) The other tensors are still served intact.
    other, other_sum = replica.tensor("model/b")
    assert bytes(fetch(replica.endpoint, other, other_sum)) == saved_bytes(replica.state["model"]["b"])
    assert replica.ck.agent.request(Kind.PING, 10.0)["pid"] == replica.env.agent_pid()
    # Nor is it written to disk: the end of the run's persist of that step is refused, and close() says so.
    with pytest.raises(easyckpt.PersistError, match="no longer matches the checksum the agent took after its commit"):
        replica.ck.close()
