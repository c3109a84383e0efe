"""Multi-node coordination of one agent: peers, hashing, buddy backups, backed-up steps, staged commits,
and the transport of the job-wide agreement (``easyckpt_agent.jobwide``).

The agent's main loop calls :meth:`NodeReplication.tick` every round once the ranks have told it the
job's other nodes (PEERS). Hashing, pushes to the buddy and coverage surveys run in their own threads,
so the loop keeps answering its ranks; the replica server answers other nodes in its own thread.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import zmq

from easyckpt_agent.agreement import NodeState
from easyckpt_agent.commit import describe
from easyckpt_agent.jobwide import Courier, JobWide
from easyckpt_agent.persister import lower_priority
from easyckpt_agent.replica import (
    BuddyPuller,
    Holdings,
    MapCache,
    ReplicaServer,
    build_manifest,
    push_manifests,
    survey_coverage,
)
from easyckpt_agent.stages import commit_stage, drop_stage, stage_names, stage_steps
from easyckpt_agent.watcher import Watcher
from easyckpt_wire import layout, protocol
from easyckpt_wire.episode import Episode
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import Manifest, PeerTable, RecordError, SlotMeta
from easyckpt_wire.savedir import AuditLog
from easyckpt_wire.shm import SlotFormatError
from easyckpt_wire.transfer import tensor_checksum

logger = logging.getLogger(__name__)

STAGE_WAIT = 120.0  # how long a leader whose ranks finished waits for other nodes' shards
COVERAGE_EVERY = 2.0


def stage_outlook(step: int, *, own_note: bool, node: str, floor: int, others: Mapping[str, NodeState | None],
                  missing: Collection[str]) -> str | None:
    """Why the leader's stage of ``step`` can never be committed, once the leader's ranks are gone and its agent
    persists and claims nothing (or None: it may still be, wait for it, at most STAGE_WAIT).

    ``own_note``: the leader's own node finished its shards of ``step`` (its note is in the stage); ``floor``:
    the leader's newest step on disk or given up; ``others``: each other node's latest STATE of this incarnation
    of the job (None: not heard since it began); ``missing``: the other nodes whose note is not in the stage.
    Only this agent writes its node's shards: with none in flight and no rank left to ask for one, a stage
    without them stays incomplete for good (its persist failed, e.g. on a full disk). With them, the stage waits
    for other nodes, unless the leader has since given up a newer step and no node is writing this one (a stage
    left behind by a persist that failed on another node; a newer stage, which the leader waits for, supersedes
    it anyway), or every node it lacks has said that its ranks are gone and it neither holds the step nor writes
    it (a stage an earlier incarnation of the job left, whose other nodes' copies of the step died with it: soak
    seed 33569623 fault 11). A node whose ranks live may still commit the step (a slower node at the end of a run).
    """
    if not own_note:
        return f"node {node} never wrote its shards of step {step} and writes none now"
    if floor > step and step not in {state.busy for state in others.values() if state is not None}:
        return f"node {node} has moved on to step {floor} and no node writes step {step}"
    lacking = sorted(missing)
    if lacking and all((state := others.get(name)) is not None and not may_write(state, step) for name in lacking):
        return (f"node(s) {', '.join(lacking)} never wrote their shards of step {step} and can no longer: their "
                "ranks are gone and none holds the step in memory or writes it")
    return None


def may_write(state: NodeState, step: int) -> bool:
    """Whether the node whose latest STATE is ``state`` may still write its shards of ``step``: a rank of it lives
    (and may commit the step yet), or it writes them now, has just written them (its note is on its way), or holds
    the step in memory."""
    return state.alive or step in (state.busy, state.wrote) or step in state.local or step in state.held


def _logged(function: Callable[..., Any], *args: Any) -> None:
    """Run a background task; a thread pool would swallow its exception."""
    try:
        function(*args)
    except Exception:
        logger.exception("background task %s failed", getattr(function, "__name__", function))


class NodeReplication:
    def __init__(self, *, node: str, bind_host: str, port: int, save_dir: Path, audit: AuditLog, watcher: Watcher,
                 ctx: zmq.Context, max_ckpt_num: Callable[[], int], complete: int | None,
                 port_file: Path | None = None, rotate: Callable[[int], Any] | None = None,
                 wake: Callable[[], None] = lambda: None, floor: Callable[[], int] = lambda: -1,
                 stored_at: Callable[[], float] = lambda: 0.0) -> None:
        self.wake = wake
        self.node = node
        self.rotate = rotate   # the agent's timeline-aware rotation (abandoned iterations first)
        self.port_file = port_file
        self.bind_host = bind_host
        self.port = port
        self.save_dir = save_dir
        self.audit = audit
        self.watcher = watcher
        self.ctx = ctx
        self.max_ckpt_num = max_ckpt_num
        self.complete = complete                 # newest complete multi-node checkpoint (leader)
        self.holdings = Holdings(node)
        self.peers: PeerTable | None = None
        self.replica: ReplicaServer | None = None
        # Hashing and pushing (from the same thread, as soon as a step's last local snapshot is hashed) are what
        # the node-safe step waits for (a node loss resumes no later than the newest step backed up): they run at
        # the loop's priority, not niced like persisting, or a node whose CPU training takes whole would back up
        # steps long after they were taken.
        self.hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hash")
        # On one node the checksums only verify a later read from memory: niced like persisting, so that hashing
        # never takes CPU from training (a snapshot not hashed yet is read unverified, and the read says so).
        self.verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hash-verify",
                                                              initializer=lower_priority)
        self.surveyor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="survey", initializer=lower_priority)
        self.hashing: set[tuple[int, int, int]] = set()     # (rank, slot, generation) queued or hashed
        self.pushed: set[int] = set()     # steps handed to the buddy (the hash thread's)
        self._push_courier = Courier(ctx)   # used by the hash thread only
        self.puller = BuddyPuller(self.holdings, lambda: self.peers)
        self._hash_maps = {True: MapCache(), False: MapCache()}   # the hasher's and the verifier's (one thread each)
        self.coverage: dict[str, Any] | None = None
        self._coverage_at = 0.0
        self._stages_at = 0.0
        self._commit_failing = Episode(logger)   # retried every 0.2 s: said once, not five times a second
        self._list_failing = Episode(logger)     # the same for listing the stages (the store down)
        self._list_pause = 0.0                   # seconds between two tries to list them while that fails
        self._list_failed_at = 0.0               # when listing them last failed (monotonic)
        # When this agent's last persist reached the store (monotonic): one after a failed listing means the store
        # is back, and the stages are listed at once instead of after the rest of the pause (up to 30 s, in which
        # the job's end could come before the commit of its final step).
        self.stored_at = stored_at
        self._stage_wait_since: float | None = None
        self._hopeless_said: list[int] | None = None   # the stages last said to be never committed
        self.safe_step: int | None = None   # the agent's, shown by status
        self.floor = floor                  # the agent's newest step on disk or given up (a new agreement starts there)
        self.jobwide = JobWide(node=node, ctx=ctx, wake=wake)

    def tick(self) -> None:
        # Hashed on one node too: the checksums verify a read from memory (a byte flipped in a slot after its
        # commit is refused, not trained on); only the push to a buddy and the stage commits need peers.
        self._hash_and_push()
        if self.peers is not None:
            self._commit_stages()

    def status(self) -> dict[str, Any]:
        peers = self.peers
        return {"node": self.node, "endpoint": self.replica.endpoint if self.replica else None,
                "leader": peers.leader if peers else None, "buddy": peers.buddy() if peers else None,
                "nodes": {n: v.endpoint for n, v in peers.nodes.items()} if peers else {},
                "coverage": self.coverage, "complete_step": self.complete, "pinned_step": self.safe_step,
                "served_bytes": self.replica.served_bytes if self.replica else 0,
                "refused": self.replica.refused if self.replica else 0,
                "malformed": self.replica.dropped if self.replica else 0}

    def close(self) -> None:
        self.hasher.shutdown(wait=True, cancel_futures=True)
        self.verifier.shutdown(wait=True, cancel_futures=True)
        self.surveyor.shutdown(wait=True, cancel_futures=True)
        self._push_courier.close()
        self.jobwide.close()
        self.puller.close()
        if self.replica is not None:
            self.replica.stop()

    def ranks_alive(self) -> None:
        """The job runs: a wait for stages that its ranks' end started is over."""
        self._stage_wait_since = None
        self._hopeless_said = None

    def awaiting_stages(self) -> bool:
        """Leader: staged steps other nodes are still writing (bounded by STAGE_WAIT once ranks finish).

        Asked only while this agent persists and claims nothing and its ranks said goodbye or are gone
        (``Lifecycle.should_exit``; a running job's leader would list its store every round): once its ranks are
        gone, a stage that can never be committed (``stage_outlook``) is not waited for."""
        peers = self.peers
        if peers is None or not peers.is_leader:
            return False
        try:
            pending = [s for s in stage_steps(self.save_dir) if self.complete is None or s > self.complete]
        except OSError as exc:
            if self.watcher.any_alive():
                return True   # the store down while the job runs: the stages are looked at again
            # The ranks gone and the store unreachable: no stage can be committed now, and a wait would only keep
            # the agent from its exit (which keeps the memory the failed persists left as the only copy).
            if self._hopeless_said != [-1]:
                self._hopeless_said = [-1]
                logger.warning("the ranks of node %s finished and the staged steps in %s cannot be read (%s): not "
                               "waiting for them; the next run of the job commits or drops them", self.node,
                               self.save_dir, exc)
            return False
        if not pending:
            return False
        if self.watcher.any_alive():
            self.ranks_alive()
            return True
        with self.jobwide.lock:
            others = {node: self.jobwide.states.get(node) for node in peers.nodes if node != self.node}
        hopeless = {}
        for step in pending:
            try:
                names = stage_names(self.save_dir, step)
            except OSError:   # unreadable now: waited for, as before
                break
            why = stage_outlook(step, own_note=layout.node_file_name(self.node) in names, node=self.node,
                                floor=self.floor(), others=others,
                                missing=[node for node in others if layout.node_file_name(node) not in names])
            if why is None:
                break
            hopeless[step] = why
        else:
            if self._hopeless_said != sorted(hopeless):
                self._hopeless_said = sorted(hopeless)
                logger.warning("the ranks of node %s finished and staged step(s) %s can never be committed (%s): "
                               "not waiting for them; the next run of the job drops them once a newer step is "
                               "committed", self.node, sorted(hopeless), "; ".join(hopeless.values()))
            return False
        now = time.monotonic()
        self._stage_wait_since = self._stage_wait_since or now
        if now - self._stage_wait_since < STAGE_WAIT:
            return True
        logger.warning("staged steps %s never got every node's shards within %.0fs: not committed", pending, STAGE_WAIT)
        return False

    def start_server(self) -> None:
        if self.replica is None:
            self.replica = ReplicaServer(self.holdings, self.ctx, self.bind_host, self.port, self.on_push,
                                         self.on_news, port_file=self.port_file)
            self.replica.start()
            logger.info("replica server of node %s listening on %s", self.node, self.replica.endpoint)

    def set_peers(self, message: dict[str, Any]) -> str | None:
        """A rank's PEERS message; returns what is wrong with it, or None once adopted."""
        try:
            peers = PeerTable.from_wire(message, "PEERS")
        except RecordError as exc:
            return str(exc)
        if peers.node != self.node or len(peers.token) < 16:
            return (f"PEERS for node {peers.node!r} (leader {peers.leader!r}) reached the agent of node "
                    f"{self.node!r}: set EASYCKPT_NODE_ID alike for the ranks and their agent")
        self.start_server()
        if not peers.same_job(self.peers):
            logger.info("job spans nodes %s; leader %s; buddy %s", sorted(peers.nodes), peers.leader, peers.buddy())
            self.jobwide.reset(decided=self.floor())   # another incarnation of the job: its agents say anew
            self.jobwide.courier.forget({p.endpoint for p in peers.nodes.values()})
        self.peers = peers
        self.watcher.assign(peers.nodes[self.node].ranks or None)   # a standalone launcher's table names no ranks
        assert self.replica is not None
        self.replica.token = peers.token
        return None

    def run_alone(self) -> None:
        """The job now runs on this node alone (it shrank after losing nodes): no backup is awaited and no
        other node's persister consulted, or the safe step would wait for a node that is gone. The replica
        server stays up: the shrunk job's ranks may still read the backups it holds of the lost ranks."""
        if self.peers is not None:
            logger.info("the job now runs on node %s alone (was %s): safe steps no longer wait for other nodes",
                        self.node, sorted(self.peers.nodes))
            self.peers = None
            self.jobwide.reset(decided=self.floor())
        self.watcher.assign(None)

    def on_news(self, kind: Kind, message: dict[str, Any]) -> None:
        """Server thread: a node's STATE (this node leads) or the leader's VERDICT."""
        if kind == Kind.STATE:
            self.jobwide.on_state(message, self.peers)
        elif kind == Kind.VERDICT:
            self.jobwide.on_verdict(message, self.peers)

    def on_push(self, message: dict[str, Any]) -> None:
        """Server thread: a peer handed us its ranks' manifests of one step."""
        peers = self.peers
        if peers is None or message["node"] != peers.predecessor():
            raise ValueError(f"PUSH from node {message['node']!r}: only node "
                             f"{peers.predecessor() if peers else None!r} hands this one its manifests")
        where = f"PUSH from node {message['node']!r}"
        manifests = [Manifest.from_wire(m, where) for m in message["manifests"]]   # RecordError: refused
        for manifest in manifests:
            if manifest.step != message["step"]:
                raise RecordError(where, "manifest", "step", f"is {manifest.step}, the PUSH is of step {message['step']}")
        blobs = message.get("blobs", [])
        if not isinstance(blobs, list) or not all(
                isinstance(b, list) and len(b) == 2 and isinstance(b[0], bytes) and len(b[0]) == protocol.CHECKSUM_BYTES
                and isinstance(b[1], bytes) for b in blobs):
            raise RecordError(where, "PUSH", "blobs", "must list [checksum, bytes] pairs")
        for manifest in manifests:
            self.holdings.add_backup(manifest)
        for checksum, data in blobs:
            if tensor_checksum(data) != checksum:   # damaged on the way or in the sender's memory: pulled instead
                logger.warning("%s: a tensor's bytes do not match their checksum %s: not kept", where, checksum.hex())
                continue
            self.holdings.add_blob(checksum, bytearray(data))
        self.puller.submit(message["node"], message["step"], manifests)
        logger.debug("PUSH of step %d from node %s: %d manifests, %d small tensors", message["step"], message["node"],
                     len(manifests), len(blobs))

    def _hash_and_push(self) -> None:
        """Hash new local snapshots, hand complete steps to the buddy, refresh coverage (all off-loop)."""
        live = set()
        self.holdings.local_ranks = frozenset(self.watcher.local_ranks())
        for (rank, slot), info in self.watcher.slots.items():
            header = info.header
            if header is None or not header.committed or info.meta is None or info.meta_generation != header.generation:
                continue
            if (rank, slot, header.generation) in self.watcher.abandoned:
                continue   # a snapshot of an abandoned timeline (its rank resumed at an older step)
            live.add((rank, slot))
            key = (rank, slot, header.generation)
            if key not in self.hashing:
                self.hashing = {k for k in self.hashing if k[:2] != (rank, slot)} | {key}
                multi = self.peers is not None
                (self.hasher if multi else self.verifier).submit(_logged, self._hash, self._hash_maps[multi], rank, slot,
                                                                 info.path, info.meta, header.generation)
        self.holdings.forget_local(live)
        now = time.monotonic()
        if now - self._coverage_at > COVERAGE_EVERY:
            self._coverage_at = now
            self.surveyor.submit(_logged, self._refresh_coverage)

    def _hash(self, maps: MapCache, rank: int, slot: int, path: Path, meta: SlotMeta, generation: int) -> None:
        try:
            if maps.get(path).generation() != generation:
                return   # rewritten while it waited in the queue: hashing it would be wasted
            entry = build_manifest(maps.get(path), meta, generation, self.node, inline=self.peers is not None)
        except (OSError, SlotFormatError) as exc:
            logger.warning("cannot hash %s: %s", path, exc)
            return
        if entry is None:
            return
        self.holdings.set_local(rank, slot, entry)
        # The step's last local snapshot is hashed: hand it to the buddy at once, from this thread (a push never
        # waits for an answer), so that a node loss a step later finds it backed up.
        peers = self.peers
        if peers is not None and entry.step not in self.pushed and entry.step in self.holdings.hashed_steps():
            self.pushed = {s for s in self.pushed if s > entry.step - 8} | {entry.step}
            push_manifests(self._push_courier, peers, entry.step, self.holdings.local_at(entry.step),
                           self.holdings.inline_at(entry.step))
        self.wake()   # the node's state (what it backed up, what it hashed) changed

    def _refresh_coverage(self) -> None:
        if self.peers is not None:
            self.coverage = survey_coverage(self.peers, self.holdings)


    def backed_up(self) -> set[int] | None:
        """Steps whose backup from the predecessor node is complete here (its ranks' tensors that this
        node's own ranks do not hold were pulled), or None when no node backs up to this one.

        The agent's safe step must be one of them (``policy.next_safe``): the safe step's slots are held,
        so losing the predecessor at any moment leaves a step its ranks can get from this node, even though
        the backup trails the snapshot by milliseconds.
        """
        if self.peers is None:
            return None
        predecessor = self.peers.predecessor()
        if predecessor is None:
            return None
        return self.holdings.backed_up_steps(list(self.peers.nodes[predecessor].ranks))

    def _commit_stages(self) -> None:
        """Leader: publish each staged step whose every rank is durable, oldest first (a due step whose last node
        finished just as the final step's did is committed too, not dropped as superseded); drop stages older
        than a committed step that never completed."""
        now = time.monotonic()
        if self.peers is None or not self.peers.is_leader:
            return
        if self._list_pause and self.stored_at() > self._list_failed_at:
            self._stages_at = 0.0   # a persist reached the store since listing failed: it is back
        if now - self._stages_at < 0.2:
            return
        self._stages_at = now
        try:
            staged = sorted(stage_steps(self.save_dir))
        except OSError as exc:   # the store down or unreachable: the stages wait there, and so does their commit
            # Each try takes the client's retries (seconds) out of the loop that answers the ranks: tried again
            # after a pause that doubles up to 30 s, not every 0.2 s.
            self._list_pause = min(30.0, max(1.0, 2 * self._list_pause))
            self._list_failed_at = time.monotonic()
            self._stages_at = self._list_failed_at + self._list_pause
            self._list_failing.hit("cannot list the staged steps in %s: %s (tried again after pauses of up to 30 s "
                                   "until it works)", self.save_dir, exc)
            return
        self._list_pause = 0.0
        self._list_failing.end("the staged steps in %s can be listed again", self.save_dir)
        for step in staged:
            if self.complete is not None and step <= self.complete:
                drop_stage(self.save_dir, step, self.audit, f"superseded by complete step {self.complete}")
                continue
            try:
                stats = commit_stage(self.save_dir, step, self.audit)
            except (OSError, layout.CheckpointFormatError) as exc:
                self._commit_failing.hit("cannot commit staged step %d: %s (retried until it works)", step, exc)
                continue
            if stats is not None:
                self._commit_failing.end("staged steps commit again (step %d)", step)
                self.complete = step
                if self.rotate is not None:
                    try:
                        self.rotate(step)
                    except OSError as exc:   # the step is committed all the same; the next commit rotates again
                        logger.warning("rotation after step %d failed: %s", step, exc)
                logger.info("committed step %d: every node's shards are durable (%s)", step, describe(stats, 0))

