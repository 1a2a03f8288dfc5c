"""FedAvg's round on the batched engine under ``--secagg``: the clients' local SGD as one batched
computation, then the round's unmasked sum computed directly
(:func:`fedswarm.sim.batched_secagg.secure_sum`) instead of a weighted sum of plain models.

What follows the in-process server (``SecAggGrid`` and the nodes' ``secagg_mod``): each node's
update is its new model minus the global one (float64), weighted by its number of examples
(under ``--dp``: clipped, weight 1, its distributed-DP noise share, the round's field room from
:class:`~fedswarm.server.secagg_dp.SecAggDP`), its train loss appended as the nodes append it
without DP (:func:`~fedswarm.algorithms.secagg.quantize.with_loss`: the row's ``train_loss`` is the
decoded weighted mean, as ``SecAggGrid``'s); the neighbour graph's seed is the run's
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

from collections.abc import Callable

import numpy as np
import torch

from fedswarm.algorithms.privacy.distributed import node_rng
from fedswarm.algorithms.secagg import SecAggFailed
from fedswarm.algorithms.secagg.dropouts import draw_dropouts
from fedswarm.algorithms.secagg.quantize import loss_coordinate, split_loss
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.secagg import secagg_params
from fedswarm.server.secagg_dp import SecAggDP
from fedswarm.sim.batched_round import NODE_ROWS_MAX, add_clients, cohort_rows, cohort_schedule
from fedswarm.sim.batched_secagg import SecureRound, SecureSum
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["SecureFedAvg", "SecureRounds"]


class SecureRounds:
    """What every batched secure round shares with ``SecAggGrid``: the protocol's parameters,
    the run's graph-seed sequence (one draw per round from the run's seed), the simulated
    dropouts of the run's seed and the round, and distributed DP's round parameters and
    accountant (under ``--dp``). FedAvg's round (:class:`SecureFedAvg`) and the linear codecs'
    (:mod:`fedswarm.sim.batched_secagg_codec`) run on it."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.params = secagg_params(cfg)
        self.rng = np.random.default_rng([int(cfg.seed), 0x5EC])  # SecAggGrid's: one graph seed per round
        self.dp = SecAggDP(cfg.dp, cfg.seed) if cfg.dp else None
        self.rounds = 0
        self.loss = self.dp is None  # the nodes' train loss travels in the masked vector (SecAggGrid's loss)
        self.survivors: list[int] = []  # the last sum's senders (SecAggGrid's survivors)
        self.weights: dict[int, int] = {}  # the last sum's senders' weights

    def split(self, out: SecureSum | None) -> tuple[np.ndarray | None, float | None]:
        """The decoded weighted mean payload and the survivors' weighted mean train loss (None
        under DP, or where the round failed), as ``SecAggGrid`` splits them."""
        if out is None:
            return None, None
        return split_loss(out.decoded.mean, self.params.clip) if self.loss else (out.decoded.mean, None)

    def begin(self, ids: list[int], dim: int) -> SecureRound:
        """The next round over the sorted node ids ``ids`` for vectors of ``dim`` values: its
        parameters (with DP's noise room), neighbour graph and simulated dropouts."""
        self.rounds += 1
        params = self.params if self.dp is None else self.dp.round_params(self.params, len(ids), dim)
        graph_seed = int(self.rng.integers(1 << 62))
        rate = self.cfg.secagg_dropout
        drop = draw_dropouts(ids, rate, self.cfg.seed, self.rounds) if rate else {}
        return SecureRound(ids, dim, params, graph_seed=graph_seed, drop=drop)

    def finish(self, rnd: SecureRound, rows, weights, server_round: int, gone=(), failed: str | None = None,
               check: Callable[[set[int]], None] | None = None, stream: int = 0) -> tuple[SecureSum | None, dict]:
        """The round's unmasked sum of ``rows`` (node -> float vector, weighted by ``weights``:
        node -> examples; under DP each node's weight is 1) over the nodes that send, or None
        where the round fails (``failed``: it failed already; ``check(senders)`` raises
        ValueError: the server cannot use their sum, as ``SecAggGrid`` fails it); and its
        row's figures: ``secagg``, ``secagg_failed``, DP's ``epsilon``. ``stream``: the round's
        secure sum (1: Sketched-SGD's exact values), whose rounding and noise draw from their own
        stream of :func:`node_rng`, as the nodes draw that sum's noise."""
        row: dict = {}
        out = None
        self.survivors, self.weights = [], {}
        if failed is None:
            try:
                senders = rnd.senders(gone)
                if check is not None:
                    try:
                        check(senders)
                    except ValueError as exc:
                        raise SecAggFailed(f"{type(exc).__name__}: {exc}", "unmask") from None
                out = rnd.total(rows, senders, seed=self.cfg.seed, round_=server_round, weights=weights,
                                dp=None if self.dp is None else self.dp._round,
                                rngs=None if not stream else {i: node_rng(self.cfg.seed, server_round, i, stream)
                                                              for i in senders},
                                # the nodes' noise draws, as client/secagg_dp.py draws them (secure=false)
                                noise_rngs=None if self.dp is None else
                                {i: node_rng(self.dp._round.seed, server_round, i, stream) for i in senders})
            except SecAggFailed as exc:
                failed = str(exc)
        if failed is not None:
            row["secagg_failed"] = failed
        else:
            self.survivors, self.weights = sorted(out.senders), {i: int(weights[i]) for i in out.senders}
            if self.dp is not None:
                row.update(self.dp.account(out.report.masked))
        row["secagg"] = _secagg_row(None if out is None else out.report, len(rnd.ids), rnd.server.params, failed)
        return out, row


