"""What the training library (``easyckpt``) and the node agent (``agent``) share, and nothing else.

Both sides import only this package from each other's world: the shared-memory slot format
(:mod:`easyckpt_wire.shm`), the ZeroMQ message protocol (:mod:`easyckpt_wire.protocol`), the
on-disk layout rules (:mod:`easyckpt_wire.layout`), and the named fault points used by the
fault-injection tests (:mod:`easyckpt_wire.faults`). Everything here is versioned and free of torch,
so the agent never needs to import torch.
"""
