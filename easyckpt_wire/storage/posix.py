"""The POSIX implementation of ``Storage``: a save_dir on a local or shared file system.

Durability is fsync: every file is fsynced once when it is complete, a directory after a rename or a new
file in it. An iteration is written under ``.tmp-<final>-<pid>`` (one writer) or ``.stage-<final>``
(multi-node: every node's writer), sealed with its marker, and published by one rename
(``replace_dir``: an atomic swap when an older copy is in place). Deleting starts with a rename to
``.trash-<name>-<pid>``, so no half-deleted tree ever has a name a reader looks at. These scratch names are
this implementation's own; ``leftovers`` finds the ones whose writer process is dead.

Also here: the path helpers that every other atomic publish of this package family uses (the HF, Megatron
and Lightning exports, ``easyckpt convert``), so that only this module renames and fsyncs.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from easyckpt_wire.faults import fault_point
from easyckpt_wire.storage.base import Entry, Leftover

PAGE = 4096   # O_DIRECT alignment (``easyckpt_wire.shm.PAGE``: the stager lays files out on it)
TMP_PREFIX, TRASH_PREFIX, ASIDE_PREFIX, STAGE_PREFIX = ".tmp-", ".trash-", ".aside-", ".stage-"
_SCRATCH_RE = re.compile(r"^\.(tmp|trash|aside)-(.+)-(\d+)$")
_STAGE_RE = re.compile(r"^\.stage-(.+)$")


# path helpers ---------------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (the last step of every atomic publish here)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory``, each directory after its files."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))


def write_file_atomic(path: Path, data: str | bytes) -> None:
    """Replace the small file ``path`` atomically and durably (a reader sees the old content or the new one):
    a temporary file beside it, fsynced, renamed over it, the directory fsynced."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_file(tmp: Path, final: Path) -> None:
    """Publish the finished file ``tmp`` as ``final`` (same directory): fsync, rename over, fsync the parent."""
    fsync_file(tmp)
    rename_file(tmp, final)
    fsync_dir(final.parent)


def rename_file(tmp: Path, final: Path) -> None:
    """Rename the fsynced file ``tmp`` over ``final`` (same directory) in one step; the caller fsyncs the parent
    (``fsync_dir``) once it no longer holds what made the rename exclusive (the Lightning export's guard)."""
    os.replace(tmp, final)


_RENAME_EXCHANGE = 2   # renameat2(2) flag: swap two existing entries atomically
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    """libc's renameat2 (Linux, glibc 2.28+), or None where there is none."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step; False (nothing done) where the system or the
    file system cannot (no renameat2, or EINVAL from a file system without RENAME_EXCHANGE)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def replace_dir(src: Path, final: Path, *, aside: Path | None = None, trash: Path | None = None,
                exchange: Callable[[Path, Path], bool] | None = None) -> Path | None:
    """Publish the complete directory ``src`` as ``final`` (same parent), replacing a directory already
    there; the parent is fsynced. Returns where the old directory now is (``trash``, for the caller to
    delete, when convenient), or None when there was none.

    The name ``final`` never stops naming a whole directory, old or new, so a tracker naming it stays
    true: the old and new are swapped in one atomic step (``exchange_dirs``), and the old one, now under
    ``src``'s temporary name, is renamed to ``trash``. Where no atomic swap exists the old one is first
    renamed to ``aside``, then ``src`` in; a crash between the two leaves ``final`` missing and the old
    directory whole under ``aside``, which the caller's clean-up puts back (``settle_aside``). An aside
    name only ever holds a whole directory: deleting starts under the ``trash`` name.

    Without ``aside`` and ``trash`` an existing ``final`` is refused (FileExistsError). ``exchange``: the atomic
    swap to try (``exchange_dirs``; a test gives one that cannot, to take the aside path).
    """
    parent = final.parent
    if not final.exists():
        os.rename(src, final)
        fsync_dir(parent)
        return None
    if aside is None or trash is None:
        raise FileExistsError(errno.EEXIST, "replace_dir: it exists and no aside name was given", str(final))
    if (exchange or exchange_dirs)(src, final):
        fault_point("layout.replace.swapped")       # new in place, the old one under src's temporary name
        fsync_dir(parent)
        rename_to_trash(src, trash)
    else:
        os.rename(final, aside)
        fault_point("layout.replace.aside")         # final missing; the old one whole under aside
        os.rename(src, final)
        fsync_dir(parent)
        rename_to_trash(aside, trash)
    return trash


def settle_aside(aside: Path, final: Path, trash: Path) -> bool:
    """Finish a ``replace_dir`` that died with the old directory under ``aside`` (its writer is dead): put
    it back as ``final`` when ``final`` is missing (returns True), else move it to ``trash`` and delete it."""
    if not final.exists():
        os.rename(aside, final)
        fsync_dir(final.parent)
        return True
    rename_to_trash(aside, trash)
    shutil.rmtree(trash, ignore_errors=True)
    return False


def move_into(paths: list[Path], directory: Path) -> list[Path]:
    """Move ``paths`` (entries of one directory) into the new ``directory`` beside them, one rename each, and fsync
    both directories: each entry is in one place or the other at any moment. Returns the new paths."""
    directory.mkdir()
    moved = []
    for path in paths:
        os.rename(path, directory / path.name)
        moved.append(directory / path.name)
    fsync_dir(directory)
    fsync_dir(directory.parent)
    return moved


def rename_to_trash(path: Path, trash: Path) -> None:
    """The first step of deleting a tree: one rename, so that no half-deleted tree keeps a name a reader uses."""
    if trash.exists():   # a deletion of the same name that failed before: it is trash all the same
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)


def _named(exc: OSError, where: str) -> OSError:
    """``exc`` with the path in it: pwrite, fsync and mmap do not say which file, and the message must."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), where)


