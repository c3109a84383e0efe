"""Object storage throughput: easyckpt's persist to, and load from, an ``s3://`` save_dir against each client's
own plain upload and download of the same bytes, on the same server in the same run.

    python benchmarks/s3_throughput.py --size-mb 256 --repeats 2 --out benchmarks/results/s3-throughput.json

THE SERVER IS MOTO'S SERVER MODE ON LOOPBACK (127.0.0.1), started here in its own process: a Python server
that keeps objects in memory, so the absolute figures say how fast moto is on this machine, not S3; the
ratios say how much of what the client itself reaches easyckpt keeps.

1. persist: a real agent (``save_storage_interval=1``) persists one snapshot of a GPT-like state (as in
   throughput.py) to ``s3://bench/easy-N``; seconds and bytes from its ``log_file_path`` line (its writer:
   boto3, parts of ``EASYCKPT_S3_PART_MB`` in ``EASYCKPT_S3_THREADS`` threads). Raw: the same byte count as
   one object, with boto3's managed ``upload_fileobj`` (same part size and threads), and with obstore's
   ``put`` (same part size and concurrency) when obstore is installed.
2. load: ``load()`` in a new process of a new job id (so the memory tier has nothing: it reads the object
   store) into a state of the same structure. Raw: the same object downloaded whole by boto3's managed
   ``download_fileobj`` (parallel ranged GETs), by a plain ``get_object().read()``, and by obstore's ``get``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from common import poll, write_result

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
_LOG_RE = re.compile(r"persisted step=(?P<step>\d+) ranks=\d+ bytes=(?P<bytes>\d+) .*seconds=(?P<seconds>[\d.]+)")


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    log = Path(tempfile.mkdtemp(prefix="easyckpt-bench-moto-")) / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    match = poll(lambda: re.search(r"Running on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace")), 60,
                 "moto's server to start")
    return proc, match.group(1)


def settings() -> tuple[int, int]:
    """(part bytes, threads): easyckpt's (``EASYCKPT_S3_PART_MB``, ``EASYCKPT_S3_THREADS``), given to the clients too."""
    from easyckpt_wire.storage.s3client import S3Settings

    found = S3Settings.from_env()
    return found.part_bytes, found.threads


def easy_persist(state: dict[str, Any], url: str, log_file: Path) -> dict[str, Any]:
    import easyckpt

    ck = easyckpt.Checkpointer(url, 1, 1, 1, log_file_path=str(log_file))
    try:
        ck.save_if_needed(0, state)
        ck.wait()
        line = poll(lambda: log_file.exists() and _LOG_RE.search(log_file.read_text()), 600, f"the persist to {url}")
    finally:
        ck.close()
    return {"bytes": int(line["bytes"]), "seconds": float(line["seconds"])}


def child_load(args: dict[str, Any]) -> dict[str, Any]:
    """Child: a reader Checkpointer of a new job id (no agent, no slots of that job) loads from the store."""
    from throughput import make_state

    import easyckpt

    template = make_state(args["size_mb"], "cpu", args["dim"])
    ck = easyckpt.Checkpointer(args["url"], 1, 10**9, 1, start_agent=False)
    try:
        started = time.perf_counter()
        result = ck.load(template)
        seconds = time.perf_counter() - started
    finally:
        ck.close()
    if result.source != "disk" or result.step != 0:
        raise RuntimeError(f"expected step 0 from disk, load() gave step {result.step} from {result.source}")
    return {"seconds": seconds, "bytes": result.nbytes}


def in_child(function: str, args: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "EASYCKPT_JOB_ID": f"bench-load-{uuid.uuid4().hex[:8]}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p)}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import s3_throughput as m; "
            "print('RESULT ' + json.dumps(getattr(m, sys.argv[2])(json.loads(sys.argv[3]))), flush=True)")
    proc = subprocess.run([sys.executable, "-c", code, str(BENCH_DIR), function, json.dumps(args)], capture_output=True,
                          text=True, timeout=900, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{function} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):]))


def timed(function: Any) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def raw_runs(endpoint: str, bucket: str, data: bytes, part: int, threads: int) -> dict[str, float]:
    """Seconds of each client's own upload and download of ``data`` as one object."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=threads)
    key = f"raw-{uuid.uuid4().hex[:8]}"
    runs = {"boto3_put_s": timed(lambda: client.upload_fileobj(io.BytesIO(data), bucket, key, Config=config)),
            "boto3_get_s": timed(lambda: client.download_fileobj(bucket, key, io.BytesIO(), Config=config)),
            "boto3_plain_get_s": timed(lambda: client.get_object(Bucket=bucket, Key=key)["Body"].read())}
    client.delete_object(Bucket=bucket, Key=key)
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return runs
    store = S3Store(bucket, endpoint=endpoint, region=os.environ["AWS_DEFAULT_REGION"],
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                    client_options={"allow_http": True})
    runs["obstore_put_s"] = timed(lambda: obstore.put(store, key, data, chunk_size=part, max_concurrency=threads))
    runs["obstore_get_s"] = timed(lambda: bytes(obstore.get(store, key).bytes()))
    obstore.delete(store, key)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(BENCH_DIR))
    from throughput import make_state

    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    server, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    runs: list[dict[str, float]] = []
    try:
        import boto3

        bucket = "bench"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        part, threads = settings()
        state = make_state(args.size_mb, "cpu", args.dim)
        with tempfile.TemporaryDirectory(prefix="easyckpt-s3-bench-") as scratch:
            for repeat in range(args.repeats):
                url = f"s3://{bucket}/easy-{repeat}"
                persist = easy_persist(state, url, Path(scratch) / f"persist-{repeat}.log")
                load = in_child("child_load", {"url": url, "size_mb": args.size_mb, "dim": args.dim})
                raw = raw_runs(endpoint, bucket, os.urandom(persist["bytes"]), part, threads)
                runs.append({"bytes": persist["bytes"], "easyckpt_persist_s": persist["seconds"],
                             "easyckpt_load_s": load["seconds"], "load_bytes": load["bytes"], **raw})
    finally:
        server.terminate()
        server.wait(30)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    nbytes = median["bytes"]

    def mbps(seconds_key: str, size: float = nbytes) -> float:
        return round(size / median[seconds_key] / 1e6, 1)

    figures = {key[:-2] + "_MBps": mbps(key, median["load_bytes"] if key == "easyckpt_load_s" else nbytes)
               for key in median if key.endswith("_s")}
    ratios = {"persist_over_boto3_put": round(median["boto3_put_s"] / median["easyckpt_persist_s"], 2),
              "load_over_boto3_get": round(median["boto3_get_s"] / median["easyckpt_load_s"], 2)}
    if "obstore_put_s" in median:
        ratios.update(persist_over_obstore_put=round(median["obstore_put_s"] / median["easyckpt_persist_s"], 2),
                      load_over_obstore_get=round(median["obstore_get_s"] / median["easyckpt_load_s"], 2))
    versions = {}
    for name in ("boto3", "botocore", "obstore", "moto", "torch"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            pass
    result = {"benchmark": "s3_throughput", "server": f"moto server mode on loopback ({endpoint})",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "versions": versions,
              "part_bytes": part, "threads": threads, "size_mb": args.size_mb, "runs": runs, "median_MBps": figures,
              "ratios": ratios}
    print(json.dumps({"median_MBps": figures, "ratios": ratios}, indent=2))
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
