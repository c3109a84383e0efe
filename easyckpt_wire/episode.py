"""A repeated condition, logged once when it starts and once when it ends (with a count and a duration).

The agent's loop and a rank's snapshot path meet the same condition many times in a row (a step passed
over while a persist runs, a snapshot skipped); one line per occurrence would bury everything else.
"""
from __future__ import annotations

import logging
import time


class Episode:
    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.level = level
        self.count = 0
        self.started = 0.0
        self.total = 0
        self.items: list[object] = []   # what each occurrence of this episode was about (``hit(item=)``)

    @property
    def active(self) -> bool:
        return self.count > 0

    def hit(self, message: str, *args: object, item: object = None) -> bool:
        """One more occurrence; logs ``message`` only for the first of an episode. True if it logged. ``item``
        (a step, say) is kept in ``items`` until the episode ends, for the end's message to name them."""
        if item is not None:
            self.items.append(item)
        self.count += 1
        self.total += 1
        if self.count > 1:
            return False
        self.started = time.monotonic()
        self.logger.log(self.level, message, *args)
        return True

    def end(self, message: str, *args: object) -> bool:
        """The condition is over: logs ``message`` with ``count`` and ``seconds`` appended, if it was on."""
        if not self.count:
            return False
        seconds = time.monotonic() - self.started
        self.logger.log(logging.INFO, message + " (%d time(s) in %.1fs)", *args, self.count, seconds)
        self.count = 0
        self.items = []
        return True
