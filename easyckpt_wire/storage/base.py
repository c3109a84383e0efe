"""The storage seam (invariant 13): what every place that keeps or reads checkpoint bytes calls.

A ``Storage`` is rooted at one ``save_dir`` (a POSIX directory; an object-store prefix next) and addresses
what is under it by *keys*: ``/``-separated paths relative to the root (``""`` is the root itself,
``iteration_0000100/metadata.json`` a file). It knows nothing of the checkpoint layout's names: those,
and the rules over them (what is complete, which iteration a load follows, rotation, timelines, the
audit log, the health index), are written once over this protocol (``easyckpt_wire.layout``,
``easyckpt_wire.savedir``), so they hold alike on every implementation.

The contract every implementation keeps (``tests/unit/test_storage_contract.py`` runs the same cases
against each):

* **Errors are OSError**, naming the path (``filename`` is ``where(key)``) with an errno-like cause:
  ``FileNotFoundError`` (ENOENT) for a missing key, ``FileExistsError`` (EEXIST), EACCES, ENOSPC,
  ETIMEDOUT... An object store maps its replies onto these (NoSuchKey -> ENOENT, AccessDenied -> EACCES,
  SlowDown after its retries -> EAGAIN), so every caller's ``except OSError`` and the persist-failure
  report (path, errno) work unchanged.
* **Deletes are idempotent**: deleting what is not there is no error.
* **An iteration becomes visible through one commit written last.** Its files are written into a
  ``Pending`` (``begin`` for one writer, ``stage`` for the writers of every node); ``seal`` writes the
  commit marker, ``publish`` makes the whole iteration visible in one step. POSIX: the files go to a
  temporary directory, ``publish`` renames it into place (``replace_dir``). An object store has no rename:
  the files go to their final keys, and the commit object (the marker) is written by ``publish``, after
  every part is complete and verified. A reader ignores an iteration without its marker, so a writer that
  dies at any point leaves nothing a load would take; ``leftovers`` finds what it left.
* **Large files are written in parts**: ``BlobWriter.write`` appends one part (the caller keeps its buffer
  unchanged until ``close``, so an object store may upload parts in parallel, as a multipart upload);
  ``close`` returns once the file is durable (fsync; the multipart upload completed).
* **Listing is by prefix**: ``entries(prefix)`` gives the direct children of a key, sorted by name, ``[]`` for
  one that does not exist; a "directory" is a prefix with something under it.

Call order of a single-node persist (``easyckpt_agent.persister.persist``)::

    p = storage.begin("iteration_0000100")      # invisible
    w = p.create(rank_file); w.write(part)...; w.close()   # every rank file, in parallel threads
    p.put("common.json", ...)
    p.seal("metadata.json", marker)              # still invisible (an object store keeps it for publish)
    old = p.publish()                            # visible; an older copy of the step is now under ``old``
    storage.put("latest_checkpointed_iteration.txt", ...)   # the tracker, after the iteration
    storage.delete_tree(old)                     # when old is not None
    # on any failure before publish: p.discard()

Multi-node: every node's agent calls ``stage(final)`` (the same Pending for all), writes its ranks' files
and ``put(note, atomic=True)``; the leader reads the notes (``names``/``read``), ``delete``s them, then
``put`` common.json, ``seal``, ``publish`` as above.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One child of a listed key."""

    name: str
    is_dir: bool
    size: int = -1      # bytes of a file when the listing was asked for sizes; -1 otherwise (and for directories)


@dataclasses.dataclass(frozen=True, slots=True)
class Leftover:
    """Something a writer that is gone left behind (``Storage.leftovers``), and what settling it does."""

    key: str
    final: str          # the iteration it belongs to (``iteration_0000100``)
    restore: bool       # True: it is the whole old copy of ``final``, which is missing: it goes back
    reason: str


class BlobReader(Protocol):
    """One stored file opened for reading ranges (an mmap on POSIX; ranged GETs on an object store)."""

    where: str
    size: int

    def view(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset+length)``: no copy where the implementation can; release the view before
        ``close``. A range beyond the end raises EOFError naming ``where``."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> BlobReader: ...

    def __exit__(self, *exc: object) -> None: ...


