"""The node agent's decisions as pure functions over plain data: which step is safe, which step to persist.

The agent's loop (``server``) feeds them what the watcher sees in the slot headers and carries out what
they return (flocks, the control block, a persist); nothing here does I/O, so the rules are tested in one
process, alone and in randomized interleavings (``tests/test_policy.py``).

Invariant 9: the safe step is the newest step every local rank has committed (multi-node: and whose
backup from the predecessor node is complete here, so that losing that node leaves a step it can get).
The agent holds the safe step's slots and publishes it; ranks never overwrite it. It moves forward only,
except when the ranks themselves dropped it (a resume invalidated the slots of an abandoned timeline).
The persister takes at most one due step at a time and only one that every local rank holds: with three
slots a rank then always has one to write (the agent keeps the safe step and the step it persists), so a
due step that arrives while a persist runs is passed over rather than held, and the next due step after
the persist is taken instead. Across nodes the same holds: the nodes tell each other what their
persisters do (``cluster_verdict``) instead of holding a due step until a busy node catches up, and the step
held for a backup costs a slot only when one is left over (``may_hold_pending``).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple


def common_steps(committed: Mapping[int, Iterable[int]], expected_ranks: int) -> frozenset[int]:
    """Steps that every local rank holds committed; none until all ``expected_ranks`` ranks are known."""
    if not committed or len(committed) < expected_ranks:
        return frozenset()
    sets = [frozenset(steps) for steps in committed.values()]
    return frozenset.intersection(*sets)


def next_safe(common: Collection[int], current: int | None, backed_up: Collection[int] | None = None) -> int | None:
    """The safe step after this round.

    ``backed_up``: multi-node only, the steps whose backup from the predecessor node is complete here
    (None in a single-node job). The current safe step stays while every rank holds it and nothing newer
    qualifies; a safe step the ranks no longer hold (their resume dropped it) is replaced by the newest
    one that qualifies, older or not.
    """
    eligible = set(common) if backed_up is None else set(common) & set(backed_up)
    newest = max(eligible, default=None)
    if current is not None and current in common and (newest is None or newest <= current):
        return current
    return newest


def next_pending(common: Collection[int], *, above: int, current: int | None, expired: bool) -> int | None:
    """Multi-node only: the step the agent holds while the predecessor's backup of it completes, so that
    it can become the safe step (the ranks would otherwise overwrite it with their next snapshot whenever
    a persist holds the third slot, and the safe step would trail by a whole persist).

    ``above``: the safe step, or a pending step given up on (``expired``: its backup did not complete in
    time); only newer steps qualify. The current one stays until it is safe, gone or expired; the agent does
    not chase newer steps meanwhile, which is what kept the safe step from ever moving.
    """
    newer = {step for step in common if step > above}
    if current is not None and current in newer and not expired:
        return current
    if expired and current is not None:
        newer = {step for step in newer if step > current}
    return max(newer, default=None)


def due_to_claim(common: Collection[int], *, floor: int, interval: int, busy: bool) -> int | None:
    """The due step to persist now: the newest step every local rank holds that is a multiple of
    ``interval`` and newer than ``floor`` (on disk, or given up), when the persister is free."""
    if busy or interval <= 0:
        return None
    return max((s for s in common if s % interval == 0 and s > floor), default=None)


class PeerPersister(NamedTuple):
    """What another node's agent last said of its persister (multi-node)."""

    busy_with: int | None       # the step it persists; None when free
    ready: int | None           # the due step it holds, free to persist it once every node is
    passed: frozenset[int]      # due steps it passed over (its recent ones)
    took: int | None = None     # the newest due step it took (its persist may be over before the news is)


def cluster_verdict(step: int, *, peers: Mapping[str, PeerPersister], waited: float, limit: float) -> str:
    """Multi-node: what a node whose persister is free does with due step ``step``, which it holds: "take"
    (persist it), "pass" (let it go, for good) or "wait" (keep holding it and ask again).

    Every node must persist the same steps (the leader commits an iteration only once every node wrote
    it), and no node may hold a due step for a busy node to catch up: that slot is the ranks' (invariant
    9). So a node takes a due step only once every other node said it holds that step and is free too (or
    already persists it); it passes the step over as soon as any node passed it over, a node busy with
    another persist passes it over at once, and a node that never answers is given up on after ``limit``
    seconds. The wait is that of one message: the nodes' ranks commit a step together.
    """
    if any(step in peer.passed for peer in peers.values()):
        return "pass"
    if all(step in (peer.ready, peer.busy_with, peer.took) for peer in peers.values()):
        return "take"
    return "pass" if waited > limit else "wait"


