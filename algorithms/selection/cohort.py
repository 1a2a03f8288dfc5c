"""Which nodes train a round: the one draw of a round's cohort, for every engine.

:func:`sample_positions` is the sampling of every fedswarm strategy that samples a fraction of
the connected nodes (:func:`fedswarm.strategies.strategy_utils.sample_train_nodes`, on every
engine) and of the batched engine's FedAvg round, which samples without building a strategy's
messages (:mod:`fedswarm.sim.batched`). Both reach it the same number of times with the same
``random`` state (each engine seeds ``random`` with the run's seed), so both draw the same
clients in the same order.

The definition: one 64-bit word from Python's ``random`` module (``random.getrandbits(64)``)
seeds a NumPy ``Generator`` (PCG64), whose ``choice(n, k, replace=False)`` gives the positions.
That is one call into C for the whole cohort; ``random.sample`` costs a Python call per drawn
node (0.3 s for 100,000 of 100,000 on a 2-core machine, more than the round's training).
The ``random`` module advances by exactly one word a draw, whatever ``n`` and ``k`` are.
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["sample_positions"]


def sample_positions(n: int, k: int) -> np.ndarray:
    """``k`` distinct positions out of ``range(n)``, in the order drawn (int64, ``[k]``).

    Raises ``ValueError`` when ``k`` is negative or more than ``n``."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"sample_positions: cannot draw {k} distinct positions out of {n}")
    seed = random.getrandbits(64)  # always one word: the random module's state moves the same for every (n, k)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    return np.random.default_rng(seed).choice(n, size=k, replace=False).astype(np.int64, copy=False)
