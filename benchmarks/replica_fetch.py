"""Replica fetch throughput (agent-to-agent tcp) against raw loopback TCP measured in the same run.

    python benchmarks/replica_fetch.py --sizes-mb 256,1024 --repeats 3 --out benchmarks/results/replica-fetch-cpu.json

For each state size a real Checkpointer commits one snapshot of ``--tensors`` equal float32 tensors to
shared memory; its agent is told the job's peers (a PEERS message with a job token, as a multi-node job's
rank sends it), which starts its replica server on 127.0.0.1 and hashes the snapshot. Then, in turns, so
that both see the same machine load:

* easyckpt: one ``PeerClient`` (connected by a LIST beforehand) fetches every tensor of the rank's manifest,
  one after the other, with ``fetch_into`` into a preallocated, touched buffer: chunk requests kept in
  flight on one connection, frames received straight into the buffer, each chunk checked against the
  server's xxh3-64 and each tensor against its xxh3-128. The default chunk and window, and every
  combination of ``--chunks-mb`` x ``--windows``, are timed.
* raw: a plain socket server in another process sends the same byte count with ``sendall`` from a
  preallocated, touched buffer; this process receives it with ``recv_into`` into the same touched buffer
  that the fetches use. No framing, no hashing: the loopback limit for one Python stream.

The headline is the best (shortest) of ``--repeats`` runs on each side and their throughput ratio
(target >= 0.70 for the default chunk and window). Every run is kept in the JSON (``runs_s``). The agent
runs at its default CPU priority (``nice 10``); the raw server at the caller's. The speed of the two hash
functions on this machine is reported too, since the fetch path hashes every byte twice on the receiver
(chunk and tensor) and once on the sender.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash
from common import poll, write_result

import easyckpt
from easyckpt_wire import protocol, transfer
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import ListReply, Manifest
from easyckpt_wire.transfer import PeerClient

TARGET = 0.70
TOKEN = "replica-fetch-benchmark-token-0123456789"

# The raw sender: announces its port, then for each connection answers every 8-byte length N with N bytes
# sent by one sendall from a preallocated buffer that was written once (touched) before any timing.
_RAW_SERVER = """
import socket, struct, sys
size = int(sys.argv[1])
buffer = bytearray(b"\\x01") * max(1, size)
view = memoryview(buffer)
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    with conn:
        while True:
            header = conn.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                break
            (count,) = struct.unpack("<Q", header)
            if count == 0:
                sys.exit(0)
            conn.sendall(view[:count])
"""


def parse_list(values: list[str], kind: Callable[[str], Any]) -> list[Any]:
    """``["256,1024"]`` or ``["256", "1024"]`` -> [256, 1024]."""
    return [kind(item) for value in values for item in value.split(",") if item.strip()]


class RawServer:
    """The raw loopback sender in its own process, and this process's receiving end."""

    def __init__(self, nbytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _RAW_SERVER, str(nbytes)], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def receive(self, dest: memoryview) -> float:
        """Seconds from the request to the last byte received into ``dest``."""
        total = len(dest)
        start = time.perf_counter()
        self.sock.sendall(struct.pack("<Q", total))
        received = 0
        while received < total:
            count = self.sock.recv_into(dest[received:])
            if count == 0:
                raise ConnectionError(f"raw sender closed after {received} of {total} bytes")
            received += count
        return time.perf_counter() - start

    def close(self) -> None:
        try:
            self.sock.sendall(struct.pack("<Q", 0))
            self.sock.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def make_state(nbytes: int, tensors: int) -> dict[str, Any]:
    numel = max(1, nbytes // 4 // tensors)
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.rand(numel, generator=gen) for i in range(tensors)}}


