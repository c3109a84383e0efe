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

And while a module of those packages (or of datasets, Accelerate, peft, sympy, numpy, which they pull in) imports,
the collector is paused, until the outermost such import has run (or raised): 363 collections ran while torch
imported and about 200 while ``torch.distributed.checkpoint`` did afterwards, each walking objects that live as long
as the process (0.2-0.3 CPU-s of a worker's imports of torch and ``torch._dynamo``; 0.5 of an HF Trainer worker's
imports, 0.1 with the pause). The job's own garbage is still collected as usual: a lazy import during the run
(``torch._dynamo`` at a DDP worker's first step) delays that by the import's time, and its objects, unless frozen,
are collected in one pass once the collector runs again. The import's own cyclic garbage is frozen with the package
(8 MiB more a worker). A 2-rank 12-step ``examples/plain_ddp.py`` job, six pairs alternated (2026-12-07): 6.7-8.1
CPU-s before, 5.9-8.0 with the pause (mean 7.4 and 6.8).

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
# Packages whose modules import with the collector paused (any module of theirs, lazy ones included: transformers'
# Trainer, DeepSpeed's engine, the GPT-2 model are imported at their first use, after the package itself)
_PAUSED = frozenset({"torch", "transformers", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed",
                     "megatron", "datasets", "accelerate", "peft", "sympy", "numpy"})
# Loaders made for one module each: wrapping their exec_module touches nothing else (BuiltinImporter, say, is a class
# shared by every built-in module)
_OWN_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader,
                importlib.machinery.ExtensionFileLoader)


class _FreezeAfterLargeImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of ``_PAUSED`` it wraps the spec's loader so that the module runs with the
    collector paused (nested imports too, until the outermost one is done), and for a package of ``_LARGE`` so that
    the collector is then frozen."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in _PAUSED and fullname not in _LARGE:
            return None
        spec = None
        for finder in sys.meta_path:   # the other finders, in the order the import system asks them
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, _OWN_LOADERS):
            return spec
        run_init = loader.exec_module
        freeze = fullname in _LARGE

        def exec_module(module: ModuleType) -> None:
            outermost = gc.isenabled()
            if outermost:
                gc.disable()
            try:
                run_init(module)
                if freeze and not _process_group_up():
                    gc.freeze()
            finally:
                if outermost:
                    gc.enable()

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
