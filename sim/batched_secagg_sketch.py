"""Sketched-SGD's second secure sum on the batched engine (``sketched_sgd --secagg``, with or
without ``--dp``): the exact values at the server's candidates, summed directly as the first
sum (the tables, :mod:`fedswarm.sim.batched_secagg_codec`) is.

In-process, ``SketchedSGD.secure_exact_values`` asks the nodes of the first sum (``SecAggGrid``'s
``survivors``) through the grid's :meth:`~fedswarm.server.secagg.SecAggGrid.second_sum`, and
``SecAggGrid`` runs a second protocol round whose masked-input stage carries the ask. Here the
strategy object asks :class:`SecureSketchExchange` (the batched sketch runner's grid) the same way,
and the round is the in-process one with the stages replaced by their outcome
(:class:`~fedswarm.sim.batched_secagg.SecureRound`, the run's :class:`SecureRounds`: the next
graph seed and dropout draw, DP's round parameters and accountant, as ``SecAggGrid`` counts its
secure rounds):

1. the protocol's first two stages decide who gets the masked-input stage (the ask): only those
   nodes answer it, by the strategy's own client half on their memories
   (:meth:`~fedswarm.strategies.federated.sketch_base.SketchClient.answer` on their rows of
   :class:`~fedswarm.sim.batched_sketched.SketchRows`, which note the candidates each was asked
   about, as the in-process node's Context does);
2. each answer is read as the in-process node reads it (:func:`payload_of`: the values, weighted
   by the node's first-sum examples); a node whose client half fails or whose values are not
   finite drops at ``masked_input``;
3. the senders' vectors are encoded and added in the field with the second sum's rounding and
   noise streams (stream 1 of :func:`~fedswarm.algorithms.privacy.distributed.node_rng`, as the
   in-process node's distributed DP draws it for the ask's ``secagg-sum`` = 1);
4. the strategy gets ONE reply (or none where the sum fails), in the smallest sender's name,
   carrying the weighted mean values, and ``survivors`` becomes the second sum's senders (the
   nodes the strategy tells which candidates it used).

The second sum's figures go to the round's row as ``secagg_values`` (and ``secagg_failed``, DP's
``epsilon`` after both releases), as ``SecAggGrid`` notes them. Bytes: each asked node's plain ask
and reply, as the runner counts the first sum's (not the protocol's stages).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from flwr.app import Message

from fedswarm.algorithms.secagg import SecAggFailed
from fedswarm.sim.batched_round import make_reply
from fedswarm.strategies.secagg_payload import SUM_KEY, check_specs, payload_of, payload_reply, sum_metrics

__all__ = ["SecureSketchExchange"]


class SecureSketchExchange:
    """Mixed into the batched sketch runner's grid (:class:`~fedswarm.sim.batched_sketched._Exchange`:
    ``rows``, ``client``, ``answer_all``, ``notes``) under ``--secagg``: ``survivors`` and
    ``second_sum`` as ``SecAggGrid`` has them, and the second sum's ask answered as above.
    ``secure``: the runner's :class:`~fedswarm.sim.batched_secagg_codec.SecurePayloadRounds`."""

    _sum: str | None = None  # the second sum's name while it runs (second_sum)

    @property
    def survivors(self) -> list[int]:
        """The last secure sum's senders (``SecAggGrid.survivors``)."""
        return list(self.secure.survivors)

    @contextmanager
    def second_sum(self, name: str):
        saved = self.secure.loss
        self.secure.loss, self._sum = False, name
        try:
            yield self
        finally:
            self.secure.loss, self._sum = saved, None

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        if self._sum is None:
            return super().send_and_receive(messages, timeout=timeout)
        return self._second_sum(list(messages))

    def _second_sum(self, messages: list[Message]) -> list[Message]:
        secure = self.secure
        by_node = {int(m.metadata.dst_node_id): m for m in messages}
        first = messages[0]
        dim = int(first.content.array_records["candidates"]["indices"].numpy().size)
        knobs = next(r for r in first.content.config_records.values() if SUM_KEY in r)
        stream, server_round = int(knobs[SUM_KEY]), int(knobs["server-round"])
        rnd = secure.begin(sorted(by_node), dim)
        failed = None
        try:
            trained = rnd.trained()
        except SecAggFailed as exc:  # before the masked-input stage: nobody is asked
            trained, failed = set(), str(exc)
        rows, weights, specs, gone = {}, {}, {}, []
        asked = sorted(trained)
        # the asked nodes' answers on their memories, each weighted as its sketch was (its first-sum weight)
        replies = self.answer_all([by_node[nid] for nid in asked],
                                  weight_of=lambda nid: int(secure.weights[nid]) if nid in secure.weights else None)
        for nid, reply in zip(asked, replies, strict=True):
            try:
                vector, weight, spec = payload_of(reply)
            except (RuntimeError, ValueError):
                gone.append(nid)
                continue
            if not np.isfinite(vector).all():
                gone.append(nid)
                continue
            rows[nid], weights[nid], specs[nid] = vector, weight, spec
        out, row = secure.finish(rnd, rows, weights, server_round, gone=gone, failed=failed, stream=stream,
                                 check=lambda senders: check_specs({n: specs[n] for n in senders}, dim))
        self.notes = {f"secagg_{self._sum}": row.pop("secagg"), **row}
        if out is None:
            return []
        survivor = min(out.senders)
        content = payload_reply(out.decoded.mean, specs[survivor])
        content["metrics"] = sum_metrics(out.decoded.total_weight, None)
        return [make_reply(by_node[survivor], content)]
