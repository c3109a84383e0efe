"""On-disk layout (Checkpoint 2.0 style), version 1: names and the rule for "complete".

::

    save_dir/
      iteration_0000100/
        metadata.json      # the commit marker: written last; a directory without it is incomplete
        common.json        # per-rank skeletons (non-tensor state), exactly round-trippable
        easyckpt-model-0000000-0000002.safetensors   # rank 0 of 2, model tensors
        easyckpt-opt-0000000-0000002.safetensors     # rank 0 of 2, optimizer tensors (a replicated
                                                     #   DTensor shard: only in its replica group's writer's
                                                     #   file; the others' records say "stored_by")
      latest_checkpointed_iteration.txt
      easyckpt-audit.log
      .tmp-iteration_0000100-<pid>/                  # a persist in progress (or a dead writer's)
      .aside-iteration_0000100-<pid>/                # the old copy while replace_dir swaps a step in
      .trash-iteration_0000100-<pid>/                # an iteration being deleted
      .stage-iteration_0000100/                      # multi-node: every node's agent adds its ranks'
        node-<node id>.json                          #   files, then this; the leader commits the step
      .abandoned-<UTC time>/iteration_0000120/       # a timeline a resume abandoned (easyckpt_wire.timeline)

The agent writes this layout; the library and the CLI read it. Both use the functions here so that
"complete" means the same thing on both sides.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from easyckpt_wire.faults import fault_point

METADATA_FORMAT = "easyckpt-ckpt2"
METADATA_VERSION = 1
METADATA = "metadata.json"
COMMON = "common.json"
TRACKER = "latest_checkpointed_iteration.txt"
AUDIT_LOG = "easyckpt-audit.log"
TMP_PREFIX = ".tmp-iteration_"
TRASH_PREFIX = ".trash-iteration_"
# An export of iteration N still owed (TrainerWrapper's checkpoint-N): rotation spares the iteration while
# the hold file exists, so a crash between the persist and the export cannot lose checkpoint-N for good.
EXPORT_HOLD_PREFIX = ".export-hold-"
ASIDE_PREFIX = ".aside-iteration_"
STAGE_PREFIX = ".stage-iteration_"
STAGE_RE = re.compile(r"^\.stage-iteration_(\d{7,})$")
NODE_FILE_RE = re.compile(r"^node-[A-Za-z0-9_.-]{1,64}\.json$")
CHECKSUM_ALGO = "xxh3_128"
ITERATION_RE = re.compile(r"^iteration_(\d{7,})$")
TMP_RE = re.compile(r"^\.(?:tmp|trash)-iteration_(\d{7,})-(\d+)$")
ASIDE_RE = re.compile(r"^\.aside-iteration_(\d{7,})-(\d+)$")
RANK_FILE_RE = re.compile(r"^easyckpt-(model|opt)-(\d{7})-(\d{7})\.safetensors$")
OPT_KEYS = ("optim", "optimizer", "opt")


def iteration_dirname(step: int) -> str:
    return f"iteration_{step:07d}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (the last step of every atomic publish here)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, text: str) -> None:
    """Replace the small file ``path`` atomically and durably (a reader sees the old text or the new one):
    a temporary file beside it, fsynced, renamed over it, the directory fsynced."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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


def replace_dir(src: Path, final: Path, *, aside: Path | None = None, trash: Path | None = None) -> Path | None:
    """Publish the complete directory ``src`` as ``final`` (same parent), replacing a directory already
    there; the parent is fsynced. Returns where the old directory now is (``trash``, for the caller to
    delete, when convenient), or None when there was none.

    The name ``final`` never stops naming a whole directory, old or new, so a tracker naming it stays
    true: the old and new are swapped in one atomic step (``exchange_dirs``), and the old one, now under
    ``src``'s temporary name, is renamed to ``trash``. Where no atomic swap exists the old one is first
    renamed to ``aside``, then ``src`` in; a crash between the two leaves ``final`` missing and the old
    directory whole under ``aside``, which the caller's clean-up puts back (``settle_aside``). An aside
    name only ever holds a whole directory: deleting starts under the ``trash`` name.

    Without ``aside`` and ``trash`` an existing ``final`` is refused (FileExistsError).
    """
    parent = final.parent
    if not final.exists():
        os.rename(src, final)
        fsync_dir(parent)
        return None
    if aside is None or trash is None:
        raise FileExistsError(errno.EEXIST, "replace_dir: it exists and no aside name was given", str(final))
    if exchange_dirs(src, final):
        fault_point("layout.replace.swapped")       # new in place, the old one under src's temporary name
        fsync_dir(parent)
        _to_trash(src, trash)
    else:
        os.rename(final, aside)
        fault_point("layout.replace.aside")         # final missing; the old one whole under aside
        os.rename(src, final)
        fsync_dir(parent)
        _to_trash(aside, trash)
    return trash


def settle_aside(aside: Path, final: Path, trash: Path) -> bool:
    """Finish a ``replace_dir`` that died with the old directory under ``aside`` (its writer is dead): put
    it back as ``final`` when ``final`` is missing (returns True), else move it to ``trash`` and delete it."""
    if not final.exists():
        os.rename(aside, final)
        fsync_dir(final.parent)
        return True
    _to_trash(aside, trash)
    shutil.rmtree(trash, ignore_errors=True)
    return False