def may_hold_pending(target: int, held: Collection[int], *, slots: int, lag: int) -> bool:
    """Multi-node: whether the agent may hold ``target`` while the predecessor's backup of it completes.

    ``held``: the steps it keeps anyway (the safe step, claimed ones, the persist in flight); ``lag``: the
    newest common step minus the safe step. With a slot left over for the ranks' next snapshot, always.
    Without one, the ranks race the backup instead (a backup that finishes within a step makes the step
    safe before the next snapshot needs its slot, and nothing is skipped); once the safe step trails by two
    steps the race was lost and the step is held anyway, at the price of skipped snapshots until it is
    safe: the safe step must move, whatever the backup takes.
    """
    extra = 0 if target in held else 1
    return len(set(held)) + extra + 1 <= slots or lag >= 2


def passed_over(common: Collection[int], *, floor: int, interval: int, busy: bool) -> int | None:
    """A due step every rank holds that the busy persister cannot take (it will not be held for later)."""
    if not busy or interval <= 0:
        return None
    return max((s for s in common if s % interval == 0 and s > floor), default=None)


def tail_to_persist(common: Collection[int], *, floor: int, interval: int) -> int | None:
    """The job ended: the newest step every rank holds, if the last due step before it never reached
    disk (it was passed over or skipped), so that the tail of the run is not lost."""
    newest = max(common, default=None)
    if newest is None or newest <= floor or interval <= 0:
        return None
    last_due = newest // interval * interval
    if last_due <= floor or last_due in common:
        return None
    return newest


def never_holds(step: int, held: Collection[int], *, ended: bool) -> str:
    """Why a rank holding ``held`` will never hold ``step`` committed; "" while it still may."""
    if step in held:
        return ""
    if ended:
        return f"ended without a snapshot of step {step}"
    # Snapshots go in step order: a rank whose newer snapshot is committed is past ``step`` for good.
    return f"moved on without a snapshot of step {step}" if held and max(held) > step else ""


# Timelines (invariant 10) ----------------------------------------------------------------------------
def abandoned_by_resume(on_disk: Iterable[int], resumed: int) -> list[int]:
    """Iterations a resume from step ``resumed`` abandons: every one newer than it, oldest first. Idempotent:
    once they are moved aside, the same resume abandons nothing more."""
    return sorted({step for step in on_disk if step > resumed})


def tracker_after_resume(complete: Iterable[int], resumed: int) -> int | None:
    """The step the tracker names once a resume from ``resumed`` moved the newer iterations aside: the
    newest complete one at or below it (None: no iteration of the current timeline is on disk yet)."""
    return max((step for step in complete if step <= resumed), default=None)


def floor_after_resume(complete: Iterable[int], resumed: int, persisted: int | None,
                       given_up: int) -> tuple[int | None, int]:
    """The agent's (newest persisted step, newest given-up step) on the new timeline: nothing newer than
    ``resumed`` counts any more, so the new timeline's steps are persisted whatever numbers the abandoned
    one reached. A persisted step at or below ``resumed`` stands (multi-node: this node's shards, which the
    leader may not have committed yet); a newer one gives way to the newest complete iteration at or
    below ``resumed``."""
    if persisted is None or persisted > resumed:
        persisted = tracker_after_resume(complete, resumed)
    return persisted, given_up if given_up <= resumed else -1


def newest_healthy(current: Collection[int], unhealthy: Collection[int]) -> int | None:
    """The newest complete iteration not known to be unhealthy (a step without a verdict counts as healthy:
    nobody reported against it). Rotation keeps it (invariant 13), so a job whose newest checkpoints
    are all unhealthy can still go back to a healthy one."""
    return max((step for step in current if step not in set(unhealthy)), default=None)


def rotation_keep(keep: Collection[int], current: Collection[int], unhealthy: Collection[int]) -> set[int]:
    """What rotation must not delete: ``keep`` (the step just persisted, the tracked one) and the newest
    healthy iteration."""
    healthy = newest_healthy(current, unhealthy)
    return set(keep) | ({healthy} if healthy is not None else set())


def rotation_victims(current: Sequence[int], abandoned: Sequence[tuple[str, int]], *, max_ckpt_num: int,
                     keep: Collection[int]) -> tuple[list[tuple[str, int]], list[int]]:
    """What rotation deletes so that at most ``max_ckpt_num`` checkpoints remain, abandoned ones counted.

    ``current``: complete iterations in save_dir; ``abandoned``: (``.abandoned-<time>`` name, step) of
    those moved aside. Abandoned iterations go first, the oldest abandonment first (its lowest step
    first); then current ones oldest first, never one in ``keep`` (the step just persisted, the tracked
    one) nor the newest.
    """
    excess = len(current) + len(abandoned) - max_ckpt_num
    if excess <= 0:
        return [], []
    gone_abandoned = sorted(abandoned)[:excess]
    excess -= len(gone_abandoned)
    newest = max(current, default=None)
    gone_current = []
    for step in sorted(current):
        if excess <= 0:
            break
        if step in keep or step == newest:
            continue
        gone_current.append(step)
        excess -= 1
    return gone_abandoned, gone_current
