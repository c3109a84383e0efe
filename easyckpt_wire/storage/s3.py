"""The object-store implementation of ``Storage``: a save_dir at ``s3://bucket/prefix`` on S3 or any
S3-compatible server (MinIO, Ceph, OSS, GCS's S3 API...), through the client of ``s3client``.

Keys map to object names under the prefix; a "directory" is a prefix with something under it (``make_dir``
stores an empty ``key/`` object so that a new, empty one exists). There is no rename, so an iteration is
written where it will stay and made visible by its commit object (the marker, ``metadata.json``), written
by ``publish`` after every rank file is complete (its multipart upload completed, every part's CRC32
checked by the server). Every reader ignores an iteration without it (``easyckpt_wire.layout.complete``).

Who writes: a pending iteration holds a lease object, ``<key>/.easyckpt-writer`` (host, pid, time; the
marker's name once sealed), from ``begin`` until ``publish`` or ``discard``; a multi-node stage holds
``<key>/.easyckpt-stage``. ``leftovers`` names the pending iterations whose writer is gone (dead pid on
this host; on another host, a lease older than ``LEASE_S``; in this process, a pending no longer in
progress), so a persist that dies half way leaves nothing a load takes, and the next persist or ``easyckpt
clean`` removes what it left. A step persisted again while a committed copy of it is in place is written
under ``.tmp-<final>-<pid>/`` and copied in by ``publish`` (server-side copies; the old marker is deleted
first), the only case that copies.

Deleting a tree deletes its marker first, so a reader never loads a half-deleted iteration; ``retire``
deletes at once (there is no trash to rename into). Incomplete multipart uploads under a deleted tree are
aborted, so a failed persist leaves no hidden parts billed either.
"""
from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil

from easyckpt_wire.storage.base import Entry, Leftover
from easyckpt_wire.storage.s3client import S3Settings, client_errors, os_error, shared_client
from easyckpt_wire.storage.s3io import Reader, Writer

logger = logging.getLogger(__name__)

COMMIT = "metadata.json"            # the commit object's name (``layout.METADATA``): what a delete removes first
LEASE = ".easyckpt-writer"
STAGE_LEASE = ".easyckpt-stage"
TMP_PREFIX, STAGE_PREFIX = ".tmp-", ".stage-"
LEASE_S = 24 * 3600.0               # a lease of another host is taken as a live writer's for this long
_COPY_MAX = 5 << 30                 # larger objects are copied in parts (``client.copy``)
_APPEND_TRIES = 50                  # an append that keeps losing the race to other writers gives up
APPEND_RACE = "append race"         # the tally's reason for an append written again after losing a race
_ACTIVE: set[str] = set()           # pending iterations in progress in this process (their lease is live)
_HOST = socket.gethostname()


