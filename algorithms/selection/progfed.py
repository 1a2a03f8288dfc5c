"""ProgFed's schedule: which stage of the model trains in a round (Wang et al., ICML 2022).

Stage ``s`` of ``S`` trains the first ``s`` blocks and a small head; stages 1..S-1 last
``T_s`` rounds each and the last stage runs to the end
(:class:`fedswarm.strategies.edge.progfed.ProgFed` explains the algorithm)::

    T_s      = T / (2S)                     (the official CIFAR-100 config: S = 4, T_s = 375, T = 3000)
    stage(t) = min(S, 1 + (t - 1) // T_s)

The default is the ResNet-18 config's; the official ConvNet configs use T_s = T / S
(EMNIST: S = 3, T_s = 500, T = 1500; CIFAR-10: S = 4, T_s = 500, T = 2000), where the
full model trains only the last 1/S of the rounds: pass ``stage_rounds`` for that.
"""

from __future__ import annotations

__all__ = ["default_stage_rounds", "stage_of", "samples_processed"]


def default_stage_rounds(total_rounds: int, num_stages: int) -> int:
    """``T_s = T / (2S)`` (at least 1): the full model trains the last ~half of the rounds
    plus one stage length, 5/8 of them for S = 4."""
    return max(1, round(total_rounds / (2 * num_stages)))


def stage_of(server_round: int, stage_rounds: int, num_stages: int) -> int:
    """The stage of a round (1-based rounds)."""
    return min(num_stages, 1 + max(0, server_round - 1) // stage_rounds)


def samples_processed(num_examples: int, batch_size: int, steps: int) -> int:
    """Examples :meth:`LocalTrainer.fit` runs through in ``steps`` minibatches (the last
    batch of each pass over the data may be short)."""
    n, total, pos = num_examples, 0, 0
    for _ in range(steps):
        if pos >= n:
            pos = 0
        total += min(batch_size, n - pos)
        pos += batch_size
    return total
