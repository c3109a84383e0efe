"""Job-wide agreement across nodes (invariants 9 and 12): pure rules over plain data.

Every node agent describes its node in a :class:`NodeState` (what its ranks committed, what it holds,
which of its predecessor's steps it backed up, what its persister does) and sends it to the leader (the
agent of rank 0's node) whenever it changes. The leader alone decides, with :func:`decide`, and sends
every agent the same :class:`Verdict`; each agent then chooses what to hold with :func:`plan_holds`. The
process code (``easyckpt_agent.jobwide``, ``easyckpt_agent.node_agreement``) only carries states and verdicts and
takes flocks.

Two protections, two steps:

* the **job-safe** step: the newest step every node holds (so every rank of the job committed it). A rank
  kill needs it while every node lives. It moves as soon as the ranks commit: the leader names the newest
  step every node's ranks committed as the *candidate*, every agent holds it, and once every agent holds
  it, it is job-safe. Nothing here waits for a backup.
* the **node-safe** step: the newest job-safe step whose rank-private bytes every node has backed up on
  its buddy. A node loss needs it; it trails the job-safe step by the time a backup takes.

Slots: an agent holds at most ``slots - 1`` steps, so every rank always has a slot to write and no
snapshot is skipped because of a hold. A persist in flight comes first (its slots are being read); the
job-safe step next (the floor a rank kill falls back to), then the candidate (the step that becomes
job-safe next), then the node-safe step. While a persist runs, every node holds the persisted step (the
leader takes a due step only once every node holds it, and every node keeps it until the leader
committed or gave up the iteration): it is the floor then, so the candidate comes before the job-safe
step and the job-safe step keeps moving with three slots as well.

Persists: a due step (a multiple of ``save_storage_interval``) is taken job-wide once every node holds it
and no node's persister is busy; one that arrives while some node still persists is passed over, and the
newer of two undecided due steps wins. Every decision is announced in the verdict (taken, passed and
why), so nothing waits for a step that will not come.

Failures: a node whose persist of a step failed (a full disk, the store down) says so in its state once none of its
ranks lives and it is not retrying it (a rank's ``close()`` asks for its last step again); the verdict names the
newest such failure of a step the leader has not committed (:func:`job_failure`), so that a rank of another node
waiting for that step's commit hears at once that it cannot come.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MAX_STEPS = 8          # steps a state lists per field (the newest): slots per rank are a handful
PASSED_KEPT = 16       # passed-over due steps a verdict repeats (the newest), for late listeners
# The fewest slots per rank with which a node says what a verdict made it hold in the same round
# (easyckpt_agent.node_agreement.NodeAgreement.agree), not at its next one.
PROMPT_STATE_SLOTS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class StepFailure:
    """A node's persist of ``step`` failed for good (its persister's newest failure, and no local rank left to ask
    for it again): the job's iteration of ``step`` cannot be committed, since it needs every node's files."""

    step: int
    node: str
    errno: int                  # 0 when the error was not an OSError
    text: str                   # the path and the error, one line
    needed: int | None = None   # bytes the persist needed, when known
    free: int | None = None     # bytes free before it started, when known

    def report(self, now: float) -> dict[str, Any]:
        """The fields of ``easyckpt_wire.control.PersistFailure`` (what a rank's ``PersistError`` carries), as heard
        at wall time ``now``."""
        return {"step": self.step, "errno": self.errno, "text": f"on node {self.node}: {self.text}",
                "needed": self.needed, "free": self.free, "since": now, "at": now, "failures": 1}


@dataclasses.dataclass(frozen=True, slots=True)
class NodeState:
    """What one node's agent tells the leader (the STATE message)."""

    node: str
    local: frozenset[int] = frozenset()   # steps every local rank holds committed now
    held: frozenset[int] = frozenset()    # steps whose slots the agent holds on every local rank
    backed: frozenset[int] = frozenset()  # steps of the predecessor node whose backup is complete here
    busy: int | None = None               # the step its persister writes (None: free)
    took: int = -1                        # the newest due step it took (started, finished or failed)
    lost: frozenset[int] = frozenset()    # due steps it was told to take but could not hold
    # The step of the persist this node's persister finished last (None: none yet), and the newest step a local
    # rank had committed when its agent saw it end: due steps between the two came while the persister wrote.
    wrote: int | None = None
    freed: int = -1
    # The persist this node's persister was busy with when it could not take the newest of ``lost`` (None: it was
    # free, and a local rank no longer held the step): a flush of a newer step, say, as the job ends.
    lost_to: int | None = None
    # Whether a local rank lives (or may still come: no rank has registered yet). False once every local rank
    # died or said goodbye: what is not in ``local`` or ``held`` then, this node can never write.
    alive: bool = True
    failure: StepFailure | None = None    # its newest failed persist, once no local rank can ask for it again

    def newest(self) -> int | None:
        return max(self.local, default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What the leader tells every agent (the VERDICT message). -1 stands for none on the wire."""

    job_safe: int | None = None
    node_safe: int | None = None
    candidate: int | None = None
    take: int | None = None               # the due step every node persists now
    passed: tuple[tuple[int, str], ...] = ()   # due steps passed over (step, why), newest last
    committed: int | None = None          # the newest iteration the leader committed
    newest: int | None = None             # the newest step every node's ranks committed
    decided: int = -1                     # due steps at or below are decided; a newer one is held until it is
    failure: StepFailure | None = None    # a node's failed persist of a step newer than ``committed``

    def passed_steps(self) -> frozenset[int]:
        return frozenset(step for step, _ in self.passed)


@dataclasses.dataclass(frozen=True, slots=True)
class Book:
    """The leader's memory: the newest decided due step (taken or passed), the one taken, those passed over,
    and the candidate it proposed."""

    decided: int = -1           # due steps at or below are decided (or were on disk before)
    taken: int | None = None    # the newest due step taken
    passed: tuple[tuple[int, str], ...] = ()
    candidate: int | None = None

    def passed_steps(self) -> frozenset[int]:
        return frozenset(step for step, _ in self.passed)


def newest(steps: Iterable[int], limit: int = MAX_STEPS) -> frozenset[int]:
    """The ``limit`` newest of ``steps`` (what a state carries)."""
    return frozenset(sorted(steps, reverse=True)[:limit])


def _meet(sets: Iterable[frozenset[int]]) -> frozenset[int]:
    sets = list(sets)
    return frozenset.intersection(*sets) if sets else frozenset()


def job_steps(states: Mapping[str, NodeState], nodes: Sequence[str],
              proposed: int | None = None) -> tuple[int | None, int | None, int | None, int | None]:
    """(job-safe, node-safe, candidate, newest common) from every node's state; None while a node of
    ``nodes`` has not reported (a node that says nothing holds nothing).

    The candidate stays the one ``proposed`` before until it is job-safe, or until some node can no longer
    hold it (its ranks hold it neither committed nor held): a candidate that moved on with every new step
    would leave the nodes holding different steps whenever one of them is a step behind, and the job-safe
    step would never move."""
    if not nodes or any(node not in states for node in nodes):
        return None, None, None, None
    chosen = [states[node] for node in nodes]
    committed = _meet(s.local for s in chosen)
    held = _meet(s.held for s in chosen)
    backed = _meet(s.backed for s in chosen) if len(chosen) > 1 else held
    job_safe = max(held, default=None)
    node_safe = max(held & backed, default=None)
    common = max(committed, default=None)
    if proposed is not None and (job_safe is None or proposed > job_safe) and all(
            proposed in s.local or proposed in s.held for s in chosen):
        return job_safe, node_safe, proposed, common
    candidate = common if common is not None and (job_safe is None or common > job_safe) else None
    return job_safe, node_safe, candidate, common


def _busy(states: Sequence[NodeState], taken: int | None) -> dict[str, int]:
    """Nodes whose persister is not free for a new due step: one writing, or one that has not yet seen the
    due step the leader told every node to take (its state trails the verdict)."""
    busy = {}
    for state in states:
        if state.busy is not None:
            busy[state.node] = state.busy
        elif taken is not None and state.took < taken:
            busy[state.node] = taken
    return busy


def decide_due(states: Mapping[str, NodeState], nodes: Sequence[str], *, interval: int,
               book: Book) -> tuple[int | None, Book]:
    """The due step every node persists now (or None), and the book after it. Pure: same inputs, same
    decision.

    A due step up to the newest step every node's ranks committed is taken once every node holds it and
    every persister is free, the oldest undecided one first. It is passed over at once when some persister
    is busy (the next due step after the persist is taken), or when the ranks of some node no longer hold
    it (they moved past it before their agent held it), named as a persist's when that node's persister was still
    writing as its ranks committed the step (the persist ended after). A taken step that some node could not take
    is announced as passed over too (its iteration cannot complete). Every due step is decided one way or the other, and
    every one passed over is announced."""
    if interval <= 0 or not nodes or any(node not in states for node in nodes):
        return None, book
    chosen = [states[node] for node in nodes]
    passed: list[tuple[int, str]] = []
    if book.taken is not None and book.taken not in book.passed_steps():
        lost = [s for s in chosen if book.taken in s.lost]
        if lost:
            passed.append((book.taken, _why_lost(book.taken, lost)))
    committed = _meet(s.local for s in chosen)
    held = _meet(s.held for s in chosen)
    busy = _busy(chosen, book.taken)
    newest_common = max(committed, default=-1)
    take, decided = None, book.decided
    # Every undecided due step up to the newest common step, oldest first. Not only the newest two: a slow
    # node's state can move the newest common step by two intervals at once, and a due step left out of this
    # list would be decided (``decided`` moves past it) without a word, persisted nowhere. The list is short
    # (``decided`` starts at the newest step on disk, and states list a few steps each); beyond PASSED_KEPT no
    # verdict could repeat them anyway.
    first = (book.decided // interval + 1) * interval if book.decided >= 0 else 0
    for step in range(first, newest_common + 1, interval)[-PASSED_KEPT:]:
        missing = sorted(s.node for s in chosen if step not in s.local and step not in s.held)
        newest = step + interval > newest_common
        if take is not None:
            passed.append((step, f"every node persists due step {take}, taken just before it"))
        elif busy:
            node, other = sorted(busy.items())[0]
            passed.append((step, f"node {node} still persists step {other}"))
        elif step in held:
            take = step
        elif missing:
            passed.append((step, _why_missing(step, [states[node] for node in missing])))
        elif newest:
            break   # every node is about to hold it: decided at the next state
        else:
            passed.append((step, f"the newer due step {step + interval} came before it was held everywhere"))
        decided = step
    if not passed and take is None and decided == book.decided:
        return None, book
    return take, Book(decided=decided, taken=take if take is not None else book.taken,
                         passed=(*book.passed, *passed)[-PASSED_KEPT:])


def _why_missing(step: int, missing: Sequence[NodeState]) -> str:
    """Why due ``step`` is passed over when the ranks of the ``missing`` nodes no longer hold it. When each of those
    nodes was still persisting as its ranks committed the step (it lies between that persist's step and the step
    its ranks had reached when the persist ended), the persist is the reason, as the rule allows: the decision
    just came after the persist ended. Otherwise the agents were too slow to hold it."""
    writing = [s for s in missing if s.wrote is not None and s.wrote < step <= s.freed]
    if len(writing) == len(missing):
        first = writing[0]
        return (f"node {first.node} still persisted step {first.wrote} when its ranks committed it (they moved past "
                "it before the persist ended)")
    return f"the ranks of node(s) {sorted(s.node for s in missing)} moved past it before their agent held it"


def _why_lost(step: int, lost: Sequence[NodeState]) -> str:
    """Why taken ``step`` is passed over when the ``lost`` nodes could not take it: named as a persist's when each
    of them was busy with another persist when told (the rule's case: a persist still runs)."""
    if all(s.lost_to is not None and max(s.lost) == step for s in lost):
        return f"node {lost[0].node} still persists step {lost[0].lost_to} (it could not take this one when told to)"
    return f"node(s) {sorted(s.node for s in lost)} could not persist it when told to"


def decide(states: Mapping[str, NodeState], nodes: Sequence[str], *, interval: int, book: Book,
           committed: int | None) -> tuple[Verdict, Book]:
    """The leader's verdict over every node's state."""
    job_safe, node_safe, candidate, common = job_steps(states, nodes, book.candidate)
    _, book = decide_due(states, nodes, interval=interval, book=book)
    book = dataclasses.replace(book, candidate=candidate)
    # The newest taken step is repeated in every verdict: an agent that missed one (or restarted) still
    # learns it, and acts on it once (``NodeState.took``).
    return Verdict(job_safe, node_safe, candidate, book.taken, book.passed, committed, common, book.decided,
                   job_failure(states, nodes, committed)), book


def job_failure(states: Mapping[str, NodeState], nodes: Sequence[str], committed: int | None) -> StepFailure | None:
    """The newest failed persist of any node of ``nodes`` whose step the leader has not committed (the first node
    by name among equals), or None.

    Every node hears it in the verdict, so that a rank waiting for the job to commit a step whose files this node
    wrote (the end of a run: ``close()``) learns at once that another node's files will not come, instead of
    waiting flush_timeout for a commit that cannot happen; and its agent keeps the memory that holds the step
    (soak seed 1323, fault 523: the leader's disk filled up after the other node had written its files)."""
    failures = [s.failure for node in sorted(nodes) if (s := states.get(node)) is not None and s.failure is not None
                and (committed is None or s.failure.step > committed)]
    return max(failures, key=lambda f: f.step, default=None)


def persist_floor(verdict: Verdict, present: Iterable[int]) -> int | None:
    """The due step the leader took, kept held by every node until the leader committed it and a newer step is
    job-safe (or it was passed over): while the nodes persist it they move their other hold to the candidate
    one by one, and it is the step every node holds for sure meanwhile.

    Not until the job-safe step alone is newer: a node still writing holds the persisted step and the candidate
    only (its ranks need a slot to write and one spare), so when the nodes that had finished let the persisted
    step go as soon as the job-safe step passed it, the nodes held no step in common for a round (the
    simulation's job-safe lag of 32-47 steps with persists longer than the interval)."""
    take = verdict.take
    if take is None or take in verdict.passed_steps():
        return None
    if verdict.committed is not None and verdict.committed >= take and verdict.job_safe is not None \
            and verdict.job_safe > take:
        return None
    return take if take in set(present) else None


def counts_on(verdict: Verdict, step: int | None) -> bool:
    """Whether the verdict counts on ``step`` as the job-safe, candidate or node-safe step. Such a step is held by a
    role of its own even while a persist or a claim holds it too (both share the slots' one flock, so it costs no
    slot), and the floor (``persist_floor``) is held after its persist only then: otherwise its slot stays with the
    ranks, as a spare for the next due step (four slots).

    The floor not held at all after its persist left no step held on every node: with three slots (the default) the
    candidate stays the persisted step until it is job-safe, so from each persist's end to the next due step the job
    had no job-safe or node-safe step, and the ranks' lag gates waited at every snapshot (a 12-step soak reference
    run of 2 nodes spent 21 of its 24 s in them). Always held, it took the slot that spares a due step the agents
    have not seen yet: at 20-35 ms a step (2 nodes x 2 ranks, four slots), due steps were overwritten before their
    agents held them. Held by a role only from the round after its persist ended, a persisted step was held by no
    one in between: the state a node sent then named it held nowhere, and the verdict over it named no job-safe or
    node-safe step after every persist (a real 2-node run of 40 steps at full speed: node-safe lag p99 22, max 40)."""
    return step is not None and step in (verdict.job_safe, verdict.candidate, verdict.node_safe)


def due_to_hold(present: Iterable[int], *, interval: int, decided: int) -> int | None:
    """The newest undecided due step the local ranks hold: held until the leader decides it, so that a
    due step is never lost for want of a hold while the decision is on its way."""
    if interval <= 0:
        return None
    return max((s for s in present if s % interval == 0 and s > decided), default=None)


def plan_holds(*, slots: int, persisting: Iterable[int], job_safe: int | None, candidate: int | None,
               node_safe: int | None, present: Iterable[int], due: int | None = None, spare: bool = True,
               adopted: int | None = None) -> list[int]:
    """The steps an agent holds on every local rank, in priority order, at most ``slots - 1`` of them.

    ``persisting``: steps held for persists (in flight, or claimed): always kept. ``due``: the newest due
    step not decided yet (``due_to_hold``). ``present``: steps every local rank holds committed (or that the
    agent holds already); a step the ranks no longer hold cannot be held. ``adopted``: the job-safe step this
    node adopted from an earlier verdict (``job_safe_here``): a verdict that names an older one (or none) was
    decided over states of different ages, and following it would let go of the one step every node still
    holds (then no node holds an older one either, and the job has no common step for a round).

    When ``spare``, four slots or more and no due step held, the job-safe step and the candidate take at most
    ``slots - 2`` slots: one slot beside the one the ranks write stays free for a due step that the agent has not
    seen yet (the ranks spare it, ``easyckpt.snapshot.slot_choice``), so that a starved agent still finds it. A
    node-safe step older than both takes that slot while it trails them: it is the only step a node loss can
    resume from (the survivors' ranks must still hold it), and without a hold the ranks overwrite it within two
    snapshots while the backup of a newer step is on its way, and a node loss finds no step both in the
    survivors' memory and backed up (CI, test_lost_node_resumes_from_replicas...: node 1 lost at step 23, the
    survivors held [23, 22, 20, 19], every rank resumed from disk at 15; the replica planner's two-step limit,
    ``easyckpt.node.replicas.CANDIDATE_STEPS``, could do the same). A due step being decided still comes first.
    While a persist runs, its step is the job's floor (every node holds it), so the candidate comes before the
    job-safe step;
    otherwise the job-safe step is the floor and is kept until the candidate is job-safe."""
    persist = sorted(set(persisting), reverse=True)
    here = set(present) | set(persist)
    chosen = list(persist)
    if due is not None and due in here and due not in chosen and len(chosen) < slots - 1:
        chosen.append(due)
    # The spare slot is for a due step nobody has seen yet: not needed while one is held, and not taken from
    # three slots, where it would leave the job-safe step no way to move but node by node.
    reserve = spare and due is None and slots > 3
    limit = min(slots - 1, max(len(chosen), slots - 2 if reserve else slots - 1))
    # With a persist in flight the persisted step is the floor every node holds, so the other hold moves to the
    # candidate first (two slots have room for nothing else); otherwise the job-safe step stays held until the
    # candidate is job-safe (two phases), and when a due step being decided takes the other slot, the candidate
    # waits the few milliseconds of that decision.
    # A node that missed the verdict's job-safe step (its state was a round old when the leader decided) keeps
    # the newest step below it that it has: the others still hold that one, and letting it go leaves the job
    # with no common step until the next rounds.
    safe_here = job_safe_here(job_safe, here, adopted)
    roles = [candidate, safe_here, node_safe] if persist or slots <= 2 else [safe_here, candidate, node_safe]
    for step in roles:
        cap = slots - 1 if step == node_safe else limit
        if step is not None and step in here and step not in chosen and len(chosen) < cap:
            chosen.append(step)
    return chosen


def job_safe_here(job_safe: int | None, held: Iterable[int], adopted: int | None = None) -> int | None:
    """The job-safe step as far as this node holds it: the newest step of ``held`` at or below the verdict's
    job-safe step, or at or below the one this node ``adopted`` before when the verdict names an older one
    (the job-safe step never moves back within a timeline; a verdict over states of different ages can)."""
    bound = max((s for s in (job_safe, adopted) if s is not None), default=None)
    return None if bound is None else max((s for s in held if s <= bound), default=None)


def lag(newest: int | None, protected: int | None) -> int | None:
    """Steps a failure at ``newest`` would recompute if the job resumed at ``protected``."""
    if newest is None:
        return None
    return newest + 1 if protected is None else max(0, newest - protected)


# On the wire (STATE, VERDICT): steps as ints, -1 for none; lists bounded and checked on arrival.
def _opt(value: int | None) -> int:
    return -1 if value is None else value


def _read_opt(message: Mapping[str, object], field: str, where: str) -> int | None:
    value = message[field]
    if type(value) is not int or value < -1:
        raise ValueError(f"{where}: field {field!r} is {value!r:.40}, expected a step or -1")
    return None if value < 0 else value


def _read_steps(message: Mapping[str, object], field: str, where: str, limit: int = MAX_STEPS) -> frozenset[int]:
    value = message[field]
    if not isinstance(value, list) or len(value) > limit or not all(type(s) is int and s >= 0 for s in value):
        raise ValueError(f"{where}: field {field!r} must list at most {limit} steps, got {value!r:.80}")
    return frozenset(value)


def state_to_wire(state: NodeState) -> dict[str, object]:
    return {"node": state.node, "local": sorted(newest(state.local)), "held": sorted(newest(state.held)),
            "backed": sorted(newest(state.backed)), "busy": _opt(state.busy), "took": state.took,
            "lost": sorted(newest(state.lost)), "wrote": _opt(state.wrote), "freed": state.freed,
            "lost_to": _opt(state.lost_to), "alive": state.alive, "failure": _failure_to_wire(state.failure)}


def state_from_wire(message: Mapping[str, object]) -> NodeState:
    where = f"STATE from node {message['node']!r:.64}"
    took = message["took"]
    if type(took) is not int or took < -1:
        raise ValueError(f"{where}: field 'took' is {took!r:.40}, expected a step or -1")
    # ``wrote``, ``freed`` and ``lost_to`` came after the first STATE: an agent that does not send them finished no
    # persist and says nothing of why it could not take a step.
    optional = {field: message.get(field, -1) for field in ("wrote", "freed", "lost_to")}
    alive = message.get("alive", True)   # absent from older senders, which never say their ranks are gone
    if type(alive) is not bool:
        raise ValueError(f"{where}: field 'alive' is {alive!r:.40}, expected true or false")
    return NodeState(str(message["node"]), _read_steps(message, "local", where), _read_steps(message, "held", where),
                     _read_steps(message, "backed", where), _read_opt(message, "busy", where), took,
                     _read_steps(message, "lost", where), _read_opt(optional, "wrote", where),
                     _decided(_read_opt(optional, "freed", where)), _read_opt(optional, "lost_to", where), alive,
                     _failure_from_wire(message, where))


def _failure_to_wire(failure: StepFailure | None) -> dict[str, object] | None:
    return None if failure is None else {**dataclasses.asdict(failure), "text": failure.text[:300]}


def _failure_from_wire(message: Mapping[str, object], where: str) -> StepFailure | None:
    """The optional ``failure`` of a STATE or VERDICT (absent from older senders: no failure said)."""
    value = message.get("failure")
    if value is None:
        return None
    ints = ("step", "errno")
    sizes = ("needed", "free")
    if not isinstance(value, dict) or set(value) != {"node", "text", *ints, *sizes} \
            or not isinstance(value["node"], str) or not isinstance(value["text"], str) \
            or not all(type(value[k]) is int and value[k] >= 0 for k in ints) \
            or not all(value[k] is None or (type(value[k]) is int and value[k] >= 0) for k in sizes):
        raise ValueError(f"{where}: field 'failure' must be null or a node's failed persist (step, node, errno, "
                         f"text, needed, free), got {value!r:.120}")
    return StepFailure(value["step"], value["node"][:64], value["errno"], value["text"][:300], value["needed"],
                       value["free"])


def verdict_to_wire(verdict: Verdict) -> dict[str, object]:
    return {"job_safe": _opt(verdict.job_safe), "node_safe": _opt(verdict.node_safe),
            "candidate": _opt(verdict.candidate), "take": _opt(verdict.take), "committed": _opt(verdict.committed),
            "newest": _opt(verdict.newest), "decided": verdict.decided,
            "passed": [[step, why[:200]] for step, why in verdict.passed], "failure": _failure_to_wire(verdict.failure)}


def _decided(value: int | None) -> int:
    return -1 if value is None else value


def verdict_from_wire(message: Mapping[str, object]) -> Verdict:
    where = f"VERDICT from node {message['node']!r:.64}"
    passed = message["passed"]
    if not isinstance(passed, list) or len(passed) > PASSED_KEPT or not all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0 and isinstance(p[1], str)
            for p in passed):
        raise ValueError(f"{where}: field 'passed' must list at most {PASSED_KEPT} [step, why] pairs, "
                         f"got {passed!r:.80}")
    return Verdict(job_safe=_read_opt(message, "job_safe", where), node_safe=_read_opt(message, "node_safe", where),
                   candidate=_read_opt(message, "candidate", where), take=_read_opt(message, "take", where),
                   passed=tuple((int(p[0]), str(p[1])) for p in passed),
                   committed=_read_opt(message, "committed", where), newest=_read_opt(message, "newest", where),
                   decided=_decided(_read_opt(message, "decided", where)), failure=_failure_from_wire(message, where))