def serving_agent(save_dir: Path, state: dict[str, Any]) -> tuple[easyckpt.Checkpointer, str, Manifest]:
    """A Checkpointer with step 1 committed, its agent's replica server listing it; (ck, endpoint, manifest)."""
    ck = easyckpt.Checkpointer(save_dir, save_mem_interval=1, save_storage_interval=10**9, max_ckpt_num=1,
                               agent_idle_timeout=60.0)
    try:
        if not ck.save_if_needed(1, state):
            raise RuntimeError("the snapshot of step 1 was skipped")
        ck.wait()
        node = protocol.node_id()
        reply = ck.agent.request(Kind.PEERS, 30.0, token=TOKEN, node=node, leader=node,
                                 nodes=[{"node": node, "endpoint": "tcp://127.0.0.1:1", "ranks": [0]}],
                                 world_size=1, replicate_unique=True)
        if not reply.get("ok"):
            raise RuntimeError(f"the agent refused PEERS: {reply}")
        endpoint = ck.agent.request(Kind.PING, 30.0)["endpoint"]
        client = PeerClient(endpoint, TOKEN, timeout=60.0)
        try:
            poll(lambda: 1 in ListReply.from_wire(client.call(Kind.LIST), endpoint).by_step(), 120,
                 "the replica server to list step 1 (hashing the snapshot)")
            manifest = Manifest.from_wire(client.call(Kind.MANIFEST, rank=0, step=1)["manifest"], endpoint)
        finally:
            client.close()
        return ck, endpoint, manifest
    except BaseException:
        ck.close()
        raise


def fetch_all(client: PeerClient, manifest: Manifest, dest: memoryview, chunk: int, window: int) -> float:
    """Seconds to fetch every tensor of ``manifest`` into consecutive ranges of ``dest``."""
    start = time.perf_counter()
    position = 0
    for entry, checksum in zip(manifest.tensors, manifest.checksums):
        nbytes = entry.nbytes
        client.fetch_into(1, checksum, dest[position:position + nbytes], chunk=chunk, window=window)
        position += nbytes
    return time.perf_counter() - start


def cell(nbytes: int, runs: list[float], raw_gbps: float | None = None, **extra: Any) -> dict[str, Any]:
    best = min(runs)
    gbps = nbytes / best / 1e9
    result = {**extra, "best_s": best, "gbps": gbps, "runs_s": runs}
    if raw_gbps is not None:
        result["ratio"] = gbps / raw_gbps
    return result


def hash_speed(buffer: memoryview) -> dict[str, float]:
    """GB/s of xxh3-64 and xxh3-128 over ``buffer`` on one core (best of 3)."""
    speeds = {}
    for name, function in (("xxh3_64_gbps", xxhash.xxh3_64_intdigest), ("xxh3_128_gbps", xxhash.xxh3_128_digest)):
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            function(buffer)
            runs.append(time.perf_counter() - start)
        speeds[name] = len(buffer) / min(runs) / 1e9
    return speeds


