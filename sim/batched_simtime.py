"""Simulated time of the batched engine's rounds with ``--devices`` alone (no fleet options).

On the in-process engine a synchronous federated round's simulated time is
:func:`fedswarm.sim.simtime.make_round_timer`'s: ``max`` over the round's non-error replies of the
node's download + compute + upload on its profile, its bytes as the meter counted them that round
(every message to and from it, a second exchange's too) and its compute from the ``steps`` its train
reply reports (a reply without ``steps``, a second exchange's, computes on its ``num-examples``:
0 for the sketch strategies' plain phase 2). Without the fleet options nothing there times a
node out: the round waits for every sampled node (a straggler's 10x slower compute makes the round
longer, it does not leave it), and a node is left out only when its ClientApp fails.

:class:`RoundClock` computes the same on the batched engine, after any round runner's round, from
what every runner leaves behind: the round's :class:`~fedswarm.server.metered_grid.Traffic`
(each node's bytes, as the in-process meter counts them: the batched engine's tests hold the
bytes equal) and its node rows (a ``failed`` node sent an error reply, which the in-process timer
skips). Each node's steps are its policy's, :func:`~fedswarm.sim.batched_round.cohort_schedule`'s,
what its train reply reports. The per-node seconds are the batched fleet's
(:meth:`fedswarm.sim.batched_fleet.BatchedFleet.seconds`, the time model's node time over arrays):
``--devices`` alone is the fleet with every node on and eligible and no quorum, whose round is
the slowest node's.

Under the fleet options the fleet's rounds carry their own simulated time (:mod:`fedswarm.sim.batched_fleet`)
and FedBuff's runner its virtual clock's; the engine asks :class:`RoundClock` only for a row that
has none. Past :data:`~fedswarm.sim.batched_round.NODE_ROWS_MAX` clients a round keeps no node
rows, so a node that failed there (its own code raised: rare) would count in the round's time.

Not under ``--secagg`` (rows carry ``sim_time_s = null``): there the in-process meter sees the
protocol's stage messages, whose replies carry no ``steps`` (its round timer counts their transfers
and no compute: 0.02 s a round for 2 steps on a 10x-slow straggler, which takes 3.2 s), and the
batched engine counts the plain train message and reply instead; neither figure is the other's,
so none is recorded here.
"""

from __future__ import annotations

import numpy as np

from fedswarm.server.metered_grid import Traffic
from fedswarm.sim.batched_round import CohortBytes, cohort_nodes, cohort_schedule

__all__ = ["RoundClock", "round_clock_for", "node_bytes"]


def node_bytes(counts, ids: np.ndarray) -> np.ndarray:
    """Each of ``ids``' bytes in a Traffic's ``node_up``/``node_down`` (a dict or a
    :class:`~fedswarm.sim.batched_round.CohortBytes`; a node given twice counts the sum), as int64."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(counts, CohortBytes) and counts._dict is None:
        if not ids.size or not counts.ids.size:
            return np.zeros(len(ids), dtype=np.int64)
        order = np.argsort(counts.ids, kind="stable")
        sid, sval = counts.ids[order], counts.values[order].astype(np.int64)
        if np.array_equal(sid, ids):  # each node once, and the nodes asked: a round's cohort
            return sval
        # the cohort's (id, bytes) pairs summed per id, read back at ``ids``
        starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
        uniq, sums = sid[starts], np.add.reduceat(sval, starts)
        pos = np.minimum(np.searchsorted(uniq, ids), len(uniq) - 1)
        return np.where(uniq[pos] == ids, sums[pos], 0).astype(np.int64)
    return np.fromiter((int(counts.get(int(i), 0)) for i in ids.tolist()), dtype=np.int64, count=len(ids))


class RoundClock:
    """See the module's docstring. ``run``: the engine's :class:`~fedswarm.sim.batched.BatchedRun`."""

    def __init__(self, run):
        from fedswarm.sim.batched_fleet import BatchedFleet

        self.cfg, self.train_config, self.n_examples = run.cfg, run.train_config, run.n_examples
        # the fleet with no options: every node on and eligible, no quorum; only its node time is asked
        self.fleet = BatchedFleet(run.cfg, run.train_config, run.n_examples, None, run.meter)

    def round_time(self, server_round: int, traffic: Traffic, node_rows: list[dict]) -> float | None:
        """Round ``server_round``'s simulated seconds: the slowest node that replied (None: none did)."""
        down_ids, up_ids = cohort_nodes(traffic.node_down), cohort_nodes(traffic.node_up)  # sorted, distinct
        ids = down_ids if np.array_equal(down_ids, up_ids) else np.union1d(down_ids, up_ids)
        failed = [int(r["node_id"]) for r in node_rows if r.get("status") == "failed"]
        if failed:
            ids = np.setdiff1d(ids, np.asarray(failed, dtype=np.int64))
        if not ids.size:
            return None
        steps = cohort_schedule(self.cfg, ids, self.train_config, self.n_examples, server_round).sched.steps.numpy()
        t = self.fleet.seconds(ids, node_bytes(traffic.node_down, ids), node_bytes(traffic.node_up, ids), steps)
        return float(t.max())


def round_clock_for(run) -> RoundClock | None:
    """The run's :class:`RoundClock`: with ``--devices``, none of the fleet options (they time their
    rounds themselves) and no ``--secagg`` (see the module's docstring), else None."""
    cfg = run.cfg
    return RoundClock(run) if cfg.devices and not cfg.fleet_options() and not cfg.secagg else None
