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
"""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedswarm.client.evaluate import TrainClock, evaluate_on_node
from fedswarm.client.persist import answer_resume, save_after_train
from fedswarm.client.secagg_mod import secagg_mod
from fedswarm.local import local_fit, node_data
from fedswarm.protocol import RESUME_ACTION
from fedswarm.strategies import registry
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["app"]

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
