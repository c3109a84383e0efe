"""What only the object-store implementation has (the shared contract is in test_storage_contract.py): URL
parsing, multipart uploads with checksums, ranged reads, the commit object of a replaced step, leases, and
errors naming the URL and the fix. Against a real S3 server process (moto's server mode on 127.0.0.1,
``tests/s3server.py``), over HTTP.
"""
from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import s3server
from conftest import s3_endpoint_down

from easyckpt import config
from easyckpt_wire import layout
from easyckpt_wire.storage import StorageURL, UnsupportedLocation, as_path, location, open_storage, s3, url
from easyckpt_wire.storage.s3client import S3Settings


@pytest.fixture
def store() -> s3.S3Storage:
    s3server.server()
    return s3.S3Storage(s3server.bucket(), "runs/x", settings=S3Settings(part_bytes=5 << 20, threads=4))


def test_urls_are_parsed_once_and_other_schemes_refused_naming_the_ones_that_work() -> None:
    assert url.split_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b") and url.split_url("/x/y") is None
    assert url.split_url("file:///x/y") is None and str(location("file:///tmp/x")) == "/tmp/x"
    where = location("s3://my-bucket/runs/a")
    assert isinstance(where, StorageURL) and str(where) == "s3://my-bucket/runs/a"
    assert str(where / "iteration_0000100") == "s3://my-bucket/runs/a/iteration_0000100"
    assert (where / "iteration_0000100").name == "iteration_0000100" and where.parent == as_path("s3://my-bucket/runs")
    for bad, why in (("gs://b/p", "gs:// scheme"), ("hdfs://nn/p", "hdfs:// scheme"), ("file://host/p", "file:// scheme"),
                     ("s3://Bad_Bucket/p", "not a valid bucket name"), ("s3://bucket/a/../b", "'..' part")):
        with pytest.raises(UnsupportedLocation, match=why) as caught:
            location(bad)
        assert bad in str(caught.value)
    with pytest.raises(UnsupportedLocation, match="a POSIX path or s3://bucket/prefix"):
        open_storage("gs://b/p")


def test_a_url_that_lost_its_slashes_is_refused_not_taken_for_a_local_folder(tmp_path: Path) -> None:
    """``Path("s3://b/p")`` is ``s3:/b/p``: taken as a path it would become a folder named ``s3:`` in the working
    directory. The error names the URL it looks like; a path that only contains such a part stays a path."""
    for bad, fixed in ((str(Path("s3://my-bucket/run")), "s3://my-bucket/run"), ("s3:my-bucket", "s3://my-bucket"),
                       ("file:/tmp/x", "file:///tmp/x"), ("GS:/b/p", "gs://b/p")):
        with pytest.raises(UnsupportedLocation, match="with its '//' lost") as caught:
            location(bad)
        assert fixed in str(caught.value) and bad in str(caught.value)
    assert location(tmp_path / "s3:" / "run") == tmp_path / "s3:" / "run"


def test_a_large_file_is_a_multipart_upload_read_back_by_ranges(store: s3.S3Storage) -> None:
    pending = store.begin("iteration_0000007")
    data = os.urandom(13 << 20)
    writer = pending.create("big")
    head = memoryview(data)[:4096]
    writer.write(head)                        # a small first part (a safetensors header) joins the next one
    for start in range(4096, len(data), 4 << 20):
        writer.write(memoryview(data)[start:start + (4 << 20)])
    writer.close()
    reply = store.client.head_object(Bucket=store.bucket, Key=store.name("iteration_0000007/big"), PartNumber=1)
    # parts of at least 5 MiB from the caller's writes: 4 KiB + 4 MiB + 4 MiB, then 4 MiB + the rest at close
    assert reply["PartsCount"] == 2, reply
    assert store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
    with store.open("iteration_0000007/big") as reader:
        assert bytes(reader.view(0, 8)) == data[:8]
        assert bytes(reader.view(12 << 20, 4096)) == data[12 << 20:(12 << 20) + 4096]
        assert bytes(reader.view(0, len(data))) == data
    pending.discard()
    assert store.entries() == []


def test_an_aborted_multipart_upload_leaves_no_parts(store: s3.S3Storage) -> None:
    pending = store.begin("iteration_0000008")
    writer = pending.create("big")
    writer.write(os.urandom(6 << 20))         # one part uploaded
    writer.abort()
    assert store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
    assert pending.names() == []


