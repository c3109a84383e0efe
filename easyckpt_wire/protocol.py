"""Wire protocol, version 1, between training ranks (and tools) and their node agent.

Two transports, one message format:

* rank <-> its node agent: ZeroMQ over ``ipc://`` in the job's runtime directory (owner-only
  permissions), messages of at most 1 MiB;
* agent <-> agent, and a recovering rank -> any agent: ZeroMQ over ``tcp://``. Every such request
  carries the job token (handed out by rank 0 through the training job's rendezvous); the agent
  answers a wrong or missing token with a refusal and nothing else. Messages are bounded by
  :data:`MAX_PEER_MESSAGE_BYTES`; a FETCH reply carries one extra frame of raw tensor bytes (at most
  :data:`MAX_CHUNK_BYTES`), checked against an xxh3-64 in its header.

A requester uses a DEALER socket, the agent a ROUTER socket; every message is one msgpack map with
``v`` (the protocol version), ``kind`` (a :class:`Kind`) and the fields that kind requires. Nothing is
ever unpickled: a message that is too large, is not msgpack, has another version, an unknown kind or
a field of the wrong type raises :class:`ProtocolError`, which the receiver logs and drops.

Session of a rank (``easyckpt.node.client.AgentClient``), in order:

1. ``HELLO`` on every (re)connect, followed by ``PEERS`` again when the rank sent one before (a restarted
   agent learns the job's nodes without a new introduction);
2. ``PING`` at start-up (``wait_ready``), and in a multi-node job the introduction: ``PING`` for the
   node and endpoint, then ``PEERS`` (``easyckpt.node.replicas.introduce``);
3. ``RESUME`` once after a load chose a step;
4. any number of ``FLUSH`` (``save(persist=True)`` once the step is committed, or ``flush()``);
5. ``BYE`` at ``close()`` (wait=True), or wait=False when the process leaves without it. An optional
   ``failed=True`` says that the run failed rather than ended (``close(failed=True)``): the agent still
   answers once no persist is in flight or claimed, but treats the rank as one that died, keeping the
   node's memory for the restart (a peer without the field takes every goodbye as the end).

Before it reads its own slot from memory, a rank sends ``MANIFEST`` on the ipc socket too (the checksums its
agent took of that slot after the commit). Tools send ``STATUS``, ``PING`` and ``PEERS`` without a ``HELLO``
(:func:`request_agent`). Recovering
ranks and agents send the tcp kinds (``LIST``, ``MANIFEST``, ``FETCH``, ``PUSH``, ``STATE``, ``VERDICT``) with the
job token.

Every reply is a ``REPLY`` with ``ok`` and the request's ``id``, plus (typed in ``easyckpt_wire.records``):

========  =====================================================================================
HELLO     ``pid``
BYE       ``persisted``, ``failure`` (at once without wait; with wait once no persist is in flight
          or claimed): :class:`~easyckpt_wire.records.ByeReply`
FLUSH     none without wait; with wait ``persisted`` and ``committed``, or ``ok=False`` with
          ``persisted``, ``error``, ``failure``: :class:`~easyckpt_wire.records.FlushReply`
RESUME    ``moved``, ``tracker``, ``persisted``, ``error`` (``ok=False`` when set):
          :class:`~easyckpt_wire.records.ResumeReply`
STATUS    the agent's status map (``Agent.status``, free-form: it is for people)
PING      ``pid``, ``node``, ``endpoint``, ``token`` (once set): :class:`~easyckpt_wire.records.PingReply`
PEERS     ``error`` (None when the table was adopted, with ``ok=False`` otherwise)
LIST      ``node``, ``steps`` (one :class:`~easyckpt_wire.records.ListRow` each, newest first)
MANIFEST  tcp: ``manifest`` (:class:`~easyckpt_wire.records.Manifest`); ipc: ``generation`` and ``checksums``
          (up to :data:`MAX_PEER_MESSAGE_BYTES`); or ``ok=False`` with ``error``
FETCH     ``xxh64`` of the chunk plus one raw data frame; ``ok=False`` with ``error``, and ``code``
          :data:`NO_COPY` when the agent holds no such copy of the tensor
PUSH      nothing (optional ``blobs``: [[checksum, bytes], ...], the small tensors of the manifests, so that
          the buddy's backup never reads the sender's slots after they may have been rewritten)
STATE     no reply (a node's state for the leader: ``local``, ``held``, ``backed`` steps, ``busy``, ``took``,
          ``lost``; optional ``wrote``, ``freed`` and ``lost_to`` (-1 for none), ``alive`` (whether a local
          rank lives) and ``failure`` (null, or its failed persist once no local rank lives: ``step``, ``node``,
          ``errno``, ``text``, ``needed``, ``free``), absent from older senders)
VERDICT   no reply (the leader's word: ``job_safe``, ``node_safe``, ``candidate``, ``take``, ``committed``,
          ``newest``, ``decided``, each -1 for none; ``passed``: [[step, why], ...]; optional ``failure``: a
          node's failed persist of a step newer than ``committed``, as in STATE)
========  =====================================================================================

A peer request with a wrong or missing token gets ``ok=False`` and a fixed ``error``, nothing else.
"""
from __future__ import annotations

