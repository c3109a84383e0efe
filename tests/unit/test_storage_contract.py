"""The ``Storage`` contract (``easyckpt_wire.storage.base``), the same cases against every implementation.

Each implementation registers a factory in ``IMPLEMENTATIONS`` (today POSIX; the object store of issue 26
adds its own, started against a real server) and the expression that opens the same storage in a child
process, for the cases where a writer is killed with SIGKILL at a seeded point. No mocks: real files, real
processes.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import s3server
from conftest import ROOT, seeded_random

from easyckpt_wire import layout
from easyckpt_wire.savedir import AuditLog
from easyckpt_wire.storage import PosixStorage, Storage, open_storage
from easyckpt_wire.storage.s3 import APPEND_RACE

FINAL = "iteration_0000100"


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    make: Callable[[Path], Storage]                 # a new, empty storage for one test
    reopen: Callable[[Storage], str]                # Python expression opening the same storage in a child
    renames: bool = True                            # False: files go to their final keys, the commit object decides


def _posix(tmp: Path) -> Storage:
    root = tmp / "save"
    root.mkdir()
    return PosixStorage(root)


def _s3(tmp: Path) -> Storage:
    """A new bucket on a real S3 server (moto's server mode, its own process on 127.0.0.1), over HTTP."""
    s3server.server()
    return open_storage(f"s3://{s3server.bucket()}/run/a")


IMPLEMENTATIONS = [
    Implementation("posix", _posix, lambda store: f"PosixStorage({store.where()!r})"),
    Implementation("s3", _s3, lambda store: f"__import__('easyckpt_wire.storage').storage.open_storage({store.where()!r})",
                   renames=False),
]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda impl: impl.name)
def impl(request: pytest.FixtureRequest) -> Implementation:
    return request.param


@pytest.fixture
def store(impl: Implementation, tmp_path: Path) -> Storage:
    return impl.make(tmp_path)


def _write(pending, name: str, parts: list[bytes]) -> bytes:  # type: ignore[no-untyped-def]
    writer = pending.create(name)
    for part in parts:
        writer.write(memoryview(part))
    writer.close()
    return b"".join(parts)


def _visible(store: Storage) -> list[int]:
    return [step for step, _ in layout.complete(store)]


def _marker(step: int) -> bytes:
    return (f'{{"format": "{layout.METADATA_FORMAT}", "format_version": {layout.METADATA_VERSION}, '
            f'"step": {step}}}').encode()


# reading and small files --------------------------------------------------------------------------------
def test_a_missing_key_is_file_not_found_naming_it(store: Storage) -> None:
    for call in (store.read, store.size, store.open):
        with pytest.raises(FileNotFoundError) as caught:
            call("nothing/here")
        assert caught.value.errno == errno.ENOENT and caught.value.filename == store.where("nothing/here")
    assert not store.exists("nothing") and not store.is_dir("nothing") and store.entries("nothing") == []


def test_a_key_that_leaves_the_root_is_refused(store: Storage) -> None:
    for key in ("../outside", "a/../../b", "/etc/passwd"):
        with pytest.raises(ValueError, match="stay under"):
            store.read(key)


def test_put_replaces_whole_and_entries_list_by_prefix(store: Storage) -> None:
    store.put("small.txt", b"one")
    store.put("small.txt", b"two, longer")
    assert store.read("small.txt") == b"two, longer" and store.size("small.txt") == 11
    store.make_dir("sub")
    with pytest.raises(FileExistsError):
        store.make_dir("sub")
    store.put("sub/b", b"bb")
    store.put("sub/a", b"a")
    assert [(e.name, e.is_dir) for e in store.entries()] == [("small.txt", False), ("sub", True)]
    assert [(e.name, e.size) for e in store.entries("sub", sizes=True)] == [("a", 1), ("b", 2)]
    assert store.exists("sub/a") and store.is_dir("sub") and not store.exists("sub")


