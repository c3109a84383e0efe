"""Every Python process the tests and the soak start imports this first (``tests/conftest.py`` and
``benchmarks/soak_job.py`` put its folder at the head of ``PYTHONPATH``): it freezes the garbage collector once the
process's own ``atexit`` hooks have run.

Why: at exit CPython runs full collections over every object still alive, and a process that imported torch holds
about 300,000 of them (torch._dynamo, which every optimizer's first call imports, and sympy add most). That walk costs
0.6 to 1 CPU-second per rank, launcher and CLI call, and every job of the tests starts several on two cores: the
soak's 20-fault smoke (seed 77, runs alternated on 2026-12-02) spent 383-405 CPU-s without this and 323-344 with it.

It changes nothing easyckpt does: hooks registered with ``atexit`` (the library's, weakref finalizers) run before it
(``atexit`` runs them last-registered first, and this one is registered before any other), objects that are not
part of a reference cycle are still freed as the interpreter tears down, and every ZeroMQ socket easyckpt opens has
``LINGER 0``. What it skips is the collection of cyclic garbage that is still around at exit; the operating system
takes back its memory and file descriptors anyway. Users' processes keep CPython's default.

It also freezes the collector once each of a few large packages has imported (torch, ``torch._dynamo``, transformers,
Lightning, DeepSpeed, megatron.core), unless a torch.distributed process group is up already (then the job's own
objects would be frozen with them): their objects, alive for the whole process, move to the permanent generation,
and the full collections that later imports (and the job) trigger no longer walk them. ``import torch._dynamo`` (every
worker's first optimizer) took 0.88-0.96 CPU-s after ``import torch``, and 0.69-0.72 with torch's objects frozen. Two
job files (``test_torchrun.py`` and ``test_freshness.py``, four runs each, alternated, 2026-12-06) used 137-151 CPU-s
before and 127-133 with it. The thresholds stay CPython's, so what the process allocates afterwards is collected as
usual (raising them for the whole process saved about twice as much, but would change when the job's own garbage is
collected: not taken).

A ``sitecustomize`` of the interpreter's own (a distribution's or a site's), which this one shadows on ``sys.path``,
is run after it.
"""
from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

atexit.register(gc.freeze)

_LARGE = frozenset({"torch", "torch._dynamo", "transformers", "lightning", "deepspeed", "megatron.core"})


class _FreezeAfterLargeImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a package of ``_LARGE`` it wraps the spec's loader so the collector is frozen once
    the package has run its ``__init__`` (with everything that imports)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _LARGE:
            return None
        spec = None
        for finder in sys.meta_path:   # the other finders, in the order the import system asks them
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_init = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_init(module)
            if not _process_group_up():
                gc.freeze()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _process_group_up() -> bool:
    """Once a torch.distributed process group exists, nothing is frozen any more: a package imported then (torch._dynamo
    at a DDP worker's first optimizer step, DeepSpeed from inside the Trainer) would freeze the job's own objects, and
    the DDP module and Trainer that a script collects before it destroys its group (examples/hf_trainer.py: gloo's
    threads must go while the interpreter is whole) then lived on, and a plain Trainer run aborted at exit with
    "terminate called without an active exception" (CI rehearsal, 2026-12-06, test_s3.py's plain reference run)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:   # a half-imported torch.distributed: no group yet
        return False


sys.meta_path.insert(0, _FreezeAfterLargeImports())

# The soak sets this in its jobs: a job that hangs is sent SIGUSR2 before it is killed, and each of its Python
# processes writes every thread's stack to its stderr (a rank's goes to its node's log, the agent's to agent.log),
# so a hang that a seed met once can be read, not only replayed in the hope that it comes back.
if os.environ.get("EASYCKPT_STACKS_ON_SIGUSR2"):
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)


def _run_the_shadowed_one() -> None:
    here = os.path.dirname(os.path.realpath(__file__))   # real paths: a link to this folder is this folder
    rest = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_the_shadowed_one()