import enum
import fcntl
import hashlib
import hmac
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20
MAX_PEER_MESSAGE_BYTES = 64 << 20   # manifests of ranks with many tensors and large plain values
MAX_CHUNK_BYTES = 16 << 20          # one FETCH reply's data frame
CHECKSUM_BYTES = 16                 # xxh3-128 digest of one tensor
RUNTIME_DIR_ENV = "EASYCKPT_RUNTIME_DIR"
JOB_ID_ENV = "EASYCKPT_JOB_ID"
NODE_ID_ENV = "EASYCKPT_NODE_ID"
AGENT_ADDR_ENV = "EASYCKPT_AGENT_ADDR"   # the address peers reach this node's agent at
AGENT_PORT_ENV = "EASYCKPT_AGENT_PORT"   # its tcp port (default: any free one)
NO_COPY = "no_copy"   # a refused FETCH's ``code``: the agent holds no such copy (try the next holder)


class Kind(enum.IntEnum):
    HELLO = 1    # a rank announces itself (pid, rank, world) and the job's persist config
    BYE = 2      # a rank finished cleanly; with wait=True the agent replies once due persists are done
    STATUS = 3   # the agent's view: ranks, slots, steps, last persist
    PING = 4     # liveness probe
    PEERS = 5    # a rank tells its agent the job token, the other nodes' agents and the leader
    FLUSH = 6    # persist this step now, whatever save_storage_interval says; with wait=True the agent
                 # replies once it is durable (or cannot be), else it does not reply
    RESUME = 7   # a rank resumed at this step (a new timeline, invariant 10): the agent forgets newer steps,
                 # moves newer iterations aside, ignores the listed slots (slot index, generation) that the
                 # rank could not invalidate, and replies
    # tcp, token required
    LIST = 10      # which steps, ranks' manifests and tensor checksums does this agent hold
    MANIFEST = 11  # one rank's manifest at one step (tensor index with checksums, plain values)
    FETCH = 12     # a byte range of the tensor with this checksum at this step
    PUSH = 13      # an agent hands its buddy the manifests of its ranks' newest snapshot
    STATE = 15     # an agent tells the leader its node's state (agent.agreement.NodeState); no reply
    VERDICT = 16   # the leader tells every agent the job-wide steps and persists (agent.agreement.Verdict); no reply
    REPLY = 100  # agent -> requester


_INT = (int,)
_STR = (str,)
_BOOL = (bool,)
_OPT_STR = (str, type(None))
_DICT = (dict,)
_LIST = (list,)
_BYTES = (bytes,)