class S3Storage:
    """``Storage`` over ``s3://bucket/prefix``; thread-safe (one client and one pool of part threads)."""

    shared_appends = False   # ``append`` reads and rewrites the object, conditional on nobody else having written
    append_segment_bytes = 4 << 20   # ``append`` sets an object this large aside and starts it again

    def __init__(self, bucket: str, prefix: str = "", *, settings: S3Settings | None = None) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.settings = settings or S3Settings.from_env()
        self.client, self.tally = shared_client(self.settings)
        self.endpoint = str(self.client.meta.endpoint_url)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.settings.threads, thread_name_prefix="s3")
        self._conditional = True   # the server takes If-Match / If-None-Match on PUT (S3 since 2024, MinIO, moto)

    def __repr__(self) -> str:
        return f"S3Storage({self.where()!r})"

    # names and calls -----------------------------------------------------------------------------------------
    def name(self, key: str) -> str:
        """The object name of ``key``; a key that would leave the prefix is refused (invariant 5)."""
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"storage key {key!r} must be relative to {self.where()} and stay under it")
        if not key:
            return self.prefix
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dir(self, key: str) -> str:
        name = self.name(key)
        return f"{name}/" if name else ""

    def where(self, key: str = "") -> str:
        name = self.name(key)
        return f"s3://{self.bucket}/{name}" if name else f"s3://{self.bucket}"

    def call(self, where: str, method: str, **kwargs: Any) -> Any:
        """One client call, its errors as the OSError naming ``where`` (after the client's own retries)."""
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except client_errors() as exc:
            raise os_error(exc, where, self.endpoint, self.settings.max_attempts) from None

    def check(self) -> None:
        """At start-up: the bucket exists and this process may write under the prefix. Raises the OSError naming
        the URL, the endpoint and the fix (a missing bucket, refused credentials, an unreachable server)."""
        try:
            self.call(self.where(), "head_bucket")
        except FileNotFoundError:
            fix = f"create it (aws s3 mb s3://{self.bucket} --endpoint-url {self.endpoint}), or fix the URL"
            raise FileNotFoundError(errno.ENOENT, f"the bucket {self.bucket!r} does not exist at {self.endpoint}: {fix}",
                                    self.where()) from None
        probe = f".easyckpt-write-test-{_HOST}-{os.getpid()}"
        self.put(probe, b"")
        self.delete(probe)

    # reading ---------------------------------------------------------------------------------------------------
    def _list(self, prefix: str, delimiter: bool) -> Iterator[dict[str, Any]]:
        token: dict[str, str] = {}
        while True:
            page = self.call(f"s3://{self.bucket}/{prefix.rstrip('/')}", "list_objects_v2", Prefix=prefix,
                             **({"Delimiter": "/"} if delimiter else {}), **token)
            yield page
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def entries(self, prefix: str = "", *, sizes: bool = False) -> list[Entry]:
        base = self._dir(prefix)
        found: dict[str, Entry] = {}
        for page in self._list(base, True):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(base):].rstrip("/")
                found[name] = Entry(name, True)
            for item in page.get("Contents", []):
                name = item["Key"][len(base):]
                if name and name not in found:   # "" is the empty directory object of ``make_dir``
                    found[name] = Entry(name, False, int(item["Size"]) if sizes else -1)
        return sorted(found.values(), key=lambda e: e.name)

    def _names_under(self, key: str) -> list[str]:
        """Every object name under ``key`` (recursively), and ``key``'s own if it is an object."""
        return [item["Key"] for page in self._list(self._dir(key), False) for item in page.get("Contents", [])]

    def exists(self, key: str) -> bool:
        try:
            self.call(self.where(key), "head_object", Key=self.name(key))
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, key: str) -> bool:
        page = self.call(self.where(key), "list_objects_v2", Prefix=self._dir(key), MaxKeys=1)
        return bool(page.get("KeyCount", 0))

    def size(self, key: str) -> int:
        return int(self.call(self.where(key), "head_object", Key=self.name(key))["ContentLength"])

    def read(self, key: str) -> bytes:
        return self._get(key)

    def _get(self, key: str, first: int | None = None, last: int | None = None) -> bytes:
        where = self.where(key)
        extra = {"Range": f"bytes={first}-{last}"} if first is not None else {}
        return self._body(self.call(where, "get_object", Key=self.name(key), **extra), where)

    def _body(self, reply: dict[str, Any], where: str) -> bytes:
        """A GET's body, read whole; a connection that drops while it streams is an OSError naming ``where``."""
        broken: tuple[type[BaseException], ...] = (*client_errors(), OSError)
        try:
            return bytes(reply["Body"].read())
        except broken as exc:
            raise os_error(exc, where, self.endpoint, 1) from None
        except Exception as exc:   # urllib3's ProtocolError and kin are not OSError
            raise ConnectionError(errno.ECONNRESET, f"the download broke off: {type(exc).__name__}: {exc}",
                                  where) from None

    def open(self, key: str) -> Reader:
        return Reader(self, key)

    def free_bytes(self) -> int | None:
        return None   # an object store does not say; the write itself fails cleanly if it must

    # writing ---------------------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self.call(self.where(key), "put_object", Key=self.name(key), Body=bytes(data))

    def append(self, key: str, data: bytes) -> None:
        """Objects are immutable: the object is read and written again with ``data`` at its end (the audit log),
        on condition that nobody wrote it meanwhile (``If-Match`` its ETag, ``If-None-Match`` when new); a writer
        that lost the race reads again. A server without conditional writes gets a plain PUT.

        An object that would grow past ``append_segment_bytes`` is first copied aside, server-side and on the same
        condition, to ``<key>.<UTC time>`` (names that sort in the order they were made), and starts again with
        ``data``: so an append never moves more than that, however long the job (an audit log grows about 1 KB
        a persist). The copy of a writer that then loses the race is deleted; one left by a writer that died
        between the copy and its write repeats lines that the object still has."""
        where, name = self.where(key), self.name(key)
        for _ in range(_APPEND_TRIES):
            try:
                reply = self.call(where, "get_object", Key=name)
                old, condition = self._body(reply, where), {"IfMatch": reply["ETag"]}
            except FileNotFoundError:
                old, condition = b"", {"IfNoneMatch": "*"}
            aside = None
            try:
                if old and len(old) + len(data) > self.append_segment_bytes and self._conditional:
                    aside = self._set_aside(key, condition["IfMatch"])
                    old = b""
                self.call(where, "put_object", Key=name, Body=old + bytes(data),
                          **(condition if self._conditional else {}))
                if aside is not None:
                    logger.info("%s passed %d bytes: its lines so far are now in %s, and it starts again", where,
                                self.append_segment_bytes, self.where(aside))
                return
            except FileExistsError:   # 412: another writer appended between our read and our write (or copy)
                self.tally.count(APPEND_RACE)
                if aside is not None:
                    self._drop_aside(aside)
                continue
            except OSError as exc:
                if aside is not None:
                    self._drop_aside(aside)
                if not self._conditional or exc.errno != errno.EIO:
                    raise
                logger.info("%s: conditional writes refused (%s): appending without them", where, exc)
                self._conditional = False
        raise OSError(errno.EAGAIN, f"another writer kept appending ({_APPEND_TRIES} tries)", where)

    def _drop_aside(self, aside: str) -> None:
        try:
            self.delete(aside)
        except OSError as exc:   # its lines are all in the object still: a repeat, not a loss
            logger.warning("%s: a copy set aside by an append that lost a race stays (its lines repeat the log's): "
                           "%s", self.where(aside), exc)

    def _set_aside(self, key: str, etag: str) -> str:
        """Copy ``key`` to a new ``<key>.<UTC time>`` if it is still the object of ``etag``; the copy's key."""
        now = time.time()
        aside = f"{key}.{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now * 1e6) % 1_000_000:06d}Z"
        self.call(self.where(aside), "copy_object", Key=self.name(aside), CopySourceIfMatch=etag,
                  CopySource={"Bucket": self.bucket, "Key": self.name(key)})
        return aside

    def make_dir(self, key: str) -> None:
        if self.is_dir(key) or self.exists(key):
            raise FileExistsError(errno.EEXIST, "it exists", self.where(key))
        self.call(self.where(key), "put_object", Key=self._dir(key), Body=b"")

    def begin(self, final: str) -> _Pending:
        key = final
        if self.exists(f"{final}/{COMMIT}"):   # a committed copy stays readable until publish replaces it
            key = f"{TMP_PREFIX}{final}-{os.getpid()}"
            self.delete_tree(key)
        else:
            self.delete_tree(final)            # a dead attempt's files
        return _Pending(self, final, key, shared=False)

    def stage(self, final: str) -> _Pending:
        scratch = f"{STAGE_PREFIX}{final}"
        key = scratch if self.is_dir(scratch) or self.exists(f"{final}/{COMMIT}") else final
        return _Pending(self, final, key, shared=True)

    def stages(self) -> list[str]:
        found = []
        for entry in self.entries():
            if not entry.is_dir:
                continue
            if entry.name.startswith(STAGE_PREFIX):
                found.append(entry.name[len(STAGE_PREFIX):])
            elif not entry.name.startswith(".") and self.exists(f"{entry.name}/{STAGE_LEASE}"):
                found.append(entry.name)
        return sorted(set(found))

    def copy(self, src: str, dst: str) -> None:
        """One object, server-side."""
        source = {"Bucket": self.bucket, "Key": self.name(src)}
        if self.size(src) <= _COPY_MAX:
            self.call(self.where(dst), "copy_object", Key=self.name(dst), CopySource=source)
            return
        try:
            self.client.copy(source, self.bucket, self.name(dst))
        except client_errors() as exc:
            raise os_error(exc, self.where(dst), self.endpoint, self.settings.max_attempts) from None

    def copy_tree(self, src: str, dst: str, *, skip: Callable[[str], bool] = lambda name: False) -> None:
        """Every object under ``src`` to the same name under ``dst``, the commit object last."""
        names = [n[len(self._dir(src)):] for n in self._names_under(src)]
        names = sorted((n for n in names if n and not skip(n)), key=lambda n: n == COMMIT)
        for future in [self.pool.submit(self.copy, f"{src}/{n}", f"{dst}/{n}") for n in names if n != COMMIT]:
            future.result()
        if COMMIT in names:
            self.copy(f"{src}/{COMMIT}", f"{dst}/{COMMIT}")

    def move(self, moves: Sequence[tuple[str, str]]) -> None:
        """Copy, then delete (the commit object is copied last and deleted first: complete at one key at least)."""
        for src, dst in moves:
            self.copy_tree(src, dst)
            self.delete_tree(src)

    def retire(self, key: str) -> str:
        """Delete at once (the commit object first); returns ``key``, already gone."""
        self.delete_tree(key)
        return key

    def delete(self, key: str) -> None:
        self.call(self.where(key), "delete_object", Key=self.name(key))

    def delete_tree(self, key: str, *, best_effort: bool = False) -> None:
        try:
            self._delete_tree(key)
        except OSError as exc:
            if not best_effort:
                raise
            logger.warning("could not delete all of %s: %s", self.where(key), exc)

    def _delete_tree(self, key: str) -> None:
        base = self._dir(key)
        names = self._names_under(key) + ([self.name(key)] if key and self.exists(key) else [])
        commit = f"{base}{COMMIT}"
        if commit in names:   # first: no reader takes the iteration from here on
            self.delete(f"{key}/{COMMIT}")
            names.remove(commit)
        for start in range(0, len(names), 1000):
            batch = [{"Key": name} for name in names[start:start + 1000]]
            reply = self.call(self.where(key), "delete_objects", Delete={"Objects": batch, "Quiet": True})
            if reply.get("Errors"):
                error = reply["Errors"][0]
                raise OSError(5, f"{error.get('Code')}: {error.get('Message')}", f"s3://{self.bucket}/{error.get('Key')}")
        uploads = self.call(self.where(key), "list_multipart_uploads", Prefix=base).get("Uploads", [])
        for upload in uploads:
            self.call(self.where(key), "abort_multipart_upload", Key=upload["Key"], UploadId=upload["UploadId"])

    def _lease(self, key: str) -> dict[str, Any] | None:
        try:
            lease = json.loads(self.read(f"{key}/{LEASE}"))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"final": key, "host": "?", "pid": 0, "time": 0.0}
        return lease if isinstance(lease, dict) else None

    def _alive(self, key: str, lease: dict[str, Any]) -> bool:
        if lease.get("host") != _HOST:
            return time.time() - float(lease.get("time", 0.0)) < LEASE_S
        pid = int(lease.get("pid", 0))
        if pid == os.getpid():
            return self.where(key) in _ACTIVE
        return pid > 0 and psutil.pid_exists(pid)

    def leftovers(self) -> list[Leftover]:
        found = []
        for entry in self.entries():
            if not entry.is_dir or entry.name.startswith(STAGE_PREFIX):
                continue   # stages are the multi-node protocol's to drop
            lease = self._lease(entry.name)
            if lease is None or self._alive(entry.name, lease):
                continue
            final = str(lease.get("final", entry.name))
            found.append(Leftover(entry.name, final, False, f"leftover of a dead writer (host {lease.get('host')}, pid "
                                  f"{lease.get('pid')}): it never published"))
        return found

    def settle(self, leftover: Leftover) -> None:
        if leftover.key == leftover.final and self.exists(f"{leftover.key}/{COMMIT}"):
            self.delete(f"{leftover.key}/{LEASE}")   # it did publish, then died before removing its lease
            return
        self.delete_tree(leftover.key)


