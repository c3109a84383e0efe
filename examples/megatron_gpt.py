"""A Megatron-style training loop with megatron-core's GPTModel and easyckpt's three lines.

On CPU (gloo; under a minute on 2 cores; needs ``pip install -e '.[megatron]'``)::

    torchrun --nproc-per-node=2 examples/megatron_gpt.py --save-dir /tmp/ckpt --out /tmp/run --train-iters 30

Kill one rank (``kill -9 $(cat /tmp/run/pid-rank1)``) under ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun
--max-restarts=1`` (without the variable torch's restarted workers hang in init_process_group: pytorch#135712) and the
restarted ranks resume from memory; start the job again after a crash and it resumes from memory too, and
from disk (``--save-dir``, every ``--save-storage-interval`` iterations) once the slots are gone, e.g. after
a clean end. The three lines (the rest is an ordinary Megatron loop)::

    from easyckpt.megatron import initialize_easyckpt, save_checkpoint_if_needed, load_checkpoint
    initialize_easyckpt(save_mem_interval=1, save_storage_interval=5, max_ckpt_num=3, save_dir=..., args=args)
    iteration, num_floating_point_operations_so_far = load_checkpoint(model, optimizer, opt_param_scheduler)
    while iteration < args.train_iters:
        ...train_step...; iteration += 1
        save_checkpoint_if_needed(iteration, model, optimizer, opt_param_scheduler)

(With Megatron-LM's ``megatron.training`` the dirs come from ``--save``/``--load`` and ``args=`` is not
needed.) ``import easyckpt.megatron.hook`` adds the exit handling: on SIGTERM or an uncaught exception the
newest snapshot is persisted (``Checkpointer.flush()``) before the process exits.

On CPU, megatron-core's forward needs two stand-ins, installed by ``use_cpu_megatron()``: its global
attention buffer is allocated on CPU, and its tensor-parallel RNG tracker forks the CPU generator
instead of the CUDA one (so the tracker states are real and are checkpointed like on a GPU). Megatron's
DDP wrapper needs CUDA, so the CPU path averages gradients with one flat all-reduce; its optimizer is
megatron-core's FP32Optimizer around a torch AdamW (``CpuFP32Optimizer``: the constructor's loss-scale tensor
and the fused gradient-norm kernel are CUDA-only, so those two are done by torch), driven by megatron-core's
own OptimizerParamScheduler, and the loop steps the scheduler only when ``optimizer.step()`` reports a
successful update, as Megatron's train_step does. With ``--cuda`` the script
uses megatron-core's DistributedDataParallel and get_megatron_optimizer (``--use-distributed-optimizer``
for the sharded optimizer); ``tests/integrations/test_megatron.py`` runs that path where CUDA is available.

``--tp 2`` splits every layer over two tensor-parallel ranks (megatron-core's parallel layers run on gloo
too); the remaining ranks are data-parallel, and gradients are averaged over the data-parallel group.

``--concat`` resumes with ``load_checkpoint(..., concat=True)``: a save of another ``--tp`` or number of ranks
(``tests/integrations/test_megatron_concat.py``); ``--dump-full`` writes the state gathered over the tensor-parallel group
and a fixed batch's loss after the load and at the end, to compare them.

``--native-save-at N --native-save-dir D`` additionally writes, at iteration N, a native Megatron legacy
checkpoint the way megatron.training.checkpointing does (``D/iter_000000N/mp_rank_00/model_optim_rng.pt``
+ tracker): the tests migrate from it with ``--load-dir D``.

Checkpoint health: ``--embedding-local-norm-threshold T`` turns the monitor on (each snapshot carries the
word embedding's gradient norm, read by save_checkpoint_if_needed, and the loss); ``--spike-steps 12,13``
scales those iterations' loss by 1e4; ``--kill-at N`` SIGKILLs rank 1 once its snapshot of N is in memory.
Data skipping: ``--global-norm-spike-threshold T`` (and ``--global-norm-spike-count-threshold C``) turns on
``use_skip_data_by_global_norm``: an iteration whose global gradient norm exceeds T is not applied (Megatron's
optimizer step returns "not successful", the scheduler is not stepped), and C such iterations in a row stop
the run with ``easyckpt.TrainingAborted`` after the newest snapshot is durable. ``--drop-steps 14`` skips
those iterations' update unconditionally (a run that never saw them, to compare against).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import xxhash

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import GlobalMemoryBuffer  # noqa: E402

import easyckpt.megatron.hook  # noqa: E402,F401  (exit handling)
from easyckpt.megatron import finalize_easyckpt, initialize_easyckpt, last_load, load_checkpoint, save_checkpoint_if_needed  # noqa: E402

VOCAB, SEQ, MICRO_BATCH = 64, 16, 4


def write_report(path: Path, report: dict[str, object]) -> None:
    """Whole or not at all: tests poll for these files while the job runs (a half-written one was read)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)