def _appended(store: s3.S3Storage, key: str) -> tuple[list[str], list[str]]:
    """(every line appended to ``key``, in the copies set aside oldest first, then the object; the copies' keys)."""
    asides = sorted(e.name for e in store.entries() if e.name.startswith(f"{key}."))
    lines = [line for name in (*asides, key) for line in store.read(name).decode().splitlines()]
    return lines, asides


@pytest.mark.parametrize("segment", [None, 300], ids=["one-object", "set-aside-past-300-bytes"])
def test_appends_of_writers_at_the_same_moment_lose_no_line(store: s3.S3Storage, segment: int | None) -> None:
    """The main audit log of a multi-node job: writers at the same moment (a leader's threads, every node's agent at
    start-up). With a small segment the object is set aside many times under the race: still every line once,
    in each writer's order, and the object never grows past the segment."""
    import threading

    if segment is not None:
        store.append_segment_bytes = segment

    def append(writer: int) -> None:
        for line in range(8):
            store.append("audit.log", f"{writer}-{line} {'x' * 40}\n".encode())

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    lines, asides = _appended(store, "audit.log")
    lines = [line.split()[0] for line in lines]
    assert sorted(lines) == sorted(f"{w}-{n}" for w in range(4) for n in range(8)), lines
    for writer in range(4):
        assert [x for x in lines if x.startswith(f"{writer}-")] == [f"{writer}-{n}" for n in range(8)], "order kept"
    assert bool(asides) == (segment is not None), asides
    if segment is not None:
        assert store.size("audit.log") <= segment and all(store.size(name) <= segment for name in asides)


