"""The Count-Sketch strategies on the batched engine: ``sketched_sgd``, ``fetchsgd`` and
``gs_sgd`` (:mod:`fedswarm.strategies.federated.sketched`).

Server half: the strategy object itself, as for the other compressed strategies
(:mod:`fedswarm.sim.batched_compressed`): its ``configure_train`` samples and writes the
train messages (knobs, replica sync, the ``select`` of what it used last time), its
``apply_accepted`` sums the sketches and takes the top k. Sketched-SGD and gs-SGD (with
``exact_values``) ask the same clients a second time in the round, for the exact values at
the candidates: the strategy builds those messages and reads the replies itself
(``exact_values``) through the grid it was given, which here is :class:`_Exchange`: each
message is answered by the strategy's registered client update (its ``phase`` 2 branch)
on that client's state, and both the message and the real reply are serialized and
counted, as the metered grid counts them.

Client half, on the client axis: after the batched trainer, the chunk's clients run the
strategy's own client half at once
(:meth:`~fedswarm.strategies.federated.sketched.SketchClient.step`, as a Flower client runs it
with ``C = 1``: clear what the server used, accumulate momentum and error, one sketch
``[C, d]`` -> ``[C, r, c]`` with the round's shared hashes). Each client has its own Flower
``Context``, whose ``state`` holds its memory between rounds as on any grid.
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message, RecordDict

from fedswarm.server.metered_grid import serialized_size
from fedswarm.sim.batched_compressed import CompressedRounds, sent_rows
from fedswarm.sim.batched_round import ClientMemory, NodeIds, make_reply
from fedswarm.sim.inprocess import client_error_reply
from fedswarm.strategies.federated.compressed_base import KNOBS, ClientRound
from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS, SketchClient

__all__ = ["SketchRounds", "SKETCH_STRATEGIES"]

#: The strategies :class:`SketchRounds` serves.
SKETCH_STRATEGIES = tuple(SKETCH_CLIENTS)


def _contexts(n: int) -> ClientMemory:
    """Each client's Flower ``Context`` by partition id, made on first use as the in-process
    grid makes them (node id = partition id + 1)."""
    return ClientMemory(lambda pid: Context(run_id=0, node_id=pid + 1,
                                            node_config={"partition-id": pid, "num-partitions": n},
                                            state=RecordDict(), run_config={}))


class _Exchange(NodeIds):
    """The grid the strategy is given: node ids for sampling, and its second exchange in a
    round answered by each client's own update (:meth:`SketchClient.update`) on that
    client's Context."""

    def __init__(self, n: int, contexts: ClientMemory, client: SketchClient):
        super().__init__(n)
        self.contexts = contexts
        self.client = client
        self.bytes: dict[int, list[int]] = {}  # node id -> [down, up] of this round's further exchanges
        self.notes: dict = {}  # the round row's figures of a second secure sum (--secagg)
        self.secure = None  # --secagg: the runner's secure rounds

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        cache: dict = {}
        return [self.answer(msg, cache) for msg in messages]

    def answer(self, msg: Message, cache: dict) -> Message:
        """``msg`` answered by its node's client update (an error reply where it raises), both
        messages' bytes counted on the node."""
        nid = msg.metadata.dst_node_id
        down = serialized_size(msg, cache)  # as the metered grid: before the push gives it an id
        try:
            reply = make_reply(msg, self.client.update(msg, self.contexts[nid - 1]))
        except Exception as exc:  # as the in-process grid: a failing client costs its reply
            reply = client_error_reply(msg, exc)
        sizes = self.bytes.setdefault(nid, [0, 0])
        sizes[0] += down
        sizes[1] += serialized_size(reply)
        return reply


def _secure_exchange() -> type:
    """:class:`_Exchange` with Sketched-SGD's second secure sum (:mod:`fedswarm.sim.batched_secagg_sketch`)."""
    from fedswarm.sim.batched_secagg_sketch import SecureSketchExchange

    return type("SecureExchange", (SecureSketchExchange, _Exchange), {})


class SketchRounds(CompressedRounds):
    """Rounds of a Count-Sketch strategy; ``model`` is the strategy's public model."""

    def __init__(self, run, model: torch.Tensor, notes=None):
        super().__init__(run, model, notes)
        self.contexts = _contexts(run.cfg.clients)  # partition id -> the client's Context
        self.client = SKETCH_CLIENTS[run.cfg.strategy]
        self.grid = (_Exchange if self.secure is None else _secure_exchange())(run.cfg.clients, self.contexts,
                                                                              self.client)
        self.grid.secure = self.secure  # --secagg: Sketched-SGD's second secure sum (sim/batched_secagg_sketch.py)

    def round(self, server_round: int) -> tuple[dict, list[dict]]:
        """The round of :class:`CompressedRounds`, plus the second exchange's bytes, per node too."""
        self.grid.bytes, self.grid.notes = {}, {}
        row, node_rows = super().round(server_round)
        row.update(self.grid.notes)  # a second secure sum's figures, as SecAggGrid notes them
        traffic = self.run.meter.traffic
        by_node = {r["node_id"]: r for r in node_rows}
        for nid, (down, up) in self.grid.bytes.items():
            traffic.bytes_down += down
            traffic.bytes_up += up
            traffic.node_down[nid] += down
            traffic.node_up[nid] += up
            if str(nid) in by_node:
                by_node[str(nid)]["bytes_down"] += down
                by_node[str(nid)]["bytes_up"] += up
        return row, node_rows

    def _client_step(self, delta, pids, ins, policies):
        """The strategy's client half on the chunk's rows of ``delta``: one step, one sketch."""
        knobs = ins[0].content.config_records[KNOBS]
        rounds = [ClientRound(ins[j], self.contexts[pid], self.run.cfg, self.run.trainer, knobs, self.model, 0, "")
                  for j, pid in enumerate(pids)]
        payload = self.client.step(rounds, delta)
        for cr in rounds:  # what finish() writes into the client's state
            for key, value in cr.state.items():
                cr.context.state[key] = value
        if self.capture is not None:  # a shard worker's client half (CompressedRounds.capture)
            self.capture.payload(payload, pids, int(payload.meta["seed"]))
            return [None] * len(pids), [None] * len(pids)
        table = payload.arrays["table"]
        values = [table[j].to(torch.float32).clone() for j in range(len(pids))]  # what parse_reply returns
        return values, sent_rows(payload, int(payload.meta["seed"]))
