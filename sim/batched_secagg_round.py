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
from fedswarm.sim.batched_round import NODE_ROWS_MAX, add_clients, cohort_rows, cohort_schedule
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
        total, d = len(sample), trainer.layout.d
        sample_ids = np.fromiter(sample, dtype=np.int64, count=total)
        order = np.argsort(sample_ids, kind="stable")  # the protocol's node order: sorted ids
        ids = sample_ids[order].tolist()
        graph_seed = int(self.rng.integers(1 << 62))
        drop = draw_dropouts(ids, cfg.secagg_dropout, cfg.seed, self.rounds) if cfg.secagg_dropout else {}
        cohort = cohort_schedule(cfg, sample_ids, run.train_config, run.n_examples, server_round)
        start = global_vec.to(torch.float32).cpu()
        updates = np.empty((total, d), dtype=np.float64)
        losses = np.zeros(total, dtype=np.float64)
        counts = np.zeros(total, dtype=np.int64)
        for rows, new, loss, n in trainer.fit(start, cohort.sched, momentum=cfg.momentum, chunk_size=run.chunk_size,
                                              memory_budget=run.memory_budget, on_chunk=run.progress(total)):
            updates[rows] = new.cpu().to(torch.float64).numpy() - start.to(torch.float64).numpy()
            losses[rows] = loss.to(torch.float64).numpy()
            counts[rows] = n.numpy()
        finite = np.isfinite(updates).all(axis=1)
        if not finite.all():  # a non-finite model is never quantized: that node drops before its masked input
            drop = {**drop, "masked_input": set(drop.get("masked_input", set())) | set(sample_ids[~finite].tolist())}
            updates[~finite] = 0.0
        params = self.params if self.dp is None else self.dp.round_params(self.params, total, d)
        row: dict = {"num_clients": total}
        weight = int(counts[finite].sum())
        row["train_loss"] = float((losses[finite] * counts[finite]).sum() / weight) if weight else None
        new_vec = global_vec
        try:
            out = secure_sum(updates[order], ids, params, seed=cfg.seed, round_=server_round, graph_seed=graph_seed,
                             weights=counts[order].tolist(), drop=drop,
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
        run.meter.traffic, node_rows = _traffic(counter, start, sample, sample_ids, counts, losses, cohort,
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


def _traffic(counter, start, sample, sample_ids, counts, losses, cohort, server_round):
    """The plain train message and reply of each node (the batched engine's byte count), as
    FedAvg's round counts them: one measured message and reply per size key."""
    down, up = counter.cohort_sizes(vector_to_arrayrecord(start), start, sample_ids, counts, cohort.sched.steps.numpy(),
                                    cohort, server_round)
    traffic = Traffic()
    add_clients(traffic, sample, up, down)
    node_rows = (cohort_rows(sample, up, down, counts.tolist(), losses.tolist(), cohort.classes(), cohort.policies())
                 if len(sample) <= NODE_ROWS_MAX else [])
    return traffic, node_rows