class CpuRNGStatesTracker(tp_random.CudaRNGStatesTracker):
    """Megatron's tensor-parallel RNG tracker on the CPU generator (the CUDA one does not exist here)."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class CpuMemoryBuffer(GlobalMemoryBuffer):
    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        needed = int(np.prod(tensor_shape))
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < needed:
            buffer = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
        return buffer[:needed].view(*tensor_shape)


def use_cpu_megatron() -> None:
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    tp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class CpuFP32Optimizer(FP32Optimizer):
    """megatron-core's FP32Optimizer (its step(): prepare_grads, clip_grad_norm when clip_grad > 0,
    step_with_ready_grads) with the two CUDA-only pieces done by torch on CPU: the loss-scale tensor and
    the gradient norm, over the same gradients as Megatron's (no tensor-parallel duplicates, no shared
    parameters) and reduced over the same group."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
        MegatronOptimizer.__init__(self, optimizer, config)
        self._scale = torch.tensor([1.0])
        self.is_stub_optimizer = False

    def get_grad_norm(self) -> float:
        grads = self.get_main_grads_for_grad_norm()
        squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(squares, group=self.get_grad_stats_parallel_group())
        return float(squares.sqrt())

    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = CpuFP32Optimizer.get_grad_norm(self)   # the class's: easyckpt wraps the instance's to read it
        torch.nn.utils.clip_grads_with_norm_(self.get_parameters(), clip_grad, torch.tensor(norm))
        return norm


def build_model(cuda: bool, tp: int = 1) -> tuple[GPTModel, TransformerConfig]:
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=not cuda,
                               tensor_model_parallel_size=tp,
                               hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    return (model.cuda() if cuda else model), config


def batch(consumed: int, dp_rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The data at this position of this data-parallel rank's stream: resuming replays the same data."""
    generator = torch.Generator().manual_seed(1_000_003 * consumed + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    positions = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), 1)[None, None]
    return inputs, positions, mask, labels


