"""One SecAgg+ round run in memory, every node's state machine driven in turn: the reference
the Flower halves and the batched engine's shortcut are held to, and the tests' driver.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedswarm.algorithms.secagg.client import SecAggClient
from fedswarm.algorithms.secagg.messages import STAGES
from fedswarm.algorithms.secagg.quantize import DecodedSum, NoiseHook
from fedswarm.algorithms.secagg.server import RoundReport, SecAggParams, SecAggServer

__all__ = ["RoundResult", "run_round"]


@dataclass(frozen=True)
class RoundResult:
    """The unmasked field sum, its decoding, each node's encoded input (to check against) and
    the server's report."""

    total: np.ndarray
    decoded: DecodedSum
    encoded: dict[int, np.ndarray]
    report: RoundReport


def run_round(updates: Mapping[int, np.ndarray], params: SecAggParams, *, weights: Mapping[int, int] | None = None,
              drop: Mapping[str, Collection[int]] | None = None, seed: int = 0,
              noise: NoiseHook | None = None, graph_seed: int | None = None,
              server: SecAggServer | None = None, clients: Sequence[SecAggClient] | None = None,
              rngs: Mapping[int, np.random.Generator] | None = None) -> RoundResult:
    """Run one round over the nodes of ``updates`` (node id -> float vector). ``drop`` maps a
    stage name (:data:`STAGES`) to the nodes that vanish instead of answering it. Raises
    :class:`SecAggFailed` when the round cannot finish. ``rngs``: each node's own generator for
    its rounding and noise (default: one shared generator from ``seed``)."""
    drop = {k: set(v) for k, v in (drop or {}).items()}
    unknown = set(drop) - set(STAGES)
    if unknown:
        raise ValueError(f"run_round: unknown stage(s) {sorted(unknown)}; stages are {STAGES}")
    ids = sorted(int(i) for i in updates)
    dims = {np.asarray(v).size for v in updates.values()}
    if len(dims) != 1:
        raise ValueError(f"run_round: updates of different sizes {sorted(dims)}")
    srv = server or SecAggServer(ids, dims.pop(), params, graph_seed=graph_seed)
    nodes = {c.node_id: c for c in clients} if clients else {i: SecAggClient(i) for i in ids}
    rng = np.random.default_rng(seed)

    def answer(stage: str, requests: Mapping[int, object], fn):
        return {i: fn(nodes[i], r) for i, r in requests.items() if i not in drop.get(stage, ())}

    encoded: dict[int, np.ndarray] = {}

    def masked(c: SecAggClient, req):
        w = 1 if weights is None else int(weights[c.node_id])
        own = rng if rngs is None else rngs[c.node_id]
        encoded[c.node_id] = c.quantizer().encode(updates[c.node_id], own, weight=w, noise=noise, noise_rng=own)
        return c.masked_input(req, encoded[c.node_id])

    keys = answer("advertise", srv.setup(), lambda c, r: c.advertise(r))
    shares = answer("share_keys", srv.collect_keys(keys), lambda c, r: c.share_keys(r))
    inputs = answer("masked_input", srv.collect_shares(shares), masked)
    unmask = answer("unmask", srv.collect_masked(inputs), lambda c, r: c.unmask(r))
    total = srv.collect_unmask(unmask)
    survivors = {i: encoded[i] for i in inputs}
    return RoundResult(total, srv.quantizer.decode_sum(total), survivors, srv.report)
