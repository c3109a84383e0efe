"""The byte path of ``S3Storage`` (``easyckpt_wire.storage.s3``): a stored object read by ranges, and a new one
written in parts (one PUT when small, else a multipart upload with parallel parts, each checksummed)."""
from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from easyckpt_wire.storage.s3 import S3Storage

logger = logging.getLogger(__name__)

_HEAD = 1 << 20                     # a reader's first GET: the safetensors header and small files whole


class Reader:
    """A stored object read by ranges: the first MiB at once (a safetensors header, a small file whole), and on
    the first range beyond it the whole object, as parallel ranged GETs; views are of that copy."""

    def __init__(self, store: S3Storage, key: str) -> None:
        self.store, self.key = store, key
        self.where = store.where(key)
        self.size = store.size(key)
        self._head: bytes | None = None
        self._all: bytearray | None = None

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise EOFError(f"{self.where}: bytes {offset}-{offset + length} are beyond its end ({self.size} bytes)")
        if length == 0:
            return memoryview(b"")
        if self._all is None and offset + length <= _HEAD:
            if self._head is None:
                self._head = self.store._get(self.key, 0, min(self.size, _HEAD) - 1)
            return memoryview(self._head)[offset:offset + length]
        if self._all is None:
            self._all = self._fetch()
        return memoryview(self._all)[offset:offset + length]

    def _fetch(self) -> bytearray:
        whole = bytearray(self.size)
        step = self.store.settings.part_bytes

        def one(first: int) -> None:
            last = min(self.size, first + step) - 1
            whole[first:last + 1] = self.store._get(self.key, first, last)

        for future in [self.store.pool.submit(one, first) for first in range(0, self.size, step)]:
            future.result()
        return whole

    def close(self) -> None:
        self._head = None
        self._all = None   # views still held keep their bytes alive (a memoryview holds its buffer)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Writer:
    """A new object written in parts: one PUT when it is small, else a multipart upload whose parts (at least
    ``part_bytes``, from the caller's buffers, which stay unchanged until ``close``) upload in parallel, each
    with its CRC32, which the server checks."""

    def __init__(self, store: S3Storage, key: str) -> None:
        self.store, self.key = store, key
        self.where = store.where(key)
        self._views: list[memoryview] = []
        self._buffered = 0
        self._upload: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._done = False

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B") if memoryview(data).ndim == 1 else memoryview(bytes(data))
        self._views.append(view)
        self._buffered += view.nbytes
        if self._buffered >= self.store.settings.part_bytes:
            self._flush()

    def _flush(self) -> None:
        views, self._views, self._buffered = self._views, [], 0
        if self._upload is None:
            reply = self.store.call(self.where, "create_multipart_upload", Key=self.store.name(self.key),
                                    ChecksumAlgorithm="CRC32")
            self._upload = str(reply["UploadId"])
        number = len(self._parts) + 1
        self._parts.append(self.store.pool.submit(self._part, number, views))

    def _part(self, number: int, views: list[memoryview]) -> dict[str, Any]:
        body = b"".join(views)   # one copy, in a part thread: bounded by the pool's size
        reply = self.store.call(self.where, "upload_part", Key=self.store.name(self.key), UploadId=self._upload,
                                PartNumber=number, Body=body, ChecksumAlgorithm="CRC32")
        return {"PartNumber": number, "ETag": reply["ETag"], "ChecksumCRC32": reply["ChecksumCRC32"]}

    def close(self) -> None:
        try:
            if self._upload is None:
                self.store.call(self.where, "put_object", Key=self.store.name(self.key), Body=b"".join(self._views))
            else:
                if self._views:
                    self._flush()
                parts = [future.result() for future in self._parts]
                self.store.call(self.where, "complete_multipart_upload", Key=self.store.name(self.key),
                                UploadId=self._upload, MultipartUpload={"Parts": parts})
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._views = []

    def abort(self) -> None:
        """Best effort: a server that is gone keeps the parts until ``delete_tree`` of the iteration aborts them."""
        self._views = []
        for future in self._parts:
            future.cancel()
        concurrent.futures.wait(self._parts)
        if self._upload is not None and not self._done:
            try:
                self.store.call(self.where, "abort_multipart_upload", Key=self.store.name(self.key), UploadId=self._upload)
            except OSError as exc:
                logger.debug("abort of %s: %s", self.where, exc)
            self._upload = None
