"""PyTorch Lightning integration: ``Trainer(callbacks=[EasyCkpt(...)])`` and ``trainer.fit(model, ckpt_path="last")``.

::

    from easyckpt.lightning import EasyCkpt
    trainer = Trainer(..., callbacks=[EasyCkpt(save_mem_interval=1), ModelCheckpoint(every_n_train_steps=50)])
    trainer.fit(model, ckpt_path="last")      # memory, replica or disk; a fresh start when there is none

What it does, and why this way:

* **Snapshot Lightning's own checkpoint.** At the end of every ``save_mem_interval``-th optimizer step
  (``on_train_batch_end``, where ``ModelCheckpoint(every_n_train_steps=...)`` saves) the callback builds the
  dictionary ``trainer.save_checkpoint`` would write (``_CheckpointConnector.dump_checkpoint``: the model,
  every optimizer and LR scheduler, the loops' progress, the callbacks' states, the precision plugin,
  ``on_save_checkpoint`` hooks' additions, the datamodule's state, a stateful dataloader's position) plus,
  in its own callback state, each rank's RNGs, and hands it to ``Checkpointer.save_if_needed``: a copy into
  shared memory overlapped with the next step.

* **Resume through Lightning's own restore.** ``ckpt_path="last"`` resolves to easyckpt
  (:mod:`easyckpt.lightning.connector`): the Checkpointer picks the newest step every rank can get
  (memory, replicas on other nodes, disk; collectively) and Lightning restores everything from that
  dictionary at exactly the points it restores a ``.ckpt`` file, so its version-specific restart logic is
  used, not re-implemented. When easyckpt holds nothing, the ``last.ckpt`` Lightning would have taken, else a
  fresh start. Then the resumed epoch leaves out the batches it had consumed when the loader is a plain
  ``DataLoader`` (:mod:`easyckpt.lightning.data`; a stateful one gets its saved state again once the epoch is
  set, its wrapped sampler's generator from :mod:`easyckpt.lightning.sampling`) and the RNGs
  continue from the snapshot: the loss curve continues bit for bit.

* **Lightning's saves are persisted by the agent.** ``ModelCheckpoint`` keeps deciding when and under
  which name to save (``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``, ``save_top_k``,
  ``monitor``, ``save_last``, ``dirpath``, ``filename``), and ``trainer.save_checkpoint(path)`` works as
  always; but instead of ``torch.save`` on rank 0 while every rank waits, each rank snapshots the state with a
  request to persist it (``Checkpointer.save(step, state, persist=True)``), taken once the step's saves are
  over (at the callback's next hook: ``ModelCheckpoint`` writes ``last.ckpt`` after the top-k file, and the
  snapshot must hold the callbacks' states as the last save left them; the step's own in-memory snapshot is
  held with them, so one copy of the step is taken, not two that differ), and rank 0's export thread
  (:mod:`easyckpt.lightning.export`) writes the ``.ckpt`` file from the persisted iteration: the file a plain
  Lightning ``Trainer`` resumes from and ``load_from_checkpoint`` reads. ``save_top_k``'s removals reach
  the files (or cancel their export). A file appears once the agent has persisted its step: training waits
  for the pending ones at the end of ``fit()`` (``EasyCkpt.wait_exports()`` waits earlier).

* **When Lightning saves faster than the agent persists** (``every_n_train_steps=1`` on a large state),
  the agent persists the newest request and passes older ones over, as for any easyckpt job: their files
  are not written (the export thread logs each), while every step stays in memory.

Supported: one device, DDP (``strategy="ddp"`` and its launchers) and ``ModelParallelStrategy`` with FSDP2
(:mod:`easyckpt.lightning.sharded`; DTensor tensor parallelism takes the same path, untested). FSDP1 and
DeepSpeed are refused at ``setup`` with the reason. It is for the ``lightning`` package (``lightning.pytorch``);
the standalone ``pytorch_lightning`` package has classes of its own, which EasyCkpt does not hook. The package:
``callback`` (EasyCkpt), ``connector`` (``ckpt_path="last"``), ``data`` (the data position), ``sharded``
(ModelParallelStrategy), ``export`` (the ``.ckpt`` files).
"""
from __future__ import annotations

# Checked here, once, so that a missing library gets the fix rather than a traceback from a submodule.
try:
    import lightning.pytorch as _pl
except ImportError as _exc:  # pragma: no cover - exercised only without lightning
    raise ImportError("easyckpt.lightning needs PyTorch Lightning 2.x: pip install 'easyckpt[lightning]' "
                      "or pip install lightning") from _exc
del _pl

from easyckpt.lightning.callback import EasyCkpt  # noqa: E402

__all__ = ["EasyCkpt"]