class _Pending:
    """An iteration written in place (or, replacing a committed copy, under a scratch prefix), published by its
    commit object; it holds a lease object from its first write until publish or discard."""

    def __init__(self, store: S3Storage, final: str, key: str, *, shared: bool) -> None:
        self.store, self.final, self.key, self.shared = store, final, key, shared
        self.where = store.where(key)
        self._lease_name = STAGE_LEASE if shared else LEASE
        self._leased = False
        self._marker: tuple[str, bytes] | None = None
        self._published = False
        self._left = False        # a discard that failed (the server gone): something is left, known without asking
        self._retries = store.tally.snapshot()
        self._lock = threading.Lock()
        if not shared:
            self._take_lease()

    def _take_lease(self, marker: str | None = None) -> None:
        with self._lock:
            if self._leased and marker is None:
                return
            _ACTIVE.add(self.where)
            lease = {"final": self.final, "host": _HOST, "pid": os.getpid(), "time": time.time(), "marker": marker}
            self.store.put(f"{self.key}/{self._lease_name}", json.dumps(lease).encode())
            self._leased = True

    def create(self, name: str) -> Writer:
        self._take_lease()
        if self.store.exists(f"{self.key}/{name}"):
            where = self.store.where(f"{self.key}/{name}")
            raise FileExistsError(errno.EEXIST, "it exists in this pending iteration", where)
        return Writer(self.store, f"{self.key}/{name}")

    def put(self, name: str, data: bytes, *, atomic: bool = False) -> None:
        self._take_lease()
        self.store.put(f"{self.key}/{name}", data)   # a PUT is atomic: a reader sees all of it or nothing

    def names(self) -> list[str]:
        return [e.name for e in self.store.entries(self.key) if not e.is_dir and e.name not in (LEASE, STAGE_LEASE)]

    def exists(self) -> bool:
        if self._published:
            return False
        if self._left:
            return True
        try:
            return self.store.is_dir(self.key)
        except OSError:
            return True   # the server does not answer: something may be there (the next persist removes it)

    def read(self, name: str) -> bytes:
        return self.store.read(f"{self.key}/{name}")

    def delete(self, name: str) -> None:
        self.store.delete(f"{self.key}/{name}")

    def seal(self, marker: str, data: bytes) -> None:
        """Kept for ``publish``: on an object store the commit object is what publishing is. The lease learns
        the marker's name (a writer that dies after publishing leaves only its lease to remove)."""
        self._marker = (marker, bytes(data))
        self._take_lease(marker)

    def publish(self) -> str | None:
        if self._marker is None:
            raise RuntimeError(f"{self.where}: publish before seal")
        marker, data = self._marker
        store = self.store
        if self.key != self.final:   # replacing a committed copy: the old one stops being readable first
            store.delete(f"{self.final}/{marker}")
            old = {e.name for e in store.entries(self.final) if not e.is_dir}
            new = set(self.names())
            store.copy_tree(self.key, self.final, skip=lambda n: n in (LEASE, STAGE_LEASE, marker))
            for name in old - new:
                store.delete(f"{self.final}/{name}")
        store.put(f"{self.final}/{marker}", data)
        self._published = True
        self._end()
        if self.key != self.final:
            store.delete_tree(self.key, best_effort=True)
        else:
            store.delete(f"{self.key}/{self._lease_name}")
        return None

    def discard(self) -> None:
        if self._published:
            return
        try:
            self.store.delete_tree(self.key)
        except OSError as exc:
            self._left = True
            logger.warning("could not remove %s (%s): it is a leftover the next persist or `easyckpt clean` removes",
                           self.where, exc)
        finally:
            self._end()

    def _end(self) -> None:
        _ACTIVE.discard(self.where)
        retried = self.store.tally.snapshot()
        retried.subtract(self._retries)
        reasons = ", ".join(f"{reason} x{n}" for reason, n in sorted(retried.items()) if n > 0)
        logger.info("%s: %d requests retried during this persist%s", self.where, sum(retried.values()),
                    f" ({reasons})" if reasons else "")
