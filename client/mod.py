"""``compression_mod``: a Flower Mod that lets a user's own ClientApp take part in any of
fedswarm's compressed federated strategies.

A Flower user keeps their model and their ordinary ``@app.train()`` function (it receives
``arrays``, trains, replies with the new ``arrays`` and a ``num-examples`` metric) and adds
the mod, as they would add Flower's own DP or SecAgg mods::

    app = ClientApp(mods=[fedswarm.client.compression_mod])

    strategy = fedswarm.strategies.CompressedFedAvg(codec="topk", codec_params={"ratio": 0.01})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(my_model.state_dict()), num_rounds=5)

A strategy built without a layout reads it from ``initial_arrays`` and sends Flower's plain
``train`` messages whose ``compress`` record names the strategy, its seed and the layout.
On such a message the mod runs that strategy's own client half (the same function
fedswarm's ClientApp runs, so the algorithm is written once): it brings the node's replica
of the model up to date from what the server sent (a full model, changed coordinates or
compressed updates), hands the user's function the model as plain arrays shaped like the
initial ones, and turns the model the function returns into the strategy's payload (the
change since the public model, compressed, with the error-feedback residual or momentum
kept in ``context.state``). Messages without a ``compress`` record (Flower's own
strategies, evaluation) pass through untouched.

Strategies whose client half needs fedswarm's data partitions (the coded schemes, ``draco``
and ``solon``) and fedswarm's decentralized and edge strategies are refused with a clear
error.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedswarm.strategies import registry
from fedswarm.strategies.federated.compressed_base import KNOBS, user_training

__all__ = ["compression_mod"]

#: Registered strategies whose client half cannot run a user's train function.
UNSUPPORTED = {"draco": "its workers compute coded gradients on fedswarm's data partitions",
               "solon": "its workers compute coded gradients on fedswarm's data partitions"}


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run the fedswarm strategy named in the message's ``compress`` record around the
    user's train function (see the module docstring); pass anything else through."""
    if msg.metadata.message_type != "train" or not msg.has_content() or KNOBS not in msg.content.config_records:
        return call_next(msg, context)
    name = str(msg.content.config_records[KNOBS].get("strategy", ""))
    if name in UNSUPPORTED:
        raise ValueError(f"compression_mod cannot run strategy '{name}': {UNSUPPORTED[name]}")
    entry = registry.get(name)
    if entry.client_update is None or entry.kind != "federated":
        raise ValueError(f"compression_mod runs fedswarm's compressed federated strategies; '{name}' is not one")
    with user_training(call_next):
        content = entry.client_update(msg, context)
    return Message(content, reply_to=msg)
