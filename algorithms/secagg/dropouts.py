"""Simulated dropouts (run config ``secagg_dropout``), drawn the same way on every engine: the
in-process and deployment server's ``SecAggGrid`` discards the replies of the drawn nodes from
their stage on, the batched engine's direct sum (``fedswarm.sim.batched_secagg``) leaves them out
as the protocol would."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DROP_STAGES", "draw_dropouts"]

#: The stages a simulated dropout happens at, in the protocol's order.
DROP_STAGES: tuple[str, ...] = ("advertise", "share_keys", "masked_input", "unmask")


def draw_dropouts(node_ids: Sequence[int], rate: float, seed: int, round_: int) -> dict[str, set[int]]:
    """Each node vanishes with probability ``rate`` at one stage drawn uniformly among
    :data:`DROP_STAGES` (the same draw for the same seed and round on every engine)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"secagg_dropout must be in [0, 1), got {rate}")
    rng = np.random.default_rng([0xD809, int(seed), int(round_)])
    ids = sorted(int(i) for i in node_ids)
    gone = rng.random(len(ids)) < rate
    stage = rng.integers(0, len(DROP_STAGES), len(ids))
    out: dict[str, set[int]] = {s: set() for s in DROP_STAGES}
    for i, g, s in zip(ids, gone, stage):
        if g:
            out[DROP_STAGES[s]].add(i)
    return out
