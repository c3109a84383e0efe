"""The easyckpt node agent: one process per node that persists the ranks' shared-memory snapshots.

It imports nothing from ``easyckpt`` but the shared wire package ``easyckpt_wire`` and never imports
torch. Run it as ``python -m easyckpt_agent`` or ``easyckpt-agent``; the training library starts it itself
when none is running.
"""