def test_an_append_moves_at_most_a_segment_however_long_the_log(store: s3.S3Storage,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """An object-store append reads and writes the whole object: past ``append_segment_bytes`` the lines so far are
    set aside (``<key>.<UTC time>``, sorting in order) and the object starts again, said once each time."""
    store.append_segment_bytes = 1000
    written = [json.dumps({"op": "write", "step": step, "pad": "y" * 60}) for step in range(60)]
    with caplog.at_level(logging.INFO, logger="easyckpt_wire.storage.s3"):
        for line in written:
            store.append(layout.AUDIT_LOG, (line + "\n").encode())
    lines, asides = _appended(store, layout.AUDIT_LOG)
    assert lines == written
    assert len(asides) >= 4 and store.size(layout.AUDIT_LOG) <= 1000, asides
    said = [r.getMessage() for r in caplog.records if "starts again" in r.getMessage()]
    assert len(said) == len(asides) and all(store.where(name) in said[i] for i, name in enumerate(asides)), said


def test_a_step_persisted_again_stays_readable_until_its_new_commit_object(store: s3.S3Storage) -> None:
    first = store.begin("iteration_0000010")
    first.put("f", b"old")
    first.put("only-old", b"x")
    first.seal(layout.METADATA, b'{"n": 1}')
    first.publish()
    again = store.begin("iteration_0000010")
    assert again.key.startswith(".tmp-iteration_0000010-"), "a committed copy is not written over"
    again.put("f", b"new")
    again.seal(layout.METADATA, b'{"n": 2}')
    assert store.read("iteration_0000010/f") == b"old" and store.read("iteration_0000010/metadata.json") == b'{"n": 1}'
    assert again.publish() is None
    assert [e.name for e in store.entries("iteration_0000010")] == ["f", layout.METADATA]
    assert store.read("iteration_0000010/f") == b"new" and [e.name for e in store.entries()] == ["iteration_0000010"]


def test_a_pending_iteration_holds_a_lease_until_published(store: s3.S3Storage) -> None:
    pending = store.begin("iteration_0000020")
    pending.put("f", b"x")
    assert store.exists(f"iteration_0000020/{s3.LEASE}") and store.leftovers() == []
    assert s3.LEASE not in pending.names()
    pending.seal(layout.METADATA, b"{}")
    pending.publish()
    assert not store.exists(f"iteration_0000020/{s3.LEASE}")
    dead = store.begin("iteration_0000030")
    dead.put("f", b"x")
    s3._ACTIVE.discard(dead.where)           # as if this process's persist had ended without removing it
    assert [lo.key for lo in store.leftovers()] == ["iteration_0000030"]


def test_errors_are_os_errors_naming_the_url_and_the_fix(store: s3.S3Storage) -> None:
    missing = s3.S3Storage("no-such-bucket-x", "p")
    with pytest.raises(FileNotFoundError) as caught:
        missing.check()
    assert caught.value.errno == errno.ENOENT and caught.value.filename == "s3://no-such-bucket-x/p"
    assert "create it" in str(caught.value) and "aws s3 mb s3://no-such-bucket-x" in str(caught.value)
    with pytest.raises(FileNotFoundError) as gone:
        store.read("nothing")
    assert gone.value.filename == store.where("nothing")
    store.check()   # the bucket is there and writable: no error, nothing left
    assert store.entries() == []



def test_a_restarted_worker_goes_on_when_the_store_is_unreachable_but_never_when_the_bucket_is_missing(
        store: s3.S3Storage, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    """Start-up's check of an s3:// save_dir (``config.check_object_store``): an unreachable store stops a first
    start (a wrong endpoint looks the same), but torchrun's restart of workers whose store answered before goes
    on, saying so, to resume from memory; a missing bucket stops a restart as well. A restart torchrun does not
    count (workers restarted because another node's failed: the soak's 2-node outage, seed 5, fault 7) is known
    by this node's memory holding the job's snapshots (``resuming``)."""
    s3_endpoint_down(monkeypatch)
    url_down = location(f"s3://{store.bucket}/runs/x")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(ConnectionError, match=f"save_dir {url_down} cannot be used .*AWS_ENDPOINT_URL_S3"):
        config.check_writable(url_down)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with caplog.at_level(logging.WARNING, logger="easyckpt.config"):
        config.check_writable(url_down)
    assert f"save_dir {url_down} cannot be reached now" in caplog.text and "restart 2 of this job's workers" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="easyckpt.config"):
        config.check_writable(url_down, resuming=True)
    assert "this node's memory holds its snapshots" in caplog.text, caplog.text
    settings = {"save_dir": url_down, "save_mem_interval": 1, "save_storage_interval": 2, "max_ckpt_num": 2,
                "job_id": "j7", "shm_dir": tmp_path}
    with pytest.raises(ConnectionError, match="cannot be used"):   # the shm holds nothing of job j7: a first start
        config.CheckpointerConfig(**settings)
    (tmp_path / "easyckpt-j7-r000001-s2").write_bytes(b"")   # a slot a worker of this job left on this node
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="easyckpt.config"):
        config.CheckpointerConfig(**settings)
    assert "this node's memory holds its snapshots" in caplog.text, caplog.text
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3server.server().url)
    with pytest.raises(FileNotFoundError, match="create it"):
        config.check_writable(location("s3://no-such-bucket-x/p"))


def test_easyckpt_clean_removes_a_dead_writers_iteration_and_status_reads_the_bucket(store: s3.S3Storage, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from conftest import ROOT

    kept = store.begin("iteration_0000040")
    kept.put("f", b"x")
    kept.seal(layout.METADATA, json.dumps({"format": layout.METADATA_FORMAT, "format_version": layout.METADATA_VERSION,
                                           "step": 40, "world_size": 1, "ranks": {}}).encode())
    kept.publish()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EASYCKPT_RUNTIME_DIR": str(tmp_path), "EASYCKPT_SHM_DIR": str(tmp_path)}
    writer = ("import sys; from easyckpt_wire.storage import open_storage; p = open_storage(sys.argv[1])"
              ".begin('iteration_0000050'); p.put('easyckpt-model-0000000-0000001.safetensors', b'partial')")
    subprocess.run([sys.executable, "-c", writer, store.where()], check=True, timeout=120, env=env)   # then it is gone
    done = subprocess.run([sys.executable, "-m", "easyckpt.cli", "clean", store.where()], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"removed {store.where('iteration_0000050')}" in done.stdout, done.stdout
    assert [e.name for e in store.entries() if e.is_dir] == ["iteration_0000040"]
    assert '"op": "delete"' in store.read(layout.AUDIT_LOG).decode()
    status = subprocess.run([sys.executable, "-m", "easyckpt.cli", "status", store.where()], capture_output=True,
                            text=True, timeout=120, env=env)
    assert status.returncode == 0 and f"on disk in {store.where()}: 1 complete iteration(s), steps 40" in status.stdout, (
        status.stdout + status.stderr)