def _to_trash(path: Path, trash: Path) -> None:
    if trash.exists():   # a deletion of the same name that failed before: it is trash all the same
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)


def stage_dirname(step: int) -> str:
    return f"{STAGE_PREFIX}{step:07d}"


def node_file_name(node: str) -> str:
    return "node-" + re.sub(r"[^A-Za-z0-9_.-]", "_", node)[:64] + ".json"


def rank_file_name(group: str, rank: int, world_size: int) -> str:
    return f"easyckpt-{group}-{rank:07d}-{world_size:07d}.safetensors"


def tensor_group(name: str) -> str:
    """Which file of the rank a tensor goes to: optimizer state apart from the model, as Megatron does."""
    top = name.split("/", 1)[0].lower()
    return "opt" if top in OPT_KEYS or top.startswith("optim") else "model"


class CheckpointFormatError(RuntimeError):
    """A checkpoint directory that is damaged or not ours."""


def link_replicas(ranks_meta: dict[str, Any], where: str) -> None:
    """Complete, in place, the metadata.json records of replicated shards that another rank wrote.

    A rank whose copy of a replicated DTensor shard its replica group's writer puts on disk (the rule is
    ``easyckpt.sharding.writer_coordinate``) has a record with ``stored_by`` (the writer's rank) and the
    writer's ``file``; this gives it the writer's checksum, so that every reader, older builds included,
    reads it from there like any other record. Raises CheckpointFormatError naming the tensor and both
    ranks when the writer did not save that tensor with the same shape and dtype: such an iteration would
    not load, so it is never committed."""
    by_rank: dict[str, dict[str, Any]] = {}
    for rank, info in ranks_meta.items():
        for record in info["tensors"]:
            if "stored_by" not in record:
                by_rank.setdefault(rank, {})[record["name"]] = record
    for rank, info in ranks_meta.items():
        for record in info["tensors"]:
            writer = record.get("stored_by")
            if writer is None:
                continue
            if str(writer) not in ranks_meta:
                raise CheckpointFormatError(
                    f"{where}: rank {rank}'s tensor {record['name']!r} is replicated and stored by rank {writer}, "
                    f"which is not among the saved ranks {sorted(ranks_meta, key=int)}")
            source = by_rank.get(str(writer), {}).get(record["name"])
            if source is None or (source["shape"], source["dtype"], source["file"]) != (
                    record["shape"], record["dtype"], record["file"]):
                found = "lacks it" if source is None else (f"has it as {source['dtype']} {source['shape']} in "
                                                           f"{source['file']}")
                raise CheckpointFormatError(
                    f"{where}: rank {rank}'s tensor {record['name']!r} ({record['dtype']} {record['shape']}) is "
                    f"replicated and stored by rank {writer} in {record['file']}, but rank {writer}'s state {found}: "
                    "the ranks of one replica group must hold the same DTensor")
            record[CHECKSUM_ALGO] = source[CHECKSUM_ALGO]


def read_metadata(iteration_dir: Path) -> dict[str, Any]:
    """The parsed commit marker of ``iteration_dir``; raises CheckpointFormatError if incomplete."""
    path = iteration_dir / METADATA
    try:
        with open(path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{iteration_dir} has no {METADATA}: it is incomplete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path} is unreadable: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise CheckpointFormatError(f"{path} is not an easyckpt checkpoint (format {meta.get('format')!r})"
                                    if isinstance(meta, dict) else f"{path} is not a JSON object")
    if meta.get("format_version") != METADATA_VERSION:
        raise CheckpointFormatError(
            f"{path} has format version {meta.get('format_version')!r}, this build reads {METADATA_VERSION}"
        )
    return meta


def list_iterations(save_dir: Path) -> list[tuple[int, Path, bool]]:
    """Every ``iteration_N`` directory as (step, path, complete), oldest first."""
    found = []
    try:
        entries = list(os.scandir(save_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        match = ITERATION_RE.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            complete = (Path(entry.path) / METADATA).is_file()
            found.append((int(match.group(1)), Path(entry.path), complete))
    return sorted(found)


def export_hold(save_dir: Path, step: int) -> Path:
    return save_dir / f"{EXPORT_HOLD_PREFIX}{step:07d}"


def export_holds(save_dir: Path) -> set[int]:
    """Steps whose export is still owed (``export_hold`` files in ``save_dir``)."""
    try:
        names = [entry.name for entry in save_dir.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {int(name[len(EXPORT_HOLD_PREFIX):]) for name in names
            if name.startswith(EXPORT_HOLD_PREFIX) and name[len(EXPORT_HOLD_PREFIX):].isdigit()}


def complete_iterations(save_dir: Path) -> list[tuple[int, Path]]:
    """Iterations whose commit marker exists and parses, oldest first."""
    complete = []
    for step, path, has_marker in list_iterations(save_dir):
        if not has_marker:
            continue
        try:
            meta = read_metadata(path)
        except CheckpointFormatError:
            continue
        if meta.get("step") == step:
            complete.append((step, path))
    return complete


def read_tracker(save_dir: Path) -> int | None:
    """The step the tracker names; None when there is none or it holds no step number. Read as bytes: a damaged
    tracker (a flipped byte that is not UTF-8) is passed over like any other unreadable one, and readers take the
    newest complete iteration, instead of every load and every agent start-up raising UnicodeDecodeError."""
    try:
        text = (save_dir / TRACKER).read_bytes().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None   # bytes.isdigit(): ASCII digits only
