"""Where checkpoints are kept: the ``Storage`` protocol (``base``) and its implementations (``posix``; an object
store next, issue 26). ``open_storage`` picks the implementation for a ``save_dir``.

The layout written over this protocol (iterations, tracker, audit, health index, timelines, clean-up) is in
``easyckpt_wire.layout`` (names, reading) and ``easyckpt_wire.savedir`` (the agent's writes).
"""
from __future__ import annotations

import errno
import os
import threading

from easyckpt_wire.storage.base import BlobReader, BlobWriter, Entry, Leftover, Pending, Storage
from easyckpt_wire.storage.posix import PosixStorage
from easyckpt_wire.storage.url import (
    SCHEMES,
    StorageURL,
    UnsupportedLocation,
    as_path,
    is_url,
    local_path,
    location,
    split_url,
)

__all__ = ["unavailable", "BlobReader", "BlobWriter", "Entry", "Leftover", "Pending", "PosixStorage", "Storage", "SCHEMES",
           "StorageLike", "StorageURL", "UnsupportedLocation", "as_path", "is_url", "location",
           "open_storage"]

StorageLike = Storage | str | os.PathLike[str]

# One S3Storage per bucket, prefix and AWS endpoint/profile settings in a process: a client and its connection
# pool are made once, not at every open_storage of a save_dir's path.
_OPENED: dict[tuple[str, ...], Storage] = {}
_CLIENT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION")
_OPENED_LOCK = threading.Lock()


def unavailable(exc: OSError) -> bool:
    """The store did not answer, or kept refusing for load (after the client's retries), as opposed to a missing
    bucket or refused credentials: its next calls would most likely fail the same way, each after its retries."""
    return isinstance(exc, ConnectionError | TimeoutError) or exc.errno in (errno.EAGAIN, errno.ECONNREFUSED,
                                                                         errno.ETIMEDOUT, errno.ECONNRESET)


def open_storage(where: StorageLike) -> Storage:
    """The Storage of ``where``: one already opened, a path, or an ``s3://bucket/prefix`` URL. A URL of a scheme
    with no implementation is refused with the ones that work (UnsupportedLocation, a ValueError), never taken
    as a local path (``s3://b/p`` would become ``s3:/b/p``)."""
    if isinstance(where, Storage):
        return where
    text = os.fspath(where)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    parts = split_url(text)
    if parts is None:
        return PosixStorage(local_path(text))
    key = (*parts, *(os.environ.get(name, "") for name in _CLIENT_ENV))
    with _OPENED_LOCK:
        store = _OPENED.get(key)
        if store is None:
            from easyckpt_wire.storage.s3 import S3Storage  # boto3 only where an s3:// save_dir is used

            store = _OPENED[key] = S3Storage(*parts)
        return store
