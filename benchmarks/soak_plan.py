"""The fault soak's plan: which fault strikes which job, drawn from one seed before any job runs.

Fault ``k`` of seed ``S`` is drawn from ``random.Random(f"soak:{S}:{k}")`` alone, so a soak split across sittings
(``--resume-from``) or a single replayed fault (``--only k``) gets the very same fault as the full run. A fault
kind is one entry of :data:`KINDS`: its name, what it does, the configurations it applies to, how it draws its
step, moment and variant, and, for a kind the product cannot take yet, why it is unavailable (drawing skips it;
asking for it by name is an error that says why). The object-store outage is such an entry until issue 26 lands:
then it needs a runner in ``soak_faults.py`` and ``available=None`` here.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One job shape: the integration, simulated nodes, ranks per node; ``weight`` says how often it is drawn
    (HuggingFace jobs cost two to three times a plain one on CPU, mostly importing transformers); ``default``: drawn
    when ``--configs`` is not given (a configuration added later is not, so that every earlier seed keeps its draws)."""

    api: str
    nodes: int
    ranks_per_node: int
    weight: int
    default: bool = True

    def __post_init__(self) -> None:
        if self.api not in ("plain", "hf"):
            raise ValueError(f"api must be 'plain' (examples/plain_ddp.py) or 'hf' (examples/hf_trainer.py), "
                             f"got {self.api!r}")
        if self.nodes not in (1, 2, 3) or self.ranks_per_node not in (1, 2) or self.weight < 1:
            raise ValueError(f"{self.api}: 1 to 3 nodes of 1 or 2 ranks and a positive weight, got {self}")

    @property
    def name(self) -> str:
        return f"{self.api}-{self.nodes}x{self.ranks_per_node}"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


# HF jobs stay at two ranks or fewer: the Trainer syncs gradients with DDP's buckets, whose summation order
# changes after DDP's first step, so with more ranks a resumed run differs from the reference in the last
# bits (examples/plain_ddp.py avoids this with --grad-sync flat; the HF example has no such option).
CONFIGS: dict[str, Config] = {c.name: c for c in (
    Config(api="plain", nodes=1, ranks_per_node=1, weight=2),
    Config(api="plain", nodes=1, ranks_per_node=2, weight=3),
    Config(api="plain", nodes=2, ranks_per_node=1, weight=2),
    Config(api="plain", nodes=2, ranks_per_node=2, weight=3),
    Config(api="hf", nodes=1, ranks_per_node=1, weight=1),
    Config(api="hf", nodes=1, ranks_per_node=2, weight=1),
    Config(api="hf", nodes=2, ranks_per_node=1, weight=1),
    # Since 2026-12-04, asked for by name: a node's buddy is then not the only other node (the backups go round a
    # ring), and a lost node leaves two survivors to agree on the job-wide steps
    Config(api="plain", nodes=3, ranks_per_node=1, weight=2, default=False),
)}
DEFAULT_CONFIGS = [name for name, config in CONFIGS.items() if config.default]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """A job's steps: the examples number them ``first``..``last``; every ``interval``-th is due for disk."""

    first: int
    last: int
    interval: int

    @classmethod
    def of(cls, api: str, steps: int, interval: int) -> Shape:
        # plain_ddp.py logs steps 0..steps-1 (step 0 is due); the Trainer's global steps are 1..steps
        return cls(first=0, last=steps - 1, interval=interval) if api == "plain" else \
            cls(first=1, last=steps, interval=interval)

    def strike(self, rng: random.Random, tail: int = 4) -> int:
        """A step for a fault: past the first persist, with ``tail`` steps after it to show the resumed curve."""
        return rng.randint(self.first + 3, self.last - tail)

    def due(self, step: int) -> bool:
        return step % self.interval == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """One planned fault: ``step`` is where it strikes (for an armed agent fault: from where the next persist
    is hit); ``moment`` where inside the step; ``variant`` what follows; ``victim`` a rank or a node."""

    index: int
    kind: str
    config: str
    step: int
    moment: str
    variant: str = ""
    victim: int = 0
    hold_s: float = 0.0                       # rank_stop: how long the rank stays frozen
    after: int = 0                            # disk_full, outage: steps between the fault and the follow-up
    params: dict[str, Any] = dataclasses.field(default_factory=dict)   # byte flips: where and which bits

    def label(self) -> str:
        parts = [self.moment] + ([self.variant] if self.variant else [])
        return f"{self.kind}({','.join(parts)})"


