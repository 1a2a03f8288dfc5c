"""The node half of the decentralized strategies: one gossip exchange on one node.

A node keeps its own model and its algorithm's memory (momentum, previous model, ...) in
Flower's ``Context.state``; the router (:mod:`fedswarm.strategies.decentralized.router`) only
hands it the messages of its neighbours. Each exchange the node

1. starts from the initial model if the message carries ``init`` (round 1, or a node
   that lost its state), else loads its state;
2. mixes the neighbours' messages of the previous iteration with its row of W
   (``algo.node_mix``), which completes that iteration;
3. unless this is the final exchange, takes the next iteration's local step at its
   current model and computes its outgoing message;
4. saves its state, then replies with the algorithm's payload (``algo.payload``: what its
   neighbours get next, compressed when the algorithm compresses) and ``report.model`` (its
   model after the mix, for the node-average accuracy, when the router asks for it; left
   out when the dense message is the model, as for D-PSGD). ``report.*`` records are
   monitoring: the MeteredGrid counts them as ``bytes_report``, apart from ``bytes_up``
   (:data:`fedswarm.protocol.REPORT_PREFIX`). The metrics carry only what the
   router and the recorder read (partition id, examples, loss; rejected neighbour messages
   when there were any).

Federated evaluation scores the node's model after its last mix (:func:`own_model`), the one
it reports; when the local step has already moved ``x`` (adapt-then-combine steps: D², D-PSGD
``order="atc"``, ...), that model is kept beside the state.

State is written only at the very end, so a node that fails mid-exchange keeps its
previous state: the failure costs that round its update, nothing more.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.local import node_data, node_partition, run_config_of
from fedswarm.strategies import registry
from fedswarm.config import round_seed
from fedswarm.algorithms.decentralized.steps import local_gradient, minibatch_gradient
from fedswarm.algorithms.decentralized import GossipState, make_algorithm
from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm
from fedswarm.train import trainer_for
from fedswarm.payload import PayloadError
from fedswarm.protocol import REPORT_PREFIX
from fedswarm.wire import (PAYLOAD_ARRAYS, PAYLOAD_META, arrayrecord_to_vector, payload_from_records,
                           payload_to_records, recorddict_nbytes, vector_to_arrayrecord)

__all__ = [
    "NO_STATE",
    "REPORT_MODEL",
    "minibatch_gradient",
    "local_gradient",
    "save_state",
    "load_state",
    "own_model",
    "message_nbytes_of",
    "neighbour_keys",
    "make_client_update",
]

#: Marker in the error of a node that has no gossip state; the router re-initializes it.
NO_STATE = "fedswarm: no gossip state on this node"

_STATE, _META = "gossip.state", "gossip.meta"
# the node's model after its last mix, kept only when the next local step already moved x (D², atc, ...)
_MODEL = "gossip.model"

#: Where a node's model report travels (monitoring, not the algorithm's message).
REPORT_MODEL = f"{REPORT_PREFIX}model"


def message_nbytes_of(arrays: ArrayRecord, meta: ConfigRecord) -> int:
    """Serialized size of one gossip message (the algorithm's payload records as they
    would travel peer to peer), measured, not computed from a formula."""
    return recorddict_nbytes(RecordDict({PAYLOAD_ARRAYS: arrays, PAYLOAD_META: meta}))


def neighbour_keys(j: int) -> tuple[str, str]:
    """Where the router puts neighbour ``j``'s payload in a node's message."""
    return f"nbr.{j}", f"nbr.{j}.meta"


# --------------------------------------------------------------------------- state


def save_state(context: Context, algorithm: str, state: GossipState) -> None:
    """Write a one-node state into ``context.state`` (x, buffers, step, meta)."""
    arrays = ArrayRecord()
    arrays["x"] = Array(np.ascontiguousarray(state.x[0].numpy()))
    for k, v in state.buffers.items():
        arrays[f"buf.{k}"] = Array(np.ascontiguousarray(v[0].detach().cpu().numpy()))
    meta = {"algorithm": algorithm, "step": int(state.step)}
    meta.update({f"meta.{k}": float(v) for k, v in state.meta.items()})
    context.state[_STATE] = arrays
    context.state[_META] = ConfigRecord(meta)


def load_state(context: Context, algorithm: str, d: int) -> GossipState:
    """Read the one-node state back; raise RuntimeError(:data:`NO_STATE`) if absent."""
    if _STATE not in context.state.array_records or _META not in context.state.config_records:
        raise RuntimeError(f"{NO_STATE} (it restarted or never got the initial model)")
    meta = context.state.config_records[_META]
    if meta.get("algorithm") != algorithm:
        raise RuntimeError(f"{NO_STATE} for '{algorithm}' (it holds '{meta.get('algorithm')}')")
    arrays = context.state.array_records[_STATE]
    x = arrayrecord_to_vector(ArrayRecord({"x": arrays["x"]}), d)[None]
    buffers = {k[len("buf."):]: torch.from_numpy(arrays[k].numpy().copy())[None]
               for k in arrays if k.startswith("buf.")}
    extra = {k[len("meta."):]: v for k, v in meta.items() if k.startswith("meta.")}
    return GossipState(x=x, buffers=buffers, step=int(meta["step"]), meta=extra)


def own_model(context: Context, d: int) -> torch.Tensor | None:
    """This node's own model from its state (for federated evaluation): its model after its
    last mix, the one it reports (not ``x`` half-way through the next iteration, which an
    adapt-then-combine step has already moved), or None if it holds no gossip state."""
    arrays = context.state.array_records.get(_MODEL) or context.state.array_records.get(_STATE)
    if arrays is None or "x" not in arrays:
        return None
    return arrayrecord_to_vector(ArrayRecord({"x": arrays["x"]}), d)


def _received(content: RecordDict, algo: DecentralizedAlgorithm, i: int,
              d: int) -> tuple[dict[int, torch.Tensor], dict[int, float], int]:
    """Neighbours' messages (their payloads, decoded by the algorithm) and node ``i``'s
    mixing weights. A malformed message is rejected and its weight moved to ``i`` itself,
    so the model is never touched by it."""
    if "weights" not in content.config_records:
        return {}, {}, 0
    weights = {int(k): float(v) for k, v in content.config_records["weights"].items()}
    received, rejected = {}, 0
    for j in [j for j in weights if j != i]:
        arrays_key, meta_key = neighbour_keys(j)
        try:
            if arrays_key not in content.array_records or meta_key not in content.config_records:
                raise PayloadError(f"no message from neighbour {j}")
            sub = RecordDict({PAYLOAD_ARRAYS: content.array_records[arrays_key],
                              PAYLOAD_META: content.config_records[meta_key]})
            received[j] = algo.read_payload(payload_from_records(sub, max_bytes=8 * d + 4096), d)
        except PayloadError:
            rejected += 1
    for j in [j for j in weights if j != i and j not in received]:
        weights[i] = weights.get(i, 0.0) + weights.pop(j)
    return received, weights, rejected


# --------------------------------------------------------------------------- update


def make_client_update(algorithm: str) -> Callable[[Message, Context], RecordDict]:
    """The client update of decentralized strategy ``algorithm`` (served by the
    ClientApp for message type ``train.<algorithm>``)."""

    def client_update(msg: Message, context: Context) -> RecordDict:
        cfg = run_config_of(msg, context)
        pid, n = node_partition(context, cfg)
        params = registry.resolve_params(algorithm, cfg.params)
        params.pop("report_every", None)  # the router's, not the algorithm's
        algo: DecentralizedAlgorithm = make_algorithm(algorithm, **params)
        trainer = trainer_for(cfg, pid, n, local=node_data(context))
        d = trainer.layout.d
        content = msg.content
        conf = content.config_records["config"]
        if "init" in content.array_records:
            state = algo.init_state(arrayrecord_to_vector(content.array_records["init"], d))
        else:
            state = load_state(context, algorithm, d)
        state.index0 = pid
        received, weights, rejected = _received(content, algo, pid, d)
        if weights:
            algo.node_mix(state, pid, received, weights)
        model = state.x[0].clone()
        # only what the router and the recorder read: every byte here is framing on each reply
        metrics: dict[str, int | float] = {"partition-id": pid, "num-examples": 0}
        if rejected:
            metrics["rejected_neighbours"] = rejected
        reply = RecordDict()
        if not bool(conf.get("final", False)):
            steps = cfg.local_steps or 1
            point = algo.gradient_point(state, 0, int(conf.get("staleness", 0)))  # a fixed schedule's may be stale
            grad, loss = local_gradient(trainer, point, steps=steps, batch_size=cfg.batch_size, lr=cfg.lr,
                                        seed=round_seed(cfg.seed, int(conf["iteration"]), pid))
            algo.local_step(state, grad[None], cfg.lr)
            payload = algo.payload(state, 0)
            payload_to_records(payload, reply)  # the algorithm's real message (compressed if it compresses)
            metrics.update({"num-examples": steps * min(cfg.batch_size, trainer.num_examples), "train_loss": loss})
            dense_is_model = payload.meta.get("kind") == "dense" and torch.equal(algo.message(state)[0], model)
            if not dense_is_model and bool(conf.get("report-model", True)):
                reply[REPORT_MODEL] = vector_to_arrayrecord(model)
        else:
            reply[REPORT_MODEL] = vector_to_arrayrecord(model)
        save_state(context, algorithm, state)  # last: a failure above leaves the old state
        if torch.equal(state.x[0], model):
            context.state.array_records.pop(_MODEL, None)
        else:
            context.state[_MODEL] = ArrayRecord({"x": Array(np.ascontiguousarray(model.numpy()))})
        reply["metrics"] = MetricRecord(metrics)
        return reply

    client_update.__name__ = f"client_update_{algorithm}"
    return client_update