# Required fields and their types per kind; extra fields are ignored so that a newer peer that adds
# optional fields still talks to an older one of the same version.
_SCHEMA: dict[Kind, dict[str, tuple[type, ...]]] = {
    Kind.HELLO: {"rank": _INT, "pid": _INT, "world_size": _INT, "local_world_size": _INT,
                 "save_storage_interval": _INT, "max_ckpt_num": _INT, "log_file_path": _OPT_STR},
    Kind.BYE: {"rank": _INT, "pid": _INT, "wait": _BOOL},
    Kind.STATUS: {},
    Kind.PING: {},
    Kind.FLUSH: {"rank": _INT, "step": _INT, "wait": _BOOL},
    Kind.RESUME: {"rank": _INT, "step": _INT, "stale": _LIST},
    Kind.PEERS: {"token": _STR, "node": _STR, "leader": _STR, "nodes": _LIST, "world_size": _INT,
                  "replicate_unique": _BOOL},
    # the token of peer kinds is checked by token_ok(), so that a request without one gets a refusal
    Kind.LIST: {},
    Kind.MANIFEST: {"rank": _INT, "step": _INT},
    Kind.FETCH: {"step": _INT, "checksum": _BYTES, "offset": _INT, "length": _INT},
    Kind.PUSH: {"node": _STR, "step": _INT, "manifests": _LIST},
    Kind.STATE: {"node": _STR, "local": _LIST, "held": _LIST, "backed": _LIST, "busy": _INT, "took": _INT,
                 "lost": _LIST},
    Kind.VERDICT: {"node": _STR, "job_safe": _INT, "node_safe": _INT, "candidate": _INT, "take": _INT,
                   "committed": _INT, "newest": _INT, "decided": _INT, "passed": _LIST},
    Kind.REPLY: {"ok": _BOOL},
}
PEER_KINDS = frozenset({Kind.LIST, Kind.MANIFEST, Kind.FETCH, Kind.PUSH, Kind.STATE, Kind.VERDICT})
NO_REPLY_KINDS = frozenset({Kind.STATE, Kind.VERDICT})   # news: the sender never waits, the next news corrects


class ProtocolError(ValueError):
    """A message that violates the protocol; the receiver drops it."""


def encode(kind: Kind, *, limit: int = MAX_MESSAGE_BYTES, **fields: Any) -> bytes:
    message = {"v": PROTOCOL_VERSION, "kind": int(kind), **fields}
    _check(message, Kind(kind))
    blob = msgpack.packb(message, use_bin_type=True)
    if len(blob) > limit:
        raise ProtocolError(f"{kind.name} message of {len(blob)} bytes exceeds {limit}")
    return blob


