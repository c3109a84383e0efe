"""The records that cross a process boundary, as named types: one place to encode, decode and validate.

Every record has ``to_wire()`` (what msgpack packs) and ``from_wire(obj, where)`` (which checks types
and bounds and raises :class:`RecordError` naming the record, the field and ``where`` it came from: a
slot file, a peer's endpoint). The encodings are those of slot format 1 and protocol version 1, so
these types read what older builds wrote and older builds read what these write:

* :class:`TensorEntry`: one tensor's place in a slot, a msgpack list
  ``[name, kind, dtype, shape, offset, nbytes, group, shard]`` (a list, not a map: a state may hold 10k+
  tensors, and the index is packed once per plan by the stager); ``shard`` (a :class:`ShardSpec`, or nil
  for a whole tensor) came with sharded state, and readers of 7 fields ignore it; the shard's 5th and 6th
  fields (this rank's mesh coordinate, the rank that writes its replica group) came with replicated-once
  saves, and readers of 4 ignore them (appended optional fields: no format version bump, as for ``shard``);
* :class:`SlotMeta`: the msgpack map after a slot's tensor bytes;
* :class:`Manifest`: a slot's metadata as the agents hand it around (no pid, plus checksums);
* :class:`PeerTable`: the job's nodes, token and leader (the PEERS fields);
* :class:`ListRow`: one row of a LIST reply;
* the replies of the request kinds that callers act on (:class:`PingReply`, :class:`FlushReply`,
  :class:`ByeReply`, :class:`ResumeReply`, :class:`ListReply`, :class:`FetchReply`).

Nothing outside this module indexes a record by position.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from easyckpt_wire.health import NEUTRAL, RankHealth
from easyckpt_wire.protocol import CHECKSUM_BYTES
from easyckpt_wire.shm import FORMAT_VERSION

logger = logging.getLogger(__name__)

MAX_TENSOR_BYTES = 1 << 40   # a record naming a bigger tensor is refused (a buddy would allocate it)
MAX_OFFSET = 1 << 50
TENSOR_KINDS = frozenset({"torch", "numpy"})


class RecordError(ValueError):
    """A record that does not have the shape its format promises; says which field and where it came from."""

    def __init__(self, where: str, record: str, field: str, problem: str) -> None:
        self.where, self.record, self.field = where, record, field
        super().__init__(f"{where}: {record} field {field!r} {problem}")


# validation helpers: each returns the checked value, so a decoder reads as a list of fields ----------
def _field(obj: Mapping[str, Any], key: str, where: str, record: str) -> Any:
    if key not in obj:
        raise RecordError(where, record, key, "is missing")
    return obj[key]


def _int(value: Any, where: str, record: str, field: str, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int:   # bool is an int to isinstance
        raise RecordError(where, record, field, f"is {value!r:.80}, expected an int")
    if not low <= value <= high:
        raise RecordError(where, record, field, f"is {value}, outside [{low}, {high}]")
    return value


def _str(value: Any, where: str, record: str, field: str) -> str:
    if not isinstance(value, str):
        raise RecordError(where, record, field, f"is {value!r:.80}, expected a str")
    return value


def _float(value: Any, where: str, record: str, field: str) -> float:
    if type(value) not in (int, float):
        raise RecordError(where, record, field, f"is {value!r:.80}, expected a number")
    return float(value)


def _list(value: Any, where: str, record: str, field: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise RecordError(where, record, field, f"is a {type(value).__name__}, expected a list")
    return list(value)


def _ints(value: Any, where: str, record: str, field: str, high: int = 1 << 62) -> tuple[int, ...]:
    return tuple(_int(v, where, record, f"{field}[{i}]", 0, high)
                 for i, v in enumerate(_list(value, where, record, field)))


def _checksum(value: Any, where: str, record: str, field: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != CHECKSUM_BYTES:
        raise RecordError(where, record, field, f"is {value!r:.60}, expected {CHECKSUM_BYTES} bytes")
    return value


# shard spec -----------------------------------------------------------------------------------------
MAX_DIMS = 64
MAX_MESH_DIMS = 8


class ShardSpec(NamedTuple):
    """Where a saved local shard sits in its global tensor (a DTensor's): plain ints and strings, so the
    agent and the wire stay torch-free. A tuple, packed as the list ``[global_shape, offsets, placements,
    mesh_shape, coordinate, writer]``; the last two are nil from a writer before replicated-once saves (and
    readers of four fields ignore them).

    ``writer`` is the rank that writes this shard to disk for its whole replica group (the ranks that hold
    the same copy because a placement is ``R``): the rank at ``coordinate`` with 0 on every replicated mesh
    dim (``easyckpt.snapshot.sharding.writer_coordinate``). Every other rank of the group keeps its copy in memory
    only, and ``metadata.json`` says which rank's file holds it (``stored_by``)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]       # of this shard's first element in the global tensor, per dim
    placements: tuple[str, ...]    # one per mesh dim, as torch prints them: "S(0)", "R"
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None = None   # this rank's place in the mesh (None: an older writer)
    writer: int | None = None      # the rank whose file holds this shard (None: every rank writes its own)

    @property
    def replicated(self) -> bool:
        """Every rank of the mesh holds the whole tensor."""
        return all(p == "R" for p in self.placements)

    @property
    def split(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
        """What the bytes of the shard depend on (not who holds or writes it): two specs with the same split
        hold the same part of the same global tensor."""
        return self.global_shape, self.offsets, self.placements, self.mesh_shape

    def written_by(self, rank: int) -> bool:
        """Whether ``rank``, holding this shard, writes it to disk (else the ``writer``'s file holds it)."""
        return self.writer is None or self.writer == rank

    def to_wire(self) -> list[Any]:
        return [list(self.global_shape), list(self.offsets), list(self.placements), list(self.mesh_shape),
                None if self.coordinate is None else list(self.coordinate), self.writer]

    @classmethod
    def from_wire(cls, obj: Any, where: str, record: str, shape: tuple[int, ...]) -> ShardSpec:
        """Checked against the local ``shape``: the shard must lie inside its global tensor."""
        items = _list(obj, where, record, "shard")
        if len(items) < 4:
            raise RecordError(where, record, "shard", f"is {obj!r:.80}, expected [global_shape, offsets, "
                              "placements, mesh_shape]")
        global_shape = _ints(items[0], where, record, "shard.global_shape")
        offsets = _ints(items[1], where, record, "shard.offsets")
        placements = tuple(_str(p, where, record, f"shard.placements[{i}]")
                           for i, p in enumerate(_list(items[2], where, record, "shard.placements")))
        mesh_shape = _ints(items[3], where, record, "shard.mesh_shape")
        if not len(global_shape) == len(offsets) == len(shape) <= MAX_DIMS:
            raise RecordError(where, record, "shard", f"global shape {global_shape}, offsets {offsets} and "
                              f"local shape {shape} must have the same number of dims")
        if not 1 <= len(mesh_shape) == len(placements) <= MAX_MESH_DIMS:
            raise RecordError(where, record, "shard", f"needs one placement per mesh dim: {placements} "
                              f"for mesh {mesh_shape}")
        if any(o + n > g for o, n, g in zip(offsets, shape, global_shape)):
            raise RecordError(where, record, "shard", f"local shape {shape} at offsets {offsets} does not "
                              f"fit in the global shape {global_shape}")
        coordinate = None if len(items) < 5 or items[4] is None else _ints(items[4], where, record, "shard.coordinate")
        if coordinate is not None and (len(coordinate) != len(mesh_shape)
                                       or any(c >= n for c, n in zip(coordinate, mesh_shape))):
            raise RecordError(where, record, "shard.coordinate", f"is {coordinate}, not a place in the mesh {mesh_shape}")
        writer = None if len(items) < 6 or items[5] is None else _int(items[5], where, record, "shard.writer", 0, 1 << 20)
        return cls(global_shape, offsets, placements, mesh_shape, coordinate, writer)


# tensor entry ---------------------------------------------------------------------------------------
class TensorEntry(NamedTuple):
    """One tensor's place in a slot. A tuple, so msgpack packs it as the list it always was, at no cost."""

    name: str               # "/"-joined key path in the state
    kind: str               # "torch" | "numpy": which library rebuilds it
    dtype: str              # safetensors dtype code
    shape: tuple[int, ...]
    offset: int             # from the start of the slot's data region
    nbytes: int
    group: str              # the file it goes to on disk (layout.tensor_group)
    shard: ShardSpec | None = None   # a DTensor's local shard: where it sits in the global tensor

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_wire(self) -> list[Any]:
        # Eight fields even for a whole tensor (nil): the stager packs the tuple itself, which has eight.
        return [self.name, self.kind, self.dtype, list(self.shape), self.offset, self.nbytes, self.group,
                None if self.shard is None else self.shard.to_wire()]

    @classmethod
    def from_wire(cls, obj: Any, where: str, index: int = 0) -> TensorEntry:
        record = f"tensor entry {index}"
        if not isinstance(obj, (list, tuple)) or len(obj) < 7:   # a newer writer may append fields
            raise RecordError(where, record, "*", f"is {obj!r:.80}, expected a list of 7 fields")
        name, kind, dtype, shape, offset, nbytes, group = obj[:7]
        _str(name, where, record, "name")
        if kind not in TENSOR_KINDS:
            raise RecordError(where, record, "kind", f"is {kind!r:.40}, expected one of {sorted(TENSOR_KINDS)}")
        shape = _ints(shape, where, record, "shape")
        shard = None if len(obj) < 8 or obj[7] is None else ShardSpec.from_wire(obj[7], where, record, shape)
        return cls(name, kind, _str(dtype, where, record, "dtype"), shape,
                   _int(offset, where, record, "offset", 0, MAX_OFFSET),
                   _int(nbytes, where, record, "nbytes", 0, MAX_TENSOR_BYTES), _str(group, where, record, "group"),
                   shard)


def _entries(value: Any, where: str, record: str) -> tuple[TensorEntry, ...]:
    return tuple(TensorEntry.from_wire(e, where, i) for i, e in enumerate(_list(value, where, record, "tensors")))


def data_len(entries: Iterable[TensorEntry]) -> int:
    """The data region a slot needs for these entries."""
    return max((e.end for e in entries), default=0)


# slot metadata --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class SlotMeta:
    """The msgpack map a rank writes after its slot's tensor bytes (``Stager._meta``)."""

    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pid: int | None            # the writing process; None in a manifest (it names no process)
    pid_start: float | None
    skeleton_version: int
    tensors: tuple[TensorEntry, ...]
    step: int
    skeleton: Any              # the non-tensor state (easyckpt.snapshot.state's tagged skeleton)
    created: float
    health: RankHealth = NEUTRAL   # the rank's verdict on this snapshot (neutral: it reported nothing)

    DYNAMIC = ("step", "skeleton", "created", "health")   # what changes between two snapshots of one plan

    @staticmethod
    def static_fields(*, job: str, rank: int, world_size: int, local_rank: int, local_world_size: int,
                      pid: int | None, pid_start: float | None, skeleton_version: int,
                      tensors: Sequence[Any]) -> dict[str, Any]:
        """The keys that stay the same while a rank's state keeps its structure: the stager packs them
        (the tensor index is the bulk) once per plan. The entries go as they are: tuples pack as lists."""
        fields: dict[str, Any] = {"v": FORMAT_VERSION, "job": job, "rank": rank, "world_size": world_size,
                                  "local_rank": local_rank, "local_world_size": local_world_size}
        if pid is not None:
            fields.update(pid=pid, pid_start=pid_start)
        fields.update(skeleton_version=skeleton_version, tensors=tensors)
        return fields

    @staticmethod
    def dynamic_fields(*, step: int, skeleton: Any, created: float, health: RankHealth = NEUTRAL) -> dict[str, Any]:
        return {"step": step, "skeleton": skeleton, "created": created, "health": health.to_wire()}

    def to_wire(self) -> dict[str, Any]:
        return {**self.static_fields(job=self.job, rank=self.rank, world_size=self.world_size,
                                     local_rank=self.local_rank, local_world_size=self.local_world_size,
                                     pid=self.pid, pid_start=self.pid_start, skeleton_version=self.skeleton_version,
                                     tensors=[e.to_wire() for e in self.tensors]),
                **self.dynamic_fields(step=self.step, skeleton=self.skeleton, created=self.created,
                                      health=self.health)}

    @classmethod
    def from_wire(cls, obj: Any, where: str, *, record: str = "slot metadata", with_pid: bool = True) -> SlotMeta:
        """Extra keys (say the ``config`` that builds before this one wrote) are ignored."""
        if not isinstance(obj, Mapping):
            raise RecordError(where, record, "*", f"is a {type(obj).__name__}, expected a map")
        version = _field(obj, "v", where, record)
        if type(version) is not int or version != FORMAT_VERSION:
            raise RecordError(where, record, "v", f"is {version!r:.20}, this build reads {FORMAT_VERSION}")
        world_size = _int(_field(obj, "world_size", where, record), where, record, "world_size", 1, 1 << 20)
        rank = _int(_field(obj, "rank", where, record), where, record, "rank", 0, world_size - 1)
        pid: int | None = None
        pid_start: float | None = None
        if with_pid:
            pid = _int(_field(obj, "pid", where, record), where, record, "pid", 1, 1 << 22)
            start = obj.get("pid_start")
            pid_start = None if start is None else _float(start, where, record, "pid_start")
        return cls(
            job=_str(_field(obj, "job", where, record), where, record, "job"), rank=rank, world_size=world_size,
            local_rank=_int(obj.get("local_rank", 0), where, record, "local_rank", 0, world_size - 1),
            local_world_size=_int(_field(obj, "local_world_size", where, record), where, record,
                                  "local_world_size", 1, world_size),
            pid=pid, pid_start=pid_start,
            skeleton_version=_int(_field(obj, "skeleton_version", where, record), where, record, "skeleton_version"),
            tensors=_entries(_field(obj, "tensors", where, record), where, record),
            step=_int(_field(obj, "step", where, record), where, record, "step"),
            skeleton=_field(obj, "skeleton", where, record),
            created=_float(obj.get("created", 0.0), where, record, "created"),
            health=_health(obj.get("health"), where, record))

    @property
    def data_len(self) -> int:
        return data_len(self.tensors)


def _health(value: Any, where: str, record: str) -> RankHealth:
    try:
        return RankHealth.from_wire(value, where)   # absent (older builds) or None: neutral
    except ValueError as exc:
        raise RecordError(where, record, "health", str(exc)) from None


# manifest -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """A slot's metadata as agents hand it around: without the writer's pid, with one xxh3-128 per
    tensor (in tensor order), the node that hashed it and the slot generation it describes."""

    meta: SlotMeta
    checksums: tuple[bytes, ...]
    node: str
    generation: int
    # The encoded map, built on first use: the server answers MANIFEST and PUSH with the same manifest many
    # times, and a manifest of 10k+ tensors is not re-listed for each.
    _wire: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return self.meta.rank

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def tensors(self) -> tuple[TensorEntry, ...]:
        return self.meta.tensors

    @classmethod
    def of(cls, meta: SlotMeta, checksums: list[bytes], node: str, generation: int) -> Manifest:
        return cls(dataclasses.replace(meta, pid=None, pid_start=None), tuple(checksums), node, generation)

    def to_wire(self) -> dict[str, Any]:
        if self._wire is None:
            wire = self.meta.to_wire()
            wire.update(checksums=list(self.checksums), node=self.node, generation=self.generation)
            object.__setattr__(self, "_wire", wire)
        assert self._wire is not None
        return self._wire

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> Manifest:
        record = "manifest"
        meta = SlotMeta.from_wire(obj, where, record=record, with_pid=False)
        checksums = tuple(_checksum(c, where, record, f"checksums[{i}]")
                          for i, c in enumerate(_list(_field(obj, "checksums", where, record), where, record,
                                                      "checksums")))
        if len(checksums) != len(meta.tensors):
            raise RecordError(where, record, "checksums", f"has {len(checksums)} items for {len(meta.tensors)} tensors")
        return cls(meta, checksums, _str(_field(obj, "node", where, record), where, record, "node"),
                   _int(_field(obj, "generation", where, record), where, record, "generation"), dict(obj))


# peer table -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class PeerNode:
    endpoint: str               # the node agent's tcp endpoint
    ranks: tuple[int, ...]      # the training ranks on that node (none for a standalone launcher's table)


@dataclasses.dataclass(frozen=True, slots=True)
class PeerTable:
    """The job's nodes as the ranks introduce them (PEERS): the same table on every rank and agent."""

    token: str
    node: str                   # this process's node
    leader: str                 # the node of rank 0: it commits multi-node checkpoints
    nodes: dict[str, PeerNode]
    world_size: int = 1
    replicate_unique: bool = True

    @property
    def is_leader(self) -> bool:
        return self.node == self.leader

    def endpoint(self, node: str) -> str:
        return self.nodes[node].endpoint

    def ordered(self) -> list[str]:
        """This node first (loopback is cheapest), then the others by name: the same order everywhere."""
        return [self.node] + sorted(n for n in self.nodes if n != self.node)

    def _neighbour(self, step: int) -> str | None:
        names = sorted(self.nodes)
        if len(names) < 2 or self.node not in names:
            return None
        return names[(names.index(self.node) + step) % len(names)]

    def predecessor(self) -> str | None:
        """The node whose buddy this one is (the previous one in the ring sorted by node id)."""
        return self._neighbour(-1)

    def buddy(self) -> str | None:
        """The next node in the sorted ring: it receives this node's manifests and unique tensors."""
        return self._neighbour(1)

    def same_job(self, other: PeerTable | None) -> bool:
        return other is not None and (self.token, self.nodes, self.leader) == (other.token, other.nodes, other.leader)

    def to_wire(self) -> dict[str, Any]:
        """The PEERS message fields."""
        return {"token": self.token, "node": self.node, "leader": self.leader,
                "nodes": [{"node": n, "endpoint": p.endpoint, "ranks": list(p.ranks)}
                          for n, p in sorted(self.nodes.items())],
                "world_size": self.world_size, "replicate_unique": self.replicate_unique}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> PeerTable:
        record = "peer table"
        nodes: dict[str, PeerNode] = {}
        for i, item in enumerate(_list(_field(obj, "nodes", where, record), where, record, "nodes")):
            if not isinstance(item, Mapping):
                raise RecordError(where, record, f"nodes[{i}]", f"is {item!r:.80}, expected a map")
            name = _str(_field(item, "node", where, record), where, record, f"nodes[{i}].node")
            nodes[name] = PeerNode(_str(_field(item, "endpoint", where, record), where, record, f"nodes[{i}].endpoint"),
                                   _ints(_field(item, "ranks", where, record), where, record, f"nodes[{i}].ranks"))
        leader = _str(_field(obj, "leader", where, record), where, record, "leader")
        if leader not in nodes:
            raise RecordError(where, record, "leader", f"is {leader!r}, not one of the nodes {sorted(nodes)}")
        replicate_unique = obj.get("replicate_unique", True)
        if not isinstance(replicate_unique, bool):
            raise RecordError(where, record, "replicate_unique", f"is {replicate_unique!r:.20}, expected a bool")
        return cls(_str(_field(obj, "token", where, record), where, record, "token"),
                   _str(_field(obj, "node", where, record), where, record, "node"), leader, nodes,
                   _int(obj.get("world_size", 1), where, record, "world_size", 1, 1 << 20), replicate_unique)


# LIST -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ListRow:
    """What one agent holds at one step: the ranks it has a manifest of, and the tensor checksums it can serve."""

    step: int
    ranks: frozenset[int]
    checksums: frozenset[bytes]

    def to_wire(self) -> list[Any]:
        # The checksums back to back in one bytes object: a few thousand 16-byte items as one msgpack bin.
        return [self.step, sorted(self.ranks), b"".join(sorted(self.checksums))]

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> ListRow:
        record = "LIST row"
        if not isinstance(obj, (list, tuple)) or len(obj) < 3:
            raise RecordError(where, record, "*", f"is {obj!r:.80}, expected [step, ranks, checksums]")
        step, ranks, blob = obj[:3]
        if not isinstance(blob, bytes) or len(blob) % CHECKSUM_BYTES:
            raise RecordError(where, record, "checksums", f"is not a multiple of {CHECKSUM_BYTES} bytes")
        return cls(_int(step, where, record, "step"), frozenset(_ints(ranks, where, record, "ranks")),
                   frozenset(blob[i:i + CHECKSUM_BYTES] for i in range(0, len(blob), CHECKSUM_BYTES)))


# replies --------------------------------------------------------------------------------------------
# A reply is a REPLY message: ``ok``, the request's ``id``, and the fields below (``to_wire`` gives the
# fields, ``protocol.reply`` adds the rest). A refusal (``ok=False``) carries ``error`` and, where a program
# must tell refusals apart, a ``code`` (protocol.NO_COPY).
def _opt_int(obj: Mapping[str, Any], key: str, where: str, record: str) -> int | None:
    value = obj.get(key)
    return None if value is None else _int(value, where, record, key, -1)


@dataclasses.dataclass(frozen=True, slots=True)
class PingReply:
    pid: int
    node: str | None = None
    endpoint: str | None = None     # the replica server's tcp endpoint, None while it does not run
    # The job token the replica server answers to (set by the last PEERS), None before any: PING is answered
    # only on the agent's ipc socket, in a 0700 runtime directory, so only this user's processes on this node
    # (who can read the slots anyway) learn it. A job that shrank to this one node uses it to read the
    # replicas this agent still holds of the lost nodes' ranks (easyckpt.memory_reshard).
    token: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = {"pid": self.pid, "node": self.node, "endpoint": self.endpoint}
        if self.token is not None:   # older readers ignore extra keys
            wire["token"] = self.token
        return wire

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> PingReply:
        node, endpoint, token = obj.get("node"), obj.get("endpoint"), obj.get("token")
        return cls(_int(_field(obj, "pid", where, "PING reply"), where, "PING reply", "pid", 1),
                   None if node is None else _str(node, where, "PING reply", "node"),
                   None if endpoint is None else _str(endpoint, where, "PING reply", "endpoint"),
                   None if token is None else _str(token, where, "PING reply", "token"))


def _refusal(obj: Mapping[str, Any], where: str, record: str) -> str | None:
    """The ``error`` of a refusal (``ok`` false), None for a success; a refusal without one is named as such."""
    if obj.get("ok", True):
        return None
    error = obj.get("error")
    return _str(error, where, record, "error") if error is not None else f"{record}: refused without a reason"


@dataclasses.dataclass(frozen=True, slots=True)
class ByeReply:
    persisted: int | None = None                 # the newest step durable on this node
    failure: dict[str, Any] | None = None        # the last persist failure (Agent._failure_dict)

    def to_wire(self) -> dict[str, Any]:
        return {"persisted": self.persisted, "failure": self.failure}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> ByeReply:
        failure = obj.get("failure")
        return cls(_opt_int(obj, "persisted", where, "BYE reply"), failure if isinstance(failure, dict) else None)


@dataclasses.dataclass(frozen=True, slots=True)
class FlushReply:
    persisted: int | None = None
    committed: bool = False                      # the iteration directory of ``persisted`` exists
    error: str | None = None                     # with ok=False: why the step cannot be persisted
    failure: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"persisted": self.persisted}
        if self.error is None:
            fields["committed"] = self.committed
        else:
            fields.update(error=self.error, failure=self.failure)
        return fields

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> FlushReply:
        """From the whole REPLY message: a refusal (``ok`` false) always has an ``error``."""
        failure = obj.get("failure")
        return cls(_opt_int(obj, "persisted", where, "FLUSH reply"), bool(obj.get("committed")),
                   _refusal(obj, where, "FLUSH reply"), failure if isinstance(failure, dict) else None)


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeReply:
    moved: list[int]                 # steps of the iterations moved aside (a new timeline)
    tracker: int | None              # the tracker's step afterwards
    persisted: int | None
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"moved": self.moved, "tracker": self.tracker, "persisted": self.persisted, "error": self.error}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> ResumeReply:
        """From the whole REPLY message: a refusal (``ok`` false) always has an ``error``."""
        moved = list(_ints(obj.get("moved") or [], where, "RESUME reply", "moved"))
        return cls(moved, _opt_int(obj, "tracker", where, "RESUME reply"),
                   _opt_int(obj, "persisted", where, "RESUME reply"), _refusal(obj, where, "RESUME reply"))


@dataclasses.dataclass(frozen=True, slots=True)
class ListReply:
    node: str
    rows: tuple[ListRow, ...]        # newest step first

    def to_wire(self) -> dict[str, Any]:
        return {"node": self.node, "steps": [row.to_wire() for row in self.rows]}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> ListReply:
        return cls(_str(obj.get("node", ""), where, "LIST reply", "node"),
                   tuple(ListRow.from_wire(row, where)
                         for row in _list(_field(obj, "steps", where, "LIST reply"), where, "LIST reply", "steps")))

    def by_step(self) -> dict[int, ListRow]:
        return {row.step: row for row in self.rows}


@dataclasses.dataclass(frozen=True, slots=True)
class FetchReply:
    """The header of a FETCH reply; the chunk itself follows as one raw frame."""

    xxh64: int

    def to_wire(self) -> dict[str, Any]:
        return {"xxh64": self.xxh64}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> FetchReply:
        return cls(_int(_field(obj, "xxh64", where, "FETCH reply"), where, "FETCH reply", "xxh64", 0, (1 << 64) - 1))
