"""How each fault kind of ``soak_plan.KINDS`` is thrown at a running job, through the product's public surface only:
SIGKILL/SIGSTOP by pid, the named fault points (``EASYCKPT_FAULT``, armed and fired once through
``EASYCKPT_FAULT_ARM``/``EASYCKPT_FAULT_ONCE``), a tmpfs that fills up, bytes flipped in files.

A runner starts the job, strikes, restarts what a launcher or an operator would restart, and returns a
:class:`Strike`; the caller waits for the job's end and judges it (``soak_check.py``). Nothing waits for the
job to settle before a fault: a step is reached, the fault strikes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from soak_job import PEER_TIMEOUT, Cluster, gone, signal_pid
from soak_plan import Fault

from easyckpt_wire.shm import DATA_OFFSET, HEADER_BYTES, SlotFormatError, SlotMap

# A frozen rank stays stopped this long beyond its drawn hold: past the longest timeout a peer or an agent
# applies to it (the plain example's --peer-timeout; the HF example keeps the default peer_timeout of 10 s).
STOP_BEYOND = {"plain": PEER_TIMEOUT, "hf": 10.0}
DISK_MB = 16            # the tmpfs under save_dir for disk_full: a few iterations of either example
# torchrun's restarts for a job whose every attempt must fail alike: storage down to the end ("never": each attempt's
# final persist fails) or the only iteration damaged (each attempt's load may refuse it). One restart shows a
# restarted worker meeting the failure again and saying so; a second showed nothing more and cost 8 to 25 s of
# the smoke's 3 minutes (the other jobs keep 2)
SAME_FAILURE_RESTARTS = 1


@dataclasses.dataclass(kw_only=True)
class Strike:
    """What happened: ``at`` the newest step any rank had logged when the fault struck (what a resume can cost is
    counted from it); ``fired`` whether the fault happened at all; ``resume`` whether a resume must follow."""

    at: int | None = None
    fired: bool = True
    resume: bool = True
    expect_error: str | None = None      # a failure the product must report with these words (a full disk to the end)
    may_refuse: str | None = None        # words of a refusal to load that is right here (the only iteration damaged)
    flipped: tuple[int, int] | None = None   # flip_slot: (rank, step) of the slot whose byte was flipped
    verify: bool = False                 # run `easyckpt verify` on the save_dir after the job
    storage_intact: bool = True          # False: the fault damaged storage (a flipped byte) or cut it off (an outage)
    notes: list[str] = dataclasses.field(default_factory=list)


def fault_env(cluster: Cluster, spec: str, *, once: bool = True, arm: Path | None = None) -> dict[str, str]:
    env = {"EASYCKPT_FAULT": spec}
    if once:
        env["EASYCKPT_FAULT_ONCE"] = str(cluster.root / "fired")
    if arm is not None:
        env["EASYCKPT_FAULT_ARM"] = str(arm)
    return env


def everywhere(cluster: Cluster, env: dict[str, str]) -> dict[int, dict[str, str]]:
    return {node: env for node in range(cluster.config.nodes)}


def fired(cluster: Cluster) -> bool:
    return (cluster.root / "fired").exists()


def rank_kill(c: Cluster, f: Fault) -> Strike:
    if f.moment == "external":
        c.start_all()
        c.wait_step(f.step, [f.victim])
        pid = c.rank_pid(f.victim)
        at = c.newest_all()
        return Strike(at=at, fired=signal_pid(pid, signal.SIGKILL))
    c.start_all(env=everywhere(c, fault_env(c, f"stager.{f.moment}@{f.step}#{f.victim}")))
    c.wait_until(lambda: fired(c) or c.ended(), f"rank {f.victim} to reach stager.{f.moment} of step {f.step}")
    return Strike(at=c.newest_all(), fired=fired(c))


def node_loss(c: Cluster, f: Fault) -> Strike:
    if f.variant == "leader":
        c.lead_with(f.victim)
    ranks = c.ranks_of(f.victim)
    strike = Strike()
    if f.moment.startswith("stop_"):
        # every rank of the node freezes at that point of step f.step's snapshot; then the node dies whole
        point = f.moment.removeprefix("stop_")
        c.start_all(env={f.victim: fault_env(c, f"stager.{point}@{f.step}:stop", once=False)})
        try:
            c.wait_until(lambda: all(c.stopped(c.rank_pid(r)) for r in ranks) or c.ended(),
                         f"node {f.victim}'s ranks to freeze in step {f.step}", limit=max(60.0, c.left() / 2))
        except Exception:   # noqa: BLE001 - a rank that never froze: the node dies all the same, and it is said
            strike.notes.append("not every rank of the node froze at its fault point")
    else:
        c.start_all()
        c.wait_step(f.step, ranks)
    c.kill_node(f.victim, wipe=True)
    strike.at = c.newest_all()   # after the kill: the other node's ranks may log a step until they block on it
    if c.config.nodes == 1:
        c.start_all(fresh=True)
    else:
        c.start(f.victim)
    return strike


def agent_kill(c: Cluster, f: Fault) -> Strike:
    first = c.ranks_of(f.victim)[0]
    if f.moment == "idle":
        c.start_all()
        c.wait_step(f.step, [first])
        at = c.newest_all()
        return Strike(at=at, fired=signal_pid(c.agent_pid(f.victim), signal.SIGKILL), resume=False, verify=True)
    armed = c.root / "armed"
    c.start_all(env={f.victim: fault_env(c, f"agent.persist.{f.moment}", arm=armed)})
    c.wait_step(f.step, [first])
    armed.touch()
    c.wait_until(lambda: fired(c) or c.ended(), f"node {f.victim}'s agent to reach agent.persist.{f.moment}")
    return Strike(at=c.newest_all(), fired=fired(c), resume=False, verify=True)


def rank_stop(c: Cluster, f: Fault) -> Strike:
    if f.moment == "external":
        c.start_all()
        c.wait_step(f.step, [f.victim])
        pid = c.rank_pid(f.victim)
        if pid is not None and signal_pid(pid, signal.SIGSTOP):   # delivered asynchronously: seen a moment later
            frozen: int = pid
            c.wait_until(lambda: c.stopped(frozen) or gone(frozen), f"rank {f.victim} to stop", limit=30.0)
    else:
        c.start_all(env=everywhere(c, fault_env(c, f"stager.{f.moment}@{f.step}#{f.victim}:stop")))
        c.wait_until(lambda: c.stopped(c.rank_pid(f.victim)) or c.ended(),
                     f"rank {f.victim} to freeze at stager.{f.moment} of step {f.step}")
        pid = c.rank_pid(f.victim)
    strike = Strike(at=c.newest_all(), fired=c.stopped(pid), resume=f.variant == "kill")
    hold = f.hold_s + STOP_BEYOND[c.config.api]
    until = time.monotonic() + hold
    # the fault's own duration (the rank is frozen this long), watched against the job's end
    c.wait_until(lambda: time.monotonic() >= until or c.ended(), f"the {hold:.1f} s freeze of rank {f.victim}")
    if c.ended():
        strike.notes.append("the job ended while a rank was frozen")
    signal_pid(pid, signal.SIGCONT if f.variant == "cont" else signal.SIGKILL)
    return strike


@contextlib.contextmanager
def tmpfs(point: Path, megabytes: int) -> Iterator[Path]:
    """A small tmpfs of our own (root only), always unmounted."""
    point.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(point)],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise RuntimeError(f"cannot mount a tmpfs on {point} (disk_full needs root): {proc.stderr.strip()}")
    try:
        yield point
    finally:
        if subprocess.run(["umount", str(point)], capture_output=True, timeout=60).returncode:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=60)


def fill(directory: Path, leave: int) -> int:
    """Write a file that leaves ``leave`` bytes free on ``directory``'s file system (or none); its size."""
    stat = os.statvfs(directory)
    want = max(0, stat.f_bavail * stat.f_frsize - leave)
    written = 0
    chunk = b"\0" * (1 << 20)
    # Unbuffered: a buffered file whose flush failed for want of space still holds the bytes, and its close
    # raises ENOSPC again, outside the try (soak seed 300322676, fault 18: the harness failed, not the job).
    with open(directory / "filler", "wb", buffering=0) as handle:
        try:
            while written < want:
                written += handle.write(chunk[:min(len(chunk), want - written)])
        except OSError:
            pass   # the persist in flight took the space first: the disk is full either way
    return written


