"""A real S3 server for the tests: moto's server mode in its own process on 127.0.0.1 (a free port chosen by
the server itself), spoken to over HTTP by boto3 exactly as a real one would be. No in-process patching.

``server()`` starts one per test session on first use (stopped at exit); ``bucket()`` makes a new empty bucket
and returns its name; ``env()`` is the AWS environment a child process (torchrun, the agent) needs. Tests
that need it skip when moto or boto3 is not installed (CI installs them with the ``test`` extra).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

_RUNNING = re.compile(r"Running on (http://127\.0\.0\.1:\d+)")


class MotoServer:
    """``python -m moto.server -H 127.0.0.1 -p 0``; its URL read from its log against a deadline."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.log = Path(tempfile.mkdtemp(prefix="easyckpt-moto-")) / "moto.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            match = _RUNNING.search(self.log.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not start within {timeout:.0f}s: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)   # polling the server's log for its port, against the deadline above

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # Its log's folder goes with it (one per test session was left in /tmp for good).
        shutil.rmtree(self.log.parent, ignore_errors=True)


_SERVER: MotoServer | None = None


def env(url: str) -> dict[str, str]:
    """The AWS settings of a test against ``url`` (dummy credentials: moto takes any)."""
    return {"AWS_ENDPOINT_URL_S3": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def server() -> MotoServer:
    """The session's server (started on first use); its settings are put into this process's environment."""
    global _SERVER
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = MotoServer()
        atexit.register(_SERVER.stop)
    os.environ.update(env(_SERVER.url))
    return _SERVER


_CLIENTS: dict[str, object] = {}


def client(url: str):  # type: ignore[no-untyped-def]
    import boto3

    if url in _CLIENTS:
        return _CLIENTS[url]
    made = _CLIENTS[url] = boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")
    return made


def bucket(url: str | None = None) -> str:
    """A new, empty bucket on the session's server (or on ``url``)."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    client(url or server().url).create_bucket(Bucket=name)
    return name
