"""fedswarm's Flower ClientApp: one app serves every registered algorithm.

Flower's plain ``train`` message runs local SGD and returns the new model (FedAvg).
A message of type ``train.<name>`` is dispatched to the client update that strategy
``<name>`` registered (compressed deltas with error feedback, gossip steps, ...).

The node's partition comes from its node config (``partition-id``, ``num-partitions``),
set by the simulation engines or by ``fedswarm client``, or its own dataset (``data-path``,
``label-column``, ``val-fraction``: ``fedswarm client --data``); the run config from Flower's
``run_config``, overridden by the keys the server sends in each message's ``config``.

After every train reply the node's ``Context.state`` is saved to its own disk when the run and
the node keep state there, and a resumed server's ``query.fedswarm_resume`` message restores
it (:mod:`fedswarm.client.persist`). Under secure aggregation (``secagg = true``) the
``secagg_mod`` runs the protocol's stages around these handlers (:mod:`fedswarm.client.secagg_mod`).

Test only: a node config ``test-step-delay-s = S`` makes plain training wait ``S`` seconds per
local step (a straggler in a loopback deployment test); nothing else reads it.
"""

from __future__ import annotations

import time

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedswarm.client.evaluate import TrainClock, answer_telemetry, evaluate_on_node
from fedswarm.client.persist import answer_resume, save_after_train
from fedswarm.client.secagg_mod import secagg_mod
from fedswarm.local import local_fit, node_data
from fedswarm.protocol import RESUME_ACTION, TELEMETRY_ACTION
from fedswarm.strategies import registry
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["app", "TEST_STEP_DELAY_KEY"]

#: Node config key, for tests only: seconds the node waits per local step after plain training,
#: a slow device on a fast machine (a real deployment's straggler). Never set it in production.
TEST_STEP_DELAY_KEY = "test-step-delay-s"

# secagg_mod answers secure-aggregation stage messages (a run with secagg = true) and passes others through.
app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Plain local training: the reply carries the new model and the example count (the
    node's partition id travels in its ``node`` record, not among the metrics Flower averages)."""
    clock = TrainClock()
    fit = local_fit(msg, context)
    metrics = {}
    if node_data(context) is not None:  # its own data: examples it could not read (an ImageFolder's bad images)
        metrics["skipped_examples"] = fit.trainer.skipped_examples
    content = fit.reply(RecordDict({"arrays": vector_to_arrayrecord(fit.result.flat)}), **metrics)
    content["node"]["partition-id"] = int(context.node_config.get("partition-id", -1))
    delay = float(context.node_config.get(TEST_STEP_DELAY_KEY, 0) or 0)
    if delay > 0:  # test only: a node made slow (tests/test_fedbuff_deployment.py)
        time.sleep(delay * fit.result.steps)
    save_after_train(msg, context)
    return Message(clock.attach(content), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation: the global model (or, decentralized, the node's own) scored on
    this node's validation split (:mod:`fedswarm.client.evaluate`)."""
    return Message(evaluate_on_node(msg, context), reply_to=msg)


@app.query(RESUME_ACTION)
def resume(msg: Message, context: Context) -> Message:
    """A resumed server asks: restore this node's state of the checkpoint's round."""
    return answer_resume(msg, context)


@app.query(TELEMETRY_ACTION)
def telemetry(msg: Message, context: Context) -> Message:
    """The server's eligibility probe (``--eligible``): this node's telemetry, no training."""
    return Message(answer_telemetry(msg, context), reply_to=msg)


def _dispatch(name: str):
    def handler(msg: Message, context: Context) -> Message:
        clock = TrainClock()
        content = registry.get(name).client_update(msg, context)  # the entry registered under the name now
        save_after_train(msg, context)  # the state this reply leaves, on the node's disk
        return Message(clock.attach(content), reply_to=msg)

    handler.__name__ = f"train_{name}"
    return handler


_SERVED: set[str] = set()  # message types train.<name> this app has a handler for


def _serve(entry: registry.StrategyEntry) -> None:
    """Serve ``entry``'s train messages: every registered strategy with a client update of its
    own, the built-in ones now and any registered later (registry.on_register)."""
    if entry.client_update is not None and entry.name not in _SERVED:
        _SERVED.add(entry.name)
        app.train(entry.name)(_dispatch(entry.name))


for _entry in registry.entries():
    _serve(_entry)
registry.on_register(_serve)
