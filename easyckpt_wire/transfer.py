"""The requesting side of the agent-to-agent protocol: ask an agent over tcp, fetch tensor bytes.

Used by agents (a buddy pulls the tensors only its peer holds) and by recovering ranks (a rank whose
node lost its memory pulls its state from the agents that still hold it). It is part of the wire
protocol, so both sides use this one implementation.

A fetch keeps ``window`` chunk requests in flight on one connection and receives every data frame
straight into the destination buffer (``recv_into``: no intermediate copy); each chunk is checked
against the xxh3-64 the server computed, and the whole tensor against its xxh3-128 from the manifest.
Any failure raises :class:`FetchError` naming the peer, so the caller can fail over to another holder.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import xxhash
import zmq

from easyckpt_wire import protocol
from easyckpt_wire.protocol import Kind, ProtocolError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20   # 8-16 MiB frames are what ZeroMQ moves fastest on these machines
WINDOW = 4


class PeerError(RuntimeError):
    """A peer agent refused, timed out, or sent something invalid."""


class PeerTimeout(PeerError):
    """The peer did not answer within the timeout (hung, stopped, or its host gone): asking it again costs the
    whole timeout again."""


class FetchError(PeerError):
    """Tensor bytes from a peer did not arrive intact."""


class NoCopyError(PeerError):
    """The peer holds no such copy of the tensor (``protocol.NO_COPY``): ask the next holder, not again."""


class PeerClient:
    """Requests to one agent's tcp endpoint. Not thread-safe: one per thread."""

    def __init__(self, endpoint: str, token: str, *, timeout: float = 10.0, ctx: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.token = token
        self.timeout = timeout
        self.ctx = ctx or zmq.Context.instance()
        self._ids = itertools.count(1)
        self.sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self.sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_PEER_MESSAGE_BYTES)
            sock.setsockopt(zmq.RCVHWM, 0)  # frames of a granted window must never be dropped
            sock.connect(self.endpoint)
            self.sock = sock
        return self.sock

    def reset(self) -> None:
        """Drop the connection: after a timeout, late replies must not be taken for new ones."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def close(self) -> None:
        self.reset()

    def _send(self, kind: Kind, **fields: Any) -> int:
        request_id = next(self._ids)
        self._socket().send(protocol.encode(kind, limit=protocol.MAX_PEER_MESSAGE_BYTES, id=request_id,
                                            token=self.token, **fields))
        return request_id

    def _recv_header(self, kind: Kind, request_id: int, deadline: float) -> dict[str, Any]:
        sock = self._socket()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000)):
                self.reset()
                raise PeerTimeout(f"{kind.name} to agent {self.endpoint}: no reply within {self.timeout:.1f}s")
            blob = sock.recv()
            try:
                _, message = protocol.decode(blob, limit=protocol.MAX_PEER_MESSAGE_BYTES)
            except ProtocolError as exc:
                self.reset()
                raise PeerError(f"{kind.name} to agent {self.endpoint}: malformed reply: {exc}") from None
            if message.get("id") != request_id:
                while sock.getsockopt(zmq.RCVMORE):  # a stale reply's data frame
                    sock.recv()
                continue
            if not message["ok"]:
                while sock.getsockopt(zmq.RCVMORE):
                    sock.recv()
                refusal = NoCopyError if message.get("code") == protocol.NO_COPY else PeerError
                raise refusal(f"{kind.name} to agent {self.endpoint} refused: {message.get('error', 'no reason given')}")
            return message

    def call(self, kind: Kind, **fields: Any) -> dict[str, Any]:
        """One request, one reply (raises PeerError naming the peer and the request)."""
        request_id = self._send(kind, **fields)
        return self._recv_header(kind, request_id, time.monotonic() + self.timeout)

    def fetch_into(self, step: int, checksum: bytes, dest: memoryview, *, copy: int = 0, chunk: int = CHUNK_BYTES,
                   window: int = WINDOW) -> None:
        """Fill ``dest`` with the bytes of the tensor ``checksum`` at ``step`` from the peer's ``copy``-th
        copy of it; verified, else FetchError (bad bytes: try another copy) or PeerError."""
        total = len(dest)
        ranges = [(start, min(chunk, total - start)) for start in range(0, total, chunk)]
        pending: list[tuple[int, int, int]] = []
        sent = 0
        whole = xxhash.xxh3_128()   # fed chunk by chunk while each is still in cache: one pass less
        try:
            for _ in ranges:
                while sent < len(ranges) and len(pending) < window:
                    start, length = ranges[sent]
                    pending.append((self._send(Kind.FETCH, step=step, checksum=checksum, offset=start, length=length,
                                               copy=copy), start, length))
                    sent += 1
                request_id, start, length = pending.pop(0)
                header = self._recv_header(Kind.FETCH, request_id, time.monotonic() + self.timeout)
                sock = self._socket()
                if not sock.getsockopt(zmq.RCVMORE):
                    raise FetchError(f"FETCH from agent {self.endpoint}: reply without data for bytes {start}+{length}")
                target = dest[start:start + length]
                received = sock.recv_into(target)
                if received != length or sock.getsockopt(zmq.RCVMORE):
                    raise FetchError(f"FETCH from agent {self.endpoint}: {received} bytes for a chunk of {length}")
                if xxhash.xxh3_64_intdigest(target) != header.get("xxh64"):
                    raise FetchError(f"FETCH from agent {self.endpoint}: chunk at {start} of tensor "
                                     f"{checksum.hex()} fails its checksum")
                whole.update(target)
        except BaseException:
            self.reset()
            raise
        if whole.digest() != checksum:
            raise FetchError(f"tensor from agent {self.endpoint} at step {step} does not match its checksum "
                             f"{checksum.hex()} (corrupted in the peer's memory?)")


def tensor_checksum(view: memoryview | bytes) -> bytes:
    return xxhash.xxh3_128_digest(view)
