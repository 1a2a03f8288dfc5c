"""A node's distributed DP under secure aggregation (``--dp`` with ``--secagg``): before its
update is masked, the node clips it to the DP norm, weighs it 1 (DP-FedAvg's uniform
weights: a count would multiply its sensitivity) and adds its share of integer noise
(:mod:`fedswarm.algorithms.privacy.distributed`) to the quantized vector, so the sum the
server unmasks is already private.

The node computes its noise from its own run config (``dp``, ``seed``) and the round's setup
(field bits, clip, the round's nodes, the vector's length), never from a noise level the
server sends; a setup that does not leave the room this node's noise needs
(``weight_max = 1``, the same ``noise_bound``) is refused, so a server cannot ask for an
update with less noise than the run asked for.

The noise draws come from :func:`~fedswarm.algorithms.privacy.distributed.node_rng` of the
run's seed, the server round, the node and the round's secure sum (``stream``: the
:data:`~fedswarm.strategies.secagg_payload.SUM_KEY` of the message's config, 0 when absent;
Sketched-SGD's exact values are sum 1, so the round's two sums draw independent noise), so a
simulation is reproducible and the batched engine can compute the same sum; or from the OS with
``secure=true`` in ``--dp``: a deployment whose server must not know the noise sets it (a
server that knows the run's seed knows the seeded noise, whatever the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Context, Message

from fedswarm.algorithms.privacy.distributed import DistributedDP, clip_l2, node_rng, secagg_with_dp
from fedswarm.algorithms.privacy.dp_spec import parse_dp
from fedswarm.algorithms.secagg import NoiseHook, SecAggParams, SecAggRefused, Setup
from fedswarm.strategies.secagg_payload import SUM_KEY

__all__ = ["NodeDP", "node_dp"]


@dataclass(frozen=True)
class NodeDP:
    """What a node does to its update under distributed DP in one round."""

    dp: DistributedDP
    rng: np.random.Generator | None  # None: the OS (secure=true)

    @property
    def noise(self) -> NoiseHook:
        return self.dp.noise_hook()

    def prepare(self, update: np.ndarray) -> tuple[np.ndarray, int]:
        """The update clipped to L2 norm ``clip`` and its weight, 1."""
        return clip_l2(update, self.dp.clip), 1


def _config_int(msg: Message, key: str) -> int:
    """``key`` of the first config record of ``msg`` that has it, else 0."""
    for record in msg.content.config_records.values():
        if key in record:
            return int(record[key])
    return 0


def node_dp(context: Context, setup: Setup, msg: Message) -> NodeDP | None:
    """The node's distributed DP for this round, or None when the run has no ``--dp``."""
    text = context.run_config.get("dp")
    if not text:
        return None
    spec = parse_dp(str(text))
    if spec.noise_multiplier is None:
        raise SecAggRefused("secagg: distributed DP needs noise_multiplier=N in --dp")
    params, dp = secagg_with_dp(SecAggParams(clip=setup.clip, bits=setup.bits), len(setup.node_ids), setup.dim,
                                mechanism=spec.mechanism or "dgauss", noise_multiplier=spec.noise_multiplier,
                                dp_clip=spec.clip, delta=spec.delta, seed=int(context.run_config.get("seed", 0)))
    if (setup.weight_max, setup.noise_bound) != (params.weight_max, params.noise_bound):
        raise SecAggRefused(f"secagg: the setup's weight_max={setup.weight_max}, noise_bound={setup.noise_bound} "
                            f"do not leave this node's DP noise its room (weight_max={params.weight_max}, "
                            f"noise_bound={params.noise_bound}): refused")
    stream = _config_int(msg, SUM_KEY)  # which of the round's secure sums: its own noise stream
    if stream < 0:
        raise SecAggRefused(f"secagg: the message's {SUM_KEY}={stream} is not a secure sum's index (>= 0)")
    rng = None if spec.secure else node_rng(dp.seed, _config_int(msg, "server-round"), int(context.node_id), stream)
    return NodeDP(dp, rng)