def measure(size_mb: float, tensors: int, repeats: int, configs: list[tuple[int, int]],
            directory: Path) -> dict[str, Any]:
    state = make_state(int(size_mb * (1 << 20)), tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    ck, endpoint, manifest = serving_agent(directory / f"ckpt-{size_mb:g}", state)
    raw = None
    clients: dict[tuple[int, int], PeerClient] = {}
    try:
        assert sum(entry.nbytes for entry in manifest.tensors) == nbytes, "the manifest does not cover the state"
        dest_tensor = torch.empty(nbytes, dtype=torch.uint8)
        dest_tensor.fill_(1)  # every page written once: no page faults in the timed part
        dest = memoryview(dest_tensor.numpy()).cast("B")
        raw = RawServer(nbytes)
        for config in configs:
            clients[config] = PeerClient(endpoint, TOKEN, timeout=120.0)
            clients[config].call(Kind.LIST)  # connect before timing
        raw.receive(dest)  # warm-up: the sender's pages and the connection
        raw_runs: list[float] = []
        runs: dict[tuple[int, int], list[float]] = {config: [] for config in configs}
        for _ in range(repeats):
            raw_runs.append(raw.receive(dest))
            for config in configs:
                runs[config].append(fetch_all(clients[config], manifest, dest, *config))
        # Outside the timing: what the last fetch left in the buffer is exactly the saved state.
        expected = torch.cat([t.view(torch.uint8) for t in state["model"].values()])
        if not torch.equal(dest_tensor, expected):
            raise AssertionError("fetched bytes differ from the saved state")
        speeds = hash_speed(dest)
    finally:
        for client in clients.values():
            client.close()
        if raw is not None:
            raw.close()
        ck.close()
    raw_cell = cell(nbytes, raw_runs)
    default = (transfer.CHUNK_BYTES, transfer.WINDOW)
    grid = [cell(nbytes, runs[config], raw_cell["gbps"], chunk_mb=config[0] / (1 << 20), window=config[1],
                 default=config == default) for config in configs]
    default_cell = next(c for c in grid if c["default"])
    best = max(grid, key=lambda c: c["gbps"])
    return {"bytes": nbytes, "tensors": len(manifest.tensors), "raw": raw_cell, "easyckpt": default_cell,
            "grid": grid, "best_config": {"chunk_mb": best["chunk_mb"], "window": best["window"],
                                          "ratio": best["ratio"]},
            "target": TARGET, "met": default_cell["ratio"] >= TARGET, **speeds}


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "device": "cpu",
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", nargs="+", default=["256,1024"],
                        help="total state sizes in MiB (default 256,1024)")
    parser.add_argument("--tensors", type=int, default=4, help="equal float32 tensors per state (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (best reported)")
    parser.add_argument("--chunks-mb", nargs="+", default=["8,16"], help="chunk sizes to try, MiB (default 8,16)")
    parser.add_argument("--windows", nargs="+", default=["2,4,8"], help="windows to try (default 2,4,8)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary save_dir")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    sizes = parse_list(args.sizes_mb, float)
    chunks = parse_list(args.chunks_mb, float)
    windows = parse_list(args.windows, int)
    if args.repeats < 1 or args.tensors < 1 or not sizes or any(s <= 0 for s in sizes):
        parser.error("--repeats, --tensors and every size must be positive")
    if any(c <= 0 or c * (1 << 20) > protocol.MAX_CHUNK_BYTES for c in chunks) or any(w < 1 for w in windows):
        parser.error(f"chunks must be in (0, {protocol.MAX_CHUNK_BYTES >> 20}] MiB and windows >= 1")
    default = (transfer.CHUNK_BYTES, transfer.WINDOW)
    configs = [default] + [(int(c * (1 << 20)), w) for c in chunks for w in windows
                           if (int(c * (1 << 20)), w) != default]
    info = machine()
    saved_addr = os.environ.get(protocol.AGENT_ADDR_ENV)
    os.environ[protocol.AGENT_ADDR_ENV] = "127.0.0.1"  # the replica server binds here
    try:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="easyckpt-replica-fetch-") as tmp:
            rows = [measure(size, args.tensors, args.repeats, configs, Path(tmp)) for size in sizes]
    finally:
        if saved_addr is None:
            os.environ.pop(protocol.AGENT_ADDR_ENV, None)
        else:
            os.environ[protocol.AGENT_ADDR_ENV] = saved_addr
    print(f"{'MiB':>7} {'chunk MiB':>9} {'window':>6} {'best s':>8} {'GB/s':>6} {'raw GB/s':>8} {'ratio':>6}")
    for row in rows:
        raw = row["raw"]
        for c in row["grid"]:
            verdict = "ok" if c["ratio"] >= TARGET else "MISS"
            mark = f" <- default, target >={TARGET:.2f} {verdict}" if c["default"] else ""
            print(f"{row['bytes'] / (1 << 20):7.0f} {c['chunk_mb']:9g} {c['window']:6d} {c['best_s']:8.4f} "
                  f"{c['gbps']:6.2f} {raw['gbps']:8.2f} {c['ratio']:6.2f}{mark}")
        print(f"{'':7} raw loopback best {raw['best_s']:.4f}s; xxh3-64 {row['xxh3_64_gbps']:.1f} GB/s, "
              f"xxh3-128 {row['xxh3_128_gbps']:.1f} GB/s on one core")
    result = {"benchmark": "replica_fetch", "machine": info, "repeats": args.repeats, "target": TARGET,
              "default": {"chunk_mb": transfer.CHUNK_BYTES / (1 << 20), "window": transfer.WINDOW},
              "notes": {"ratio": "easyckpt fetch throughput / raw loopback TCP throughput, best run of each",
                        "raw": "one stream, sendall from a touched buffer in another process, recv_into a "
                               "touched buffer; no framing, no hashing"},
              "rows": rows}
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
