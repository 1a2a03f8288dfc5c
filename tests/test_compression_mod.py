"""A Flower user's own ClientApp (tests/flower_user_app.py: their model, their train
function, no fedswarm task) takes part in fedswarm's compressed strategies through
``fedswarm.client.compression_mod``; the strategies are built from the initial ArrayRecord
alone. On Flower's Simulation Engine (Ray) the uplink bytes match the codec's formula; in
process, every compressed strategy runs, ``codec=none`` equals FedAvg computed by hand, and
the error-feedback residual lives in ``context.state``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

import fedswarm.strategies
from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.algorithms.robust.aggregators import make_rule
from fedswarm.server.metered_grid import MeteredGrid
from fedswarm.sim.flower_engine import start_ray
from fedswarm.sim.inprocess import InProcessGrid
from fedswarm.strategies.strategy_utils import layout_of_arrays
from fedswarm.wire import arrayrecord_to_vector

from tests.flower_user_app import SAMPLES, accuracy, app, make_model, teacher_data, train

NODES = 3
HEADER = 800  # framing of one reply: metadata, record names, metrics, node record


def _initial() -> ArrayRecord:
    return ArrayRecord(make_model().state_dict())


class Rounds:
    """``evaluate_fn``: per round, the uplink bytes of each node and the accuracy."""

    def __init__(self, grid: MeteredGrid):
        self.grid, self.up, self.acc, self.errors = grid, [], [], []

    def __call__(self, rnd: int, arrays: ArrayRecord):
        traffic = self.grid.take()
        self.errors += [m.error.reason for m in traffic.replies if m.has_error()]
        if rnd > 0:
            self.up.append(dict(traffic.node_up))
        self.acc.append(accuracy(arrays))
        return None


# -- on Flower's Simulation Engine, exactly the README's shape ------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_user_app_on_flower_simulation_engine_sends_the_codecs_bytes():
    from flwr.simulation import run_simulation

    seen: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        metered = MeteredGrid(grid)
        rounds = Rounds(metered)
        # Every node in every round: wait for all of them to register (Flower samples whoever is connected).
        strategy = fedswarm.strategies.CompressedFedAvg(codec="topk", codec_params={"ratio": 0.01},
                                                        min_available_nodes=NODES, min_train_nodes=NODES)
        result = strategy.start(grid=metered, initial_arrays=_initial(), num_rounds=3, evaluate_fn=rounds)
        seen.update(rounds=rounds, result=result, strategy=strategy)

    init_args = {"num_cpus": 2, "log_to_driver": False, "include_dashboard": False}
    start_ray(init_args)  # Ray started as Flower would, but retried if its node misses Ray's 30 s (loaded machine)
    run_simulation(server_app=server_app, client_app=app, num_supernodes=NODES,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init_args})
    rounds = seen["rounds"]
    assert not rounds.errors, rounds.errors[0]
    layout = layout_of_arrays(_initial())
    wire = make_codec("topk", ratio=0.01).wire_bytes(layout)
    assert len(rounds.up) == 3
    for per_node in rounds.up:
        assert len(per_node) == NODES
        for up in per_node.values():
            assert wire <= up <= 1.05 * wire + HEADER, (up, wire)
            assert up < layout.d  # a quarter of the dense model's 4d bytes, at most
    final = arrayrecord_to_vector(seen["result"].arrays)
    assert not torch.equal(final, arrayrecord_to_vector(_initial()))  # the model moved


# -- in process: every compressed strategy, an oracle, the residual -------------------------

STRATEGIES = {
    "compressed_fedavg": lambda: fedswarm.strategies.CompressedFedAvg(codec="topk", codec_params={"ratio": 0.05}),
    "onebit": lambda: fedswarm.strategies.OneBitSGD(),
    "gtopk": lambda: fedswarm.strategies.GlobalTopK(density=0.05),
    "sketched_sgd": lambda: fedswarm.strategies.SketchedSGD(density=0.05, rows=3, cols=60),
    "fetchsgd": lambda: fedswarm.strategies.FetchSGD(density=0.05, rows=3, cols=60),
    "gs_sgd": lambda: fedswarm.strategies.GlobalSketchSGD(density=0.05, rows=3, cols=60),
    "signum": lambda: fedswarm.strategies.Signum(),
    "median": lambda: fedswarm.strategies.RobustAggregation(rule=make_rule("median", f=1)),
}


def _run(strategy, rounds: int = 3, nodes: int = NODES):
    grid = InProcessGrid(app, nodes)
    metered = MeteredGrid(grid)
    log = Rounds(metered)
    result = strategy.start(grid=metered, initial_arrays=_initial(), num_rounds=rounds, evaluate_fn=log)
    return grid, log, result


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_compressed_strategy_runs_the_users_app(name):
    torch.set_num_threads(1)
    strategy = STRATEGIES[name]()
    assert strategy.layout is None and strategy.message_type == "train"
    _, log, result = _run(strategy)
    assert not log.errors, log.errors[0]
    assert not strategy.notes.rejections
    assert strategy.layout == layout_of_arrays(_initial())
    assert log.acc[-1] > log.acc[0], log.acc  # it learns the teacher
    if strategy.codec.name != "none":  # the robust rules send dense updates unless given a codec
        dense = 4 * strategy.layout.d
        assert all(up < dense for per_node in log.up for up in per_node.values())


def _user_delta(x0: ArrayRecord, partition: int) -> torch.Tensor:
    """What the user's train function makes of ``x0`` on ``partition``, minus ``x0``."""
    ctx = Context(run_id=1, node_id=partition + 1, node_config={"partition-id": partition}, state=RecordDict(),
                  run_config={})
    msg = Message(RecordDict({"arrays": x0}), dst_node_id=partition + 1, message_type="train")
    reply = train(msg, ctx)
    return arrayrecord_to_vector(reply.content["arrays"]) - arrayrecord_to_vector(x0)


