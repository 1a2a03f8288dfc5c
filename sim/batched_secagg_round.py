"""FedAvg's round on the batched engine under ``--secagg``: the clients' local SGD as one batched
computation, then the round's unmasked sum computed directly
(:func:`fedswarm.sim.batched_secagg.secure_sum`) instead of a weighted sum of plain models.

What follows the in-process server (``SecAggGrid`` and the nodes' ``secagg_mod``): each node's
update is its new model minus the global one (float64), weighted by its number of examples
(under ``--dp``: clipped, weight 1, its distributed-DP noise share, the round's field room from
:class:`~fedswarm.server.secagg_dp.SecAggDP`); the neighbour graph's seed is the run's
``SecAggGrid`` sequence (one draw per round from the run's seed); ``secagg_dropout`` is
:func:`~fedswarm.algorithms.secagg.dropouts.draw_dropouts` of the run's seed and the round, as
``SecAggGrid`` draws it; the new model is the global one plus the decoded weighted mean; a round
past the threshold leaves the model as it was and says why (``secagg_failed``). Not the same
bits: each node's stochastic rounding (here :func:`~fedswarm.algorithms.privacy.distributed.node_rng`
of the run's seed, round and node; in-process a generator of the protocol's random round id)
and the engines' training (held to 1e-5, not bit for bit, tests/test_batched*.py).

Not simulated: the protocol's four stages' bytes and CPU (the round's bytes are the plain train
message and reply each node would exchange), and the per-client rows of a diverged client: a
client whose model is not finite never sends a masked input (it drops at ``masked_input``).
"""

from __future__ import annotations

import numpy as np
import torch

from fedswarm.algorithms.privacy.distributed import node_rng
from fedswarm.algorithms.secagg import SecAggFailed
from fedswarm.algorithms.secagg.dropouts import draw_dropouts
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.secagg import secagg_params
from fedswarm.server.secagg_dp import SecAggDP
from fedswarm.sim.batched_round import NODE_ROWS_MAX, add_client, round_schedule
from fedswarm.sim.batched_secagg import secure_sum
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["SecureFedAvg"]


class SecureFedAvg:
    """The run's secure rounds (its graph-seed sequence and distributed DP's accountant)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.params = secagg_params(cfg)
        self.rng = np.random.default_rng([int(cfg.seed), 0x5EC])  # SecAggGrid's: one graph seed per round
        self.dp = SecAggDP(cfg.dp, cfg.seed) if cfg.dp else None
        self.rounds = 0

    def round(self, run, counter, global_vec: torch.Tensor, sample: list[int],
              server_round: int) -> tuple[torch.Tensor, dict, list[dict]]:
        """Train ``sample``, sum their updates securely; the new model, the round's row, node rows."""
        cfg, trainer = self.cfg, run.trainer
        self.rounds += 1
        ids = sorted(sample)
        graph_seed = int(self.rng.integers(1 << 62))
        drop = draw_dropouts(ids, cfg.secagg_dropout, cfg.seed, self.rounds) if cfg.secagg_dropout else {}
        sched, classes, pols = round_schedule(cfg, sample, run.train_config, run.n_examples, server_round)
        total, d = len(sample), trainer.layout.d
        start = global_vec.to(torch.float32).cpu()
        updates = np.empty((total, d), dtype=np.float64)
        losses, counts = [0.0] * total, [0] * total
        for rows, new, loss, n in trainer.fit(start, sched, momentum=cfg.momentum, chunk_size=run.chunk_size,
                                              memory_budget=run.memory_budget, on_chunk=run.progress(total)):
            updates[rows] = new.cpu().to(torch.float64).numpy() - start.to(torch.float64).numpy()
            losses[rows] = [float(v) for v in loss.tolist()]
            counts[rows] = [int(v) for v in n.tolist()]
        diverged = {sample[i] for i in range(total) if not np.isfinite(updates[i]).all()}
        if diverged:  # a non-finite model is never quantized: that node drops before its masked input
            drop = {**drop, "masked_input": set(drop.get("masked_input", set())) | diverged}
            updates[[sample.index(i) for i in diverged]] = 0.0
        order = [sample.index(i) for i in ids]
        params = self.params if self.dp is None else self.dp.round_params(self.params, total, d)
        row: dict = {"num_clients": total}
        kept = [i for i in range(total) if sample[i] not in diverged]
        weight = sum(counts[i] for i in kept)
        row["train_loss"] = (sum(losses[i] * counts[i] for i in kept) / weight) if weight else None
        new_vec = global_vec
        try:
            out = secure_sum(updates[order], ids, params, seed=cfg.seed, round_=server_round, graph_seed=graph_seed,
                             weights=[counts[i] for i in order], drop=drop,
                             dp=None if self.dp is None else self.dp._round,
                             # the nodes' noise draws, as client/secagg_dp.py draws them (secure=false)
                             noise_rngs=None if self.dp is None else {i: node_rng(self.dp._round.seed, server_round, i)
                                                                      for i in ids})
        except SecAggFailed as exc:
            report = None
            row["secagg_failed"] = str(exc)
        else:
            report = out.report
            new_vec = torch.from_numpy((start.to(torch.float64).numpy() + out.decoded.mean).astype(np.float32))
            if self.dp is not None:
                row.update(self.dp.account(report.masked))
        row["secagg"] = _secagg_row(report, len(ids), params, row.get("secagg_failed"))
        run.meter.traffic, node_rows = _traffic(counter, start, sample, counts, losses, sched, classes, pols,
                                                server_round)
        return new_vec, row, node_rows


def _secagg_row(report, participants: int, params, failed: str | None) -> dict:
    """The round's ``secagg`` figures, as SecAggGrid writes them (less the stages' bytes)."""
    if report is None:
        return {"participants": participants, "failed": failed, "field_bits": int(params.bits)}
    return {"participants": report.participants, "dropped_after_sharing": report.dropped_after_sharing,
            "recovered": report.recovered, "threshold": report.threshold, "degree": report.degree,
            "field_bits": report.field_bits,
            "nodes": {"advertise": report.advertised, "share_keys": report.shared, "masked_input": report.masked}}


def _traffic(counter, start, sample, counts, losses, sched, classes, pols, server_round):
    """The plain train message and reply of each node (the batched engine's byte count)."""
    import json

    traffic, arrays = Traffic(), vector_to_arrayrecord(start)
    node_rows: list[dict] | None = [] if len(sample) <= NODE_ROWS_MAX else None
    steps = sched.steps.tolist()
    for i, node_id in enumerate(sample):
        policy = json.dumps(pols[i], sort_keys=True)
        down, up = counter.sizes(arrays, start, node_id, node_id - 1, counts[i], steps[i], losses[i], classes[i],
                                 policy, server_round)
        add_client(traffic, node_rows, node_id, up, down, counts[i], losses[i], classes[i], pols[i])
    return traffic, node_rows or []
