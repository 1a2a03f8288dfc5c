"""A Grid whose ``send_and_receive`` notices replies promptly.

Flower's deployment grid polls the SuperLink for replies every 3 seconds, so a round that
the nodes finish in half a second still costs up to 3 s of waiting, and a run of many short
rounds is mostly waiting. :class:`PromptGrid` pushes the same way and pulls the replies
itself, soon after pushing and then at a growing interval (``first_s``, times 1.5, at most
``max_s``): a reply is seen within about half a second, at the cost of a few more small
pull requests on the SuperLink. Which replies come back, and when it gives up (``timeout``),
is Flower's contract unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message

from fedswarm.server.metered_grid import WrappingGrid
from fedswarm.strategies.strategy_utils import pull_replies  # (named here too, where the server's callers find it)

__all__ = ["PromptGrid", "pull_replies"]


class PromptGrid(WrappingGrid):
    def __init__(self, inner, *, first_s: float = 0.05, max_s: float = 0.5):
        super().__init__(inner)
        if not 0 < first_s <= max_s:
            raise ValueError(f"PromptGrid needs 0 < first_s <= max_s (got {first_s}, {max_s})")
        self.first_s, self.max_s = first_s, max_s

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        waiting = [mid for mid in self.inner.push_messages(messages) if mid]
        return pull_replies(self.inner, waiting, timeout=timeout, first_s=self.first_s, max_s=self.max_s)


