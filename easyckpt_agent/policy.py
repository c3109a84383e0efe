"""The node agent's decisions as pure functions over plain data: which step is safe, which step to persist.

The agent's loop (``server``) feeds them what the watcher sees in the slot headers and carries out what
they return (flocks, the control block, a persist); nothing here does I/O, so the rules are tested in one
process, alone and in randomized interleavings (``tests/unit/test_policy.py``).

Invariant 9 on one node: the safe step is the newest step every local rank has committed. The agent
holds the safe step's slots and publishes it; ranks never overwrite it. It moves forward only, except
when the ranks themselves dropped it (a resume invalidated the slots of an abandoned timeline). The
persister takes at most one due step at a time and only one that every local rank holds: with three
slots a rank then always has one to write (the agent keeps the safe step and the step it persists), so a
due step that arrives while a persist runs is passed over rather than held, and the next due step after
the persist is taken instead. Across nodes the same rules hold job-wide, decided by the leader: see
``easyckpt_agent.agreement``.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence


def common_steps(committed: Mapping[int, Iterable[int]], expected_ranks: int) -> frozenset[int]:
    """Steps that every local rank holds committed; none until all ``expected_ranks`` ranks are known."""
    if not committed or len(committed) < expected_ranks:
        return frozenset()
    sets = [frozenset(steps) for steps in committed.values()]
    return frozenset.intersection(*sets)


def next_safe(common: Collection[int], current: int | None) -> int | None:
    """The safe step after this round (one node).

    The current safe step stays while every rank holds it and nothing newer qualifies; a safe step the
    ranks no longer hold (their resume dropped it) is replaced by the newest one that qualifies, older or
    not.
    """
    newest = max(common, default=None)
    if current is not None and current in common and (newest is None or newest <= current):
        return current
    return newest


def due_to_claim(common: Collection[int], *, floor: int, interval: int, busy: bool) -> int | None:
    """The due step to persist now: the newest step every local rank holds that is a multiple of
    ``interval`` and newer than ``floor`` (on disk, or given up), when the persister is free."""
    if busy or interval <= 0:
        return None
    return max((s for s in common if s % interval == 0 and s > floor), default=None)


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


def next_to_persist(ready: Collection[int], asked: Collection[int], *, failing: bool) -> int | None:
    """Of the claimed steps ready to write, the one to persist now: the newest, except while the job is failing
    (a rank died without closing) and a rank asked for an older one by name (a Trainer's save step, waiting
    for its export): then the oldest such first. Written after a newer step it would be older than what is on
    disk and given up, and a dying job does not ask again (the soak's HF kill lost checkpoint-10 so: step 10
    asked for while step 5 was written, then the failure flush of step 11 went first)."""
    if not ready:
        return None
    if failing:
        older = sorted(step for step in ready if step in asked)
        if older:
            return older[0]
    return max(ready)


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
