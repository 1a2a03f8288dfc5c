"""The Count-Sketch strategies on the batched engine: ``sketched_sgd``, ``fetchsgd`` and
``gs_sgd`` (:mod:`fedswarm.strategies.federated.sketched`).

Server half: the strategy object itself, as for the other compressed strategies
(:mod:`fedswarm.sim.batched_compressed`): its ``configure_train`` samples and writes the
train messages (knobs, replica sync, the ``select`` of what it used last time), its
``apply_accepted`` sums the sketches and takes the top k. Sketched-SGD and gs-SGD (with
``exact_values``) ask the same clients a second time in the round, for the exact values at
the candidates: the strategy builds those messages and reads the replies itself
(``exact_values``) through the grid it was given, which here is :class:`_Exchange` (under the
fleet options :class:`~fedswarm.sim.batched_fleet.BatchedFleet`, which passes it on and holds the
replies to the quorum and availability again): each message is answered by the strategy's client half
(:meth:`~fedswarm.strategies.federated.sketch_base.SketchClient.answer`) on that client's
memory, and both the message and the real reply are serialized and counted, as the metered
grid counts them.

Client half, on the client axis: after the batched trainer, the chunk's clients run the
strategy's own client step at once
(:meth:`~fedswarm.strategies.federated.sketch_base.SketchClient.step`, the one a Flower client
runs with ``C = 1``: clear what the server used, accumulate momentum and error, one sketch
``[C, d]`` -> ``[C, r, c]`` with the round's shared hashes). The clients' memories between
rounds are arrays, held only for the clients that have one (:class:`SketchRows`): no Flower
``Context`` per client.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from flwr.app import Message

from fedswarm.algorithms.compression.sketched import SketchClientState
from fedswarm.server.metered_grid import serialized_size
from fedswarm.sim.batched_compressed import CompressedRounds, sent_rows
from fedswarm.sim.batched_round import ClientRows, NodeIds, make_reply
from fedswarm.sim.inprocess import client_error_reply
from fedswarm.strategies.federated.compressed_base import KNOBS
from fedswarm.strategies.federated.compressed_client import SELECT
from fedswarm.strategies.federated.sketch_base import taken_mask
from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS, SketchClient

__all__ = ["SketchRounds", "SketchRows", "SKETCH_STRATEGIES"]

#: The strategies :class:`SketchRounds` serves.
SKETCH_STRATEGIES = tuple(SKETCH_CLIENTS)


class SketchRows:
    """A sketch strategy's client memories (:class:`SketchClient`'s ``error_key``,
    ``momentum_key`` and ``prefix``) held as arrays, for the clients that have one: the error
    and momentum accumulators as ``[d]`` rows (:class:`~fedswarm.sim.batched_round.ClientRows`),
    the round of each client's last sketch in an int32 array over the population (-1: none),
    and the candidates each last answered in phase 2 as int32 rows (made at the first answer).
    A client with no state reads as the one its ClientApp starts from: zero memories, nothing
    sent. FetchSGD's stateless clients keep nothing. Its memory:
    :func:`~fedswarm.sim.batched_memory.sketch_state_bytes`."""

    def __init__(self, client: SketchClient, d: int, population: int):
        self.client = client
        self.error = ClientRows(d, population) if client.error_key is not None else None
        self.momentum = ClientRows(d, population) if client.momentum_key is not None else None
        self.sent_round = np.full(population, -1, dtype=np.int32) if client.prefix is not None else None
        self.sent_idx: ClientRows | None = None  # [m] int32 rows, m known at the first phase-2 answer

    def __len__(self) -> int:
        """How many clients have state."""
        return 0 if self.error is None else len(self.error)

    def state(self, pids: Sequence[int]) -> SketchClientState:
        """Clients ``pids``' memories as one batch. A memory that is not finite (a diverged
        client's) reads as zeros, as :func:`~fedswarm.strategies.strategy_utils.load_vector`
        reads it from a Context."""
        if self.error is None:
            return SketchClientState()
        rows = [_finite_or_zero(r.stack(pids)) for r in (self.error, self.momentum) if r is not None]
        return SketchClientState(*rows)

    def taken(self, pids: Sequence[int], selects: Sequence) -> torch.Tensor | None:
        """What the server used of each client's last sketch (:func:`taken_mask`): each train
        message's ``select`` read against the round and candidates the client kept."""
        if self.sent_round is None:
            return None
        sent = [(None, None)] * len(pids)
        for i, (pid, select) in enumerate(zip(pids, selects)):
            if select is not None:  # only these are read
                rnd = int(self.sent_round[pid])
                idx = self.sent_idx[pid].to(torch.int64) if self.sent_idx is not None and pid in self.sent_idx else None
                sent[i] = (None if rnd < 0 else rnd, idx)
        return taken_mask(list(selects), sent, self.error.d)

    def keep(self, pids: Sequence[int], state: SketchClientState, sent_round: int) -> None:
        """Clients ``pids``' memories after their round's sketch, sent in round ``sent_round``."""
        if self.error is None:
            return
        self.error.keep_stacked(pids, state.error)
        if self.momentum is not None:
            self.momentum.keep_stacked(pids, state.momentum)
        self.sent_round[np.asarray(pids, dtype=np.int64)] = sent_round

    def keep_answered(self, pids: Sequence[int], cand: np.ndarray) -> None:
        """Clients ``pids`` answered phase 2 at the candidates ``cand`` (int32)."""
        if self.sent_idx is None:
            self.sent_idx = ClientRows(cand.size, len(self.sent_round), dtype=torch.int32)
        if cand.size != self.sent_idx.d:
            raise ValueError(f"SketchRows.keep_answered: {cand.size} candidates, the run's clients answered "
                             f"{self.sent_idx.d}")
        rows = torch.from_numpy(np.ascontiguousarray(cand, dtype=np.int32)).expand(len(pids), -1)
        self.sent_idx.keep_stacked(pids, rows)

    def nbytes(self) -> int:
        """Bytes held: slots, rounds and rows."""
        return (sum(r.nbytes() for r in (self.error, self.momentum, self.sent_idx) if r is not None)
                + (self.sent_round.nbytes if self.sent_round is not None else 0))


