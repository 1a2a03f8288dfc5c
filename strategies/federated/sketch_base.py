"""The Count-Sketch strategies' shared halves: :class:`SketchStrategy` (the server side) and
:class:`SketchClient` (a node's step), used by :mod:`fedswarm.strategies.federated.sketched`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.sketched import SketchClientState, sketch_client_step
from fedswarm.algorithms.compression.sparse import CountSketchCodec
from fedswarm.strategies.federated.compressed_base import (KNOBS, Accepted, ClientRound, CompressedStrategy,
                                                           begin, finish, read_payload, save_sent, train)
from fedswarm.strategies.federated.compressed_client import SELECT, selected_indices, sent_of
from fedswarm.strategies.strategy_utils import load_vector, save_vector
from fedswarm.algorithms.compression.countsketch import CountSketch
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import payload_to_records

__all__ = ["SketchStrategy", "SketchClient", "taken_mask"]


class SketchStrategy(CompressedStrategy):
    """Shared by the three: sketch dimensions, the hash seed and payload validation.

    Parameters
    ----------
    layout : ParamLayout
    density : float (default: 0.001)
        k = ceil(density · d) coordinates are updated per round.
    rows : int (default: 5)
        Sketch rows r (independent hashes).
    cols : int (default: 0)
        Sketch columns c; 0 means 10·k (FetchSGD's ratio).
    server_lr, fraction_train, min_train_nodes, min_available_nodes, seed, history
        See :class:`~fedswarm.strategies.federated.compressed_base.CompressedStrategy`; ``seed``
        also seeds the hashes every party shares.
    """

    def __init__(self, layout: ParamLayout | None = None, density: float = 0.001, rows: int = 5, cols: int = 0,
                 **kwargs: Any):
        super().__init__(layout, **kwargs)
        self.codec = CountSketchCodec(rows=rows, cols=cols, k_ratio=density)
        self.density = self.codec.params["k_ratio"]
        self.hash_seed = (self.seed * 7919 + 17) % (2**31 - 1)
        if self.layout is not None:
            self.on_layout()

    def on_layout(self) -> None:
        self.rows, self.cols, self.k = self.codec._dims(self.layout.d, self.codec.params)
        self.sketch = CountSketch(self.layout.d, self.rows, self.cols, self.hash_seed)

    @property
    def secagg_dim(self) -> int | None:
        """Under ``--secagg``, the length of the vector a node masks: its r·c table."""
        return None if self.layout is None else self.rows * self.cols

    def summary_lines(self) -> list[str]:
        ratio = self.layout.d / (self.rows * self.cols)
        return [f"sketch {self.rows} x {self.cols} ({ratio:.1f}x of float32), "
                f"k = {self.k} of d = {self.layout.d}"]

    def knobs(self, server_round: int) -> dict[str, Any]:
        return {"rows": self.rows, "cols": self.cols, "density": self.density, "hash_seed": self.hash_seed}

    def parse_reply(self, msg: Message) -> torch.Tensor:
        """The client's table ``[r, c]``, checked against this strategy's sketch."""
        p = read_payload(msg, self.layout.d)
        want = {"codec": "countsketch", "K": 1, "d": self.layout.d, "seed": self.hash_seed,
                "rows": self.rows, "cols": self.cols}
        bad = {k: p.meta.get(k) for k, v in want.items() if p.meta.get(k) != v}
        if bad:
            raise PayloadError(f"sketch payload does not match the server's sketch: {bad} (expected {want})")
        if set(p.arrays) != {"table"}:
            raise PayloadError(f"sketch payload must hold one array 'table', got {sorted(p.arrays)}")
        table = p.arrays["table"]
        if table.dtype != np.float32 or table.shape != (1, self.rows, self.cols):
            raise PayloadError(f"sketch table is {table.dtype} {list(table.shape)}, "
                               f"expected float32 [1, {self.rows}, {self.cols}]")
        return torch.from_numpy(np.array(table[0]))  # finiteness was checked by payload_from_records

    def summed(self, accepted: list[Accepted]) -> torch.Tensor:
        """Σ_i (n_i/Σn) S_i: by linearity, the sketch of the weighted average."""
        total = torch.zeros(self.rows, self.cols, dtype=torch.float32)
        for wi, a in zip(self.weights(accepted).tolist(), accepted, strict=True):
            total.add_(a.value, alpha=wi)
        return total

    def sparse_update(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        update = torch.zeros(self.layout.d, dtype=torch.float32)
        update[idx] = vals * self.server_lr
        return update

    def exact_values(self, server_round: int, accepted: list[Accepted],
                     cand: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
        """Phase 2, a second exchange in the round: ask the clients of ``accepted`` for the
        exact values of their vector at ``cand``; return Σ_i n_i v_i[cand] / Σ n_i over the
        valid replies and those clients' node ids (None if there are none). A bad reply
        is rejected like any other."""
        ask = RecordDict({KNOBS: ConfigRecord({"round": server_round, "phase": 2}),
                          "candidates": ArrayRecord({"indices": Array(cand.to(torch.int32).numpy())})})
        weight = {a.node_id: a.weight for a in accepted}
        replies = self.send_and_receive([Message(ask, message_type=self.message_type, dst_node_id=a.node_id)
                                         for a in accepted])
        values, weights, nodes = [], [], []
        for msg in replies:
            nid = msg.metadata.src_node_id
            if msg.has_error() or nid not in weight:
                continue
            try:
                rec = msg.content.array_records.get("values")
                v = rec["values"].numpy() if rec is not None and list(rec.keys()) == ["values"] else None
                if v is None or v.dtype != np.float32 or v.shape != (cand.numel(),):
                    raise PayloadError(f"phase 2 reply must hold float32 'values' [{cand.numel()}]")
                if not np.isfinite(v).all():
                    raise PayloadError("phase 2 values are not finite")
            except (PayloadError, KeyError, TypeError, ValueError) as exc:
                self.reject(msg, str(exc))
                continue
            values.append(torch.from_numpy(v.copy()))
            weights.append(weight[nid])
            nodes.append(nid)
        if not values:
            return None
        w = torch.tensor(weights, dtype=torch.float64)
        return (torch.stack(values) * (w / w.sum()).to(torch.float32)[:, None]).sum(0), nodes


@dataclass(frozen=True)
class SketchClient:
    """A sketch strategy's client half, written once for ``C`` clients: :meth:`step` and
    :meth:`answer` are the math on tensors, which a Flower client runs on itself (``C = 1``,
    :meth:`update` and :meth:`phase2`, reading and writing its ``Context`` around them) and the
    batched engine on a cohort, with the memories in arrays
    (:class:`~fedswarm.sim.batched_sketched.SketchRows`).

    A client's memory: ``error_key`` (v or e, ``[d]``) and ``momentum_key`` (u, ``[d]``), None:
    not kept; ``prefix`` tags what it sent (``.sent``: the round; ``.sent_idx``: the candidates it
    answered in phase 2), to match the server's ``select`` and its phase-2 question; None: a
    stateless client with one exchange. The math is
    :func:`~fedswarm.algorithms.compression.sketched.sketch_client_step`.
    """

    prefix: str | None = None
    error_key: str | None = None
    momentum_key: str | None = None

    def step(self, knobs: ConfigRecord, layout: ParamLayout, delta: torch.Tensor, state: SketchClientState,
             taken: torch.Tensor | None) -> tuple[Payload, SketchClientState]:
        """``C`` clients of one round (same ``knobs``) after local training, ``delta`` ``[C, d]``
        their model changes, ``state`` their memories, ``taken`` (:func:`taken_mask`) what the
        server used of each one's last sketch: one step and one sketch for all. Returns the
        ``[C, r, c]`` payload (row ``i`` client ``i``'s table) and the new memories."""
        codec = CountSketchCodec(rows=int(knobs["rows"]), cols=int(knobs["cols"]), k_ratio=float(knobs["density"]))
        return sketch_client_step(state, codec, delta, layout, seed=int(knobs["hash_seed"]),
                                  rho=float(knobs.get("momentum", 0.0)), taken=taken)

    def answer(self, knobs: ConfigRecord, sent_round: int | None, weight: int | None, error: np.ndarray,
               cand: np.ndarray) -> RecordDict:
        """Phase 2: the reply of a client whose last sketch was of round ``sent_round`` (None:
        none), of ``weight`` examples (None: not kept), its error accumulator ``error`` ``[d]``,
        asked for the exact values at ``cand`` (int32). Raises as the client fails."""
        if sent_round is None or sent_round != int(knobs["round"]):
            raise RuntimeError(f"{self.prefix} phase 2 of round {knobs['round']}: this node sent no sketch that round")
        if cand.dtype != np.int32 or cand.ndim != 1 or (cand.size and (cand.min() < 0 or cand.max() >= error.size)):
            raise PayloadError("candidates must be int32 indices in [0, d)")
        values = np.ascontiguousarray(error[cand])
        if knobs.get("secagg"):  # a second secure sum: the values as a payload, weighted as its sketch was
            if not weight or weight < 1:
                raise RuntimeError(f"{self.prefix} phase 2 under secagg: this node kept no weight of its sketch")
            return payload_to_records(Payload({"values": values}, {"codec": "values", "K": 1}),
                                      RecordDict({"metrics": MetricRecord({"num-examples": weight, "phase": 2})}))
        return RecordDict({"values": ArrayRecord({"values": Array(values)}),
                           "metrics": MetricRecord({"num-examples": 0, "phase": 2})})

    def update(self, msg: Message, context: Context) -> RecordDict:
        """The Flower client update: train, :meth:`step` with ``C = 1`` on the memory in its
        ``Context``, reply with the sketch; a ``phase`` 2 message is answered by :meth:`phase2`."""
        knobs = msg.content.config_records[KNOBS]
        if self.prefix is not None and int(knobs.get("phase", 1)) == 2:
            return self.phase2(msg, context)
        cr = begin(msg, context)
        fit = train(cr)
        payload = self.step_context(cr, (fit.result.flat - fit.start)[None])
        if self.prefix is not None:  # its weight, for a secure second exchange (phase2)
            cr.state[self.prefix + ".sent"]["num-examples"] = int(fit.result.num_examples)
        return finish(cr, fit, payload_to_records(payload, RecordDict()))

    def step_context(self, cr: ClientRound, delta: torch.Tensor) -> Payload:
        """:meth:`step` of one Flower client (``delta`` ``[1, d]``) on the memory in its
        ``Context``; the new memory goes into ``cr.state`` (written by ``finish``)."""
        if self.error_key is None:
            return self.step(cr.knobs, cr.layout, delta, SketchClientState(), None)[0]
        d, state = cr.layout.d, cr.context.state
        memory = SketchClientState(load_vector(state, self.error_key, d)[None], None if self.momentum_key is None
                                   else load_vector(state, self.momentum_key, d)[None])
        taken = taken_mask([cr.msg.content.config_records.get(SELECT)], [sent_of(state, self.prefix)], d)
        payload, new = self.step(cr.knobs, cr.layout, delta, memory, taken)
        save_vector(cr.state, self.error_key, new.error[0])
        if self.momentum_key is not None:
            save_vector(cr.state, self.momentum_key, new.momentum[0])
        save_sent(cr, self.prefix)
        return payload

    def phase2(self, msg: Message, context: Context) -> RecordDict:
        """Reply with the exact values of the vector this node sketched at the candidates
        (:meth:`answer` on its ``Context``), and remember the candidates it answered."""
        knobs = msg.content.config_records[KNOBS]
        sent = context.state.config_records.get(self.prefix + ".sent")
        rec = context.state.array_records.get(self.error_key)
        error = rec["vector"].numpy() if rec is not None else np.zeros(0, dtype=np.float32)
        cand = msg.content.array_records["candidates"]["indices"].numpy()
        content = self.answer(knobs, None if sent is None else int(sent["round"]),
                              None if sent is None else int(sent.get("num-examples", 0)), error, cand)
        context.state[self.prefix + ".sent_idx"] = ArrayRecord({"indices": Array(cand.copy())})
        return content


def taken_mask(selects: list[ConfigRecord | None], sent: list[tuple[int | None, torch.Tensor | None]],
               d: int) -> torch.Tensor | None:
    """What the server used of each of ``C`` clients' last sketches, as a bool ``[C, d]`` mask:
    client ``i``'s train message's ``select`` record ``selects[i]`` read against what it kept of
    its last message, ``sent[i]`` (round and indices, :func:`sent_of`). None: nothing used."""
    taken = None
    for i, (select, (rnd, idx)) in enumerate(zip(selects, sent, strict=True)):
        used = selected_indices(select, rnd, idx, d)
        if used is not None:
            if taken is None:
                taken = torch.zeros(len(selects), d, dtype=torch.bool)
            taken[i, used] = True
    return taken