def decode(blob: bytes | memoryview, *, limit: int = MAX_MESSAGE_BYTES) -> tuple[Kind, dict[str, Any]]:
    if len(blob) > limit:
        raise ProtocolError(f"message of {len(blob)} bytes exceeds the {limit} byte limit")
    try:
        message = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several exception types on garbage
        raise ProtocolError(f"message is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"message is a {type(message).__name__}, expected a map")
    version = message.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 == 1.0 in Python
        raise ProtocolError(f"protocol version {version!r}, this build speaks {PROTOCOL_VERSION}")
    try:
        if type(message.get("kind")) is not int:
            raise ValueError
        kind = Kind(message["kind"])
    except ValueError:
        raise ProtocolError(f"unknown message kind {message.get('kind')!r}") from None
    _check(message, kind)
    return kind, message


# Inclusive bounds for int fields: a well-typed but absurd value (say local_world_size=10**6) would
# otherwise wedge the agent's bookkeeping.
_MAX_RANKS = 1 << 20
MAX_STEP = 1 << 62
_RANGES: dict[str, tuple[int, int]] = {
    "rank": (0, _MAX_RANKS - 1), "pid": (1, 1 << 22), "world_size": (1, _MAX_RANKS),
    "local_world_size": (1, 4096), "save_storage_interval": (1, 1 << 62), "max_ckpt_num": (1, 1 << 20),
    "step": (0, MAX_STEP), "offset": (0, 1 << 50), "length": (1, MAX_CHUNK_BYTES),
}


def _check(message: dict[str, Any], kind: Kind) -> None:
    for field, types in _SCHEMA[kind].items():
        value = message.get(field)
        if field not in message or not isinstance(value, types) or (
                types == _INT and isinstance(value, bool)):
            raise ProtocolError(
                f"{kind.name} message field {field!r} is {value!r}, expected {'/'.join(t.__name__ for t in types)}"
            )
        bounds = _RANGES.get(field)
        if bounds is not None and not (isinstance(value, int) and bounds[0] <= value <= bounds[1]):
            raise ProtocolError(f"{kind.name} message field {field!r} is {value}, outside [{bounds[0]}, {bounds[1]}]")
    if kind == Kind.HELLO and not (message["rank"] < message["world_size"]
                                   and message["local_world_size"] <= message["world_size"]):
        raise ProtocolError(f"HELLO with rank {message['rank']}, local_world_size {message['local_world_size']} "
                            f"and world_size {message['world_size']} is inconsistent")
    if "token" in message and not isinstance(message["token"], str):
        raise ProtocolError(f"{kind.name} message token is a {type(message['token']).__name__}, expected str")
    if kind == Kind.RESUME and (len(message["stale"]) > 64 or not all(
            isinstance(item, list) and len(item) == 2 and all(type(v) is int and 0 <= v < 1 << 62 for v in item)
            for item in message["stale"])):
        raise ProtocolError(f"RESUME message field 'stale' must list at most 64 [slot, generation] pairs, "
                            f"got {message['stale']!r:.200}")
    if kind == Kind.FETCH and len(message["checksum"]) != CHECKSUM_BYTES:
        raise ProtocolError(f"FETCH checksum of {len(message['checksum'])} bytes, expected {CHECKSUM_BYTES}")


def token_ok(message: dict[str, Any], token: str | None) -> bool:
    """Constant-time check of a peer request's job token (no token configured: nobody is let in)."""
    given = message.get("token")
    return bool(token) and isinstance(given, str) and hmac.compare_digest(given.encode(), (token or "").encode())


def reply(ok: bool = True, **fields: Any) -> bytes:
    return encode(Kind.REPLY, ok=ok, **fields)


def job_id_for(save_dir: str | os.PathLike[str]) -> str:
    """Stable across restarts: the env override, else a digest of the absolute save_dir."""
    override = os.environ.get(JOB_ID_ENV)
    if override:
        return override
    text = os.fspath(save_dir)
    if isinstance(text, str) and "://" in text:   # an object-store URL is absolute already (and no local path)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    return hashlib.sha256(str(Path(save_dir).resolve()).encode()).hexdigest()[:16]


def runtime_base() -> Path:
    configured = os.environ.get(RUNTIME_DIR_ENV)
    if configured:
        return Path(configured)
    return Path("/tmp") / f"easyckpt-{os.getuid()}"


def node_id() -> str:
    """This node's name in the job: EASYCKPT_NODE_ID, else the host name."""
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()


def job_dir_name(job_id: str) -> str:
    """One runtime directory per job and node: two simulated nodes on one host need two agents."""
    configured = os.environ.get(NODE_ID_ENV)
    return f"{job_id}@{re.sub(r'[^A-Za-z0-9_.-]', '_', configured)[:64]}" if configured else job_id


def advertised_address() -> str:
    """The address other nodes reach this agent at: EASYCKPT_AGENT_ADDR, else the local address of
    the route to the job's MASTER_ADDR (torchrun sets it), else the host name's address."""
    configured = os.environ.get(AGENT_ADDR_ENV)
    if configured:
        return configured
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))  # a UDP connect sends nothing; it only picks the route
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def file_in_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its ancestors that exists and is not a directory (None: there is none), so
    that a directory we must create is refused with that cause rather than with mkdir's "File exists"."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return None if candidate.is_dir() else candidate
        except OSError:
            return None
    return None


