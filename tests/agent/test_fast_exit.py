"""The processes the tests start skip CPython's final garbage collection, pause the collector while torch (and a few
other large packages) imports and freeze it once they have (tests/fast_exit/sitecustomize.py): what they run is the
interpreter's own sitecustomize as well, and nothing else about the collector changes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import FAST_EXIT

PROBE = """
import atexit, gc, sitecustomize
print(sitecustomize.__file__)
print(gc.isenabled(), gc.get_freeze_count())
atexit._run_exitfuncs()
print(gc.get_freeze_count() > 0)
"""


def run(code: str, env: dict[str, str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_child_process_freezes_the_collector_only_once_its_exit_hooks_ran() -> None:
    lines = run(PROBE, dict(os.environ))
    assert Path(lines[0]) == FAST_EXIT / "sitecustomize.py", lines
    assert lines[1] == "True 0", f"the collector must run as usual until exit: {lines}"
    assert lines[2] == "True", f"nothing froze the collector at exit: {lines}"


LARGE_IMPORT = """
import gc
before = gc.get_freeze_count()
import torch
after_torch = gc.get_freeze_count()
import torch._dynamo
print(before, after_torch > 0, gc.get_freeze_count() > after_torch, gc.isenabled(), gc.get_threshold() == THRESHOLDS)
cycle = []
cycle.append(cycle)
del cycle
print(gc.collect() >= 1)
"""


def test_a_child_process_freezes_the_objects_of_torch_once_it_has_imported_and_collects_the_rest_as_usual() -> None:
    lines = run(LARGE_IMPORT.replace("THRESHOLDS", repr(__import__("gc").get_threshold())), dict(os.environ))
    assert lines[0] == "0 True True True True", f"frozen after torch, again after torch._dynamo, thresholds kept: {lines}"
    assert lines[1] == "True", f"garbage made after the imports must still be collected: {lines}"


PAUSED_IMPORTS = """
import gc
started = []
gc.callbacks.append(lambda phase, info: phase == "start" and started.append(info["generation"]))
import torch
at_torch = len(started)
import torch.distributed.checkpoint   # a lazy import, after the package's own
at_lazy = len(started)
cycle = []
cycle.append(cycle)
del cycle
print(at_torch, at_lazy - at_torch, gc.isenabled(), gc.collect() >= 1)
"""


def test_the_collector_is_paused_while_a_large_package_imports_and_runs_again_after() -> None:
    """363 collections ran while torch imported and about 200 while torch.distributed.checkpoint did (2026-12-07),
    walking objects that stay alive for the whole process: 0.2-0.3 CPU-s of a worker's start-up with torch._dynamo.
    A lazy import's objects are not frozen, so the collector makes one pass over them once it runs again."""
    at_torch, at_lazy, running, collects = run(PAUSED_IMPORTS, dict(os.environ))[0].split()
    assert (at_torch, running, collects) == ("0", "True", "True"), "paused while torch imported, running after it"
    assert int(at_lazy) <= 1, f"{at_lazy} collections while torch.distributed.checkpoint imported"


def test_an_import_that_fails_midway_leaves_the_collector_running(tmp_path: Path) -> None:
    (tmp_path / "sympy").mkdir()   # a package of the paused list whose import raises
    (tmp_path / "sympy" / "__init__.py").write_text("import gc\nprint(gc.isenabled())\nraise RuntimeError('broken')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAST_EXIT), str(tmp_path)])}
    code = "import gc\ntry:\n    import sympy\nexcept RuntimeError:\n    print(gc.isenabled())\n"
    assert run(code, env) == ["False", "True"], "paused while it ran, running again after it raised"


AFTER_INIT = """
import gc, os, tempfile
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
frozen = gc.get_freeze_count()
import torch._dynamo
print(gc.get_freeze_count() <= frozen)   # frozen objects freed by refcount leave it
dist.destroy_process_group()
"""


def test_nothing_is_frozen_once_a_process_group_is_up() -> None:
    """torch._dynamo imported at a DDP worker's first optimizer step would freeze the DDP module and the Trainer with
    it: a script's gc.collect() before destroy_process_group could not free them, and a plain Trainer run aborted at
    exit ("terminate called without an active exception", CI rehearsal 2026-12-06)."""
    assert run(AFTER_INIT, dict(os.environ)) == ["True"], "frozen after the process group was up"


def test_a_link_to_its_folder_on_the_path_as_well_runs_it_once(tmp_path: Path) -> None:
    """The same folder twice on PYTHONPATH, once through a link: taken for a shadowed sitecustomize, it ran itself
    again without end (RecursionError at start-up, and then every import of torch failed)."""
    (tmp_path / "link").symlink_to(FAST_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "link"), str(FAST_EXIT)])}
    proc = subprocess.run([sys.executable, "-c", "import sys, torch; print(len(sys.meta_path))"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "Error in sitecustomize" not in proc.stderr, proc.stderr[-2000:]
    alone = run("import sys; print(len(sys.meta_path))", {**os.environ, "PYTHONPATH": str(FAST_EXIT)})
    assert proc.stdout.split() == alone, f"one import hook, as with the folder once: {proc.stdout} against {alone}"


def test_the_sitecustomize_it_shadows_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SHADOWED_RAN = True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAST_EXIT), str(tmp_path)])}
    assert run("import builtins; print(getattr(builtins, 'SHADOWED_RAN', False))", env) == ["True"]


def test_a_soak_job_process_writes_its_stacks_on_sigusr2() -> None:
    """How the soak reads a hang: with EASYCKPT_STACKS_ON_SIGUSR2 set, SIGUSR2 makes the process write every
    thread's stack to stderr and go on; without it, nothing is registered."""
    import signal

    code = ("import sys, time\n"
            "def stuck_here():\n"
            "    print('ready', flush=True)\n"
            "    sys.stdin.readline()\n"
            "stuck_here()\n")
    for registered in (True, False):
        env = {**os.environ, "PYTHONPATH": str(FAST_EXIT)}
        env.pop("EASYCKPT_STACKS_ON_SIGUSR2", None)
        if registered:
            env["EASYCKPT_STACKS_ON_SIGUSR2"] = "1"
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        if registered:
            proc.send_signal(signal.SIGUSR2)
        out, err = proc.communicate("go on\n", timeout=60)
        assert proc.returncode == 0, err
        assert ("stuck_here" in err) == registered, err
