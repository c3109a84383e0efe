"""The bound under starvation (multi-node): ``save_if_needed`` waits while the node-safe step trails.

A node loss resumes from the node-safe step: the newest step every node holds and whose rank-private bytes
are backed up on another node (``easyckpt_agent.agreement``). When the agents cannot keep up at all (their CPU is
taken by data loaders, say), that step falls behind without bound and a node loss would cost more and more.
With ``max_backup_lag`` = K, a rank about to snapshot step s waits while the node-safe step is older than
s - K: its newest snapshot stays where it is, so the agents catch up. Each wait is bounded by a few observed
step times (never a fixed timeout) and polls the control block (shared memory, no syscall); the episode is
said once when it starts and once when it ends. Training is slowed by agents that cannot keep up, never
stopped: a wait that runs out lets the snapshot go ahead, and the next snapshot waits again.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from easyckpt_wire.control import ControlView
from easyckpt_wire.episode import Episode

logger = logging.getLogger(__name__)

MIN_WAIT = 0.2      # seconds: the floor of a wait's bound (a step can be far shorter than an agent's round)
STEPS_OF_WAIT = 4   # a wait lasts at most this many observed step times per step of excess lag
WINDOW = 8          # the step time is the shortest of this many recent times between snapshots
POLL = 0.001        # seconds between looks at the control block


class LagGate:
    def __init__(self, *, rank: int, limit: int, read: Callable[[], ControlView | None]) -> None:
        self.rank = rank
        self.limit = limit
        self.read = read
        self.step_seconds: float | None = None   # the shortest recent time between snapshots (outside episodes)
        self._times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._last: float | None = None
        self.ran_out = 0          # waits that reached their bound in this episode
        self.waited = 0.0         # seconds waited in all
        self.resumed = -1         # the step the job resumed at: every rank has it, however behind the agents are
        # The newest node-safe step read since then: the leader's word can name no step for a round while the
        # nodes move their holds (a node that missed a verdict), and backups made do not come undone.
        self.seen = -1
        self.episode = Episode(logger, logging.WARNING)

    def lag(self, step: int, word: ControlView | None) -> int | None:
        """Steps from the node-safe step to ``step``; None in a single-node job (nothing to wait for)."""
        if word is None or not word.gated:
            return None
        if word.node_safe is not None:
            self.seen = max(self.seen, word.node_safe)
        return step - max(self.resumed, self.seen)

    def resume_at(self, step: int) -> None:
        """The job resumed at ``step``: backups start again from there, whatever was backed up after it."""
        self.resumed, self.seen = step, -1

    def before_snapshot(self, step: int) -> None:
        now = time.monotonic()
        if self._last is not None and not self.episode.active:
            # The shortest recent time, and none from inside an episode: there the time between two snapshots
            # holds the other ranks' waits (the step's collectives wait for them), and the first step of an
            # episode holds the first wait of a rank that began it. An average of such times made each wait
            # longer than the one before until the ranks stopped each other (fault soak, seed 11, fault 7).
            self._times.append(now - self._last)
            self.step_seconds = min(self._times)
        self._last = now
        if self.limit <= 0:
            return
        word = self.read()
        lag = self.lag(step, word)
        if lag is None or lag <= self.limit:
            if self.episode.active:
                self.episode.end("rank %d: node-safe step %s is within max_backup_lag=%d steps of step %d again "
                                 "(%.2fs waited in all)", self.rank, word.node_safe if word else None, self.limit,
                                 step, self.waited)
            self.ran_out = 0
            return
        per_step = self.step_seconds if self.step_seconds is not None else MIN_WAIT
        # Longer the further behind, so that agents slower than any fixed bound still catch up; at most
        # STEPS_OF_WAIT x max_backup_lag step times, so that a stuck backup slows training down, never stops it.
        budget = max(MIN_WAIT, STEPS_OF_WAIT * per_step * min(lag - self.limit, self.limit))
        self.episode.hit("rank %d: the node-safe step (%s) trails step %d by %d steps, more than max_backup_lag=%d: "
                         "snapshots wait for the node agents' backups to catch up (at most %.2fs each; the agents are "
                         "starved of CPU or the network is slow)", self.rank, word.node_safe if word else None, step,
                         lag, self.limit, budget)
        started = time.monotonic()
        deadline = started + budget
        while time.monotonic() < deadline:
            time.sleep(POLL)   # polling the agent's control block against the deadline above
            lag = self.lag(step, self.read())
            if lag is None or lag <= self.limit:
                break
        else:
            self.ran_out += 1
            if self.ran_out == 1:
                logger.warning("rank %d: waited %.2fs (the bound) and the node-safe step still trails step %d by %s "
                               "steps: this snapshot goes ahead, the next ones wait again", self.rank, budget, step, lag)
        self.waited += time.monotonic() - started
        self._last = time.monotonic()   # the wait is not part of the step time