Drawer = Callable[[random.Random, Config, Shape], dict[str, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kind:
    name: str
    what: str
    draw: Drawer
    applies: Callable[[Config], bool] = lambda config: True
    unavailable: str | None = None            # why the product cannot take this fault yet; None: it can


def _rank_kill(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    return {"step": shape.strike(rng), "victim": rng.randrange(config.world),
            "moment": rng.choice(["mid_copy", "before_commit", "external"])}


def _node_loss(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    # node 0 hosts the rendezvous store (as a launcher host would): a multi-node job loses its last node; a 1-node
    # job loses its only node, and with it all memory
    fault = {"step": shape.strike(rng), "victim": config.nodes - 1,
             "moment": rng.choice(["stop_mid_copy", "stop_before_commit", "external"])}
    # "leader": half the time the lost node runs rank 0, so its agent is the one that decides the job-wide steps and
    # commits every checkpoint (soak_job.Cluster.lead_with). Drawn last: every earlier draw of a seed stays what it was.
    if config.nodes > 1 and rng.random() < 0.5:
        fault["variant"] = "leader"
    return fault


def _agent_kill(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    moment = rng.choice(["after_file", "before_marker", "before_tracker", "idle"])
    if moment == "idle":    # two or three steps after a due step: its persist (tens of ms here) is over
        due = [s for s in range(shape.first + 1, shape.last - 4) if shape.due(s)]
        step = rng.choice(due) + rng.randint(2, 3)
    else:                   # armed from this step: the next persist that starts is hit at that point
        step = rng.randint(shape.first + 2, shape.last - shape.interval - 2)
    victim = rng.randrange(config.nodes)
    if moment in ("before_marker", "before_tracker"):
        # Only the leader's agent (node 0's) writes a multi-node job's marker and tracker: armed on another node,
        # the fault never fired. Drawn all the same, so that every later draw of a seed stays what it was.
        victim = 0
    return {"step": step, "victim": victim, "moment": moment}


def _rank_stop(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    return {"step": shape.strike(rng), "victim": rng.randrange(config.world),
            "moment": rng.choice(["before_commit", "external"]), "variant": rng.choice(["cont", "kill"]),
            "hold_s": round(rng.uniform(1.0, 4.0), 2)}   # beyond the job's timeouts (soak_faults.STOP_BEYOND)


def _disk_full(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    return {"step": rng.randint(shape.first + 3, shape.last - 8), "moment": "external",
            "variant": rng.choice(["recover", "crash", "never"]), "after": rng.randint(2, 4),
            "params": {"leave": rng.randrange(0, 96 << 10)}}


def _flip(rng: random.Random) -> dict[str, Any]:
    return {"fraction": rng.random(), "mask": rng.randrange(1, 256), "pick": rng.random()}


def _flip_slot(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    region = rng.choices(["data", "meta", "header"], weights=[6, 2, 2])[0]
    return {"step": shape.strike(rng), "victim": rng.randrange(config.world), "moment": "external",
            "variant": region, "params": {**_flip(rng), "newest": rng.random() < 0.7}}


def _flip_disk(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    target = rng.choices(["tensors", "metadata", "common", "tracker"], weights=[6, 2, 1, 1])[0]
    return {"step": shape.strike(rng), "moment": "external", "variant": target, "params": _flip(rng)}


def _object_store_outage(rng: random.Random, config: Config, shape: Shape) -> dict[str, Any]:
    # armed from ``step``: the store goes down at the ``write``-th object written under an iteration after it, inside
    # the next persist; back ``after`` steps later, after every node was lost (crash), or never
    fault = {"step": rng.randint(shape.first + 2, shape.last - shape.interval - 3), "moment": "persist",
             "variant": rng.choice(["recover", "crash", "never"]), "after": rng.randint(2, 4),
             "params": {"write": rng.randint(1, 3)}}
    # recover: half the time a rank is SIGKILLed while the store is down, so that torchrun restarts the workers
    # into the outage (they must resume from memory). Drawn last: every earlier draw of a seed stays what it was.
    kill = rng.randrange(config.world) if rng.random() < 0.5 else -1
    fault["params"]["kill"] = kill if fault["variant"] == "recover" else -1
    return fault


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind(name="rank_kill", what="SIGKILL of one rank (inside its snapshot copy, before the commit, or from outside)",
         draw=_rank_kill),
    Kind(name="node_loss", what="SIGKILL of every process of a simulated node (launcher, ranks, agent), its shared "
                                "memory wiped; a replacement node joins. In a multi-node job half of them lose the node "
                                "that leads (variant 'leader': it runs rank 0)", draw=_node_loss),
    Kind(name="agent_kill", what="SIGKILL of a node agent in the middle of a persist (after a file, before the "
                                 "marker, before the tracker) or idle", draw=_agent_kill),
    Kind(name="rank_stop", what="SIGSTOP of one rank for longer than the job's timeouts, then SIGCONT or SIGKILL",
         draw=_rank_stop),
    Kind(name="disk_full", what="save_dir on a small tmpfs filled up during the run: freed later, the job lost "
                                "whole meanwhile, or full to the end", draw=_disk_full),
    Kind(name="flip_slot", what="every rank killed, then a byte flipped in a committed slot file before the resume",
         draw=_flip_slot),
    Kind(name="flip_disk", what="every node lost with its memory, then a byte flipped in the newest persisted "
                                "iteration (or its tracker) before the resume", draw=_flip_disk),
    Kind(name="object_store_outage", what="an s3:// save_dir's object store down in the middle of a persist "
                                          "(connections dropped and refused): back a few steps later, after every "
                                          "node was lost meanwhile, or never", draw=_object_store_outage,
         applies=lambda config: config.api == "plain"),
)}


def check_names(kinds: Sequence[str], configs: Sequence[str]) -> None:
    """Refuse a kind or configuration that does not exist, and a kind that applies to none of ``configs``, naming
    the fix (``plan`` would refuse that kind too, but without the fix, and only once the seed's header is out)."""
    for name in kinds:
        if name not in KINDS:
            raise SystemExit(f"--kinds: no fault kind {name!r}; the kinds are {', '.join(KINDS)}")
        if KINDS[name].unavailable:
            raise SystemExit(f"--kinds: {name} is not available yet: {KINDS[name].unavailable}")
    check_configs(configs)
    for name in kinds:
        if not fitting(name, configs):
            raise SystemExit(f"--kinds: {name} applies to none of the configurations {', '.join(configs)}: leave it "
                             f"out of --kinds, or add one of {', '.join(fitting(name, list(CONFIGS)))} to --configs")


def check_configs(configs: Sequence[str]) -> None:
    """Refuse a configuration that does not exist, naming those that do (before anything looks one up)."""
    for name in configs:
        if name not in CONFIGS:
            raise SystemExit(f"--configs: no configuration {name!r}; they are {', '.join(CONFIGS)}")


def fitting(kind: str, configs: Sequence[str]) -> list[str]:
    """The configurations of ``configs`` that fault kind ``kind`` applies to."""
    return [name for name in configs if KINDS[kind].applies(CONFIGS[name])]


def plan(seed: int, index: int, *, kinds: Sequence[str], configs: Sequence[str], steps: int,
         interval: int) -> Fault:
    """Fault ``index`` of ``seed``: a kind, a configuration it applies to (by weight), and the kind's own draws. The
    same arguments give the same fault, whatever else ran before. Kinds come in blocks of ``len(kinds)`` faults, each
    block a seeded shuffle of every kind, so that any stretch of a soak mixes them all evenly."""
    block = list(kinds)
    random.Random(f"soak:{seed}:block:{index // len(block)}").shuffle(block)
    kind = KINDS[block[index % len(block)]]
    rng = random.Random(f"soak:{seed}:{index}")
    fits = [CONFIGS[name] for name in fitting(kind.name, configs)]
    if not fits:
        raise SystemExit(f"fault kind {kind.name} applies to none of the configurations {list(configs)}")
    config = rng.choices(fits, weights=[c.weight for c in fits])[0]
    drawn = kind.draw(rng, config, Shape.of(config.api, steps, interval))
    return Fault(index=index, kind=kind.name, config=config.name, **drawn)


# A job's rough cost relative to a plain 1x1 rank kill, from the median seconds of the 1000-fault campaign (seed
# 1127, benchmarks/results/soak-1127.json): a "never" fault ends every attempt torchrun makes with a failed persist,
# a flipped iteration is refused and reloaded, a second node doubles the processes.
_KIND_COST = {("disk_full", "never"): 1.8, ("object_store_outage", "never"): 2.5, ("object_store_outage", "crash"): 1.6,
              ("disk_full", "crash"): 1.2, ("flip_disk", ""): 1.6, ("rank_stop", "kill"): 1.3, ("agent_kill", ""): 0.8}
_CONFIG_COST = {"plain-1x1": 1.0, "plain-1x2": 1.0, "plain-2x1": 1.4, "plain-2x2": 1.4, "hf-1x1": 1.4,
                "hf-1x2": 1.6, "hf-2x1": 1.9, "plain-3x1": 1.8}


def expected_cost(fault: Fault) -> float:
    """How long ``fault``'s job should take, relative to others: the soak starts the longest first, so that no lane
    is left with a long job once the others have run dry. An order only: no draw depends on it."""
    variant = fault.variant if fault.kind in ("disk_full", "object_store_outage", "rank_stop") else ""
    return _KIND_COST.get((fault.kind, variant), 1.0) * _CONFIG_COST.get(fault.config, 1.0) + fault.hold_s / 10


def available_kinds() -> list[str]:
    return [name for name, kind in KINDS.items() if kind.unavailable is None]