def test_a_reader_of_a_put_sees_the_old_or_the_new_content(store: Storage) -> None:
    """Atomic replace (the tracker, the health index): a reader racing the writer never sees a mix."""
    old, new = b"a" * 100_000, b"b" * 150_000
    store.put("tracker", old)
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = store.read("tracker")
            seen.add(data[:1] + bytes([len(data) == len(old)]) + bytes([len(set(data)) == 1]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            store.put("tracker", new if i % 2 == 0 else old)
    finally:
        stop.set()
        reader.join(30)
    assert seen <= {b"a\x01\x01", b"b\x00\x01"}, seen


def test_append_adds_lines_durably(store: Storage) -> None:
    for i in range(3):
        store.append("audit.log", f"line {i}\n".encode())
    assert store.read("audit.log").decode().splitlines() == ["line 0", "line 1", "line 2"]


def test_every_nodes_audit_lines_land_whole_in_order_and_nodes_never_race(store: Storage) -> None:
    """Every node records its part of a multi-node persist at the same moment, while the leader records its
    own lines. Each node's lines land whole and in order, the leader's in the main log; where an append rewrites
    the object, each node appends to its own log, so no append loses a race to another node's (in one object,
    the appends of N nodes cost O(N^2) requests per persist)."""
    nodes, ops = 12, ("write-begin", "write", "delete")
    audit = AuditLog(store)
    tally = getattr(store, "tally", None)
    races_before = tally.snapshot()[APPEND_RACE] if tally is not None else 0
    barrier = threading.Barrier(nodes + 1, timeout=60)
    errors: list[BaseException] = []

    def node(i: int) -> None:
        try:
            barrier.wait()
            for op in ops:
                audit.record(op, f"stage/node{i}", step=100, node=f"node{i}")
        except BaseException as exc:   # noqa: BLE001 (reported by the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(nodes)]
    for thread in threads:
        thread.start()
    barrier.wait()
    audit.record("tracker", store.where(layout.TRACKER), step=100)
    for thread in threads:
        thread.join(120)
    assert not errors and not any(thread.is_alive() for thread in threads), errors

    def lines(key: str) -> list[dict]:
        return [json.loads(line) for line in store.read(key).decode().splitlines()]

    main = lines(layout.AUDIT_LOG)
    assert [row["op"] for row in main if "node" not in row] == ["tracker"], main
    for i in range(nodes):
        own = main if store.shared_appends else lines(layout.node_audit_log(f"node{i}"))
        assert [row["op"] for row in own if row.get("node") == f"node{i}"] == list(ops), (i, own)
    if not store.shared_appends:
        assert not [row for row in main if "node" in row], "a node's line in the log every node would race for"
        assert tally is not None and tally.snapshot()[APPEND_RACE] == races_before, tally.snapshot()


def test_a_reader_gives_views_of_ranges(store: Storage) -> None:
    pending = store.begin(FINAL)
    data = _write(pending, "blob", [bytes(range(256)) * 64])
    pending.seal(layout.METADATA, _marker(100))
    pending.publish()
    with store.open(f"{FINAL}/blob") as reader:
        assert reader.size == len(data) and reader.where == store.where(f"{FINAL}/blob")
        with reader.view(1000, 300) as part:
            assert bytes(part) == data[1000:1300]
        with pytest.raises(EOFError):
            reader.view(len(data) - 10, 11)
    free = store.free_bytes()
    assert free is None or free > 0


# an iteration: visible only through its commit, written last --------------------------------------------
def test_an_iteration_is_visible_only_once_published(impl: Implementation, store: Storage) -> None:
    pending = store.begin(FINAL)
    page = bytearray(8192)            # a page-aligned size at a page-aligned offset, then an odd tail
    page[:5] = b"hello"
    parts = [bytes(page), os.urandom(4096 * 3), b"tail-of-odd-size"]
    data = _write(pending, "easyckpt-model-0000000-0000001.safetensors", parts)
    pending.put(layout.COMMON, b"{}")
    assert _visible(store) == [] and (not impl.renames or not store.is_dir(FINAL))
    pending.seal(layout.METADATA, _marker(100))
    assert _visible(store) == [], "sealed is not published"
    assert pending.publish() is None
    assert _visible(store) == [100] and store.read(f"{FINAL}/easyckpt-model-0000000-0000001.safetensors") == data
    assert not pending.exists(), "nothing of the pending copy is left once it is published"


def test_a_publish_replaces_an_older_copy_in_one_step(store: Storage) -> None:
    first = store.begin(FINAL)
    _write(first, "f", [b"old"])
    first.seal(layout.METADATA, _marker(100))
    first.publish()
    second = store.begin(FINAL)
    _write(second, "f", [b"new"])
    second.seal(layout.METADATA, _marker(100))
    old = second.publish()
    assert store.read(f"{FINAL}/f") == b"new" and _visible(store) == [100]
    if old is not None:
        store.delete_tree(old)
    assert [e.name for e in store.entries() if e.name != FINAL] == []


def test_discard_and_abort_leave_nothing(store: Storage) -> None:
    pending = store.begin(FINAL)
    _write(pending, "kept-until-discard", [b"x" * 5000])
    writer = pending.create("aborted")
    writer.write(b"partial")
    writer.abort()
    writer.abort()   # idempotent
    assert "aborted" not in pending.names() and "kept-until-discard" in pending.names()
    with pytest.raises(FileExistsError):
        pending.create("kept-until-discard")
    pending.discard()
    pending.discard()
    assert not pending.exists() and store.entries() == [] and _visible(store) == []


def test_begin_again_starts_empty(store: Storage) -> None:
    first = store.begin(FINAL)
    _write(first, "a", [b"a"])
    again = store.begin(FINAL)
    assert again.names() == []


def test_a_stage_is_shared_by_writers_and_reading_it_creates_nothing(store: Storage) -> None:
    reader = store.stage(FINAL)
    assert reader.names() == [] and not reader.exists() and store.stages() == [] and store.entries() == []
    node_a, node_b = store.stage(FINAL), store.stage(FINAL)
    _write(node_a, "easyckpt-model-0000000-0000002.safetensors", [b"a" * 10])
    node_a.put("node-a.json", b'{"node": "a"}', atomic=True)
    _write(node_b, "easyckpt-model-0000001-0000002.safetensors", [b"b" * 10])
    node_b.put("node-b.json", b'{"node": "b"}', atomic=True)
    assert store.stages() == [FINAL] and _visible(store) == []
    leader = store.stage(FINAL)
    notes = [n for n in leader.names() if layout.NODE_FILE_RE.match(n)]
    assert notes == ["node-a.json", "node-b.json"] and leader.read("node-b.json") == b'{"node": "b"}'
    for name in notes:
        leader.delete(name)
        leader.delete(name)   # idempotent
    leader.seal(layout.METADATA, _marker(100))
    leader.publish()
    assert _visible(store) == [100] and store.stages() == []
    assert sorted(e.name for e in store.entries(FINAL)) == [
        "easyckpt-model-0000000-0000002.safetensors", "easyckpt-model-0000001-0000002.safetensors", layout.METADATA]


def _publish(store: Storage, step: int, key: str | None = None) -> str:
    pending = store.begin(key or layout.iteration_dirname(step))
    _write(pending, "f", [str(step).encode()])
    pending.seal(layout.METADATA, _marker(step))
    pending.publish()
    return pending.final


def test_move_keeps_an_iteration_whole_at_its_new_key(store: Storage) -> None:
    keys = [_publish(store, step) for step in (30, 40)]
    store.make_dir(".abandoned-x")
    store.move([(key, f".abandoned-x/{key}") for key in keys])
    assert _visible(store) == []
    assert [(s, k, c) for s, k, c in layout.iterations(store, ".abandoned-x")] == [
        (30, ".abandoned-x/iteration_0000030", True), (40, ".abandoned-x/iteration_0000040", True)]
    assert store.read(".abandoned-x/iteration_0000040/f") == b"40"


def test_retire_makes_a_tree_vanish_at_once_and_deletes_are_idempotent(store: Storage) -> None:
    key = _publish(store, 10)
    store.make_dir(".abandoned-x")
    store.move([(key, f".abandoned-x/{key}")])
    _publish(store, 10)                     # the new timeline's step 10: two trees of one name
    gone = [store.retire(f".abandoned-x/{key}"), store.retire(key)]
    assert len(set(gone)) == 2 and _visible(store) == [] and layout.iterations(store, ".abandoned-x") == []
    for leftover in gone:
        store.delete_tree(leftover)
        store.delete_tree(leftover)
    store.delete("never-there")
    store.delete_tree("never-there")
    assert [e.name for e in store.entries()] == [".abandoned-x"]


# a writer killed at a seeded point (kill -9) ---------------------------------------------------------------
_CHILD = """
import os, signal, sys
from easyckpt_wire.storage import PosixStorage
store = {reopen}
kill_after = int(sys.argv[1])
pending = store.begin("{final}")
done = 0
for name in ("easyckpt-model-0000000-0000001.safetensors", "easyckpt-opt-0000000-0000001.safetensors"):
    writer = pending.create(name)
    for part in range(4):
        if done == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        writer.write(bytes([part]) * 70000)
        done += 1
    writer.close()
if done == kill_after:
    os.kill(os.getpid(), signal.SIGKILL)
pending.seal("metadata.json", {marker!r})
if kill_after == 9:
    os.kill(os.getpid(), signal.SIGKILL)
pending.publish()
print("published", flush=True)
"""


def test_a_writer_killed_at_any_point_leaves_nothing_a_load_takes(impl: Implementation, store: Storage) -> None:
    """Killed (SIGKILL) after a seeded number of parts, sealed or not: no iteration is visible, ``leftovers``
    names what the dead writer left, settling it leaves the storage empty, and a new persist works."""
    rng = seeded_random()
    for kill_after in sorted({rng.randrange(0, 10), 9, 0}):
        code = _CHILD.format(reopen=impl.reopen(store), final=FINAL, marker=_marker(100))
        proc = subprocess.run([sys.executable, "-c", code, str(kill_after)], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == -signal.SIGKILL, (kill_after, proc.stdout, proc.stderr)
        assert _visible(store) == [] and store.stages() == []
        leftovers = store.leftovers()
        assert [lo.final for lo in leftovers] == [FINAL] and not leftovers[0].restore, (kill_after, leftovers)
        for leftover in leftovers:
            store.settle(leftover)
        assert store.entries() == [] and store.leftovers() == []
    _publish(store, 100)
    assert _visible(store) == [100] and store.leftovers() == []


_LIVE = """
import sys
from easyckpt_wire.storage import PosixStorage
store = {reopen}
pending = store.begin("{final}")
pending.create("f").write(b"in progress")
print("ready", flush=True)
sys.stdin.read()   # alive until the test closes stdin
"""


def test_a_live_writers_pending_copy_is_no_leftover(impl: Implementation, store: Storage) -> None:
    """Another process's persist in progress is never a leftover; once that process is gone, it is."""
    code = _LIVE.format(reopen=impl.reopen(store), final=FINAL)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert store.leftovers() == [] and _visible(store) == []
    finally:
        child.communicate(timeout=60)
    assert [lo.final for lo in store.leftovers()] == [FINAL]


def test_open_storage_takes_a_path_or_a_storage_and_refuses_unknown_schemes(store: Storage, tmp_path: Path) -> None:
    assert open_storage(store) is store
    assert isinstance(open_storage(tmp_path), PosixStorage) and isinstance(open_storage(str(tmp_path)), PosixStorage)
    with pytest.raises(ValueError, match="gs:// scheme has no storage implementation here"):
        open_storage("gs://bucket/run")