def _finite_or_zero(rows: torch.Tensor) -> torch.Tensor:
    bad = ~torch.isfinite(rows).all(dim=1)
    if bool(bad.any()):
        rows[bad] = 0.0
    return rows


class _Exchange(NodeIds):
    """The grid the strategy is given: node ids for sampling, and its second exchange in a
    round answered by each client's :meth:`SketchClient.answer` on its memory in ``rows``."""

    def __init__(self, n: int, rows: SketchRows, client: SketchClient):
        super().__init__(n)
        self.rows = rows
        self.client = client
        self.bytes: dict[int, list[int]] = {}  # node id -> [down, up] of this round's further exchanges
        self.notes: dict = {}  # the round row's figures of a second secure sum (--secagg)
        self.secure = None  # --secagg: the runner's secure rounds
        self.fleet = None  # the fleet options: the runner's BatchedFleet, which holds the replies again

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        return self.answer_all(list(messages), keep=self.fleet.again if self.fleet is not None else None)

    def answer_all(self, messages: list[Message], weight_of=None, keep=None) -> list[Message]:
        """Each message's reply from its client's :meth:`SketchClient.answer` (an error reply
        where the client fails), the bytes down counted, and up those of the replies returned;
        ``weight_of(node id)``: the weight its sketch was sent with (a secure second sum's), None
        where not kept; ``keep(node ids, replies, down, up)``: the positions of the replies
        returned, in their order (:meth:`~fedswarm.sim.batched_fleet.BatchedFleet.again`; default:
        every reply, as sent). Every client that answered remembers what it was asked, as an
        in-process node whose reply the fleet grid discards did."""
        pids = [msg.metadata.dst_node_id - 1 for msg in messages]
        store = self.rows
        error = store.error.stack(pids).numpy() if store.error is not None and pids else None
        replies, cache, answered, cands, down, up = [], {}, [], {}, [], []
        for i, msg in enumerate(messages):
            nid = msg.metadata.dst_node_id
            down.append(serialized_size(msg, cache))  # as the metered grid: before the push gives it an id
            try:
                knobs = msg.content.config_records[KNOBS]
                if self.client.prefix is None or int(knobs.get("phase", 1)) != 2:
                    raise RuntimeError("the batched engine's clients answer the round's second exchange only")
                cand = msg.content.array_records["candidates"]["indices"].numpy()
                rnd = int(store.sent_round[pids[i]])
                weight = None if weight_of is None else weight_of(nid)
                content = self.client.answer(knobs, None if rnd < 0 else rnd, weight, error[i], cand)
                reply = make_reply(msg, content)
                answered.append(i)
                cands[i] = cand
            except Exception as exc:  # as the in-process grid: a failing client costs its reply
                reply = client_error_reply(msg, exc)
            up.append(serialized_size(reply))
            replies.append(reply)
        # what each answering client remembers: the candidates it answered (one write per distinct question)
        groups: dict[int, list[int]] = {}
        for i in answered:
            groups.setdefault(id(cands[i]), []).append(i)
        for members in groups.values():
            store.keep_answered([pids[i] for i in members], cands[members[0]])
        nodes = [int(msg.metadata.dst_node_id) for msg in messages]
        for node, nbytes in zip(nodes, down):
            self.bytes.setdefault(node, [0, 0])[0] += nbytes
        order = range(len(replies)) if keep is None else keep(nodes, replies, down, up)
        for i in order:
            self.bytes[nodes[i]][1] += up[i]
        return [replies[i] for i in order]