class SecureFedAvg(SecureRounds):
    """FedAvg's secure rounds: the new model is the global one plus the decoded weighted mean."""

    def round(self, run, counter, global_vec: torch.Tensor, sample: list[int],
              server_round: int) -> tuple[torch.Tensor, dict, list[dict]]:
        """Train ``sample``, sum their updates securely; the new model, the round's row, node rows."""
        cfg, trainer = self.cfg, run.trainer
        total, d = len(sample), trainer.layout.d
        sample_ids = np.fromiter(sample, dtype=np.int64, count=total)
        rnd = self.begin(sorted(sample), d + (1 if self.loss else 0))
        cohort = cohort_schedule(cfg, sample_ids, run.train_config, run.n_examples, server_round)
        start = global_vec.to(torch.float32).cpu()
        updates = np.empty((total, rnd.server.dim), dtype=np.float64)  # the loss last, as the nodes append it
        losses = np.zeros(total, dtype=np.float64)
        counts = np.zeros(total, dtype=np.int64)
        for rows, new, loss, n in trainer.fit(start, cohort.sched, momentum=cfg.momentum, chunk_size=run.chunk_size,
                                              memory_budget=run.memory_budget, on_chunk=run.progress(total)):
            updates[rows, :d] = new.cpu().to(torch.float64).numpy() - start.to(torch.float64).numpy()
            losses[rows] = loss.to(torch.float64).numpy()
            counts[rows] = n.numpy()
        if self.loss:
            updates[:, d] = [loss_coordinate(v, self.params.clip) for v in losses]
        finite = np.isfinite(updates).all(axis=1)
        # a non-finite model is never quantized: that node drops before its masked input
        row: dict = {"num_clients": total}
        out, figures = self.finish(rnd, dict(zip(sample, updates)), dict(zip(sample, counts.tolist())), server_round,
                                   gone=sample_ids[~finite].tolist())
        row.update(figures)
        mean, row["train_loss"] = self.split(out)
        new_vec = global_vec
        if out is not None:
            new_vec = torch.from_numpy((start.to(torch.float64).numpy() + mean).astype(np.float32))
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
    hidden = [None] * len(sample)  # a node's example count and loss travel inside its masked vector, as in-process
    node_rows = (cohort_rows(sample, up, down, hidden, hidden, cohort.classes(), cohort.policies())
                 if len(sample) <= NODE_ROWS_MAX else [])
    return traffic, node_rows
