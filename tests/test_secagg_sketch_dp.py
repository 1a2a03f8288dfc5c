"""Sketched-SGD under --secagg with --dp (in-process): its round's two secure sums (the tables,
then the exact values at the candidates) each carry their own noise share, drawn from an
independent stream, and each is a release of its own in the accounting (two a round, composed in
the epsilon the round's row records)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedswarm.algorithms.privacy.distributed import RDP_ORDERS, integer_sensitivity, secagg_with_dp
from fedswarm.algorithms.secagg import SecAggParams, SecAggServer
from fedswarm.client.secagg_dp import node_dp
from fedswarm.strategies.secagg_payload import SUM_KEY
from tests import test_secagg_codecs as codecs
from tests import test_secagg_flower as flower

DP = "noise_multiplier=0.7,clip=1.0"
RUN = dict(strategy="sketched_sgd", clients=4, seed=3, rounds=1, secagg=True, dp=DP, params={"density": 0.05})
capture = codecs.capture  # keeps the train rounds' messages below SecAggGrid


def _setup(nodes: int, dim: int):
    params, _ = secagg_with_dp(SecAggParams(), nodes, dim, mechanism="dgauss", noise_multiplier=0.7, dp_clip=1.0)
    return SecAggServer(list(range(1, nodes + 1)), dim, params).setup()[1]


def _noise(seed: int, setup, msg: Message) -> np.ndarray:
    """What node 1's distributed DP adds to a vector of ``setup.dim`` values for ``msg``."""
    ctx = Context(run_id=0, node_id=1, node_config={}, state=RecordDict(), run_config={"dp": DP, "seed": seed})
    dp = node_dp(ctx, setup, msg)
    return dp.noise(setup.dim, dp.rng)


def test_the_two_sums_of_a_round_draw_independent_noise():
    """The first sum's message (the train message's config) and the second's (Sketched-SGD's
    exact-values ask, SUM_KEY 1) on one node in one round: over 300 seeds, the two noise shares
    are uncorrelated, and so are their magnitudes, while the first sum's share is reproducible
    from its seed. Keyed by the round alone (the code before), the magnitudes correlate 0.50."""
    tables, values = _setup(4, 40), _setup(4, 12)
    first = Message(RecordDict({"config": ConfigRecord({"server-round": 2})}), dst_node_id=1, message_type="train")
    second = Message(RecordDict({"compress": ConfigRecord({"round": 2, "phase": 2, "server-round": 2, SUM_KEY: 1})}),
                     dst_node_id=1, message_type="train")
    a, b = [], []
    for seed in range(300):
        n1, n2 = _noise(seed, tables, first), _noise(seed, values, second)
        assert np.array_equal(n1, _noise(seed, tables, first))  # a seeded stream: the same draws again
        a.append(n1[:values.dim])
        b.append(n2)
    a, b = np.concatenate(a).astype(np.float64), np.concatenate(b).astype(np.float64)
    assert a.std() > 1e6 and b.std() > 1e6  # real noise, at the run's scale
    # 3600 pairs: |corr| of independent draws ~ 0.017. The magnitudes too: from one generator, vectors of
    # other lengths share their magnitudes' draws (the sampler draws them first) and differ in sign only
    for x, y in ((a, b), (np.abs(a), np.abs(b))):
        corr = float(np.corrcoef(x, y)[0, 1])
        assert abs(corr) < 0.05, corr
    bad = Message(RecordDict({"compress": ConfigRecord({SUM_KEY: -1})}), dst_node_id=1, message_type="train")
    with pytest.raises(Exception, match="secure sum's index"):
        _noise(0, values, bad)


def _gaussian_epsilon(multipliers: list[float], delta: float) -> float:
    """dp-accounting's own epsilon for Gaussian mechanisms of these noise multipliers, composed."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders=[float(o) for o in RDP_ORDERS])
    acc.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in multipliers]))
    return acc.get_epsilon(delta)


def test_sketched_sgd_secagg_dp_records_both_sums_and_their_composed_epsilon(store, capture):
    cfg, rid, status, grid, _ = flower._run(store, **RUN)
    assert status == "finished"
    rows = flower._rows(store, rid)[1:]
    assert len(rows) == 1 and all("secagg_failed" not in r for r in rows)
    # every round: both sums' figures, each with its own stages' bytes (the values' masked inputs are smaller)
    for r in rows:
        for key in ("secagg", "secagg_values"):
            assert r[key]["participants"] == cfg.clients and r[key]["nodes"]["unmask"] == cfg.clients
            assert set(r[key]["bytes"]) == {"advertise", "share_keys", "masked_input", "unmask"}
        assert r["secagg_values"]["bytes"]["masked_input"]["up"] < r["secagg"]["bytes"]["masked_input"]["up"]
        assert r["bytes_up"] == sum(s["up"] for k in ("secagg", "secagg_values") for s in r[k]["bytes"].values())
    # the exact values' masked-input messages ask for the second sum (the nodes' second noise stream)
    asks = [m.content.config_records["compress"] for m in grid.sent if "candidates" in m.content.array_records]
    assert len(asks) == cfg.clients and all(int(a[SUM_KEY]) == 1 for a in asks)
    # The oracle: dp-accounting's Gaussian mechanism, one event per secure sum (two a round). At this field's
    # scale (s ~ 5e7 integer units per unit) the distributed discrete Gaussian of each sum is the Gaussian
    # with multiplier z / (1 + sqrt(d) / (s C)) (its integer sensitivity s C + sqrt(d) over the noise z C s).
    z = 0.7
    dims = _sum_dims(grid)
    multipliers = []
    for d in dims:
        params, dp = secagg_with_dp(SecAggParams(), cfg.clients, d, mechanism="dgauss", noise_multiplier=z,
                                    dp_clip=1.0)
        l2, _ = integer_sensitivity(1.0, dp.scale, d)
        multipliers.append(z * dp.scale / l2)
    for rnd, r in enumerate(rows, start=1):
        want = _gaussian_epsilon(multipliers * rnd, 1e-5)
        assert r["epsilon"] == pytest.approx(want, rel=1e-4), (rnd, r["epsilon"], want)
    one_release = _gaussian_epsilon(multipliers[:1], 1e-5)
    assert rows[0]["epsilon"] > 1.2 * one_release  # the second sum is counted, not only the tables


def _sum_dims(grid) -> list[int]:
    """The two sums' vector lengths, from their advertise requests (the first round's)."""
    from fedswarm.strategies.secagg_records import RECORD, decode_request

    dims = []
    for m in grid.sent:
        rec = m.content.config_records.get(RECORD)
        if rec is None:
            continue
        req = decode_request(rec)
        if getattr(req, "stage", None) == 0 and req.dim not in dims:
            dims.append(int(req.dim))
    assert len(dims) == 2, dims
    return dims
