"""The linear-codec strategies' rounds on the batched engine under ``--secagg``:
``compressed_fedavg`` with a linear codec (countsketch; randk, whose coordinates come from the
round's shared seed) and ``fetchsgd``, their unmasked sum computed directly.

The masked sum the protocol's server unmasks is the sum, mod 2^b, of the senders' quantized
(and noised) payloads (:mod:`fedswarm.strategies.secagg_payload`: a node masks its payload's one
array, flat, weighted by its examples). So the round here is the in-process round's, step by
step, with the protocol's stages replaced by their outcome
(:class:`~fedswarm.sim.batched_secagg.SecureRound`):

1. the strategy object samples and writes the train messages (its ``configure_train``);
2. the protocol's first two stages decide who gets the masked-input stage, which carries the
   train message: only those nodes train and run their client half (error-feedback residuals
   move for them alone), through the runner's own ``_train_replies``;
3. each node's one-row payload becomes the vector it masks (:func:`payload_vector`, the
   in-process node's layout, its train loss appended without DP: ``quantize.with_loss``); a
   node whose client half failed or whose payload is not finite drops at ``masked_input``, as
   the in-process node that refuses to quantize it;
4. the senders' vectors are encoded with the protocol's quantizer, rounding, DP noise and
   dropouts and added in the field (:meth:`SecureRounds.finish`);
5. the strategy reads ONE reply, in the name of the smallest sender, carrying the weighted
   mean payload (:func:`payload_reply`), the total weight and the mean train loss (the row's
   ``train_loss``), as ``SecAggGrid`` hands it: its
   ``parse_reply`` decodes it (countsketch: the top-k of the unsketched mean table; FetchSGD
   unsketches it into its momentum and error sketches) and ``apply_accepted`` commits it.

A round that fails (past the threshold, or survivors whose payload specs differ) leaves the
model as it was and says why (``secagg_failed``). Bytes: the plain train message and reply of
each node that trained, measured by the runner; not the protocol's four stages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from fedswarm.algorithms.secagg import SecAggFailed
from fedswarm.algorithms.secagg.quantize import with_loss
from fedswarm.payload import PayloadError
from fedswarm.server.metered_grid import Traffic
from fedswarm.sim.batched_round import NODE_ROWS_MAX, add_client, make_reply, strategy_round
from fedswarm.sim.batched_secagg_round import SecureRounds
from fedswarm.sim.batched_trainer import ClientSchedule
from fedswarm.strategies.federated.compressed_base import Accepted
from fedswarm.strategies.secagg_payload import check_specs, payload_reply, payload_vector, sum_metrics

__all__ = ["SecurePayloadRounds"]


def _subset(sched: ClientSchedule, pos: list[int]) -> ClientSchedule:
    """The schedule of the clients at positions ``pos``."""
    idx = torch.tensor(pos, dtype=torch.int64)
    return ClientSchedule(*(getattr(sched, f)[idx] for f in ("partitions", "steps", "batch_size", "lr", "seeds")))


class SecurePayloadRounds(SecureRounds):
    """A codec runner's secure rounds (:class:`~fedswarm.sim.batched_compressed.CompressedRounds`
    and :class:`~fedswarm.sim.batched_sketched.SketchRounds` hand theirs here under ``--secagg``)."""

    def round(self, runner, server_round: int) -> tuple[dict, list[dict]]:
        run, strategy = runner.run, runner.strategy
        messages, node_ids, sched, classes, pols = strategy_round(run, strategy, runner.grid, runner.arrays,
                                                                  server_round)
        dim = strategy.secagg_dim
        if not dim:
            raise RuntimeError(f"--secagg: strategy '{strategy.name}' has no linear payload to sum (secagg_dim)")
        rnd = self.begin(sorted(node_ids), int(dim) + (1 if self.loss else 0))
        failed = None
        try:
            trained = rnd.trained()
        except SecAggFailed as exc:  # before the masked-input stage: nobody trains
            trained, failed = set(), str(exc)
        pos = [k for k, nid in enumerate(node_ids) if nid in trained]  # the nodes that train, in sample order
        sub = _Cohort([messages[k] for k in pos], [node_ids[k] for k in pos], [classes[k] for k in pos],
                      [pols[k] for k in pos])
        replies = []
        if pos:
            policy_json = {c: json.dumps(p, sort_keys=True) for c, p in zip(classes, pols)}
            replies = runner._train_replies(runner.model, _subset(sched, pos), sub.messages, sub.node_ids,
                                            sub.classes, sub.pols, policy_json, len(pos))
            replies.sort(key=lambda r: r.k)
        rows, weights, specs, gone = {}, {}, {}, []
        for r in replies:
            vector, spec = (None, None) if r.error is not None else payload_vector(r.sent())
            if vector is not None and np.isfinite(vector).all():
                if self.loss:  # the node's train loss, last (the in-process node's layout)
                    vector = with_loss(vector, r.loss, self.params.clip)
                rows[r.node_id], weights[r.node_id], specs[r.node_id] = vector, int(r.n), spec
            else:  # its client half failed, or its node refuses to quantize a non-finite payload
                gone.append(r.node_id)
        out, row = self.finish(rnd, rows, weights, server_round, gone=gone, failed=failed,
                               check=lambda senders: check_specs({n: specs[n] for n in senders}, int(dim)))
        mean, train_loss = self.split(out)
        accepted = [] if out is None else _one_reply(strategy, out, mean, train_loss, specs, sub)
        strategy.apply_accepted(server_round, accepted)
        runner.arrays = strategy.model_arrays()
        run.meter.traffic, node_rows = _traffic(replies, sub, len(node_ids) <= NODE_ROWS_MAX)
        row.update(num_clients=len(node_ids), train_loss=train_loss)
        return row, node_rows


@dataclass
class _Cohort:
    """The round's nodes that train (those the masked-input stage reaches), in sample order."""

    messages: list
    node_ids: list[int]
    classes: list[str]
    pols: list[dict]


def _one_reply(strategy, out, mean, train_loss, specs: dict, sub: _Cohort) -> list[Accepted]:
    """What ``SecAggGrid`` hands the strategy: one reply in the smallest sender's name carrying the
    weighted mean payload ``mean``, the total weight and the mean ``train_loss`` (if carried),
    acknowledged and parsed as the strategy's ``aggregate_train`` would (a reply it refuses is rejected)."""
    survivor = min(out.senders)
    content = payload_reply(mean, specs[survivor])
    content["metrics"] = sum_metrics(out.decoded.total_weight, train_loss)
    msg = make_reply(sub.messages[sub.node_ids.index(survivor)], content)
    strategy.sync.ack(survivor)
    strategy.pending.pop(survivor, None)
    try:
        return [Accepted(survivor, msg, float(out.decoded.total_weight), strategy.parse_reply(msg))]
    except (PayloadError, KeyError, TypeError, ValueError) as exc:
        strategy.reject(msg, str(exc) or type(exc).__name__)
        return []


def _traffic(replies, sub: _Cohort, record_nodes: bool) -> tuple[Traffic, list[dict]]:
    """The plain train message and reply of each node that trained, and its row (a node whose
    client half raised: ``failed``, with the reason)."""
    traffic = Traffic()
    node_rows: list[dict] | None = [] if record_nodes else None
    for r in replies:
        # its example count and loss travel inside its masked vector: not on its row, as in-process
        add_client(traffic, node_rows, r.node_id, r.up, r.down, None, None, r.device_class, sub.pols[r.k])
        if r.error is not None and node_rows is not None:
            node_rows[-1].update(status="failed", reason=r.error.error.reason[:2000])
    return traffic, node_rows or []
