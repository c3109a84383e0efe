"""Where checkpoints are kept: the ``Storage`` protocol (``base``) and its implementations (``posix``; an object
store next, issue 26). ``open_storage`` picks the implementation for a ``save_dir``.

The layout written over this protocol (iterations, tracker, audit, health index, timelines, clean-up) is in
``easyckpt_wire.layout`` (names, reading) and ``easyckpt_wire.savedir`` (the agent's writes).
"""
from __future__ import annotations

import os

from easyckpt_wire.storage.base import BlobReader, BlobWriter, Entry, Leftover, Pending, Storage
from easyckpt_wire.storage.posix import PosixStorage

__all__ = ["BlobReader", "BlobWriter", "Entry", "Leftover", "Pending", "PosixStorage", "Storage", "SCHEMES",
           "StorageLike", "open_storage"]

SCHEMES = ("a POSIX path",)   # what open_storage takes; s3:// joins with issue 26

StorageLike = Storage | str | os.PathLike[str]


def open_storage(where: StorageLike) -> Storage:
    """The Storage of ``where``: one already opened, or a path. A URL of a scheme with no implementation is
    refused with the ones that work, never taken as a local path (``s3://b/p`` would become ``s3:/b/p``)."""
    if isinstance(where, Storage):
        return where
    text = os.fspath(where)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "://" in text:
        raise ValueError(f"{text}: the {text.split('://', 1)[0]}:// scheme has no storage implementation here; "
                         f"give {' or '.join(SCHEMES)}")
    return PosixStorage(text)
