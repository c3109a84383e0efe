"""Run a script with Accelerate's FSDP enabled on CPU: ``python accelerate_fsdp_cpu.py SCRIPT ARGS...``.

Accelerate 1.15 keeps the FSDP plugin only for accelerator devices (``AcceleratorState``: MULTI_GPU,
MULTI_XPU, ...), so a Trainer asked for FSDP with ``use_cpu=True`` trains as DDP. FSDP2 itself
(``fully_shard``, DTensors, ``torch.distributed.checkpoint``) runs on CPU with gloo, and so does every
code path Accelerate and the Trainer take with it: this shim lifts that one check, as Accelerate does
on a GPU (the plugin kept, the distributed type FSDP), and runs the script unchanged. The tests that use
it are what a CPU-only machine can run of TrainerWrapper with FSDP2; the same script runs unpatched on
GPUs.
"""
from __future__ import annotations

import runpy
import sys
from typing import Any

import accelerate.state
from accelerate.utils import DistributedType

_original_init = accelerate.state.AcceleratorState.__init__


def _init_keeping_fsdp(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


if __name__ == "__main__":
    accelerate.state.AcceleratorState.__init__ = _init_keeping_fsdp   # type: ignore[method-assign]
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
