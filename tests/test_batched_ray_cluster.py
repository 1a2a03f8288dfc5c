"""--engine batched --ray-address on a real Ray cluster on loopback: a head and a second node
(``ray start --head``, ``ray start --address``), two workers spread over them, and the same
models as one process for fedavg, compressed_fedavg (top-k with error feedback), fetchsgd and
gtopk, and the same federated evaluation. One cluster and one pool of actors serve the runs;
the cluster is stopped at the end."""

import pytest
import torch

from fedswarm.config import RunConfig
from tests.ray_helpers import ray_cluster
from tests.test_batched import _models

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = dict(clients=10, rounds=3, local_steps=2, fraction=0.6, lr=0.1)
CASES = {
    "fedavg": dict(strategy="fedavg"),
    "topk-ef": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1"}),
    "fetchsgd": dict(strategy="fetchsgd"),
    # the server's select records (Flower ConfigRecords) cross to the actors, top-k state stays on them
    "gtopk": dict(strategy="gtopk", rounds=4),
}


@pytest.fixture(scope="module")
def cluster_pool():
    """Two Ray nodes of our own and a pool of two actors on them, for every run of the module."""
    from fedswarm.sim.batched_ray import RayPool

    with ray_cluster(nodes=2) as (address, _):
        pool = RayPool(RunConfig(engine="batched", ray_address=address), 2)
        try:
            yield address, pool
        finally:
            pool.close()


class _Kept:
    """The module's pool as a run gets it: its run does not close it."""

    def __init__(self, pool):
        self.pool = pool

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def close(self):
        pass


@pytest.mark.parametrize("case", list(CASES))
def test_ray_sharded_batched_gives_the_single_process_models(case, cluster_pool, tmp_path, monkeypatch):
    import fedswarm.sim.batched_ray as batched_ray

    address, pool = cluster_pool
    assert len(set(pool.nodes)) == 2, f"the two actors run on one node: {pool.nodes}"
    monkeypatch.setattr(batched_ray, "RayPool", lambda cfg, workers, **kw: _Kept(pool))
    kw = {**BASE, **CASES[case]}
    for sub in ("one", "ray"):
        (tmp_path / sub).mkdir()
    ref, ref_res = _models(RunConfig(engine="batched", **kw), tmp_path / "one", monkeypatch)
    got, got_res = _models(RunConfig(engine="batched", ray_address=address, workers=2, **kw), tmp_path / "ray",
                           monkeypatch)
    assert len(got) == len(ref) == kw["rounds"] + 1
    for rnd, (a, b) in enumerate(zip(ref, got)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), f"round {rnd}: max diff {(a - b).abs().max():.3g}"
    assert not torch.equal(ref[0], ref[-1])
    for r_ref, r_got in zip(ref_res["rounds"][1:], got_res["rounds"][1:]):
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        assert r_got["shard_bytes_out"] > 0 and r_got["shard_wait_s"] >= r_got["shard_compute_s"] > 0
        # federated evaluation: each actor scored the clients it owns
        assert r_got["fed_loss"] == pytest.approx(r_ref["fed_loss"], abs=1e-6) and r_got["eval_shard_bytes_in"] > 0
