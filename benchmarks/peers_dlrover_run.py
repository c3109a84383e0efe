"""``dlrover-run`` (DLRover 0.6.1) on torch >= 2.11: a launcher shim, nothing else changed.

dlrover-run starts its local master through torch's ``SubprocessHandler`` with six positional arguments; torch
2.11 added a required seventh, ``numa_options``, so the unpatched launcher fails with ``SubprocessHandler.__init__()
missing 1 required positional argument: 'numa_options'``. This shim gives it the default it had (None) and runs
dlrover-run's own ``main`` with the same command line:

    python benchmarks/peers_dlrover_run.py --standalone --nproc_per_node=2 ... script.py args
"""
from __future__ import annotations

import sys
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

_original = subprocess_handler.SubprocessHandler.__init__


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    if len(args) < 7 and "numa_options" not in kwargs:
        kwargs["numa_options"] = None
    _original(self, *args, **kwargs)


subprocess_handler.SubprocessHandler.__init__ = _init  # type: ignore[method-assign]

if __name__ == "__main__":
    from dlrover.trainer.torch.elastic_run import main

    sys.argv[0] = "dlrover-run"
    sys.exit(main())