def disk_full(c: Cluster, f: Fault) -> Strike:
    """The caller mounted the tmpfs under the cluster's save_dir (``Cluster(disk=...)``)."""
    disk = c.save_dir.parent if c.config.api == "plain" else c.save_dir.parent.parent
    c.start_all(max_restarts=SAME_FAILURE_RESTARTS if f.variant == "never" else 2)
    c.wait_step(f.step)
    size = fill(disk, f.params["leave"])
    strike = Strike(at=c.newest_all(), resume=f.variant == "crash", verify=True,
                    notes=[f"filled {size >> 10} KiB, leaving {f.params['leave'] >> 10} KiB"])
    if f.variant == "never":
        strike.expect_error = "PersistError"
        return strike
    c.wait_step(f.step + f.after)
    if f.variant == "crash":
        for node in range(c.config.nodes):
            c.kill_node(node, wipe=True)
        strike.at = c.newest_all()
    (disk / "filler").unlink()
    if f.variant == "crash":
        c.start_all(fresh=True)
    return strike


def flip_byte(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([old[0] ^ mask]))
        handle.flush()
        os.fsync(handle.fileno())


def committed_slots(c: Cluster, rank: int) -> list[tuple[int, Path, tuple[int, int, int]]]:
    """(step, path, (data_len, meta_offset, meta_len)) of every committed slot of ``rank``, oldest step first."""
    node = rank // c.config.ranks_per_node
    found = []
    for path in c.shm[node].glob(f"easyckpt-*-r{rank:06d}-s*"):
        with contextlib.suppress(SlotFormatError, OSError, ValueError):
            slot = SlotMap(path, writable=False)
            try:
                header = slot.header()
            finally:
                slot.close()
            if header.committed:
                found.append((header.step, path, (header.data_len, header.meta_offset, header.meta_len)))
    return sorted(found, key=lambda item: item[0])


