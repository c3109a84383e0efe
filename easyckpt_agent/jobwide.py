"""The process side of job-wide agreement: carry each node's state to the leader and the leader's verdict to
every agent. The rules are ``easyckpt_agent.agreement``'s; this module only moves their inputs and outputs.

News travels fire-and-forget over one ZeroMQ DEALER per peer, owned by the agent's loop thread: a send never
blocks the loop, and a peer that is gone simply misses a message that the next change (or the heartbeat,
every ``HEARTBEAT`` seconds) says again. Arriving news is stored by the replica server's thread, which wakes
the loop at once, so a verdict is applied within a round of the loop, not at the next poll.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from easyckpt_agent.agreement import (
    Book,
    NodeState,
    Verdict,
    decide,
    state_from_wire,
    state_to_wire,
    verdict_from_wire,
    verdict_to_wire,
)
from easyckpt_wire import protocol
from easyckpt_wire.protocol import Kind
from easyckpt_wire.records import PeerTable

logger = logging.getLogger(__name__)

HEARTBEAT = 1.0   # seconds between repeats of unchanged news (a restarted agent learns the state of things)
SEND_HWM = 8      # news queued per peer at most: a peer that reads nothing gets the newest, not a backlog


class Courier:
    """Fire-and-forget messages to other agents' tcp endpoints; one thread only (its owner's: the agent's loop
    for news, the push thread for backups)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.socks: dict[str, zmq.Socket] = {}
        self.dropped = 0

    def send(self, endpoint: str, kind: Kind, token: str, **fields: Any) -> bool:
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 1)   # no queue for a peer that is not connected: its news would be stale
            sock.connect(endpoint)
            self.socks[endpoint] = sock
        try:   # replies to kinds that have one (PUSH) are of no use here: dropped unread
            while sock.poll(0):
                sock.recv_multipart(zmq.NOBLOCK)
            sock.send(protocol.encode(kind, limit=protocol.MAX_PEER_MESSAGE_BYTES, token=token, **fields), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped += 1
            return False

    def forget(self, keep: set[str]) -> None:
        for endpoint in set(self.socks) - keep:
            self.socks.pop(endpoint).close(linger=0)

    def close(self) -> None:
        self.forget(set())


class JobWide:
    """One agent's part in the agreement: its state goes to the leader; the leader decides for everyone."""

    def __init__(self, *, node: str, ctx: zmq.Context, wake: Callable[[], None] = lambda: None) -> None:
        self.node = node
        self.wake = wake
        self.lock = threading.Lock()
        self.states: dict[str, NodeState] = {}   # the leader's view of every node (its own included)
        self.verdict: Verdict | None = None      # the newest verdict (the leader's own, or received)
        self.verdict_at = 0.0                    # monotonic time it arrived
        self.book = Book()
        self.courier = Courier(ctx)
        self._sent: tuple[Any, float] = (None, 0.0)

    def reset(self, *, decided: int) -> None:
        """A new incarnation of the job (new peers) or a new timeline: nothing said before holds."""
        with self.lock:
            self.states.clear()
            self.verdict = None
        self.book = Book(decided=decided)
        self._sent = (None, 0.0)

    def rewind(self, step: int, *, decided: int) -> None:
        """The job resumed at ``step``: steps after it belong to an abandoned timeline."""
        book = self.book
        self.book = Book(decided=decided, taken=book.taken if book.taken is not None and book.taken <= step else None,
                            passed=tuple(p for p in book.passed if p[0] <= step))
        with self.lock:
            self.states.clear()   # every node's next state says what it holds on the new timeline
            self.verdict = None
        self._sent = (None, 0.0)

    # the replica server's thread ---------------------------------------------------------------------
    def on_state(self, message: Mapping[str, Any], peers: PeerTable | None) -> None:
        if peers is None or not peers.is_leader or message["node"] not in peers.nodes:
            raise ValueError(f"STATE from node {message['node']!r:.64} reached node {self.node!r}, which does not "
                             "lead this job")
        state = state_from_wire(message)
        with self.lock:
            self.states[state.node] = state
        self.wake()

    def on_verdict(self, message: Mapping[str, Any], peers: PeerTable | None) -> None:
        if peers is None or message["node"] != peers.leader:
            raise ValueError(f"VERDICT from node {message['node']!r:.64}, which does not lead this job")
        verdict = verdict_from_wire(message)
        with self.lock:
            self.verdict, self.verdict_at = verdict, time.monotonic()
        self.wake()

    # the agent's loop -------------------------------------------------------------------------------------
    def exchange(self, state: NodeState, peers: PeerTable, *, interval: int, committed: int | None) -> Verdict | None:
        """Say this node's state; the leader also decides and tells everyone. Returns the newest verdict."""
        now = time.monotonic()
        if not peers.is_leader:
            if self._due(state, now):
                self.courier.send(peers.endpoint(peers.leader), Kind.STATE, peers.token, **state_to_wire(state))
            with self.lock:
                return self.verdict
        nodes = sorted(peers.nodes)
        with self.lock:
            self.states[self.node] = state
            states = {node: s for node, s in self.states.items() if node in peers.nodes}
        verdict, self.book = decide(states, nodes, interval=interval, book=self.book, committed=committed)
        with self.lock:
            if verdict != self.verdict:
                self.verdict_at = now
            self.verdict = verdict
        if self._due(verdict, now):
            fields = verdict_to_wire(verdict)
            for node in nodes:
                if node != self.node:
                    self.courier.send(peers.endpoint(node), Kind.VERDICT, peers.token, node=self.node, **fields)
        return verdict

    def _due(self, news: Any, now: float) -> bool:
        """Whether ``news`` must go out now: it changed, or the heartbeat is due."""
        last, at = self._sent
        if news == last and now - at < HEARTBEAT:
            return False
        self._sent = (news, now)
        return True

    def close(self) -> None:
        self.courier.close()