class BlobWriter(Protocol):
    """One new file, written in parts, in order."""

    where: str

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data``; the caller keeps it unchanged until ``close`` returns."""
        ...

    def close(self) -> None:
        """Return once every part is durable."""
        ...

    def abort(self) -> None:
        """Drop the file (idempotent): nothing of it stays."""
        ...


class Pending(Protocol):
    """An iteration being written: nothing of it is visible as ``final`` until ``publish``."""

    final: str      # the key it is published as (``iteration_0000100``)
    key: str        # where its files are meanwhile (POSIX: a temporary or stage directory)
    where: str      # ``key`` as a message names it

    def create(self, name: str) -> BlobWriter:
        """A new file (FileExistsError if ``name`` exists in this pending iteration)."""
        ...

    def put(self, name: str, data: bytes, *, atomic: bool = False) -> None:
        """A small file, durable on return; ``atomic``: a concurrent reader sees all of it or nothing."""
        ...

    def names(self) -> list[str]:
        """The files written so far (by any writer of a stage), sorted; [] when there is none."""
        ...

    def exists(self) -> bool:
        """Whether anything of it is stored (a stage another node began, a writer's temporary copy)."""
        ...

    def read(self, name: str) -> bytes: ...

    def delete(self, name: str) -> None: ...

    def seal(self, marker: str, data: bytes) -> None:
        """The commit marker, the last file: after every other file is durable."""
        ...

    def publish(self) -> str | None:
        """Make the iteration visible as ``final`` in one step, replacing one already there: returns the key
        the replaced copy now has (for ``Storage.delete_tree`` when convenient), None when there was none."""
        ...

    def discard(self) -> None:
        """Remove everything written (idempotent); never anything published."""
        ...


@runtime_checkable
class Storage(Protocol):
    """One save_dir. Every method may raise OSError naming the path (see the module's contract)."""

    # True: writers anywhere may append to one file at once at no extra cost (POSIX: O_APPEND). False: an append
    # rewrites the object, and writers that append to one at once race (each loser reads and writes it again).
    shared_appends: bool

    def where(self, key: str = "") -> str:
        """The key as a user would name it in a message: a path, or a URL."""
        ...

    # reading ------------------------------------------------------------------------------------------------
    def entries(self, prefix: str = "", *, sizes: bool = False) -> list[Entry]: ...

    def exists(self, key: str) -> bool:
        """A file (or object) at ``key``."""
        ...

    def is_dir(self, key: str) -> bool:
        """A directory (or a prefix with something under it) at ``key``."""
        ...

    def size(self, key: str) -> int: ...

    def read(self, key: str) -> bytes: ...

    def open(self, key: str) -> BlobReader: ...

    def free_bytes(self) -> int | None:
        """Bytes a writer may still use, None when the storage does not say (an object store)."""
        ...

    # writing ------------------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Replace a small file atomically and durably: a reader sees the old content or the new one."""
        ...

    def append(self, key: str, data: bytes) -> None:
        """Append durably (the audit log); an object store may rewrite the object (``shared_appends``)."""
        ...

    def make_dir(self, key: str) -> None:
        """A new empty directory; FileExistsError if ``key`` exists (how a unique name is claimed)."""
        ...

    def begin(self, final: str) -> Pending:
        """This writer's own pending copy of ``final``, empty (a dead attempt's files are dropped)."""
        ...

    def stage(self, final: str) -> Pending:
        """The pending copy of ``final`` shared by every node's writer; reading it creates nothing, its first
        write does."""
        ...

    def stages(self) -> list[str]:
        """The ``final`` keys with a stage in progress."""
        ...

    def move(self, moves: Sequence[tuple[str, str]]) -> None:
        """Move whole trees (the abandoned iterations of a timeline), durable on return. A moved iteration is
        complete at its new key or its old one at every moment (an object store copies the marker last and
        deletes it first)."""
        ...

    def retire(self, key: str) -> str:
        """Make the tree ``key`` vanish for every reader at once; returns the key of what is left to delete
        (``delete_tree``), outside any lock."""
        ...

    def delete(self, key: str) -> None:
        """Remove one file, durably; no error when it is not there."""
        ...

    def delete_tree(self, key: str, *, best_effort: bool = False) -> None:
        """Remove a whole tree; no error when it is not there. ``best_effort``: remove what can be, raise
        nothing."""
        ...

    def leftovers(self) -> list[Leftover]:
        """What writers that are gone left (POSIX: temporary, trash and aside directories of dead processes);
        never anything of a live writer."""
        ...

    def settle(self, leftover: Leftover) -> None:
        """Remove a leftover, or put it back as its ``final`` when ``restore``."""
        ...
