"""A seeded discrete-event simulation of a multi-node job driving easyckpt's own rules (invariants 9 and 12).

    python benchmarks/cluster_sim.py --nodes 8,64,512 --seed 1 --json benchmarks/results/cluster-sim.json

Nothing here re-implements a rule: the ranks choose slots with ``easyckpt.snapshot.slot_choice``, the leader decides
with ``easyckpt_agent.agreement.decide`` and every agent holds what ``easyckpt_agent.agreement.plan_holds`` says,
exactly as the
processes do. What is modelled is time: step times with jitter, the copy, each agent's reaction time (a
slow agent reacts ``--slow-factor`` times later), the network between agents, the hashing and push of a
backup, the leader's cost per node, and persists that take ``--persist-ms``. ``--backup-ms`` makes backups slow
(a starved agent hashing late): a backup then fails when its source's ranks overwrote the step before it ended.

Faults are drawn from the seed: a rank kill (every rank restarts; the job resumes at the newest step every
rank still holds) and a node loss (its memory is gone; the job resumes at the newest step every survivor
holds whose rank-private bytes the lost node's buddy backed up). Reported per run: steps lost per fault,
the job-safe and node-safe lags (newest committed step minus each, sampled every step), due steps persisted
and passed over, and snapshots skipped (never, by invariant 9).
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import platform
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from easyckpt.snapshot.slot_choice import SlotView, undecided_due, waits_for_due, write_order  # noqa: E402
from easyckpt.snapshot.slots import MULTI_NODE_SLOTS  # noqa: E402
from easyckpt_agent.agreement import (  # noqa: E402
    PROMPT_STATE_SLOTS,
    Book,
    NodeState,
    Verdict,
    counts_on,
    decide,
    due_to_hold,
    job_safe_here,
    newest,
    persist_floor,
    plan_holds,
)


@dataclasses.dataclass(frozen=True)
class Config:
    nodes: int = 2
    ranks: int = 2                 # per node
    slots: int = 4
    steps: int = 60
    interval: int = 5              # save_storage_interval
    step_ms: float = 100.0
    jitter_ms: float = 10.0        # per rank and step, uniform
    copy_ms: float = 5.0
    agent_ms: float = 3.0          # an agent's reaction to a commit or a message (mean, exponential)
    slow_node: int = -1            # this node's agent reacts slow_factor times later
    slow_factor: float = 10.0
    net_ms: float = 1.0
    hash_ms: float = 2.0           # hashing and pushing one step's backup
    backup_ms: float = 0.0         # a backup's further time (mean, exponential; the slow node's times slow_factor):
    #                                a starved agent's fetch that takes steps, failing if its source overwrote the step
    persist_ms: float = 30.0
    leader_us_per_node: float = 20.0
    max_backup_lag: int = 2        # Checkpointer(max_backup_lag=): ranks wait while the node-safe step trails more
    due_wait_ms: float = 500.0     # easyckpt.snapshot.slots.DUE_WAIT: a rank waits this long (or 4 steps, the longer)
    #                                for its agent's word on a due step in its one free slot (four slots or
    #                                more); 0: it never waits


@dataclasses.dataclass
class Rank:
    slots: list[tuple[int, int]]     # (step, generation) per slot, step -1: empty or being written
    committed: dict[int, int] = dataclasses.field(default_factory=dict)   # step -> slot
    node_safe_seen: int = -1          # the newest node-safe step its lag gate read
    due_since: float | None = None    # when its wait for the agent's word on a due step began


@dataclasses.dataclass
class Node:
    index: int
    ranks: list[Rank]
    held: set[int] = dataclasses.field(default_factory=set)
    published: frozenset[int] = frozenset()
    decided: int = -1
    verdict: Verdict | None = None
    busy: int | None = None
    node_safe: int | None = None     # what the control block says (the verdict's, when held here)
    adopted: int | None = None       # the job-safe step as far as this node holds it (``Protection.safe``)
    took: int = -1
    writing: int | None = None       # the persist in flight at the agent's last tick
    wrote: int | None = None         # the last persist the agent saw end, and its ranks' newest step by then
    freed: int = -1
    lost_to: int | None = None       # the persist that kept it from the newest due step it could not take
    lost: set[int] = dataclasses.field(default_factory=set)
    backed: set[int] = dataclasses.field(default_factory=set)   # predecessor's steps backed up here
    pushed: dict[int, float] = dataclasses.field(default_factory=dict)   # step -> when the backup arrived
    tick_pending: bool = False
    alive: bool = True
    sent: NodeState | None = None

    def local(self) -> set[int]:
        sets = [set(rank.committed) for rank in self.ranks]
        return set.intersection(*sets) if sets else set()


class Simulation:
    def __init__(self, config: Config, rng: random.Random) -> None:
        self.c = config
        self.rng = rng
        self.now = 0.0
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.nodes = [Node(i, [Rank([(-1, 0)] * config.slots) for _ in range(config.ranks)])
                      for i in range(config.nodes)]
        self.names = [f"n{i:04d}" for i in range(config.nodes)]
        self.states: dict[str, NodeState] = {}
        self.book = Book()
        self.generation = 0
        self.skipped = 0
        self.taken: list[int] = []
        self.passed: dict[int, str] = {}
        self.persisted: set[int] = set()
        self.committed_times: dict[int, float] = {}
        self.job_lags: list[int] = []
        self.node_lags: list[int] = []
        self.newest_begun = -1
        self.leading = False
        self.last_verdict: Verdict | None = None
        self.begun = 0
        self.waited_ms = 0.0
        self.due_waited_ms = 0.0
        self.slowest_ms = 0.0     # the longest any agent took to react (the property tests' precondition)
        self.withdrawn = 0        # verdicts that named no job-safe step after one had been named
        self.uncovered = 0        # samples at which no step was held on every node
        self.backups_failed = 0   # backups whose step the source node's ranks overwrote before the fetch ended

    # events ---------------------------------------------------------------------------------------------
    def at(self, when: float, action: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (when, self.seq, action))

    def run_until(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            self.now, _, action = heapq.heappop(self.queue)
            action()
        self.now = until

    def agent_delay(self, node: Node) -> float:
        mean = self.c.agent_ms * (self.c.slow_factor if node.index == self.c.slow_node else 1.0)
        delay = self.rng.expovariate(1.0 / mean) if mean > 0 else 0.0
        self.slowest_ms = max(self.slowest_ms, delay)
        return delay

    def wake(self, node: Node) -> None:
        if not node.tick_pending and node.alive:
            node.tick_pending = True
            self.at(self.now + self.agent_delay(node), lambda: self.tick(node))

    # ranks ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.at(0.0, lambda: self.step_begins(0))

    def step_begins(self, step: int) -> None:
        """The ranks move in lockstep (a collective every step): each begins its snapshot of ``step`` after a
        jitter, and the next step starts once every rank began this one."""
        if step >= self.c.steps:
            return
        self.sample(step - 1)
        self.begun = 0
        for node in self.nodes:
            for rank in node.ranks:
                self.at(self.now + self.rng.uniform(0, self.c.jitter_ms),
                        lambda n=node, r=rank: self.gate(n, r, step, self.now, None))

    def gate(self, node: Node, rank: Rank, step: int, since: float, budget: float | None) -> None:
        """``easyckpt.node.lag_gate``: wait while the node-safe step trails by more than max_backup_lag (bounded)."""
        if node.node_safe is not None:   # easyckpt.node.lag_gate remembers the newest node-safe step it read
            rank.node_safe_seen = max(rank.node_safe_seen, node.node_safe)
        lag = step - rank.node_safe_seen
        limit = self.c.max_backup_lag
        if limit > 0 and lag > limit and self.now - since < max(200.0, 4 * self.c.step_ms * min(lag - limit, limit)):
            self.at(self.now + 1.0, lambda: self.gate(node, rank, step, since, budget))
            return
        if self.due_waits(node, rank):
            self.at(self.now + 1.0, lambda: self.gate(node, rank, step, since, budget))
            return
        self.waited_ms += self.now - since
        self.begin(node, rank, step)
        self.begun += 1
        if self.begun == self.c.nodes * self.c.ranks:
            self.at(self.now + self.c.step_ms, lambda: self.step_begins(step + 1))

    def choice(self, node: Node, rank: Rank) -> tuple[list[SlotView], int | None, list[int]]:
        """``RankSlots._order``: the slot headers, the undecided due step to spare and the write order."""
        views = [SlotView(i, True, s >= 0, s, g) for i, (s, g) in enumerate(rank.slots)]
        spare = undecided_due(views, every=self.c.interval, decided=node.decided)
        return views, spare, write_order(views, lambda s: s in node.published, spare=spare)

    def due_waits(self, node: Node, rank: Rank) -> bool:
        """``RankSlots._let_due_be_decided``: whether the rank still waits for its agent's word on the undecided due
        step in its one free slot (at most ``due_wait_ms`` or four steps, the longer)."""
        views, spare, order = self.choice(node, rank)
        if self.c.due_wait_ms > 0 and node.alive and waits_for_due(views, order, spare, gated=True):
            rank.due_since = self.now if rank.due_since is None else rank.due_since
            if self.now - rank.due_since < max(self.c.due_wait_ms, 4 * self.c.step_ms):
                return True
        if rank.due_since is not None:
            self.due_waited_ms += self.now - rank.due_since
            rank.due_since = None
        return False

    def begin(self, node: Node, rank: Rank, step: int) -> None:
        if not node.alive:
            return
        self.newest_begun = max(self.newest_begun, step)
        _, _, order = self.choice(node, rank)
        if not order:
            self.skipped += 1
            return
        index = order[0]
        old = rank.slots[index][0]
        rank.committed.pop(old, None)
        self.generation += 1
        rank.slots[index] = (-1, self.generation)
        generation = self.generation
        self.at(self.now + self.c.copy_ms, lambda: self.commit(node, rank, index, step, generation))

    def commit(self, node: Node, rank: Rank, index: int, step: int, generation: int) -> None:
        if not node.alive or rank.slots[index][1] != generation:
            return
        rank.slots[index] = (step, generation)
        rank.committed[step] = index
        self.committed_times.setdefault(step, self.now)
        self.wake(node)
        if step in node.local():   # every local rank has it: hash and push the backup to the buddy
            buddy = self.nodes[(node.index + 1) % len(self.nodes)]
            self.at(self.now + self.c.hash_ms + self.c.net_ms + self.backup_delay(node),
                    lambda: self.backup_arrives(node, buddy, step))

    def backup_delay(self, node: Node) -> float:
        mean = self.c.backup_ms * (self.c.slow_factor if node.index == self.c.slow_node else 1.0)
        return self.rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    def backup_arrives(self, source: Node, buddy: Node, step: int) -> None:
        # The fetch reads the source's slots to its end: a step its ranks overwrote meanwhile (not held) fails,
        # as the processes' FETCH is refused ("step N ... was overwritten").
        if self.c.backup_ms > 0 and step not in source.local() | source.held:
            self.backups_failed += 1
            return
        if buddy.alive:
            buddy.pushed[step] = self.now
            self.wake(buddy)

    # agents ---------------------------------------------------------------------------------------------
    def tick(self, node: Node) -> None:
        node.tick_pending = False
        if not node.alive:
            return
        local = node.local()
        node.held &= local | {node.busy} - {None}   # type: ignore[operator]
        # A backup is complete once the push arrived and this node's own ranks hold (and hashed) that step.
        node.backed = {s for s in node.pushed if s in local or s in node.held}
        # backups are kept for the steps this node's ranks still hold (agent.replica.Holdings.keep)
        node.pushed = {s: t for s, t in node.pushed.items() if s >= max(local | {0}) - 8 or s in local | node.held}
        if node.writing is not None and node.busy != node.writing:   # as NodeAgreement._note_persist_end
            node.wrote = node.writing
            node.freed = max((step for rank in node.ranks for step in rank.committed), default=-1)
        node.writing = node.busy
        self.say(node, local)
        self.apply(node, local)
        if self.c.slots >= PROMPT_STATE_SLOTS:
            self.say(node, local)   # what the verdict made it hold, at once (easyckpt_agent.node_agreement.agree)

    def say(self, node: Node, local: set[int]) -> None:
        state = NodeState(self.names[node.index], newest(local), newest(node.held), newest(node.backed), node.busy,
                          node.took, newest(node.lost), node.wrote, node.freed, node.lost_to)
        if state != node.sent:   # news on change (the processes also repeat it every second)
            node.sent = state
            self.at(self.now + self.c.net_ms, lambda: self.state_arrives(state))

    def state_arrives(self, state: NodeState) -> None:
        self.states[state.node] = state
        leader = self.nodes[0]
        if leader.alive and not self.leading:   # the leader decides once per round over every state it has
            self.leading = True
            cost = self.c.leader_us_per_node * len(self.nodes) / 1000
            self.at(self.now + self.agent_delay(leader) + cost, self.lead)

    def lead(self) -> None:
        self.leading = False
        alive = [name for name, node in zip(self.names, self.nodes) if node.alive]
        verdict, book = decide({n: s for n, s in self.states.items() if n in alive}, alive, interval=self.c.interval,
                               book=self.book, committed=max(self.persisted, default=None))
        for step, why in book.passed:
            self.passed.setdefault(step, why)
        if book.taken is not None and book.taken != self.book.taken:
            self.taken.append(book.taken)
        self.book = book
        if verdict.job_safe is None and self.last_verdict is not None and self.last_verdict.job_safe is not None:
            self.withdrawn += 1   # a round in which no step was job-safe any more: a rank kill had no floor
        if verdict == self.last_verdict:
            return
        self.last_verdict = verdict
        for node in self.nodes:
            if node.alive:
                self.at(self.now + self.c.net_ms, lambda n=node, v=verdict: self.verdict_arrives(n, v))

    def verdict_arrives(self, node: Node, verdict: Verdict) -> None:
        node.verdict = verdict
        self.wake(node)

    def apply(self, node: Node, local: set[int]) -> None:
        verdict = node.verdict or Verdict()
        if verdict.take is not None and verdict.take > node.took:
            node.took = verdict.take
            if node.busy is not None or verdict.take not in local | node.held:
                node.lost.add(verdict.take)
                node.lost_to = node.busy
            else:
                node.busy = verdict.take
                self.at(self.now + self.c.persist_ms, lambda: self.persist_done(node, verdict.take))
        decided = max(verdict.decided, max(self.persisted, default=-1))
        floor = persist_floor(verdict, local | node.held)
        persisting = {s for s in (node.busy, floor) if s is not None}
        due = due_to_hold(local | node.held, interval=self.c.interval, decided=decided)
        plan = plan_holds(slots=self.c.slots, persisting=persisting, job_safe=verdict.job_safe,
                          candidate=verdict.candidate, node_safe=verdict.node_safe, present=local | node.held, due=due,
                          adopted=node.adopted)
        busy = {node.busy} - {None}   # as easyckpt_agent.node_agreement: the floor's own role only when counted on
        node.held = set(plan) - ({floor} - busy if not counts_on(verdict, floor) else set())
        node.adopted = job_safe_here(verdict.job_safe, node.held, node.adopted)
        node.published = frozenset(node.held)
        node.node_safe = verdict.node_safe
        node.decided = max(decided, max(persisting, default=-1))

    def persist_done(self, node: Node, step: int) -> None:
        if node.alive and node.busy == step:
            node.busy = None
            self.wake(node)
            if all(n.busy != step for n in self.nodes if n.alive) and step in self.taken:
                self.persisted.add(step)

    # measurements ---------------------------------------------------------------------------------------
    def sample(self, step: int) -> None:
        if step < 0:
            return
        verdict = self.nodes[0].verdict
        newest_committed = max(self.committed_times, default=None)
        if verdict is None or newest_committed is None:
            return
        if not set.intersection(*(node.held for node in self.nodes if node.alive)) and self.job_lags:
            self.uncovered += 1   # no step held on every node at this moment (not the leader's view: the truth)
        self.job_lags.append(newest_committed - (verdict.job_safe if verdict.job_safe is not None else -1))
        self.node_lags.append(newest_committed - (verdict.node_safe if verdict.node_safe is not None else -1))

    def resume_after_rank_kill(self) -> int | None:
        """Every rank restarts: the newest step every rank holds committed."""
        sets = [set(rank.committed) for node in self.nodes for rank in node.ranks]
        return max(set.intersection(*sets), default=None)

    def resume_after_node_loss(self, lost: int) -> int | None:
        """Node ``lost`` is gone with its memory: the newest step every survivor's ranks hold and whose backup
        from the lost node its buddy completed (its pushes up to the loss)."""
        buddy = self.nodes[(lost + 1) % len(self.nodes)]
        sets = [set(rank.committed) for node in self.nodes if node.index != lost for rank in node.ranks]
        common = set.intersection(*sets) if sets else set()
        return max((s for s in common if s in buddy.pushed), default=None)


def run(config: Config, seed: int, fault: str | None = None, fault_step: int | None = None) -> dict[str, Any]:
    """One simulated job; ``fault`` ("rank" or "node") at a moment inside ``fault_step``."""
    rng = random.Random(seed)
    sim = Simulation(config, rng)
    sim.start()
    result: dict[str, Any] = {"fault": fault}
    if fault is not None:
        assert fault_step is not None
        while sim.queue and sim.newest_begun < fault_step:
            sim.run_until(sim.queue[0][0])
        sim.run_until(sim.now + rng.uniform(0, config.step_ms))
        killed_at = sim.newest_begun
        lost_node = rng.randrange(1, config.nodes) if fault == "node" else None
        resumed = sim.resume_after_rank_kill() if fault == "rank" else sim.resume_after_node_loss(lost_node or 0)
        result.update(step=killed_at, resumed=resumed, lost=None if resumed is None else killed_at - resumed)
        return result
    while sim.queue:
        sim.run_until(sim.queue[0][0])
    due = [s for s in range(config.steps) if s % config.interval == 0]
    result.update(persisted=sorted(sim.persisted), passed=dict(sorted(sim.passed.items())), due=due,
                  skipped=sim.skipped, job_lags=sim.job_lags, node_lags=sim.node_lags,
                  waited_ms=sim.waited_ms, due_waited_ms=sim.due_waited_ms, elapsed_ms=sim.now,
                  slowest_reaction_ms=sim.slowest_ms,
                  job_safe_withdrawn=sim.withdrawn, uncovered=sim.uncovered, backups_failed=sim.backups_failed)
    return result


def pct(values: list[int], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def table(nodes_list: list[int], seed: int, faults: int, base: Config) -> list[dict[str, Any]]:
    rows = []
    for nodes in nodes_list:
        config = dataclasses.replace(base, nodes=nodes, slow_node=nodes - 1)
        rng = random.Random(seed * 1000 + nodes)
        whole = run(config, rng.randrange(1 << 30))
        losses: dict[str, list[int]] = {"rank": [], "node": []}
        for kind in ("rank", "node"):
            for _ in range(faults):
                step = rng.randrange(config.interval * 2, config.steps - 2)
                outcome = run(config, rng.randrange(1 << 30), kind, step)
                losses[kind].append(outcome["lost"] if outcome["lost"] is not None else config.steps)
        passed_busy = sum(1 for why in whole["passed"].values() if "still persist" in why)
        rows.append({
            "nodes": nodes, "ranks_per_node": config.ranks, "slots": config.slots,
            "rank_kill_lost_median": statistics.median(losses["rank"]), "rank_kill_lost_max": max(losses["rank"]),
            "node_loss_lost_median": statistics.median(losses["node"]), "node_loss_lost_max": max(losses["node"]),
            "job_safe_lag_median": statistics.median(whole["job_lags"]), "job_safe_lag_p99": pct(whole["job_lags"], 0.99),
            "job_safe_lag_max": max(whole["job_lags"]),
            "node_safe_lag_median": statistics.median(whole["node_lags"]),
            "node_safe_lag_p99": pct(whole["node_lags"], 0.99), "node_safe_lag_max": max(whole["node_lags"]),
            "due": len(whole["due"]), "persisted": len(whole["persisted"]), "passed_busy": passed_busy,
            "passed_other": len(whole["passed"]) - passed_busy, "skipped": whole["skipped"],
            "uncovered": whole["uncovered"], "withdrawn": whole["job_safe_withdrawn"],
            "elapsed_s": round(whole["elapsed_ms"] / 1000, 2), "gate_waited_s": round(whole["waited_ms"] / 1000, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,8,64,512")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--faults", type=int, default=20, help="rank kills and node losses each, per node count")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slots", type=int, default=MULTI_NODE_SLOTS, help="slots per rank (the multi-node default)")
    parser.add_argument("--persist-ms", type=float, default=30.0)
    parser.add_argument("--slow-factor", type=float, default=10.0, help="the last node's agent reacts this much later")
    parser.add_argument("--backup-ms", type=float, default=0.0,
                        help="a backup's further time, mean ms (a starved agent; the slow node's times --slow-factor)")
    parser.add_argument("--step-ms", type=float, default=Config.step_ms)
    parser.add_argument("--hash-ms", type=float, default=Config.hash_ms, help="hashing and pushing one step's backup")
    parser.add_argument("--max-backup-lag", type=int, default=Config.max_backup_lag,
                        help="the ranks' lag gate, in steps (Checkpointer's default: two snapshots)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed}")
    base = Config(steps=args.steps, slots=args.slots, persist_ms=args.persist_ms, slow_factor=args.slow_factor,
                  backup_ms=args.backup_ms, step_ms=args.step_ms, hash_ms=args.hash_ms,
                  max_backup_lag=args.max_backup_lag)
    rows = table([int(n) for n in args.nodes.split(",")], seed, args.faults, base)
    header = ["nodes", "rank_kill_lost_median", "rank_kill_lost_max", "node_loss_lost_median", "node_loss_lost_max",
              "job_safe_lag_median", "job_safe_lag_p99", "job_safe_lag_max", "node_safe_lag_median",
              "node_safe_lag_p99", "node_safe_lag_max", "due", "persisted", "passed_busy", "passed_other", "skipped",
              "uncovered", "withdrawn", "elapsed_s", "gate_waited_s"]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seed": seed, "config": dataclasses.asdict(base), "rows": rows,
                                         "machine": platform.platform()}, indent=1))


if __name__ == "__main__":
    main()
