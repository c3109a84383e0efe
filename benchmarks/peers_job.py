"""The training job of ``peers.py``: one rank of the same DDP job, checkpointed by one system.

    <launcher> benchmarks/peers_job.py --system easyckpt|dlrover|lm_resiliency|nvrx|dcp|none --out DIR ...

It runs in each peer's own virtual environment, so it needs nothing but torch (and the system under test). The
job: a GPT-like stack of MLP blocks (LayerNorm, d -> 4d, GELU, 4d -> d, residual) under DDP on gloo, AdamW,
the batch of a step a function of (step, rank) alone, so a resumed run must end bit-exact with an
uninterrupted one. Each system checkpoints every step into memory and persists every ``--persist-every``-th
step where it has both tiers, and resumes the way its documentation shows.

Each rank writes ``DIR/rank<r>-attempt<a>.json``: what it resumed (step, source, seconds from process start to
its first finished step), every step's time and the time the loop waited on the checkpoint system, whether
any model or optimizer tensor after the resume lies in shared memory (aliasing the snapshot), and a digest of
the final state. ``--kill-at A:K:R`` makes attempt A's rank R SIGKILL itself in step K right after the
optimizer update, before any checkpoint work of step K (an optimizer hook registered first), so K - 1 is the
newest step that rank can have saved.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

BATCH = 64


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(dim) for _ in range(layers)])


def state_bytes(dim: int, layers: int) -> int:
    """Model + AdamW's two moments, fp32: what every system has to copy per rank."""
    params = layers * (2 * dim + 2 * 4 * dim * dim + 4 * dim + dim)
    return 3 * 4 * params


def batch(step: int, rank: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    return torch.randn(BATCH, dim, generator=generator), torch.randn(BATCH, dim, generator=generator)


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter and every optimizer state tensor, in a fixed order: equal means equal bits."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    for i, p in enumerate(model.parameters()):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            h.update(f"{i}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def shm_aliases(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Which model / optimizer tensors live in a shared-memory mapping: state loaded as views of a snapshot."""
    from peers_systems import in_shm

    named: list[tuple[str, torch.Tensor]] = [("param", p) for p in model.parameters()]
    named += [(f"optim.{k}", v) for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)]
    hits = {id(t) for t in in_shm([t for _, t in named])}
    found = [(name, t.numel() * t.element_size()) for name, t in named if id(t) in hits]
    return {"tensors": len(found), "bytes": sum(b for _, b in found), "kinds": sorted({n for n, _ in found})}


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all: a rank may be killed while it writes."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


def process_start_time() -> float:
    """When this process started (wall clock), from /proc: psutil is not in every peer's environment."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def init_process_group() -> None:
    """gloo on a store prefix of its own per rendezvous round: a restarted rank must not find the dead round's
    addresses. One node: the restart count names the round; several nodes: the round's master port (the
    launchers pick a new one per round, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) since a replaced node's launcher
    counts its restarts from 0."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_store), timeout=datetime.timedelta(seconds=120))
    round_name = os.environ["MASTER_PORT"]
    if os.environ.get("GROUP_WORLD_SIZE", "1") == "1":
        round_name += "-" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"peers-{round_name}", base), rank=rank, world_size=world)


def run(args: argparse.Namespace, report: dict[str, Any], path: Path, out: Path, net: torch.nn.Module,
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, kills: dict[int, tuple[int, int]], rank: int,
        attempt: int) -> None:
    from peers_systems import make_system  # imports the peer: only in its own environment

    current = [-1]

    def kill_hook(*_: Any) -> None:
        if kills.get(attempt, (-1, -1)) == (current[0], rank):
            write_json(out / f"killed-attempt{attempt}", {"step": current[0], "time": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)

    # Registered before the system exists, so it runs before a system's own post-step hook (lm-resiliency's).
    optimizer.register_step_post_hook(kill_hook)
    report["pg_ready"] = time.time()
    system = make_system(args.system, args=args, net=net, model=model, optimizer=optimizer)
    report["system_ready"] = time.time()
    resumed, source = system.load()
    report.update(resumed=resumed, source=source, load_done=time.time(), aliases=shm_aliases(net, optimizer))
    write_json(path, report)
    step_s: list[float] = []
    blocking_s: list[float] = []
    start = 0 if resumed is None else resumed + 1
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = batch(step, rank, args.dim)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        waited = system.before_optimizer_step()
        current[0] = step
        optimizer.step()   # the kill hook fires inside, right after the update and before any system's hook
        waited += system.hook_seconds()
        waited += system.save(step)
        step_s.append(time.perf_counter() - t0)
        blocking_s.append(waited)
        if step == start:   # written at once: torchrun may SIGTERM this rank when another dies later
            report["first_step_done"] = time.time()
            write_json(path, report)
    report["closing"] = time.time()
    system.close()
    report.update(step_s=step_s, blocking_s=blocking_s, digest=digest(net, optimizer), done=time.time(),
                  stats=system.stats())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--persist-every", type=int, default=10)
    parser.add_argument("--kill-at", action="append", default=[], help="ATTEMPT:STEP:RANK (repeatable)")
    parser.add_argument("--replicas", action="store_true", help="the node-loss run: ask for peer replicas")
    args = parser.parse_args(argv)
    started = process_start_time()
    init_process_group()
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    kills = {int(a): (int(s), int(r)) for a, s, r in (k.split(":") for k in args.kill_at)}
    report: dict[str, Any] = {"system": args.system, "rank": rank, "attempt": attempt, "pid": os.getpid(),
                              "started": started, "node": os.environ.get("PEERS_NODE", "0"),
                              "launch": os.environ.get("PEERS_LAUNCH", "0")}
    path = out / f"rank{rank}-launch{report['launch']}-attempt{attempt}.json"
    torch.set_num_threads(1)  # two ranks on two cores: one intra-op thread each, for every system alike
    net = build(args.dim, args.layers)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    try:
        run(args, report, path, out, net, model, optimizer, kills, rank, attempt)
    except Exception as exc:   # a peer that cannot run here: its row keeps the exact error
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        report.update(error=f"{type(exc).__name__}: {exc} (at {Path(frame.filename).name}:{frame.lineno}: {frame.line})",
                      traceback=traceback.format_exc()[-4000:])
        raise
    finally:
        write_json(path, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
