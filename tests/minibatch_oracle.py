"""An independent oracle of fedswarm's minibatch draw (fedswarm.algorithms.local_sgd), written
from its definition in plain Python integers, one example at a time: splitmix64 by hand, Python's
``sorted`` for the permutation, and the step-by-step loop that cuts batches and draws a fresh
permutation when one is used up. Shared by the tests that replay a runtime's draws."""

from __future__ import annotations

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def splitmix_out(state: int) -> int:
    """splitmix64's output for the state after one increment from ``state``."""
    z = (state + GAMMA) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def stream(state: int, i: int) -> int:
    """The ``i + 1``-th output of the splitmix64 generator started at ``state`` (its state
    after ``i + 1`` increments, finalised)."""
    return splitmix_out((state + i * GAMMA) & MASK)


def permutation(seed: int, e: int, n: int) -> list[int]:
    """Permutation ``e`` of ``0..n-1`` for a client with ``seed``: positions sorted by their key
    (ties by position), the key of position ``i`` being output ``i`` of the stream whose state is
    output ``e`` of the stream whose state is output 0 of the stream of the seed."""
    client = splitmix_out(seed & MASK)
    state = stream(client, e)
    return sorted(range(n), key=lambda i: (stream(state, i), i))


def batches(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """The definition, step by step: permute, cut in order, permute again when used up."""
    e, order, at, out = 0, permutation(seed, 0, n), 0, []
    for _ in range(steps):
        if n and at >= n:
            e += 1
            order, at = permutation(seed, e, n), 0
        out.append(order[at:at + batch_size])
        at += batch_size
    return out
