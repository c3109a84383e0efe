"""The object store of the soak's object_store_outage jobs: one S3 server process for the whole soak (moto's server
mode, started on first use), and per job a bucket and a fault proxy in front of the server that the job's ranks and
agents talk to (``tests/s3proxy.py``: it drops every connection and refuses new ones while down).

The soak's own reads (the tracker after a job) go straight to the server: the proxy is the job's, not the judge's.
Needs the ``test`` extra (moto[server], boto3), as the soak's other parts need torch and the examples.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from s3proxy import FaultProxy  # noqa: E402
from s3server import MotoServer, client, env  # noqa: E402

_SERVER: MotoServer | None = None
_LOCK = threading.Lock()


def server() -> MotoServer:
    """The soak's S3 server; its settings go into this process's environment (for the judge's own reads)."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.proc.poll() is not None:
            _SERVER = MotoServer()
            atexit.register(_SERVER.stop)
            os.environ.update(env(_SERVER.url))
        return _SERVER


@dataclasses.dataclass
class JobStore:
    """A job's ``s3://`` save_dir and the proxy its processes reach the store through."""

    url: str
    proxy: FaultProxy

    def environ(self) -> dict[str, str]:
        return env(self.proxy.url)

    def close(self) -> None:
        self.proxy.close()


def job_store(seed: int, index: int) -> JobStore:
    running = server()
    bucket = f"soak-{index}-{uuid.uuid4().hex[:8]}"
    client(running.url).create_bucket(Bucket=bucket)
    return JobStore(f"s3://{bucket}/ckpt", FaultProxy(running.url, seed=seed * 100_003 + index))