# reading and writing one file ----------------------------------------------------------------------------
class _Reader:
    """A file mapped read-only: a range is a view of the mapping (no copy; only its pages are read)."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        with open(path, "rb") as handle:
            self.size = os.fstat(handle.fileno()).st_size
            try:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
            except OSError as exc:
                raise _named(exc, self.where) from None

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise EOFError(f"{self.where}: bytes {offset}-{offset + length} are beyond its end ({self.size} bytes)")
        if self._map is None or length == 0:
            return memoryview(b"")
        with memoryview(self._map) as whole:
            return whole[offset:offset + length]

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:   # a view of it is still in use (a tensor on its pages): unmapped when collected
                pass

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Writer:
    """A new file written in order: the page-aligned bulk of each part with O_DIRECT where the file system
    allows it (no page cache to fill, which on these VMs is what makes buffered writes slow), the rest
    through the page cache; fsynced once by ``close``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        self.offset = 0
        self._direct = -1
        self._direct_ok = hasattr(os, "O_DIRECT")
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, data: memoryview | bytes) -> None:
        try:
            with memoryview(data) as view:
                bulk = len(view) - len(view) % PAGE
                done = 0
                if bulk and self.offset % PAGE == 0 and self._direct_fd(view) >= 0:
                    with view[:bulk] as part:
                        _pwrite_all(self._direct, part, self.offset)
                    done = bulk
                if done < len(view):
                    with view[done:] as part:
                        _pwrite_all(self.fd, part, self.offset + done)
                self.offset += len(view)
        except OSError as exc:
            raise _named(exc, self.where) from None

    def _direct_fd(self, view: memoryview) -> int:
        # Imported here, not at the top: the CLI's readers never write and must not pay numpy's import.
        import numpy

        if not self._direct_ok or numpy.frombuffer(view, numpy.uint8).ctypes.data % PAGE:
            return -1
        if self._direct < 0:
            try:
                self._direct = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:   # EINVAL: this file system has no O_DIRECT (tmpfs, some FUSE)
                    raise
                self._direct_ok = False
        return self._direct

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            self._close_fds()
            raise _named(exc, self.where) from None
        self._close_fds()

    def abort(self) -> None:
        self._close_fds()
        self.path.unlink(missing_ok=True)

    def _close_fds(self) -> None:
        for fd in (self._direct, self.fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._direct = self.fd = -1


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        with data[done:] as rest:
            done += os.pwrite(fd, rest, offset + done)


class _Pending:
    """An iteration in a scratch directory of the save_dir, published by one rename."""

    def __init__(self, storage: PosixStorage, final: str, key: str, *, shared: bool = False) -> None:
        self.storage, self.final, self.key = storage, final, key
        self.dir = storage.path(key)
        self.where = str(self.dir)
        self._made = not shared   # a stage's directory is made by its first write (any node's)

    def _make(self) -> None:
        if not self._made:
            self.dir.mkdir(exist_ok=True)
            self._made = True

    def create(self, name: str) -> _Writer:
        self._make()
        return _Writer(self.dir / name)

    def put(self, name: str, data: bytes, *, atomic: bool = False) -> None:
        self._make()
        if atomic:
            write_file_atomic(self.dir / name, data)
            return
        with open(self.dir / name, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []

    def exists(self) -> bool:
        return self.dir.is_dir()

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def delete(self, name: str) -> None:
        # Not fsynced here: the seal's fsync of the directory makes the deletions before it durable.
        (self.dir / name).unlink(missing_ok=True)

    def seal(self, marker: str, data: bytes) -> None:
        self.put(marker, data)
        fsync_dir(self.dir)

    def publish(self) -> str | None:
        pid = os.getpid()
        root = self.storage.root
        trash = replace_dir(self.dir, root / self.final, aside=root / f"{ASIDE_PREFIX}{self.final}-{pid}",
                            trash=root / f"{TRASH_PREFIX}{self.final}-{pid}")
        return None if trash is None else trash.name

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class PosixStorage:
    """``Storage`` over the directory ``root``."""

    shared_appends = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"PosixStorage({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file system path of ``key``; a key that would leave the root is refused (invariant 5)."""
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"storage key {key!r} must be relative to {self.root} and stay under it")
        return self.root / key if key else self.root

    def where(self, key: str = "") -> str:
        return str(self.path(key))

    def entries(self, prefix: str = "", *, sizes: bool = False) -> list[Entry]:
        found = []
        try:
            with os.scandir(self.path(prefix)) as entries:
                for entry in entries:
                    size = -1
                    if sizes:
                        try:
                            size = entry.stat().st_size if entry.is_file() else -1
                        except FileNotFoundError:   # removed since it was listed (a rotation)
                            continue
                    found.append(Entry(entry.name, entry.is_dir(follow_symlinks=False), size))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(found, key=lambda e: e.name)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def is_dir(self, key: str) -> bool:
        return self.path(key).is_dir()

    def size(self, key: str) -> int:
        return os.stat(self.path(key)).st_size

    def read(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def open(self, key: str) -> _Reader:
        return _Reader(self.path(key))

    def free_bytes(self) -> int | None:
        try:
            stat = os.statvfs(self.root)
        except OSError:
            return None
        if stat.f_blocks == 0:   # some FUSE and network file systems report nothing: no judgement then
            return None
        return stat.f_bavail * stat.f_frsize

    def put(self, key: str, data: bytes) -> None:
        write_file_atomic(self.path(key), data)

    def append(self, key: str, data: bytes) -> None:
        path = self.path(key)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            with memoryview(data) as view:
                done = 0
                while done < len(view):
                    with view[done:] as rest:
                        done += os.write(fd, rest)
            os.fsync(fd)
        except OSError as exc:
            raise _named(exc, str(path)) from None
        finally:
            os.close(fd)

    def make_dir(self, key: str) -> None:
        self.path(key).mkdir()

    def begin(self, final: str) -> _Pending:
        key = f"{TMP_PREFIX}{final}-{os.getpid()}"
        path = self.path(key)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir()
        return _Pending(self, final, key)

    def stage(self, final: str) -> _Pending:
        return _Pending(self, final, f"{STAGE_PREFIX}{final}", shared=True)

    def stages(self) -> list[str]:
        return [m.group(1) for e in self.entries() if e.is_dir and (m := _STAGE_RE.match(e.name))]

    def move(self, moves: Sequence[tuple[str, str]]) -> None:
        for src, dst in moves:
            os.rename(self.path(src), self.path(dst))
        for parent in dict.fromkeys([*(self.path(d).parent for _, d in moves), *(self.path(s).parent for s, _ in moves)]):
            fsync_dir(parent)

    def retire(self, key: str) -> str:
        name = f"{TRASH_PREFIX}{Path(key).name}-{os.getpid()}"
        trash, n = name, 0
        while self.path(trash).exists():   # two of the same name at once (an abandoned and a current iteration)
            n += 1
            trash = f"{name}{n}"
        os.rename(self.path(key), self.path(trash))
        return trash

    def delete(self, key: str) -> None:
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)

    def delete_tree(self, key: str, *, best_effort: bool = False) -> None:
        path = self.path(key)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=best_effort)
            return
        try:
            path.unlink(missing_ok=True)
        except OSError:
            if not best_effort:
                raise

    def leftovers(self) -> list[Leftover]:
        found = []
        for entry in self.entries():
            match = _SCRATCH_RE.match(entry.name)
            if match is None or not entry.is_dir:
                continue
            kind, final, pid = match.group(1), match.group(2), int(match.group(3))
            if pid != os.getpid() and psutil.pid_exists(pid):
                continue   # a live writer (another agent of this save_dir?) still owns it
            if kind == "aside":
                restore = not self.path(final).exists()
                found.append(Leftover(entry.name, final, restore, "a replace that died: the old copy goes back"
                                      if restore else "leftover of a dead writer"))
            else:
                found.append(Leftover(entry.name, final, False, "leftover of a dead writer"))
        return found

    def settle(self, leftover: Leftover) -> None:
        match = _SCRATCH_RE.match(leftover.key)
        if match is not None and match.group(1) == "aside":
            settle_aside(self.path(leftover.key), self.path(leftover.final),
                         self.path(f"{TRASH_PREFIX}{leftover.final}-{match.group(3)}"))
        else:
            self.delete_tree(leftover.key)
