"""Messages received for a round, waited on with a timeout (thread-safe).

A round-based algorithm pushes its message to each neighbour and waits for theirs; the
waits end when every expected sender has answered or the timeout passes, so a dead
neighbour costs one timeout, never the run. Only rounds near the current one are kept
(``window``), which bounds memory whatever a peer sends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["Inbox"]


class Inbox:
    def __init__(self, window: int = 4):
        self.window = window
        self.current = 0
        self._items: dict[tuple[str, int], dict[str, Any]] = {}
        self._cv = threading.Condition()
        self.late = 0  # messages for rounds already left behind

    def set_round(self, r: int) -> None:
        with self._cv:
            self.current = r
            for key in [k for k in self._items if k[1] < r - self.window]:
                del self._items[key]

    def accepts(self, r: int) -> bool:
        return self.current - self.window <= r <= self.current + self.window

    def put(self, kind: str, r: int, sender: str, value: Any) -> bool:
        with self._cv:
            if not self.accepts(r):
                self.late += r < self.current
                return False
            self._items.setdefault((kind, r), {})[sender] = value
            self._cv.notify_all()
            return True

    def wait(self, kind: str, r: int, senders: Iterable[str], timeout: float,
             stop: threading.Event | None = None) -> dict[str, Any]:
        """The messages of ``kind`` for round ``r`` from ``senders`` that arrived before
        ``timeout`` seconds passed (all of them if they all did)."""
        want = set(senders)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = self._items.get((kind, r), {})
                if want <= set(got) or (stop is not None and stop.is_set()):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.25))
            got = self._items.get((kind, r), {})
            return {s: got[s] for s in want if s in got}

    def take(self, kind: str, r: int) -> dict[str, Any]:
        """Remove and return everything of ``kind`` for round ``r``."""
        with self._cv:
            return self._items.pop((kind, r), {})

    def rounds_of(self, kind: str) -> list[int]:
        with self._cv:
            return sorted(r for k, r in self._items if k == kind)