def test_codec_none_through_the_mod_is_fedavg_by_hand():
    strategy = fedswarm.strategies.CompressedFedAvg(codec="none")
    _, log, result = _run(strategy, rounds=1)
    x0 = _initial()
    oracle = arrayrecord_to_vector(x0) + torch.stack([_user_delta(x0, p) for p in range(NODES)]).mean(dim=0)
    torch.testing.assert_close(arrayrecord_to_vector(result.arrays), oracle, rtol=0, atol=1e-6)
    names = [k for k in result.arrays.keys()]
    assert names == list(x0.keys())  # the user gets their own arrays back
    for key in names:
        assert result.arrays[key].shape == x0[key].shape


def test_error_feedback_residual_lives_in_context_state():
    strategy = fedswarm.strategies.CompressedFedAvg(codec="topk", codec_params={"ratio": 0.05})
    grid, _, result = _run(strategy, rounds=1)
    x0 = _initial()
    layout = layout_of_arrays(x0)
    codec = make_codec("topk", ratio=0.05)
    for p in range(NODES):
        delta = _user_delta(x0, p)
        state = grid.contexts[p + 1].state
        keys = [k for k in state.array_records if k.endswith("residual")]
        assert len(keys) == 1, list(state.array_records)
        residual = arrayrecord_to_vector(state.array_records[keys[0]])
        sent = codec.decode(codec.encode(delta[None], layout), layout)[0]
        # nothing lost: what was sent plus what is held back is the user's whole change
        torch.testing.assert_close(sent + residual, delta, rtol=0, atol=1e-6)
        assert float(residual.abs().max()) > 0  # top-5% held most of it back


def test_plain_messages_pass_through_and_bad_replies_are_named():
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    plain = Message(RecordDict({"arrays": _initial()}), dst_node_id=1, message_type="train")
    reply = app(plain, ctx)  # no 'compress' record: Flower's own FedAvg message, untouched
    assert reply.content["metrics"]["num-examples"] == SAMPLES
    x, y = teacher_data(0)
    assert x.shape == (SAMPLES, 16) and int(y.max()) < 3

    from fedswarm.client.mod import compression_mod

    strategy = fedswarm.strategies.CompressedFedAvg(codec="topk")
    grid = InProcessGrid(app, 1)
    msgs = list(strategy.configure_train(1, _initial(), ConfigRecord(), grid))

    def wrong_arrays(msg, context):
        bad = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
        return Message(RecordDict({"arrays": bad, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    with pytest.raises(Exception, match="expected the model's"):
        compression_mod(msgs[0], grid.contexts[1], wrong_arrays)
    coded = Message(RecordDict({"compress": ConfigRecord({"strategy": "draco"})}), dst_node_id=1,
                    message_type="train")
    with pytest.raises(ValueError, match="cannot run strategy 'draco'"):
        compression_mod(coded, grid.contexts[1], wrong_arrays)
