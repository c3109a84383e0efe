"""A fault proxy in front of the test S3 server: every request of the job goes through it, over HTTP.

- ``throttle``: answers ``503 SlowDown`` (S3's throttling reply) to a seeded fraction of the requests;
- ``go_down``/``come_back``: drops every open connection and refuses new ones (its listening socket is
  closed) until told to come back, on the same port; ``down_at``: goes down by itself at the n-th request
  that writes under ``iteration_`` (a seeded point inside a persist), and sets ``went_down``.

Requests are parsed (method, path, headers, a Content-Length or chunked body) and replayed to the server with
the same Host header, so the client's signature still holds; replies are relayed whole.
"""
from __future__ import annotations

import http.client
import http.server
import random
import socket
import threading
import urllib.parse
from typing import Any

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int, throttle: float = 0.0, down_at: int | None = None) -> None:
        target = urllib.parse.urlparse(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.rng = random.Random(seed)
        self.throttle, self.down_at = throttle, down_at
        self.lock = threading.Lock()
        self.requests = self.throttled = self.writes = 0
        self.went_down = threading.Event()
        self.sockets: set[socket.socket] = set()
        self.server: http.server.ThreadingHTTPServer | None = None
        self.port = 0
        self._serve()
        self.url = f"http://127.0.0.1:{self.port}"

    # the server's life ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = _Server(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        server.allow_reuse_address = True
        self.port = server.server_address[1]
        self.server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="s3-fault-proxy").start()

    def go_down(self) -> None:
        """Refuse new connections and drop the open ones."""
        with self.lock:
            server, self.server = self.server, None
            open_ones, self.sockets = list(self.sockets), set()
        if server is not None:
            server.shutdown()
            server.server_close()
        for sock in open_ones:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.went_down.set()

    def come_back(self) -> None:
        if self.server is None:
            self._serve()

    def close(self) -> None:
        self.go_down()

    # one request ---------------------------------------------------------------------------------------------
    def decide(self, method: str, path: str) -> str:
        """'forward', '503' or 'drop' for this request."""
        with self.lock:
            self.requests += 1
            if method in ("PUT", "POST") and "/iteration_" in path:
                self.writes += 1
                if self.down_at is not None and self.writes == self.down_at:
                    return "drop"
            if self.throttle and self.rng.random() < self.throttle:
                self.throttled += 1
                return "503"
        return "forward"


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection the client or ``go_down`` dropped: expected here, not worth a traceback."""


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 (the base class's name)
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner.lock:
            self.owner.sockets.add(self.connection)

    def finish(self) -> None:
        with self.owner.lock:
            self.owner.sockets.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _any(self) -> None:
        body = self._body()
        verdict = self.owner.decide(self.command, self.path)
        if verdict == "drop":
            threading.Thread(target=self.owner.go_down, daemon=True).start()
            self.close_connection = True
            return
        if verdict == "503":
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_SLOWDOWN)))
            self.end_headers()
            self.wfile.write(_SLOWDOWN)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
            reply = upstream.getresponse()
            data = reply.read()
        finally:
            upstream.close()
        self.send_response(reply.status, reply.reason)
        for key, value in reply.getheaders():
            if key.lower() not in _HOP and (key.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any