def hashed(c: Cluster, rank: int, step: int) -> bool:
    node = rank // c.config.ranks_per_node
    report = c.status(node) or []
    return any(s.get("hashed") for r in report for s in r.get("slots", []) if s["rank"] == rank and s["step"] == step)


def flip_slot(c: Cluster, f: Fault) -> Strike:
    c.start_all()
    c.wait_step(f.step)
    c.kill_launchers_and_ranks()
    strike = Strike(at=c.newest_all())   # after the kill: the ranks go on until it lands
    slots = committed_slots(c, f.victim)
    if not slots:
        strike.fired = False
        strike.notes.append(f"rank {f.victim} holds no committed slot")
    else:
        step, path, (data_len, meta_offset, meta_len) = slots[-1] if f.params["newest"] else \
            slots[int(f.params["pick"] * len(slots))]
        start, length = {"data": (DATA_OFFSET, data_len), "meta": (meta_offset, meta_len),
                         "header": (0, HEADER_BYTES)}[f.variant]   # the rest of its page is padding
        # A snapshot changed before its agent checksummed it is checksummed changed: no checksum could tell.
        # This is the fault's precondition, not a wait for the job: the agent hashes every commit at once.
        c.wait_until(lambda: hashed(c, f.victim, step), f"node agent to checksum rank {f.victim}'s step {step}",
                     limit=60.0)
        offset = start + int(f.params["fraction"] * length)
        flip_byte(path, offset, f.params["mask"])
        strike.flipped = (f.victim, step)
        strike.notes.append(f"flipped {f.params['mask']:#04x} at byte {offset} ({f.variant}) of rank {f.victim}'s "
                            f"step {step} ({path.name})")
    c.start_all(fresh=True)
    return strike


