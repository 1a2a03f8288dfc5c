"""Distributed DP through the Flower halves (secagg_mod on the nodes, SecAggGrid on the
server): the model a secure round hands the strategy equals, bit for bit, the batched
engine's direct sum (sim/batched_secagg.py) on the same seeds; a fedswarm run with --secagg
--dp records epsilon every round, equal to the distributed accountant's for the nodes whose
noise reached the sum; what distributed DP cannot serve is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

import fedswarm.server.secagg as server_secagg
from fedswarm.algorithms.privacy.distributed import DistributedAccountant, node_rng, secagg_with_dp
from fedswarm.algorithms.privacy.dp_spec import parse_dp
from fedswarm.algorithms.secagg import SecAggParams, SecAggRefused, Setup
from fedswarm.client.secagg_dp import node_dp
from fedswarm.client.secagg_mod import rounding_rng, secagg_mod
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.server.secagg_dp import SecAggDP
from fedswarm.sim.batched_secagg import secure_sum
from fedswarm.sim.inprocess import InProcessGrid

N, D, SEED, ROUND = 6, 300, 7, 4
DP = "noise_multiplier=0.7,clip=0.5,mechanism=skellam"


def _update(node: int) -> np.ndarray:
    return np.random.default_rng(node).normal(0.0, 0.2, D)


def _app() -> ClientApp:
    app = ClientApp(mods=[secagg_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        old = msg.content["arrays"]["w"].numpy().astype(np.float64)
        new = (old + _update(int(context.node_id))).astype(np.float32)
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(new)}),
                                   "metrics": MetricRecord({"num-examples": 3})}), reply_to=msg)

    return app


def test_secure_round_with_dp_equals_the_batched_sum_bit_for_bit(monkeypatch):
    servers = []

    class Recording(server_secagg.SecAggServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(server_secagg, "SecAggServer", Recording)
    grid = InProcessGrid(_app(), N, run_config={"dp": DP, "seed": SEED})
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 0
    dp = SecAggDP(parse_dp(DP), SEED)
    outer = server_secagg.SecAggGrid(grid, SecAggParams(threshold=0.6, clip=0.3, bits=32), seed=SEED, dp=dp)
    model = np.linspace(-1, 1, D).astype(np.float32)
    msgs = [grid.create_message(RecordDict({"arrays": ArrayRecord({"w": Array(model)}),
                                            "config": ConfigRecord({"server-round": ROUND})}), "train", i, "g")
            for i in grid.get_node_ids()]
    (reply,) = outer.send_and_receive(msgs)
    got = reply.content["arrays"]["w"].numpy()
    assert int(reply.content["metrics"]["num-examples"]) == N  # weight 1 each under DP, not 3

    srv = servers[-1]
    ids = sorted(grid.get_node_ids())
    # what each node masks: its float32 model back as float64, less the float32 model it was sent
    seen = np.stack([(model.astype(np.float64) + _update(i)).astype(np.float32).astype(np.float64)
                     - model.astype(np.float64) for i in ids])
    direct = secure_sum(seen, ids, srv.params, seed=SEED, round_=ROUND,
                        graph_seed=srv.graph_seed, rngs={i: rounding_rng(srv.round_id, i) for i in ids},
                        noise_rngs={i: node_rng(SEED, ROUND, i) for i in ids}, dp=dp._round)
    expect = (model.astype(np.float64) + direct.decoded.mean).astype(np.float32)
    assert np.array_equal(got, expect)
    # the noise is in it: far from the noiseless mean of the clipped updates
    assert np.abs(got - model - np.mean([_update(i) * min(1, 0.5 / np.linalg.norm(_update(i))) for i in ids],
                                        axis=0)).mean() > 0.01
    # and the round was accounted with the 6 nodes' noise
    oracle = DistributedAccountant(1e-5)
    oracle.step(dp._round.round_rdp(N))
    assert dp.accountant.epsilon() == pytest.approx(oracle.epsilon())


def test_a_setup_without_room_for_the_nodes_noise_is_refused():
    context = Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={"dp": DP, "seed": 0})
    good, _ = secagg_with_dp(SecAggParams(clip=0.3, bits=32), 4, 50, mechanism="skellam", noise_multiplier=0.7,
                             dp_clip=0.5)
    setup = Setup(round_id=b"r" * 16, node_ids=(1, 2, 3, 4), degree=3, threshold=3, graph_seed=1, dim=50, clip=0.3,
                  bits=32, weight_max=1, noise_bound=good.noise_bound)
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 2})}), dst_node_id=3, message_type="train")
    assert node_dp(context, setup, msg) is not None
    from dataclasses import replace

    with pytest.raises(SecAggRefused, match="noise_bound"):
        node_dp(context, replace(setup, noise_bound=good.noise_bound // 2), msg)


def test_a_run_with_secagg_and_dp_records_epsilon_every_round(tmp_path):
    from fedswarm.bench.arms import run_arm, scratch_store

    cfg = RunConfig(task="digits-mlp", strategy="fedavg", clients=4, rounds=2, seed=0, local_epochs=1, secagg=True,
                    dp="noise_multiplier=1.0,clip=1.0")
    with scratch_store() as store:
        arm = run_arm(cfg, store, name="secagg-dp")
    eps = [r.get("epsilon") for r in arm.rounds if r.get("epsilon") is not None]
    assert len(eps) == 2 and eps[0] < eps[1]
    assert arm.summary["epsilon"] == eps[-1] and arm.summary["delta"] == 1e-5


@pytest.mark.parametrize("dp, why", [("noise_multiplier=1,adaptive=true", "adaptive clipping"),
                                     ("target_epsilon=3", "needs noise_multiplier")])
def test_what_distributed_dp_cannot_serve_is_refused(dp, why):
    from fedswarm.sim.engines import check_run

    with pytest.raises(ConfigError, match=why) as err:
        check_run(RunConfig(strategy="fedavg", clients=4, rounds=1, secagg=True, dp=dp))
    assert "\n" not in str(err.value)