def average_gradients(module: torch.nn.Module) -> None:
    """One flat all-reduce over the data-parallel ranks in a fixed order: bitwise the same sums at every
    step and after a restart."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    flat /= parallel_state.get_data_parallel_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def digest(model: list[torch.nn.Module], optimizer: object) -> str:
    from easyckpt.snapshot.state import flatten
    hasher = xxhash.xxh3_128()
    state = {"model": [m.state_dict() for m in model], "optim": optimizer.state_dict()}
    for ref, value in zip(*flatten(state)[1:]):
        hasher.update(ref.name.encode())
        hasher.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def trace(model: list[torch.nn.Module], optimizer: object) -> dict[str, float]:
    """Sums of the model and of each optimizer-state key on this rank (EASYCKPT_EXAMPLE_TRACE=1): where a
    resumed run first departs from an uninterrupted one."""
    sums = {"model": sum(float(t.double().sum()) for m in model for t in m.state_dict().values()
                         if isinstance(t, torch.Tensor) and t.is_floating_point())}
    inner = getattr(optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                sums[key] = sums.get(key, 0.0) + float(value.double().sum())
    for group in getattr(inner, "param_groups", []):
        sums["lr"] = float(group["lr"])
        sums["main_params"] = sums.get("main_params", 0.0) + sum(float(p.double().sum()) for p in group["params"])
    return sums


def dump_full(out: Path, tag: str, model: list[torch.nn.Module], optimizer: object) -> None:
    """``full-<tag>.safetensors``: every parameter and its AdamW moments gathered whole over the tensor-parallel
    group (Megatron's own collectives, not easyckpt's), and ``eval-<tag>.json``: the loss on a fixed batch
    without dropout (``--dump-full``: what a resume on another tensor-parallel size is checked against)."""
    from safetensors.torch import save_file
    group, tp = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size()
    inner = optimizer.optimizer
    full: dict[str, torch.Tensor] = {}
    for name, param in model[0].named_parameters():
        tensors = {name: param.detach(), **{f"{name}.{key}": value for key, value in inner.state.get(param, {}).items()
                                            if isinstance(value, torch.Tensor) and value.shape == param.shape}}
        for key, tensor in tensors.items():
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                tensor = torch.cat(parts, dim=param.partition_dim)
            full[key] = tensor.contiguous().clone()
    model[0].eval()
    with torch.no_grad():
        inputs, positions, mask, labels = batch(0, 0, next(model[0].parameters()).device)
        loss = model[0](inputs, positions, mask, labels=labels).float().mean().item()
    model[0].train()
    if dist.get_rank() == 0:
        save_file(full, str(out / f"full-{tag}.safetensors"))
        (out / f"eval-{tag}.json").write_text(json.dumps({"loss": loss, "tp": tp}))


def save_native_megatron(directory: Path, iteration: int, model, optimizer, scheduler, args, flops) -> None:
    """What megatron.training.checkpointing.save_checkpoint writes with --ckpt-format torch (legacy)."""
    if parallel_state.get_data_parallel_rank() == 0:
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(),
               "rng_tracker_states": tp_random.get_cuda_rng_tracker().get_states()}
        if torch.cuda.is_available():
            rng["cuda_rng_state"] = torch.cuda.get_rng_state()
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "model": model[0].state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                 "opt_param_scheduler": scheduler.state_dict(), "rng_state": [rng],
                 "num_floating_point_operations_so_far": flops}
        path = directory / f"iter_{iteration:07d}" / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state, path / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--load-dir", default=None, help="default: --save-dir")
    parser.add_argument("--out", required=True, help="directory for loss logs and resume reports")
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--save-mem-interval", type=int, default=1)
    parser.add_argument("--save-storage-interval", type=int, default=5)
    parser.add_argument("--max-ckpt-num", type=int, default=3)
    parser.add_argument("--step-idle", type=float, default=0.0, help="extra idle seconds per iteration")
    parser.add_argument("--native-save-dir", default=None)
    parser.add_argument("--native-save-at", type=int, default=None)
    parser.add_argument("--raise-at", type=int, default=None, help="rank 0 raises after this iteration")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--cuda", action="store_true", help="megatron-core DDP and optimizer on CUDA (NCCL)")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the rest is data-parallel)")
    parser.add_argument("--concat", action="store_true", help="load_checkpoint(..., concat=True): resume a save of "
                        "another tensor/data-parallel size")
    parser.add_argument("--dump-full", action="store_true", help="write the gathered full state and a fixed batch's "
                        "loss after the load and at the end (full-load/full-end.safetensors, eval-*.json)")
    parser.add_argument("--spike-steps", default="", help="comma-separated iterations whose loss is scaled by 1e4 "
                        "(a gradient spike)")
    parser.add_argument("--embedding-local-norm-threshold", type=float, default=None,
                        help="checkpoint health monitor on (use_checkpoint_health_monitor=True) with this threshold")
    parser.add_argument("--drop-steps", default="", help="comma-separated iterations whose update is not applied")
    parser.add_argument("--global-norm-spike-threshold", type=float, default=None,
                        help="data skipping on (use_skip_data_by_global_norm=True) with this threshold")
    parser.add_argument("--global-norm-spike-count-threshold", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself once its snapshot of this "
                        "iteration is in memory (a fresh start only)")
    cli = parser.parse_args()
    if "RANK" not in os.environ:   # else torch.distributed only says that RANK is not set
        parser.error(f"run it under torchrun: torchrun --nproc-per-node=2 {sys.argv[0]} ARGS")
    logging.basicConfig(level=os.environ.get("EASYCKPT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s rank%(process)d %(name)s: %(message)s")
    if cli.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cli.cuda else "gloo")
    rank = dist.get_rank()
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=1)
    if not cli.cuda:
        use_cpu_megatron()
    # Megatron's _set_random_seed: the same seed on every data-parallel rank.
    random.seed(cli.seed)
    np.random.seed(cli.seed)
    torch.manual_seed(cli.seed)
    tp_random.model_parallel_cuda_manual_seed(cli.seed)
    device = torch.device("cuda") if cli.cuda else torch.device("cpu")
    gpt, config = build_model(cli.cuda, cli.tp)
    if cli.cuda:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import get_megatron_optimizer
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=cli.use_distributed_optimizer)
        model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)]
        # min_lr must match the scheduler's: megatron puts config.min_lr (None by default) into every param
        # group, and the scheduler prefers the group's value.
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01,
                                                           use_distributed_optimizer=cli.use_distributed_optimizer,
                                                           clip_grad=1.0), model)
    else:
        model = [gpt]
        # one parameter group as get_megatron_optimizer makes them (its keys identify groups on load)
        optimizer = CpuFP32Optimizer(torch.optim.AdamW([{"params": list(gpt.parameters()), "wd_mult": 1.0,
                                                         "lr_mult": 1.0, "is_expert_parallel": False,
                                                         "is_decoupled_lr": False}], lr=3e-3, weight_decay=0.01),
                                     OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01,
                                                     clip_grad=0.0))
    global_batch = MICRO_BATCH * parallel_state.get_data_parallel_world_size()
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4,
                                        lr_warmup_steps=5 * global_batch, lr_decay_steps=200 * global_batch,
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=200 * global_batch, wd_incr_style="constant")
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=SEQ,
                              seq_length=SEQ, padded_vocab_size=VOCAB, micro_batch_size=MICRO_BATCH,
                              global_batch_size=global_batch, train_iters=cli.train_iters, seed=cli.seed,
                              tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=1,
                              use_distributed_optimizer=cli.use_distributed_optimizer, ckpt_format="torch",
                              consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
                              save=cli.save_dir, load=cli.load_dir or cli.save_dir)

    monitor = cli.embedding_local_norm_threshold is not None
    options: dict[str, object] = {} if not monitor else {
        "use_checkpoint_health_monitor": True, "embedding_local_norm_threshold": cli.embedding_local_norm_threshold}
    spikes = {int(step) for step in cli.spike_steps.split(",") if step}
    dropped = {int(step) for step in cli.drop_steps.split(",") if step}
    if cli.global_norm_spike_threshold is not None:
        options.update(use_skip_data_by_global_norm=True, global_norm_spike_threshold=cli.global_norm_spike_threshold,
                      global_norm_spike_count_threshold=cli.global_norm_spike_count_threshold)
    # -- easyckpt, line 1 of 3 --
    ckpt = initialize_easyckpt(save_mem_interval=cli.save_mem_interval, save_storage_interval=cli.save_storage_interval,
                               max_ckpt_num=cli.max_ckpt_num, log_file_path=str(out / "persist.log"),
                               save_dir=args.save, load_dir=args.load, args=args, **options)
    # -- easyckpt, line 2 of 3 --
    iteration, flops = load_checkpoint(model, optimizer, scheduler, concat=cli.concat)
    if cli.dump_full:
        dump_full(out, "load", model, optimizer)

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    info = last_load()
    report = {"rank": rank, "iteration": iteration, "source": info.source if info else None,
              "path": info.path if info else None, "seconds": info.seconds if info else 0.0, "attempt": attempt,
              "consumed_train_samples": args.consumed_train_samples, "pid": os.getpid()}
    write_report(out / f"resume-rank{rank}-{len(list(out.glob(f'resume-rank{rank}-*.json')))}.json", report)
    if rank == 0 and info is not None and info.source is not None:
        print(f"resumed at iteration {iteration} from {info.source} in {info.seconds * 1000:.1f} ms", flush=True)

    dp_rank = parallel_state.get_data_parallel_rank()
    tracing = os.environ.get("EASYCKPT_EXAMPLE_TRACE") == "1"
    with open(out / f"losses-rank{rank}.jsonl", "a", encoding="utf-8") as log, \
            open(out / f"trace-rank{rank}.jsonl", "a", encoding="utf-8") as traces:
        if tracing:
            traces.write(json.dumps({"trace": iteration, "attempt": attempt, **trace(model, optimizer)}) + "\n")
        while iteration < cli.train_iters:
            inputs, positions, mask, labels = batch(args.consumed_train_samples, dp_rank, device)
            if cli.cuda:
                for chunk in model:
                    chunk.zero_grad_buffer()
            optimizer.zero_grad(set_to_none=True)
            loss = model[0](inputs, positions, mask, labels=labels).float().mean()
            if iteration + 1 in spikes:
                loss = loss * 1e4
            loss.backward()
            if cli.cuda:
                for chunk in model:
                    chunk.finish_grad_sync()
            else:
                average_gradients(gpt)
            # Megatron's train_step: the scheduler steps only after a successful update (not after an
            # overflow, nor after a spike that data skipping refused)
            update_successful = False if iteration + 1 in dropped else optimizer.step()[0]
            if update_successful:
                scheduler.step(increment=global_batch)
            iteration += 1
            args.consumed_train_samples += global_batch
            flops += 6 * sum(p.numel() for p in gpt.parameters()) * global_batch * SEQ
            # -- easyckpt, line 3 of 3 --  (metrics: with the health monitor, besides the embedding's norm)
            save_checkpoint_if_needed(iteration, model, optimizer, scheduler, flops,
                                      metrics={"loss": loss.item()} if monitor else None)
            if cli.kill_at == iteration and rank == 1 and (info is None or info.source is None):
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            log.write(json.dumps({"iteration": iteration, "loss": loss.item(), "attempt": attempt}) + "\n")
            if tracing:
                traces.write(json.dumps({"trace": iteration, "attempt": attempt, **trace(model, optimizer)}) + "\n")
            log.flush()
            if cli.native_save_at == iteration and cli.native_save_dir:
                save_native_megatron(Path(cli.native_save_dir), iteration, model, optimizer, scheduler, args, flops)
            if cli.raise_at == iteration and rank == 0:
                raise RuntimeError(f"injected failure after iteration {iteration}")
            time.sleep(cli.step_idle)  # stands in for GPU work, not a synchronisation
    if cli.dump_full:
        dump_full(out, "end", model, optimizer)
    (out / f"final-rank{rank}.json").write_text(json.dumps({"iteration": iteration, "flops": flops,
                                                             "digest": digest(model, optimizer)}))
    finalize_easyckpt()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