def flip_disk(c: Cluster, f: Fault) -> Strike:
    c.start_all()
    c.wait_step(f.step)
    tracker = c.save_dir / "latest_checkpointed_iteration.txt"
    # The fault's precondition, not a wait for the job: something must be on disk to flip. On a loaded machine the
    # agent's first persist can come after the drawn step (a CI run found nothing at step 7 of 12, a persist
    # every 3, and the replay of smoke-11-1 did not fire).
    c.wait_until(tracker.exists, "the job's first persist (a file to flip)", limit=60.0)
    for node in range(c.config.nodes):
        c.kill_node(node, wipe=True)
    strike = Strike(at=c.newest_all(), storage_intact=False)   # after the kills: the other node runs on until its own
    text = tracker.read_text().strip() if tracker.exists() else ""
    iteration = next((p for p in c.save_dir.glob("iteration_*") if text.isdigit()
                      and p.name.removeprefix("iteration_").isdigit() and int(p.name[10:]) == int(text)), None)
    if f.variant == "tracker":
        target = tracker if text else None
    elif iteration is None:
        target = None
    else:
        names = {"tensors": sorted(iteration.glob("*.safetensors")), "metadata": [iteration / "metadata.json"],
                 "common": [iteration / "common.json"]}[f.variant]
        target = names[int(f.params["pick"] * len(names))] if names else None
    if target is None or not target.exists() or target.stat().st_size == 0:
        strike.fired = False
        strike.notes.append(f"nothing to flip (tracker {text or 'missing'}, {f.variant})")
    else:
        offset = int(f.params["fraction"] * target.stat().st_size)
        flip_byte(target, offset, f.params["mask"])
        if iteration is not None and target.parent == iteration and len(list(c.save_dir.glob("iteration_*"))) == 1:
            # nothing older to fall back to: the load must either pass the damage over (a fresh start) or refuse
            # loudly, naming the file; training on damaged bytes would be torn
            strike.may_refuse = "could be loaded by every rank"
        strike.notes.append(f"flipped {f.params['mask']:#04x} at byte {offset} of {target.relative_to(c.save_dir)}")
    c.start_all(fresh=True, max_restarts=SAME_FAILURE_RESTARTS if strike.may_refuse else 2)
    return strike


def object_store_outage(c: Cluster, f: Fault) -> Strike:
    """The caller gave the cluster an ``s3://`` save_dir behind a fault proxy (``Cluster(store=...)``); the store
    comes back after the job ends in any case (``run_job``), so that the judge can read it."""
    proxy = c.store.proxy
    c.start_all(max_restarts=SAME_FAILURE_RESTARTS if f.variant == "never" else 2)
    c.wait_step(f.step)
    with proxy.lock:   # inside the next persist: its ``write``-th object under an iteration
        proxy.down_at = proxy.writes + f.params["write"]
    c.wait_until(lambda: proxy.went_down.is_set() or c.ended(), "the object store to go down inside a persist")
    strike = Strike(at=c.newest_all(), resume=f.variant == "crash" or f.params.get("kill", -1) >= 0, verify=True,
                    storage_intact=False)
    if not proxy.went_down.is_set():
        strike.fired = False
        strike.notes.append("the job ended before its next persist wrote that many objects")
        return strike
    strike.notes.append(f"the store went down at object write {proxy.writes} of the job, at step {strike.at}")
    if f.variant != "never":
        c.wait_until(lambda: c.reached(min(strike.at + f.after, c.shape.last)) or c.ended(),
                     f"the ranks to log step {strike.at + f.after} with the store down")
    if c.ended() or f.variant == "never":   # the store down to the end: the last persist fails, and must say so
        strike.expect_error = "PersistError"
        strike.resume = False
        return strike
    if f.variant == "crash":
        for node in range(c.config.nodes):
            c.kill_node(node, wipe=True)
        strike.at = c.newest_all()
    victim = f.params.get("kill", -1)
    if f.variant == "recover" and victim >= 0:
        # torchrun restarts the workers while the store is still down: they resume from memory (start-up's store
        # check only warns on a restart), and the store comes back once they did
        strike.at = c.newest_all()
        if signal_pid(c.rank_pid(victim), signal.SIGKILL):
            strike.notes.append(f"rank {victim} SIGKILLed at step {strike.at} with the store down")
            c.wait_until(lambda: len(c.resumes(victim)) > 1 or c.ended(),
                         f"rank {victim}'s restarted worker to resume with the store down")
        else:
            strike.resume = False
            strike.notes.append(f"rank {victim} was gone before its kill with the store down")
    proxy.come_back()
    if f.variant == "crash":
        c.start_all(fresh=True)
    return strike


RUNNERS: dict[str, Callable[[Cluster, Fault], Strike]] = {
    "rank_kill": rank_kill, "node_loss": node_loss, "agent_kill": agent_kill, "rank_stop": rank_stop,
    "disk_full": disk_full, "flip_slot": flip_slot, "flip_disk": flip_disk, "object_store_outage": object_store_outage,
}
