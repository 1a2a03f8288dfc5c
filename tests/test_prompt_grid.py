"""PromptGrid (server/prompt_grid.py): the deployment ServerApp's grid notices replies within
half a second instead of Flower's 3-second poll, and keeps Flower's send_and_receive contract
(every reply returned, nothing after the timeout). A fake clock: no test here waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedswarm.strategies import strategy_utils  # where pull_replies, PromptGrid's loop, lives
from fedswarm.server.prompt_grid import PromptGrid


class Clock:
    def __init__(self):
        self.now, self.pauses = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.now += s


class SlowNodes:
    """A grid whose reply to message i can be pulled from time ``ready[i]`` on (never, if None)."""

    def __init__(self, clock: Clock, ready: list[float | None]):
        self.clock, self.ready, self.pulls = clock, ready, 0

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        ids = set(ids)
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=f"m{i}"))
                for i, t in enumerate(self.ready) if f"m{i}" in ids and t is not None and t <= self.clock.now]


@pytest.fixture()
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(strategy_utils, "time", c)
    return c


def test_every_reply_returned_soon_after_it_is_ready(clock):
    inner = SlowNodes(clock, [0.0, 1.0, 4.2])
    replies = PromptGrid(inner).send_and_receive(["a", "b", "c"], timeout=None)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert 4.2 <= clock.now <= 4.2 + 0.5  # Flower's own loop: up to 3 s late
    assert clock.pauses[:3] == pytest.approx([0.05, 0.075, 0.1125]) and max(clock.pauses) == 0.5


def test_timeout_returns_what_came_and_never_waits_past_it(clock):
    inner = SlowNodes(clock, [0.3, None])
    replies = PromptGrid(inner).send_and_receive(["a", "b"], timeout=2.0)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert clock.now == pytest.approx(2.0)


def test_each_reply_once_and_no_pull_after_the_last(clock):
    inner = SlowNodes(clock, [0.0, 0.0])
    replies = PromptGrid(inner).send_and_receive(["a", "b"], timeout=10.0)
    assert len(replies) == 2 and inner.pulls == 1 and clock.pauses == []


def test_bad_intervals_refused():
    with pytest.raises(ValueError, match="first_s"):
        PromptGrid(SimpleNamespace(), first_s=1.0, max_s=0.5)
