"""What a training process pays at start-up for easyckpt: every rank of every restart imports it, so a
second of imports is a second of every recovery. A fresh interpreter (this process has imported everything
already) imports the library and plans a load the way a plain DDP loop does."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

PROBE = """
import json, sys
import torch
import easyckpt
from easyckpt.recovery.ladder import build_tiers
from easyckpt.snapshot import sharding
assert not sharding.is_dtensor(torch.zeros(1))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("torch.distributed.tensor",
                                                                 "torch.distributed.checkpoint")))))
"""


def test_a_loop_without_dtensors_never_imports_dtensor_or_dcp() -> None:
    """torch.distributed.tensor and torch.distributed.checkpoint cost about a second of every rank's start-up
    (DTensor's op tables); a job whose state holds no DTensor never needs them: the DTensor check asks
    whether the module is loaded, and the tier that reads through DCP imports it when it reads."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout
