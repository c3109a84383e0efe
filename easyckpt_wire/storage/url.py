"""Where a save_dir is: a POSIX path or an object-store URL (``s3://bucket/prefix``), told apart once, at
start-up, so that a URL is never taken for a local path (``Path("s3://b/p")`` is the local ``s3:/b/p``).

``location`` turns what a user gave (``save_dir=``, ``load_dir=``, ``--save-dir``) into a resolved ``Path`` or a
``StorageURL``; any other scheme (``gs://``, ``hdfs://``, ``file://`` with a host...) is refused with the ones
that work. ``StorageURL`` stands in for a ``Path`` in the code that names and composes save_dir paths
(``save_dir / "iteration_0000100"``, ``.name``, ``.parent``, ``str()``); the bytes behind it are read and
written only through ``open_storage`` (``easyckpt_wire.storage``), never with file system calls.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import cast

SCHEMES = ("a POSIX path", "s3://bucket/prefix")   # what a save_dir may be
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# A URL whose "//" was lost: ``Path("s3://b/p")`` prints as ``s3:/b/p``, and a typo gives ``s3:b/p``. Taken as a
# local path it would quietly become a folder named "s3:" in the working directory.
_MANGLED_RE = re.compile(r"^(s3|s3a|gs|gcs|hdfs|az|abfs|abfss|oss|cos|http|https|file):(/?)(?!/)(.*)$", re.IGNORECASE)


class UnsupportedLocation(ValueError):
    """A save_dir or load_dir of a scheme with no storage implementation here."""


def _refuse(text: str, scheme: str, why: str = "") -> UnsupportedLocation:
    return UnsupportedLocation(f"{text}: the {scheme}:// scheme has no storage implementation here{why}; "
                               f"give {' or '.join(SCHEMES)}")


def split_url(text: str) -> tuple[str, str] | None:
    """(bucket, prefix without slashes at either end) of an ``s3://`` URL; None for a local path (``file:///x``
    included: the caller takes ``/x``). Raises UnsupportedLocation for any other scheme or a malformed URL."""
    match = _URL_RE.match(text)
    if match is None:
        mangled = _MANGLED_RE.match(text)
        if mangled is not None:
            scheme, rest = mangled.group(1).lower(), mangled.group(3)
            fixed = f"file:///{rest.lstrip('/')}" if scheme == "file" else f"{scheme}://{rest}"
            raise UnsupportedLocation(f"{text}: looks like the URL {fixed} with its '//' lost (a pathlib.Path turns "
                                      f"'s3://b/p' into 's3:/b/p'): pass the URL as a string, or a local path that "
                                      f"does not start with '{mangled.group(1)}:' (./{text} if you mean one)")
        return None
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        if rest.startswith("/"):
            return None
        raise _refuse(text, scheme, f" for the host {rest.split('/', 1)[0]!r} (a local file:///path is taken)")
    if scheme not in ("s3", "s3a"):
        raise _refuse(text, scheme)
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise UnsupportedLocation(f"{text}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, "
                                  "dots and hyphens): give s3://bucket/prefix")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UnsupportedLocation(f"{text}: the prefix {prefix!r} has an empty, '.' or '..' part: give s3://bucket/prefix")
    return bucket, prefix


def local_path(text: str) -> str:
    """``text`` without a ``file://`` scheme (``file:///x`` -> ``/x``)."""
    return text[len("file://"):] if text.lower().startswith("file://") else text


class StorageURL:
    """An object-store save_dir (or a key under it) where save_dir code expects a ``Path``: it composes
    (``/``, ``name``, ``parent``), prints as its URL, and answers ``exists``/``is_dir`` through its Storage."""

    def __init__(self, text: str) -> None:
        parts = split_url(text)
        if parts is None:
            raise UnsupportedLocation(f"{text}: not an object-store URL")
        self.bucket, self.prefix = parts
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __fspath__(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"StorageURL({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorageURL) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str | os.PathLike[str]) -> StorageURL:
        return StorageURL(f"{self.url}/{os.fspath(name)}")

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else ""

    @property
    def parent(self) -> StorageURL:
        return StorageURL(f"s3://{self.bucket}/{self.prefix.rsplit('/', 1)[0]}" if "/" in self.prefix
                          else f"s3://{self.bucket}")

    def resolve(self) -> StorageURL:
        return self

    def expanduser(self) -> StorageURL:
        return self

    def absolute(self) -> StorageURL:
        return self

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a prefix exists once something is stored under it."""

    def _split(self) -> tuple[object, str]:
        from easyckpt_wire.storage import open_storage

        return open_storage(self.parent.url), self.name

    def is_dir(self) -> bool:
        if not self.prefix:
            return True
        store, name = self._split()
        return bool(store.is_dir(name))   # type: ignore[attr-defined]

    def is_file(self) -> bool:
        if not self.prefix:
            return False
        store, name = self._split()
        return bool(store.exists(name))   # type: ignore[attr-defined]

    def exists(self) -> bool:
        return self.is_dir() or self.is_file()


def location(where: str | os.PathLike[str], name: str = "the path") -> Path:
    """A save_dir or load_dir as given by a user: a resolved local ``Path``, or a ``StorageURL`` typed as one (it
    implements the part of ``Path`` that save_dir code uses). Raises UnsupportedLocation for other schemes, ValueError
    for an empty string (``name`` says which setting it was)."""
    if isinstance(where, StorageURL):
        return cast(Path, where)
    text = os.fspath(where)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        # Path("") is the working directory: a setting read from an unset variable would scatter iteration_N
        # folders there.
        raise ValueError(f"{name} is empty ({where!r}): give a directory or an s3:// URL ('.' for the working "
                         "directory); a setting read from an environment variable that is not set is the usual cause")
    if isinstance(where, str) and text != text.strip():
        # " /data/ckpt" was put in a folder named " " of the working directory, "/data/ckpt\n" beside the one meant
        raise ValueError(f"{name} {where!r} begins or ends with whitespace: strip it (a value read from a file, a "
                         "YAML or an environment variable?); a directory whose name has it can be given as a pathlib.Path")
    if split_url(text) is not None:
        return cast(Path, StorageURL(text))
    return Path(local_path(text)).expanduser().resolve()


def as_path(where: str | os.PathLike[str]) -> Path:
    """``where`` as a ``Path`` for composing names, unresolved: a ``StorageURL`` kept as one (``Path()`` of a URL
    would be the local ``s3:/bucket/prefix``)."""
    if isinstance(where, StorageURL):
        return cast(Path, where)
    text = os.fspath(where)
    if isinstance(text, str) and split_url(text) is not None:
        return cast(Path, StorageURL(text))
    return Path(where)


def is_url(where: object) -> bool:
    return isinstance(where, StorageURL) or (isinstance(where, str) and split_url(where) is not None)
