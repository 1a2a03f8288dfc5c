"""``secagg_mod``: a Flower Mod that runs a node's half of SecAgg+ (fedswarm's own protocol,
:mod:`fedswarm.algorithms.secagg`) around a ClientApp's train function.

A Flower user adds it to their own ClientApp, as they would add Flower's mods::

    app = ClientApp(mods=[fedswarm.client.secagg_mod])

and fedswarm's ClientApp carries it already. Messages without a ``secagg`` record pass
through untouched. On a secagg stage message (:mod:`fedswarm.strategies.secagg_records`):

- ``advertise``, ``share_keys``, ``unmask``: the node's state machine answers; the train
  function is not called;
- ``masked_input``: the message, less its ``secagg`` record, goes to the train function
  (an ordinary Flower ``train`` message with the global model in ``arrays``); its update (the
  returned ``arrays`` minus the ones received, weighted by its ``num-examples`` metric) is
  quantized, masked and sent back instead of the plain reply. Where the round's vector is one
  value longer than the update, the server asks for the train loss: the node appends its
  ``train_loss`` metric (clipped, :func:`~fedswarm.algorithms.secagg.quantize.with_loss`), so the
  server learns the survivors' weighted mean loss. Nothing else of that reply (its metrics, own
  loss, example count) leaves the node: the server learns sums only.

The protocol state lives in ``context.state`` (record ``secagg.state``) between the stages,
kept out of it while the train function runs (fedswarm saves ``context.state`` to the node's
disk after training). A message that breaks the protocol (replayed, out of order, asking
both shares of one neighbour) raises :class:`~fedswarm.algorithms.secagg.SecAggRefused`:
the node answers with an error and reveals nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedswarm.algorithms.secagg import SecAggClient, SecAggRefused
from fedswarm.client.secagg_dp import node_dp
from fedswarm.algorithms.secagg.messages import ADVERTISE, MASKED_INPUT, SHARE_KEYS, UNMASK
from fedswarm.payload import PayloadError
from fedswarm.algorithms.secagg.quantize import with_loss
from fedswarm.strategies.secagg_payload import SPEC_RECORD, payload_of, reply_loss
from fedswarm.strategies.secagg_records import (RECORD, STATE_RECORD, decode_request, is_secagg, keys_to,
                                                masked_to, shares_to, state_dump, state_load, unmask_to)
from fedswarm.wire import arrayrecord_to_vector

__all__ = ["secagg_mod", "update_of"]


def rounding_rng(round_id: bytes, node_id: int) -> np.random.Generator:
    """The stochastic rounding's generator, seeded by the round and the node: the same run
    quantizes the same way (the masks themselves are fresh randomness every time)."""
    digest = hashlib.sha256(round_id + int(node_id).to_bytes(8, "big")).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "big"))


def update_of(sent: Message, reply: Message) -> tuple[np.ndarray, int]:
    """The node's update (its new model minus the one it was sent, float64) and its weight
    (the reply's ``num-examples``)."""
    if reply.has_error():
        raise RuntimeError(f"secagg: the train function failed: {reply.error.reason}")
    content = reply.content
    if "arrays" not in content.array_records or "arrays" not in sent.content.array_records:
        raise ValueError("secagg_mod: the train message and its reply must carry the model as 'arrays'")
    try:
        new = arrayrecord_to_vector(content.array_records["arrays"]).numpy()  # float32: widened once, below
        old = arrayrecord_to_vector(sent.content.array_records["arrays"]).numpy()
    except PayloadError as exc:
        raise ValueError(f"secagg_mod: the train reply's model is malformed: {exc}") from None
    if new.shape != old.shape:
        raise ValueError(f"secagg_mod: the train reply's model has {new.size} values, the sent one {old.size}")
    metrics = next(iter(content.metric_records.values()), None)
    if metrics is None or "num-examples" not in metrics:
        raise ValueError("secagg_mod: the train reply needs a 'num-examples' metric (the node's weight)")
    return np.subtract(new, old, dtype=np.float64), int(metrics["num-examples"])


def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run the SecAgg+ stage a message carries (see the module docstring); pass others through."""
    if not msg.has_content() or not is_secagg(msg.content):
        return call_next(msg, context)
    req = decode_request(msg.content.config_records[RECORD])
    node = SecAggClient(context.node_id, state_load(context.state.config_records.get(STATE_RECORD)))
    try:
        if req.stage == ADVERTISE:
            out = keys_to(node.advertise(req))
        elif req.stage == SHARE_KEYS:
            out = shares_to(node.share_keys(req))
        elif req.stage == MASKED_INPUT:
            node.expect(req.round_id, req.stage)  # refuse a replay before training, not after
            held = context.state.config_records.pop(STATE_RECORD, None)  # no secrets on disk while training
            del msg.content[RECORD]
            try:
                reply = call_next(msg, context)
            finally:
                if held is not None:
                    context.state[STATE_RECORD] = held
            if "arrays" in msg.content.array_records:  # the model's change
                update, weight, spec = *update_of(msg, reply), None
            else:  # a linear codec's payload (a sketch strategy: strategies/secagg_payload.py)
                update, weight, spec = payload_of(reply)
            q = node.quantizer()
            if node.setup.dim == update.size + 1:  # the server asks for the loss (SecAggGrid's loss=True)
                update = with_loss(update, reply_loss(reply), q.clip)
            dp = node_dp(context, node.setup, msg)  # distributed DP (--dp): clip, weight 1, noise share
            if dp is not None:
                update, weight = dp.prepare(update)
            encoded = q.encode(update, rounding_rng(req.round_id, node.node_id), weight=weight,
                               noise=None if dp is None else dp.noise, noise_rng=None if dp is None else dp.rng)
            out = masked_to(node.masked_input(req, encoded), q.bits)
            if spec is not None:
                out[SPEC_RECORD] = spec
        elif req.stage == UNMASK:
            out = unmask_to(node.unmask(req))
        else:  # decode_request refuses unknown stages; kept for the type checker
            raise SecAggRefused(f"secagg: unknown stage {req.stage}")
    finally:
        context.state[STATE_RECORD] = state_dump(node.to_state())
    return Message(out, reply_to=msg)