def _secure_exchange() -> type:
    """:class:`_Exchange` with Sketched-SGD's second secure sum (:mod:`fedswarm.sim.batched_secagg_sketch`)."""
    from fedswarm.sim.batched_secagg_sketch import SecureSketchExchange

    return type("SecureExchange", (SecureSketchExchange, _Exchange), {})


class SketchRounds(CompressedRounds):
    """Rounds of a Count-Sketch strategy; ``model`` is the strategy's public model."""

    def __init__(self, run, model: torch.Tensor, notes=None):
        super().__init__(run, model, notes)
        self.client = SKETCH_CLIENTS[run.cfg.strategy]
        self.memory = SketchRows(self.client, self.layout.d, run.cfg.clients)  # arrays: the clients with state
        self.grid = (_Exchange if self.secure is None else _secure_exchange())(run.cfg.clients, self.memory,
                                                                              self.client)
        self.grid.secure = self.secure  # --secagg: Sketched-SGD's second secure sum (sim/batched_secagg_sketch.py)
        if self.fleet is not None:  # the exact values' exchange, held to the quorum and availability again
            self.fleet.exchange, self.grid.fleet = self.grid, self.fleet

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
        """The strategy's client half on the chunk's rows of ``delta``: one step, one sketch,
        their memories read from and written back to :class:`SketchRows`."""
        knobs = ins[0].content.config_records[KNOBS]
        state = self.memory.state(pids)
        taken = self.memory.taken(pids, [m.content.config_records.get(SELECT) for m in ins])
        payload, new = self.client.step(knobs, self.layout, delta, state, taken)
        self.memory.keep(pids, new, int(knobs["round"]))
        if self.capture is not None:  # a shard worker's client half (CompressedRounds.capture)
            self.capture.payload(payload, pids, int(payload.meta["seed"]))
            return [None] * len(pids), [None] * len(pids)
        table = payload.arrays["table"]
        values = [table[j].to(torch.float32).clone() for j in range(len(pids))]  # what parse_reply returns
        return values, sent_rows(payload, int(payload.meta["seed"]))
