"""Stager: copy a rank's state into a free shared-memory slot while training goes on.

``snapshot`` only flattens the state (plain values are captured right away), picks and locks a slot,
and launches the copy: on CPU a background thread copies (torch's copy releases the GIL); on CUDA
the training thread only records an event on its stream, and the copy thread pins the slot once with
cudaHostRegister and queues the device-to-host copies on side streams behind that event (so the save
call pays for no per-tensor launch and no registration of a fresh slot). The copy must finish before the
optimizer next changes the parameters, so ``wait`` runs from a global optimizer step pre-hook and at the
start of the next snapshot; only then is the slot committed (header COMMITTED, even generation) and
unlocked.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from easyckpt.config import CheckpointerConfig
from easyckpt.snapshot.slots import RankSlots, SlotWrite
from easyckpt.snapshot.state import SKELETON_VERSION, TensorRef, flatten, numpy_dtype, torch_dtype
from easyckpt_wire import layout, procs
from easyckpt_wire.episode import Episode
from easyckpt_wire.faults import fault_point
from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.records import SlotMeta, TensorEntry
from easyckpt_wire.shm import DATA_OFFSET, PAGE, SlotMap, align, slot_size

logger = logging.getLogger(__name__)

_META_HEADROOM = 64 << 10  # plain values (e.g. a growing log history) may grow between snapshots
_LARGE = 1 << 20           # tensors from this size on are copied by numpy, in chunks, on copy_threads threads
_CHUNK = 16 << 20
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CUDA_PIECE = 64 << 20     # CUDA tensors over this size are split into pieces of it across the copy streams


def copy_lanes(sizes: list[int], lanes: int, piece: int = _CUDA_PIECE,
               whole: frozenset[int] = frozenset()) -> list[list[tuple[int, int, int]]]:
    """Spread byte ranges of tensors of ``sizes`` over ``lanes`` streams: (tensor, start, end) per piece.

    Tensors over ``piece`` bytes are cut into pieces of that size, except those in ``whole`` (not contiguous);
    the pieces go largest first to the lane with the fewest bytes so far (LPT), so the lanes end together
    even when one tensor is most of the state.
    """
    items = [(i, start, min(start + (size if i in whole else piece), size)) for i, size in enumerate(sizes)
             for start in (range(0, max(size, 1), piece) if i not in whole else (0,))]
    items.sort(key=lambda item: item[1] - item[2])
    loads, out = [0] * lanes, [[] for _ in range(lanes)]   # type: list[int], list[list[tuple[int, int, int]]]
    for item in items:
        lane = loads.index(min(loads))
        out[lane].append(item)
        loads[lane] += item[2] - item[1]
    return out


def _copy_chunk(pair: tuple[numpy.ndarray, numpy.ndarray]) -> None:
    numpy.copyto(pair[0], pair[1])


def _as_numpy(tensor: torch.Tensor) -> numpy.ndarray:
    """A numpy view of the same bytes (bf16 and friends have no numpy dtype, their bit pattern does)."""
    return tensor.detach().view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


@dataclasses.dataclass(slots=True)
class _Plan:
    refs: list[TensorRef]
    offsets: list[int]
    data_len: int
    entries: list[TensorEntry]
    static_meta: bytes = b""   # the msgpack key/value pairs that do not change between snapshots


@dataclasses.dataclass(slots=True)
class _Pending:
    step: int
    index: int                                 # the slot being written
    persist: bool                              # ask the agent to persist it once committed
    future: concurrent.futures.Future[float]   # the copy thread's result: seconds from launch to commit


@dataclasses.dataclass(slots=True)
class _Owed:
    """The newest snapshot that found no free slot: close() and flush() take it late, so that the end of a
    run is not lost, but only while no optimizer step has changed the state since (``moved``)."""
    step: int
    state: object
    persist: bool
    health: RankHealth
    moved: bool = False


def settle_torch_thread_pool() -> None:
    """Construct torch's intra-op thread pool (``caffe2::pthreadpool``) in this process now, before our threads run.

    A process forked later (a DataLoader worker) calls ``torch.set_num_threads(1)`` first, which constructs the pool
    if this process never did, and construction registers an exit handler under glibc's atexit lock. A fork copies
    that lock as it is: if another thread of this process held it at that moment (ours run torch code beside the
    training loop; gloo's and ZeroMQ's run too), the worker waits for it forever and so does the loader
    (pytorch/pytorch#130610; a Lightning job hung so in CI, 2026-12-02). Setting the count the pool already
    reports constructs it and changes nothing else.
    """
    torch.set_num_threads(torch.get_num_threads())


class Stager:
    def __init__(self, config: CheckpointerConfig, slots: RankSlots, *, rank: int, world_size: int,
                 local_rank: int, local_world_size: int,
                 request_persist: Callable[[int], object] = lambda step: None,
                 committed: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.slots = slots
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.request_persist = request_persist
        self.on_commit = committed   # copy thread, right after a commit: wakes the agent
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"easyckpt-copy-r{rank}")
        self._chunk_pool = concurrent.futures.ThreadPoolExecutor(
            config.copy_threads, thread_name_prefix=f"easyckpt-chunk-r{rank}") if config.copy_threads > 1 else None
        self.pending: _Pending | None = None
        self.plan: _Plan | None = None
        self._views: dict[int, tuple[int, torch.Tensor]] = {}   # slot index -> (mmap id, uint8 view)
        self._tensor_views: dict[int, tuple[int, int, list[Any]]] = {}  # slot -> (mmap id, plan id, views)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._static_keys = 0
        self._hook: RemovableHandle | None = None
        self.owed: _Owed | None = None
        self._owed_hook: RemovableHandle | None = None
        self._cuda_streams: list[Any] = []
        self._registered: dict[int, int] = {}                    # slot index -> registered address
        self.skipped = 0
        self._skips = Episode(logger)
        self._races = Episode(logger, logging.INFO)   # skips for a moment's race with the agent's round
        self._kept = Episode(logger, logging.INFO)   # skips that keep the newest step for an agent that is late
        self.committed = 0
        self._stepped = False       # an optimizer stepped since the last snapshot's launch
        self._repeats_said: set[bool] = set()   # whether a repeat of a step was said, after an optimizer step or not
        self.last_commit_step: int | None = None
        self.last_copy_seconds = 0.0
        self.last_launch_phases: dict[str, float] = {}
        self._pid, self._pid_start = os.getpid(), procs.start_time()

    # public -----------------------------------------------------------------------------------------
    def snapshot(self, step: int, state: object, *, persist: bool = False, health: RankHealth = NEUTRAL) -> bool:
        """Launch a snapshot of ``state`` at ``step``; False when it was skipped (no free slot). With
        ``persist``, the agent is asked to persist it once it is committed (not before: the agent would
        take any committed copy of that step, and an older one of the same step may be in the other slot)."""
        self.wait()
        if self._launch(step, state, persist, health):
            self._forget_owed()
            return True
        self.skipped += 1
        word = self.slots.agent_word()
        if self.slots.kept_newest is not None:   # the agent is late; the rank's own choice, not a shortage
            self._kept.hit("rank %d: snapshot of step %d skipped to keep step %d, which the agent has not declared "
                           "safe yet (safe step %s): writing over it would let a kill cost more than two snapshot "
                           "intervals", self.rank, step, self.slots.kept_newest, word.safe if word else None)
        elif self.slots.raced:   # a moment's race with the agent's round, no shortage: the next snapshot finds a slot
            self._races.hit("rank %d: snapshot of step %d skipped: the agent was taking a slot for a persist as the "
                            "rank chose one (it says which at the end of its round)", self.rank, step)
        else:
            # Expected with two slots while a persist runs (said once at start-up); with three it is not.
            self._skips.level = logging.INFO if self.slots.count < 3 else logging.WARNING
            self._skips.hit("rank %d: snapshot of step %d skipped: all %d slots hold steps the agent keeps (safe "
                            "step %s, held %s)", self.rank, step, self.slots.count, word.safe if word else None,
                            sorted(word.held) if word else [])
        self.owed = _Owed(step, state, persist, health)
        if self._owed_hook is None:
            self._owed_hook = register_optimizer_step_pre_hook(self._state_moves)
        return False

    def taken_already(self, step: int) -> bool:
        """Whether this rank's last snapshot is of ``step``: a loop with gradient accumulation calls ``save_if_needed``
        once per micro-batch with one step. One snapshot per step, the first call's: each repeat took another slot
        and a whole copy, and with three slots the copies of one step and the agent's holds left none for the next
        steps (2026-12-06: two calls per step, 12 fast steps, every snapshot from step 2 on skipped). Said once; as
        a warning when an optimizer stepped in between (the state moved on and the step did not: not the global
        step)."""
        if step != self.last_commit_step:
            return False
        if self._stepped not in self._repeats_said:
            self._repeats_said.add(self._stepped)
            if self._stepped:
                logger.warning("rank %d: save_if_needed(step=%d) again after an optimizer step: the state moved on and "
                               "the step did not, so the snapshot of step %d stands and the newer state is not taken "
                               "(pass the global optimizer step, one more per update)", self.rank, step, step)
            else:
                logger.info("rank %d: save_if_needed(step=%d) called again (once per micro-batch?): the snapshot of a "
                            "step is taken once, at its first call", self.rank, step)
        return True

    def take_owed(self, timeout: float) -> int | None:
        """The end of a run: take the newest snapshot that was skipped, if no optimizer step changed the
        state since, retrying for a free slot (the agent frees one when its persist ends) for at most
        ``timeout`` seconds; waits for its copy. Returns the step taken, or None."""
        owed = self.owed
        if owed is None or owed.moved or (self.last_commit_step is not None and self.last_commit_step >= owed.step):
            self._forget_owed()
            return None
        self.wait()
        deadline = time.monotonic() + timeout
        # At the end the snapshot itself matters more than a kill during its copy: no skipping to keep the newest step.
        waiting = False
        while not self._launch(owed.step, owed.state, owed.persist, owed.health, keep_newest=False):
            if not waiting:   # said once: the wait can be long (a persist holds a slot until it ends)
                waiting = True
                word = self.slots.agent_word()
                logger.info("rank %d: the skipped snapshot of step %d waits for a free slot at the end of the run "
                            "(safe step %s, held %s; at most %.0fs)", self.rank, owed.step, word.safe if word else None,
                            sorted(word.held) if word else [], timeout)
            if time.monotonic() > deadline:
                logger.warning("rank %d: the snapshot of step %d was skipped and no slot came free within %.0fs "
                               "(end-of-run snapshot timeout): the newest snapshot stays step %s", self.rank,
                               owed.step, timeout, self.last_commit_step)
                self._forget_owed()
                return None
            time.sleep(0.02)   # polling the agent's holds against the deadline
        self._forget_owed()
        self.wait()
        logger.info("rank %d: took the skipped snapshot of step %d at the end of the run", self.rank, owed.step)
        return owed.step

    def note_step(self, step: int) -> None:
        """The loop reached ``step``: a skipped snapshot of another step no longer describes the state (a loop
        that updates its parameters without a torch optimizer is caught here, not by the optimizer hook)."""
        if self.owed is not None and step != self.owed.step:
            self.owed.moved = True

    def _state_moves(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.owed is not None:
            self.owed.moved = True

    def _forget_owed(self) -> None:
        self.owed = None
        if self._owed_hook is not None:
            self._owed_hook.remove()
            self._owed_hook = None

    def _launch(self, step: int, state: object, persist: bool, health: RankHealth, *, keep_newest: bool = True) -> bool:
        started = time.perf_counter()
        skeleton, refs, values = flatten(state)
        plan = self._plan(refs)
        meta = self._meta(plan, step, skeleton, health)
        needed = slot_size(plan.data_len, len(meta) + _META_HEADROOM)
        planned = time.perf_counter()
        write = self.slots.write(needed, step=step if keep_newest else None, before_remap=self._drop_views)
        if write is None:
            return False
        locked = time.perf_counter()
        self._skips.end("rank %d: snapshots resume at step %d after skips", self.rank, step)
        self._races.end("rank %d: snapshots resume at step %d after skips that raced the agent", self.rank, step)
        self._kept.end("rank %d: snapshots resume at step %d after skips that kept the newest step for a late agent",
                       self.rank, step)
        try:
            dst = self._slot_views(write.index, write.slot, plan)
            ready = self._cuda_ready(values)
            future = self.pool.submit(self._finish_copy, step, write, plan, meta, dst, values, ready, started)
        except BaseException:
            write.close()
            raise
        ended = time.perf_counter()
        # Where the save call's time went (benchmarks/blocking.py reports it): flatten + plan + metadata, taking
        # and locking a slot (a first use allocates it), and the views + the launch.
        self.last_launch_phases = {"flatten_plan_meta_s": planned - started, "slot_s": locked - planned,
                                   "views_launch_s": ended - locked}
        self.pending = _Pending(step, write.index, persist, future)
        self._stepped = False
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        return True

    def wait(self) -> None:
        """Block until the pending copy is committed (or failed); a no-op when nothing is pending."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            self.last_copy_seconds = pending.future.result()
            # The other local ranks copy as much, started at about the same moment: twice this copy bounds how
            # long this rank's next slot choice waits for their commits of this step.
            self.slots.peer_wait = 2 * self.last_copy_seconds
        except Exception:
            logger.exception("rank %d: snapshot of step %d failed; the previous snapshot stays valid",
                             self.rank, pending.step)
            return
        self.committed += 1
        self.last_commit_step = pending.step
        # The same step snapshotted again (a save point after the step's own snapshot): the older copy is
        # stale, so no reader may take it for this step.
        self.slots.drop_stale_copies()
        if pending.persist:
            self.request_persist(pending.step)

    def close(self) -> None:
        self._forget_owed()
        self.wait()
        self.pool.shutdown(wait=True)
        if self._chunk_pool is not None:
            self._chunk_pool.shutdown(wait=True)
        for index in list(self._views):
            self._drop_views(index)

    # internals --------------------------------------------------------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Wait for the copy before the optimizer changes the parameters. A step of a torch optimizer given a
        closure (PyTorch Lightning runs the forward and backward passes in one, inside ``optimizer.step``) waits
        after the closure instead, so the copy still overlaps that compute."""
        self._stepped = True
        # torch hands the hook the step's own arguments: args[0] is the optimizer, args[1] a positional closure
        closure = kwargs.get("closure") if kwargs else (args[1] if len(args) > 1 else None)
        # only torch's own optimizers are known to call the closure before they touch a parameter
        if not callable(closure) or not type(optimizer).__module__.startswith("torch.optim"):
            self.wait()
            return None

        def closure_then_wait() -> Any:
            result = closure()
            self.wait()
            return result

        if kwargs and "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    def _meta(self, plan: _Plan, step: int, skeleton: object, health: RankHealth) -> bytes:
        """The slot's msgpack map; the tensor index (the bulk, for big states) is packed once per plan."""
        dynamic = SlotMeta.dynamic_fields(step=step, skeleton=skeleton, created=time.time(), health=health)
        if not plan.static_meta:
            static = SlotMeta.static_fields(
                job=self.slots.job_id, rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                local_world_size=self.local_world_size, pid=self._pid, pid_start=self._pid_start,
                skeleton_version=SKELETON_VERSION, tensors=plan.entries)
            plan.static_meta = b"".join(self._packer.pack(k) + self._packer.pack(v) for k, v in static.items())
            self._static_keys = len(static)
        return (self._packer.pack_map_header(self._static_keys + len(dynamic)) + plan.static_meta
                + b"".join(self._packer.pack(k) + self._packer.pack(v) for k, v in dynamic.items()))

    def _plan(self, refs: list[TensorRef]) -> _Plan:
        """Offsets for every tensor; reused while the state's structure is unchanged.

        Each file's tensors (model, optimizer) lie back to back from a page boundary, largest element
        size first so that every tensor stays aligned to its dtype: the agent then writes a whole file
        from one range of the slot with O_DIRECT.
        """
        if self.plan is not None and self.plan.refs == refs:
            return self.plan
        groups = [layout.tensor_group(ref.name) for ref in refs]
        order = sorted(range(len(refs)), key=lambda i: (groups[i], -torch_dtype(refs[i].dtype).itemsize, i))
        offsets, position, group = [0] * len(refs), 0, None
        for i in order:
            if groups[i] != group:
                position, group = align(position, PAGE), groups[i]
            offsets[i] = position
            position += refs[i].nbytes
        entries = [TensorEntry(ref.name, ref.kind, ref.dtype, ref.shape, offsets[i], ref.nbytes, groups[i], ref.shard)
                   for i, ref in enumerate(refs)]
        if self.plan is not None:
            logger.info("rank %d: state structure changed (%d -> %d tensors): re-planned the slot layout",
                        self.rank, len(self.plan.refs), len(refs))
        self.plan = _Plan(refs, offsets, position, entries)
        return self.plan

    def _slot_views(self, index: int, slot: SlotMap, plan: _Plan) -> list[Any]:
        """Typed views of every tensor's place in the slot; built once per (slot mapping, plan)."""
        assert slot.mm is not None
        hit = self._tensor_views.get(index)
        if hit is not None and hit[0] == id(slot.mm) and hit[1] == id(plan):
            return hit[2]
        cached = self._views.get(index)
        if cached is None or cached[0] != id(slot.mm):
            self._drop_views(index)
            base = torch.frombuffer(slot.mm, dtype=torch.uint8, count=slot.size - DATA_OFFSET, offset=DATA_OFFSET)
            self._views[index] = (id(slot.mm), base)
            cached = self._views[index]
        base = cached[1]
        views: list[Any] = []
        for ref, offset in zip(plan.refs, plan.offsets):
            raw = base[offset:offset + ref.nbytes]
            if ref.kind == "numpy":
                views.append(raw.numpy().view(numpy_dtype(ref.dtype)).reshape(ref.shape))
            else:
                views.append(raw.view(torch_dtype(ref.dtype)).view(ref.shape))
        self._tensor_views[index] = (id(slot.mm), id(plan), views)
        return views

    def _drop_views(self, index: int) -> None:
        self._unregister(index)
        self._views.pop(index, None)
        self._tensor_views.pop(index, None)

    def _cuda_ready(self, values: list[Any]) -> Any:
        """An event on the training thread's stream: the copies wait for the work queued before the save call.
        None when no value lives on a CUDA device."""
        device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.is_cuda), None)
        if device is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _copy_cuda(self, index: int, dst: list[Any], values: list[Any], ready: Any) -> list[Any]:
        """Copy thread: pin the slot (once) and queue the device-to-host copies on the side streams behind
        ``ready``; returns one event per stream."""
        pairs = [(t, v) for t, v in zip(dst, values) if isinstance(v, torch.Tensor) and v.is_cuda]
        device = pairs[0][1].device
        with torch.cuda.device(device):
            while len(self._cuda_streams) < self.config.cuda_copy_streams:
                self._cuda_streams.append(torch.cuda.Stream(device))
            self._register(index)
            sizes = [v.numel() * v.element_size() for _, v in pairs]
            whole = frozenset(i for i, (t, v) in enumerate(pairs) if not (t.is_contiguous() and v.is_contiguous()))
            events = []
            for stream, lane in zip(self._cuda_streams, copy_lanes(sizes, len(self._cuda_streams), whole=whole)):
                targets, sources = [], []
                for i, start, end in lane:
                    target, value = pairs[i]
                    if end - start < sizes[i]:
                        target = target.reshape(-1).view(torch.uint8)[start:end]
                        value = value.reshape(-1).view(torch.uint8)[start:end]
                    targets.append(target)
                    sources.append(value)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    if targets:
                        # One call per stream: Python overhead per tensor stays far below a launch.
                        torch._foreach_copy_(targets, sources, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                events.append(event)
        return events

    def _register(self, index: int) -> None:
        if index in self._registered:
            return
        slot = self.slots.maps[index]
        assert slot is not None and slot.mm is not None
        address = ctypes.addressof(ctypes.c_char.from_buffer(slot.mm))
        result = torch.cuda.cudart().cudaHostRegister(address, slot.size, 0)
        if int(result) != 0:
            logger.warning("rank %d: cudaHostRegister of %s failed (%s): copies will be synchronous",
                           self.rank, slot.path, result)
            return
        self._registered[index] = address

    def _unregister(self, index: int) -> None:
        address = self._registered.pop(index, None)
        if address is not None:
            torch.cuda.cudart().cudaHostUnregister(address)

    def _finish_copy(self, step: int, write: SlotWrite, plan: _Plan, meta: bytes,
                     dst: list[Any], values: list[Any], ready: Any, started: float) -> float:
        """Runs on the copy thread: copy, commit and unlock the slot; returns the seconds taken."""
        with write:
            events = self._copy_cuda(write.index, dst, values, ready) if ready is not None else []
            cpu = [(t, v) for t, v in zip(dst, values) if isinstance(v, numpy.ndarray) or not v.is_cuda]
            half = len(cpu) // 2
            for number, part in enumerate((cpu[:half], cpu[half:])):
                if number == 1:
                    fault_point("stager.mid_copy", step=step, rank=self.rank)
                small, chunks = [], []
                for target, value in part:
                    if isinstance(value, numpy.ndarray):
                        numpy.copyto(target, value, casting="no")
                    elif value.numel() * value.element_size() >= _LARGE and value.is_contiguous():
                        # numpy copies on our own threads (copy_threads of them); torch's copy would fan
                        # out over the intra-op pool that the training step is using at the same moment.
                        flat_dst, flat_src = _as_numpy(target).reshape(-1), _as_numpy(value).reshape(-1)
                        per_chunk = _CHUNK // flat_src.itemsize
                        chunks += [(flat_dst[i:i + per_chunk], flat_src[i:i + per_chunk])
                                   for i in range(0, flat_src.size, per_chunk)]
                    else:
                        small.append((target, value))
                if self._chunk_pool is not None:
                    list(self._chunk_pool.map(_copy_chunk, chunks))
                else:
                    for chunk in chunks:
                        _copy_chunk(chunk)
                if small:
                    # One call for the many small tensors: torch loops in C++ without the GIL.
                    torch._foreach_copy_([t for t, _ in small], [v for _, v in small])
            for event in events:
                event.synchronize()
            fault_point("stager.before_commit", step=step, rank=self.rank)
            write.commit(step, plan.data_len, meta)
        # Woken only once the slot is unlocked: an agent woken before tried to hold the new step while this rank's
        # exclusive flock was still on it, failed, and moved the safe step a poll interval later, when the ranks'
        # wait for it (SAFE_WAIT) had run out; they then overwrote their newest step, and a kill cost 3 steps
        # (CI, 2026-11-29, test_freshness.py rank0, seed 803317993).
        self.on_commit()
        return time.perf_counter() - started

    def stats(self) -> dict[str, Any]:
        return {"committed": self.committed, "skipped": self.skipped, "last_step": self.last_commit_step,
                "last_copy_seconds": self.last_copy_seconds, "pid": os.getpid()}