def runtime_dir(job_id: str) -> Path:
    """The job's private directory for the agent's socket, lock, pid and log (created 0700)."""
    base = runtime_base()
    blocker = file_in_the_way(base)
    if blocker is not None:
        raise NotADirectoryError(f"the runtime directory {base} ({RUNTIME_DIR_ENV}) cannot be created: {blocker} is a "
                                 f"file, not a directory; set {RUNTIME_DIR_ENV} to a directory of your own (it is "
                                 "created if missing), or unset it for the default /tmp/easyckpt-<uid>")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = base / job_dir_name(job_id)
    path.mkdir(mode=0o700, exist_ok=True)
    for directory in (base, path):
        stat = directory.stat()
        if stat.st_uid != os.getuid():
            raise PermissionError(
                f"runtime directory {directory} belongs to uid {stat.st_uid}, not to us ({os.getuid()}): "
                f"set {RUNTIME_DIR_ENV} to a directory of your own"
            )
        if stat.st_mode & 0o077:
            os.chmod(directory, 0o700)
    return path


def agent_endpoint(job_dir: Path) -> str:
    return f"ipc://{job_dir / 'agent.sock'}"


def wake_path(job_dir: Path) -> Path:
    """A FIFO the agent reads: a rank writes one byte to it when it commits a snapshot, so the agent looks
    at the slots at once instead of at its next poll (the safe step must move before the rank's next
    snapshot overwrites its newest one)."""
    return job_dir / "commits.fifo"


class Waker:
    """The rank's end of the wake-up FIFO; never blocks, and a missing agent costs nothing."""

    def __init__(self, job_dir: Path) -> None:
        self.path = wake_path(job_dir)
        self.fd = -1

    def wake(self) -> None:
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:   # no FIFO yet, or no reader (ENXIO): the agent's poll finds the commit anyway
                return
        try:
            os.write(self.fd, b"c")
        except BlockingIOError:
            pass   # the FIFO is full of wake-ups the agent has yet to read: one more adds nothing
        except OSError:   # the agent went away (EPIPE): reopen next time
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def agent_lock_path(job_dir: Path) -> Path:
    return job_dir / "agent.lock"


def agent_running(job_dir: Path) -> bool:
    """Whether some process holds the job's agent lock (an flock dies with its holder, a pid file does not)."""
    try:
        fd = os.open(agent_lock_path(job_dir), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe lock if we got it
    return False


class AgentNoReply(TimeoutError):
    pass


def request_agent(job_dir: Path, kind: Kind, timeout: float, **fields: Any) -> dict[str, Any]:
    """One request to a job's agent over its ipc socket, outside any rank's session (no HELLO): the
    CLI's STATUS, a standalone launcher's PING and PEERS. Raises AgentNoReply saying whether no agent
    runs (it exited, or has not started) or one runs but does not answer."""
    where = f"agent {kind.name} request for job {job_dir.name}"
    gone = f"{where}: no agent is running (it exited, died or has not started: see {job_dir / 'agent.log'})"
    if not agent_running(job_dir):
        raise AgentNoReply(gone)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(agent_endpoint(job_dir))
        sock.send(encode(kind, id=1, **fields))
        deadline = time.monotonic() + timeout
        while not sock.poll(100):   # short slices: an agent that exits meanwhile is named as such
            if not agent_running(job_dir):
                raise AgentNoReply(gone)
            if time.monotonic() > deadline:
                raise AgentNoReply(f"{where}: no reply within {timeout:.0f}s (the agent is alive but busy or "
                                   f"stuck: see {job_dir / 'agent.log'})")
        return decode(sock.recv())[1]
    finally:
        sock.close(linger=0)
        ctx.term()

