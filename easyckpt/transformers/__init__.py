"""HuggingFace Trainer integration: ``TrainerWrapper(trainer)`` and ``train(resume_from_checkpoint=True)``.

::

    from easyckpt.transformers import TrainerWrapper
    trainer = TrainerWrapper(trainer, save_mem_interval=1)   # honours save_strategy, save_steps, save_total_limit
    trainer.train(resume_from_checkpoint=True)               # memory, replica or disk; fresh start if none

What it does, and why this way:

* **Snapshot at the Trainer's own save point.** The wrapper hooks ``Trainer._maybe_log_save_evaluate``
  (on the instance) and snapshots after it returns, every ``save_mem_interval`` optimizer steps. That is
  the point where the Trainer itself writes a checkpoint: after the step's log, evaluation and save, and
  before the next batch is fetched. The snapshot holds the model, optimizer, LR scheduler, grad scaler
  (when there is one), the Trainer's state (global step, epoch, log history, best metric, the stateful
  callbacks) and every RNG in the Trainer's own layout (python, numpy, torch CPU, CUDA when present).
  The data position needs nothing more: the Trainer derives it from the global step (epochs done and
  batches to skip), and its sampler is seeded by ``seed``/``data_seed`` plus the epoch.

* **Resume through the Trainer's own resume path.** ``train(resume_from_checkpoint=True)`` asks the
  Checkpointer for the newest step every rank can get (memory, else replicas on other nodes, else a
  complete ``iteration_N`` on disk, all chosen collectively), writes that state as a Trainer checkpoint
  directory in the node's shared-memory directory (once per node; each rank adds its own
  ``rng_state_<rank>.pth``) and calls ``Trainer.train(resume_from_checkpoint=<that directory>)``. So the
  Trainer restores everything at exactly the points it always does (the RNGs after skipping the
  consumed batches, the callbacks' states, the scaler) and the loss curve continues exactly, with no
  re-implementation of its resume logic to drift from it across versions. The cost is one write and one
  read of the state through tmpfs (memory bandwidth); the directory is removed after the first step.
  When a complete ``checkpoint-N`` is newer than anything easyckpt holds (e.g. written by a plain
  Trainer), it wins. A path still works as in the Trainer; ``None``/``False`` is a fresh start (and
  drops this job's old snapshots from memory so that they cannot be mistaken for this run's). A run
  resumed at (or past) ``max_steps`` trains nothing more: the Trainer itself checks ``max_steps`` only
  after a step, so when ``max_steps`` is not a multiple of the steps per epoch it would fast-forward into
  the unfinished epoch and train one step past the end (a plain Trainer resumed from its last
  ``checkpoint-N`` does, in transformers 5.23).

* **Persist with the agent, export Trainer-native folders.** With ``save_strategy="steps"`` the
  Checkpointer's ``save_storage_interval`` is ``save_steps``: the node agent persists those snapshots to
  ``<output_dir>/easyckpt/iteration_N`` off the training path, as for any easyckpt job. When such an
  iteration is complete, a thread of the process with ``args.should_save`` exports it to
  ``<output_dir>/checkpoint-N/`` with the Trainer's file names (``model.safetensors`` through the model's
  own ``save_pretrained``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state[_<rank>].pth``,
  ``trainer_state.json``, ``training_args.bin``, the processing class; for a peft model the adapter only,
  ``adapter_model.safetensors`` and ``adapter_config.json``, as the Trainer writes) and applies ``save_total_limit``
  the way the Trainer does (newest and best are never deleted). Calling the Trainer's own
  ``_save_checkpoint`` instead would block every rank on the disk at every save, which is what easyckpt
  exists to avoid. A save the interval cannot express (the final step when ``max_steps`` is not a
  multiple of ``save_steps``, ``save_strategy="epoch"`` or ``"best"``) is snapshotted at the save point
  on every rank with a request to persist it now (``Checkpointer.save(step, state, persist=True)``) and
  exported the same way. Only when a rank finds no free slot within ``pin_timeout`` is it written
  synchronously from the live state, with a warning. ``save_strategy="no"`` keeps snapshots in memory
  only.

* **A torn checkpoint is never chosen.** Every ``checkpoint-N`` this module writes is assembled in
  ``<output_dir>/.easyckpt-tmp-checkpoint-N``, fsynced, and renamed into place (then the directory is
  fsynced): it is complete or absent. Folders of other writers (a plain Trainer killed mid-save) are
  checked before use: ``trainer_state.json`` must parse and name step N, the weights must be there (a
  safetensors file must open), and so must ``optimizer.pt``, ``scheduler.pt`` and each rank's RNG file;
  ``resume_from_checkpoint=True`` skips a folder that fails, and an explicit path that fails is refused
  with the reason.

Supported: one process, DDP (each rank holds the whole model and optimizer, as the Trainer saves
them; of a peft model the snapshots hold what trains, not the frozen base the script builds again at each
start, see ``snapshot.trained_only``), DeepSpeed ZeRO stages 1 to 3 (``zero``: each rank snapshots its own
partition, of a peft model without the frozen base as DeepSpeed's ``exclude_frozen_parameters``; resume and the
checkpoint-N exports use DeepSpeed's own layout) and FSDP2 through Accelerate (``fsdp``: each rank
snapshots its DTensor shards, of a peft model without the frozen base and laid out for the Trainer as the adapter
only, ``adapters.fsdp_trainer_state``; resume and checkpoint-N use Accelerate's FSDP layouts; on CPU Accelerate
drops the FSDP plugin and the Trainer runs DDP, which the wrapper logs). ZeRO offload, data skipping and
the health monitor with DeepSpeed, FSDP1, ``save_on_each_node``,
hyperparameter search and a Trainer whose ``args.world_size`` is not the job's are refused with a clear error;
with ``push_to_hub`` the checkpoints are not pushed at each save. A ``checkpoint-N`` appears when the
agent has persisted the step and the export is done, so a callback's ``on_save`` may run before the
folder exists (``best_model_checkpoint`` names it already, and rotation keeps it); training waits for
the pending exports before the Trainer's end-of-training work (``load_best_model_at_end``, the last
``save_total_limit`` pass). While it waits, a node agent that died is replaced (checked once a second; the
new one adopts the slots, persists the newest due step and is asked again for the steps the exports wait
for); when none can be started, the exports still waited for give up at once with a warning naming each
step, instead of waiting ``export_timeout``.

The package: ``wrapper`` (TrainerWrapper: the hooks, snapshots, saves), ``snapshot`` (the state taken
from the live Trainer), ``resume`` (choosing and staging the state to resume from), ``folders``
(checkpoint-N folders: checks, the Trainer's files, atomic publish, ``save_total_limit``), ``export``
(the thread turning persisted iterations into checkpoint-N folders), ``zero`` (DeepSpeed), ``fsdp``
(FSDP2); its collectives are ``easyckpt.collectives``.
"""
from __future__ import annotations

# Checked here, once, so that a missing library gets the fix rather than a traceback from a submodule.
# ``transformers`` is the HuggingFace library: imports are absolute, never this package.
try:
    from transformers import Trainer as _Trainer
except ImportError as _exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "easyckpt.transformers needs the transformers package (and accelerate): "
        "pip install 'easyckpt[hf]' or pip install transformers accelerate"
    ) from _exc
del _Trainer

# After the check above, so that a missing transformers is reported as such, not as a failed import deep inside.
from easyckpt.transformers.folders import checkpoint_problem, complete_checkpoints, rng_file_name  # noqa: E402
from easyckpt.transformers.resume import ResumeInfo  # noqa: E402
from easyckpt.transformers.snapshot import STATE_FORMAT  # noqa: E402
from easyckpt.transformers.wrapper import TrainerWrapper  # noqa: E402

__all__ = ["TrainerWrapper", "ResumeInfo", "checkpoint_problem", "complete_checkpoints", "rng_file_name",
           "STATE_FORMAT"]
