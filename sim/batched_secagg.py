"""Secure aggregation in the batched engine: the round's unmasked sum computed directly.

SecAgg+'s masks cancel: what the server unmasks is exactly the sum, mod 2^b, of the
surviving nodes' encoded vectors (quantized, noised by distributed DP, weight appended).
So the batched engine need not run the key agreement, the sharing and the mask expansion:
it encodes each surviving node's update with the same quantizer, the same generator
(:func:`fedswarm.algorithms.privacy.distributed.node_rng`: the node's stochastic rounding,
then its noise share) and the same noise hook as the protocol's node, and adds the results
in Z_{2^b}. ``tests/test_batched_secagg.py`` holds it to the protocol
(:func:`fedswarm.algorithms.secagg.run_round`) bit for bit, dropouts included.

Dropouts (``secagg_dropout``): a node that vanishes before sending its masked input (at
``advertise``, ``share_keys`` or ``masked_input``) is out of the sum (the protocol recovers
its pairwise masks from its shares); one that vanishes at ``unmask`` is in it (its self-mask
is rebuilt from its neighbours' shares). The membership (who is pruned, when the round
fails) is the protocol server's, on the same neighbour graph. Not simulated: the protocol's
bytes and CPU.

No Flower here beyond what the batched round hands it: float vectors and node ids.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedswarm.algorithms.privacy.distributed import DistributedDP, clip_l2, node_rng
from fedswarm.algorithms.secagg.dropouts import DROP_STAGES, draw_dropouts
from fedswarm.algorithms.secagg import DecodedSum, NoiseHook, RoundReport, SecAggFailed, SecAggParams, SecAggServer

__all__ = ["SecureRound", "SecureSum", "secure_sum", "draw_dropouts", "DROP_STAGES"]


@dataclass(frozen=True)
class SecureSum:
    """The unmasked field sum (uint64 ``[d + 1]``), its decoding and the round's membership
    report (the protocol server's :class:`RoundReport`)."""

    total: np.ndarray
    decoded: DecodedSum
    report: RoundReport
    senders: frozenset[int] = frozenset()  # the nodes whose masked input is in the sum


class SecureRound:
    """One round's membership as the protocol's server decides it, stage by stage: built for
    the round's nodes (``node_ids``, sorted), the payload length ``dim``, the neighbour graph
    of ``graph_seed`` and the simulated dropouts ``drop`` (stage -> node ids).

    :meth:`trained` (the nodes that get the masked-input stage's message, so train) comes
    before local training, :meth:`senders` after it (``gone``: the nodes whose own code fails
    there, a diverged model); each raises :class:`SecAggFailed` where the protocol would.
    :meth:`total` adds the senders' encoded vectors in the field."""

    def __init__(self, node_ids: Sequence[int], dim: int, params: SecAggParams, *, graph_seed: int,
                 drop: Mapping[str, Collection[int]] | None = None):
        self.ids = [int(i) for i in node_ids]
        self.drop = {k: set(map(int, v)) for k, v in (drop or {}).items()}
        if unknown := set(self.drop) - set(DROP_STAGES):
            raise ValueError(f"secure_sum: unknown stage(s) {sorted(unknown)}; stages are {DROP_STAGES}")
        self.server = SecAggServer(self.ids, int(dim), params, graph_seed=graph_seed, round_id=b"batched")
        self.report: RoundReport = self.server.report
        self._shared: set[int] | None = None

    def _need(self, alive: set[int], stage: str, what: str) -> None:
        if len(alive) < self.server.threshold:
            raise SecAggFailed(f"{len(alive)} nodes {what}, fewer than the threshold {self.server.threshold}", stage)

    def trained(self) -> set[int]:
        """The nodes the server sends the masked-input stage (with the train message) to."""
        if self._shared is None:
            server, drop, report = self.server, self.drop, self.report
            advertised = set(self.ids) - drop.get("advertise", set())
            report.advertised = len(advertised)
            active = server._prune(advertised)
            self._need(active, "advertise", "advertised keys with enough neighbours")
            shared = server._prune(active - drop.get("share_keys", set()))
            report.shared = len(shared)
            self._need(shared, "share_keys", "shared their keys with enough neighbours")
            self._shared = shared
        return self._shared

    def senders(self, gone: Collection[int] = ()) -> set[int]:
        """The nodes whose masked input is in the unmasked sum (``gone``: more nodes that fail
        at the masked-input stage); raises where too few are left or a secret has too few
        shares back."""
        t, graph, shared = self.server.threshold, self.server.graph, self.trained()
        senders = shared - self.drop.get("masked_input", set()) - set(map(int, gone))
        self.report.masked, self.report.dropped_after_sharing = len(senders), len(shared - senders)
        self._need(senders, "masked_input", "sent a masked input")
        answered = senders - self.drop.get("unmask", set())
        for owner in sorted(shared):  # every secret the server must rebuild needs t shares back
            holders = (set(graph[owner]) | {owner}) & answered
            if len(holders) < t:
                what = "self-mask seed" if owner in senders else "mask key"
                raise SecAggFailed(f"node {owner}'s {what} has {len(holders)} shares back, fewer than the threshold "
                                   f"{t} ({len(answered)} of {len(senders)} survivors answered the unmask stage)",
                                   "unmask")
        self.report.recovered = len(shared - senders)
        return senders

    def total(self, rows: Mapping[int, np.ndarray], senders: Collection[int], *, seed: int, round_: int,
              weights: Mapping[int, int] | None = None, noise: NoiseHook | None = None,
              rngs: Mapping[int, np.random.Generator] | None = None,
              noise_rngs: Mapping[int, np.random.Generator] | None = None,
              dp: DistributedDP | None = None) -> SecureSum:
        """The senders' encoded vectors (``rows``: node -> float vector) added in the field, as
        the protocol's nodes encode them (:func:`secure_sum` says how)."""
        quantizer = self.server.quantizer
        total = np.zeros(self.server.dim + 1, dtype=np.uint64)
        if dp is not None:
            noise, weights = dp.noise_hook(), None
        for i in sorted(senders):
            rng = rngs[i] if rngs is not None else node_rng(seed, round_, i)
            w = 1 if weights is None else int(weights[i])
            v = rows[i] if dp is None else clip_l2(rows[i], dp.clip)
            total += quantizer.encode(v, rng, weight=w, noise=noise,  # wraps mod 2^64
                                      noise_rng=rng if noise_rngs is None else noise_rngs[i])
        total &= quantizer.mask
        return SecureSum(total, quantizer.decode_sum(total), self.report, frozenset(map(int, senders)))


def secure_sum(updates: np.ndarray, node_ids: Sequence[int], params: SecAggParams, *, seed: int, round_: int,
               graph_seed: int, weights: Sequence[int] | None = None, drop: Mapping[str, Collection[int]] | None = None,
               noise: NoiseHook | None = None, rngs: Mapping[int, np.random.Generator] | None = None,
               noise_rngs: Mapping[int, np.random.Generator] | None = None,
               dp: DistributedDP | None = None) -> SecureSum:
    """What SecAgg+ would unmask for ``updates`` (``[K, d]`` floats, row i node ``node_ids[i]``).

    The membership follows the protocol's server (:class:`SecAggServer`, built for its
    neighbour graph from ``graph_seed``, its threshold and its pruning of nodes with too few
    active neighbours); ``rngs``: each node's generator for its rounding (default
    :func:`node_rng` of ``seed``, ``round_`` and the node), ``noise_rngs`` for its noise
    (default: the same one, after the rounding). ``dp``: distributed DP as the nodes run it
    (each update clipped to ``dp.clip``, weight 1, ``dp``'s noise share; it replaces
    ``noise`` and ``weights``). Raises :class:`SecAggFailed` where the protocol would."""
    x = np.asarray(updates, dtype=np.float64)
    ids = [int(i) for i in node_ids]
    if x.ndim != 2 or x.shape[0] != len(ids):
        raise ValueError(f"secure_sum: updates must be [K, d] with K = {len(ids)} node ids, got {x.shape}")
    rnd = SecureRound(ids, x.shape[1], params, graph_seed=graph_seed, drop=drop)
    senders = rnd.senders()
    return rnd.total(dict(zip(ids, x)), senders, seed=seed, round_=round_,
                     weights=None if weights is None else dict(zip(ids, weights)), noise=noise, rngs=rngs,
                     noise_rngs=noise_rngs, dp=dp)
