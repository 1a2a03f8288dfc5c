"""FedBuff on the batched engine: the in-process run's events, its clients trained in waves.

The event order is :class:`~fedswarm.algorithms.fedbuff.AsyncSchedule`'s, the one the Flower
strategy (:class:`~fedswarm.strategies.federated.fedbuff.FedBuff`) follows on the in-process engine:
dispatch the free slots, take the earliest arrival, fold every K. A dispatched client's local SGD
does not depend on when it runs (its start model and its round seed are fixed at dispatch), so
clients are trained lazily: when an arrival's update is needed, every client dispatched and not yet
trained is trained then, one batch per model version they start from (a *wave*: with K = 10, the
10 clients dispatched between two aggregations). The fold is :class:`~fedswarm.algorithms.fedbuff.FedBuffer`'s,
the strategy object's own (and its ``--dp`` mechanism). Same seed, same fleet: the same models as
``--engine inprocess`` (tests/test_fedbuff_batched.py). Bytes are the real messages' sizes as
:class:`~fedswarm.sim.batched_round.ByteCounter` builds them (Flower's plain train message: without
the strategy's ``fedbuff-version`` key, a few bytes a message fewer than in-process).

With an uplink codec, each wave's clients run ``compressed_fedavg``'s client step (the one the
ClientApp runs with C = 1) once per uplink, with their error-feedback rows
(:class:`~fedswarm.sim.batched_round.ClientRows`); each arrival's real ``train.fedbuff`` message and
reply (its one-row payload) are built, metered, and the reply is read by the strategy's own
``parse_update``, the in-process server's reading.

``--eligible`` (or a class's ``eligible`` policy): the dispatch goes through the strategy's own
:class:`~fedswarm.strategies.federated.fedbuff_eligibility.DispatchRules`, as in-process: the same
nodes drawn, the same ``ineligible`` rows.
"""

from __future__ import annotations

import json
from collections import defaultdict

import torch

from flwr.app import ConfigRecord, Message, RecordDict

from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState
from fedswarm.algorithms.fedbuff import AsyncSchedule, InFlight, Stale
from fedswarm.local import node_report, train_reply
from fedswarm.payload import PayloadError
from fedswarm.server.metered_grid import Traffic, serialized_size
from fedswarm.sim.batched_round import (ByteCounter, ClientRows, add_client, as_pushed, make_reply, reject_diverged,
                                        round_schedule)
from fedswarm.strategies.federated.compressed_client import KNOBS
from fedswarm.strategies.federated.compressed_fedavg import client_step, uplink_of
from fedswarm.strategies.strategy_utils import clean_reason
from fedswarm.wire import payload_to_records, vector_to_arrayrecord

__all__ = ["FedBuffRounds"]


class FedBuffRounds:
    """The batched round runner of ``fedbuff``: ``round(n)`` runs events until the n-th aggregation."""

    def __init__(self, run, model: torch.Tensor, notes=None):
        self.run = run
        self.model = model
        self.notes = notes
        strategy = run.strategy()
        self.strategy = strategy
        self.buffer, self.dp = strategy.buffer, strategy.dp
        self.rules = strategy.eligibility  # --eligible: which idle nodes may be dispatched (None: all)
        # with an uplink codec: partition id -> its error-feedback residual (zeros before its first update)
        self.residuals = ClientRows(model.numel(), run.cfg.clients) if strategy.codec is not None else None
        self.timed = strategy.duration is not None
        # --availability: only nodes that are on are dispatched, a dispatch that drops is given up after
        # round_timeout (simulated), as the in-process strategy's schedule does
        self.sched = AsyncSchedule(range(1, run.cfg.clients + 1), strategy.concurrency, strategy.duration,
                                   seed=strategy.seed, availability=strategy.availability,
                                   timeout=float(run.cfg.round_timeout))
        self.counter = ByteCounter(run.train_config)
        self.version = 0
        self.sent: dict[int, torch.Tensor] = {}  # version -> the model its clients start from
        self.untrained: list[InFlight] = []
        self.results: dict[int, tuple] = {}  # dispatch seq -> (model, loss, examples, steps, class, policy)
        self.t_last = 0.0

    def _dispatch(self) -> None:
        if self.rules is None:
            jobs = self.sched.dispatch(self.version)
        else:
            jobs = self.rules.dispatch(self.sched, self.version, self.run.train_config)
        if jobs:
            self.sent[self.version] = self.model
            # a lost dispatch never trains: in-process its message is never pulled, so its ClientApp
            # never runs (with a codec, its residual does not move)
            self.untrained.extend(j for j in jobs if not j.lost)

    def _train_waiting(self) -> None:
        """Train every dispatched, untrained client: one batch per start version."""
        cfg, trainer = self.run.cfg, self.run.trainer
        waves: dict[int, list[InFlight]] = defaultdict(list)
        for job in self.untrained:
            waves[job.version].append(job)
        self.untrained = []
        for version, jobs in sorted(waves.items()):
            sched, classes, pols = round_schedule(cfg, [j.node for j in jobs], self.run.train_config,
                                                  self.run.n_examples, version + 1)
            for rows, new, loss, n in trainer.fit(self.sent[version], sched, momentum=cfg.momentum,
                                                  chunk_size=self.run.chunk_size,
                                                  memory_budget=self.run.memory_budget):
                sent = self._encode(version, jobs[rows.start:rows.stop], new.detach().cpu(), pols[rows.start:rows.stop])
                for j, i in enumerate(range(rows.start, rows.stop)):
                    self.results[jobs[i].seq] = (sent[j], float(loss[j]), int(n[j]),
                                                 int(sched.steps[i]), classes[i], pols[i])

    def _encode(self, version: int, jobs: list[InFlight], new: torch.Tensor, pols: list[dict]) -> list:
        """What each client of a chunk sends: its new model, or with a codec its one-row payload of
        ``compressed_fedavg``'s client step, run once per uplink with the clients' residuals."""
        if self.residuals is None:
            return [new[j].clone() for j in range(len(jobs))]
        from fedswarm.sim.batched_compressed import client_payload

        knobs, seed, layout = self.strategy.knobs(version), self.run.cfg.seed, self.strategy.layout
        delta = new - self.sent[version][None]
        groups: dict = defaultdict(list)
        for j, (job, pol) in enumerate(zip(jobs, pols)):
            groups[uplink_of(knobs, pol, seed, job.node - 1)].append(j)
        out: list = [None] * len(jobs)
        for uplink, members in groups.items():
            pids = [jobs[j].node - 1 for j in members]
            state = ErrorFeedbackState(self.residuals.stack(pids)) if uplink.error_feedback else ErrorFeedbackState()
            payload, state = client_step(uplink, state, delta[torch.tensor(members)], layout)
            if uplink.error_feedback:
                self.residuals.keep_stacked(pids, state.residual)
            for i, j in enumerate(members):
                out[j] = client_payload(payload, i, uplink.seed)
        return out

    def _train_message(self, job: InFlight) -> Message:
        """The message the in-process strategy pushes for dispatch ``job`` (``train.fedbuff`` with the
        codec's knobs, else a plain train message), its version key included."""
        from flwr.app import MessageType

        from fedswarm.strategies.federated.fedbuff import MESSAGE_TYPE, VERSION_KEY

        config = ConfigRecord(dict(self.run.train_config))
        config["server-round"] = job.version + 1
        config[VERSION_KEY] = job.version
        record = RecordDict({"arrays": vector_to_arrayrecord(self.sent[job.version]), "config": config})
        if self.residuals is None:
            return Message(record, job.node, MessageType.TRAIN)
        record[KNOBS] = self.strategy.knobs(job.version)
        return Message(record, job.node, MESSAGE_TYPE)

    def _codec_reply(self, job: InFlight, payload, n: int, steps: int, loss: float, cls: str,
                     pol: dict) -> tuple[int, int, Message]:
        """(bytes down, bytes up, reply) of a codec run's arrival: its real ``train.fedbuff`` message
        and the reply its ClientApp sends (:func:`~fedswarm.strategies.federated.fedbuff.client_update`)."""
        ins = self._train_message(job)
        node = node_report(cls, json.dumps(pol, sort_keys=True), **{"partition-id": job.node - 1})
        reply = make_reply(ins, train_reply(payload_to_records(payload, RecordDict()), n, loss, steps, node))
        return serialized_size(ins), serialized_size(reply), reply

    def round(self, server_round: int) -> tuple[dict, list[dict]]:
        traffic, node_rows = Traffic(), []
        at: dict[int, int] = {}  # node -> its row: one per node per aggregation, as the recorder keeps them
        by_node: dict[str, list[int]] = defaultdict(list)
        lost: list[int] = []  # nodes whose dispatch was given up in this aggregation (--availability)
        lost_down: dict[int, int] = {}  # their messages' bytes
        while not self.buffer.ready:
            self._dispatch()
            job = self.sched.arrive()
            if job.lost:  # dropped mid-training: no update, given up after the timeout; its message went down
                lost.append(job.node)
                down = serialized_size(as_pushed(self._train_message(job)))
                traffic.bytes_down += down
                traffic.node_down[job.node] += down
                lost_down[job.node] = lost_down.get(job.node, 0) + down
                continue
            if job.seq not in self.results:
                self._train_waiting()
            new, loss, n, steps, cls, pol = self.results.pop(job.seq)
            start = self.sent[job.version]
            reply = None
            if self.residuals is not None:  # a codec: `new` is the client's payload
                down, up, reply = self._codec_reply(job, new, n, steps, loss, cls, pol)
            else:
                down, up = self.counter.sizes(vector_to_arrayrecord(start), new, job.node, job.node - 1, n, steps,
                                              loss, cls, json.dumps(pol, sort_keys=True), job.version + 1)
            if job.node in at:  # a fast node's second update in this aggregation: its bytes join its row
                add_client(traffic, None, job.node, up, down, n, loss, cls, pol)
                row = node_rows[at[job.node]]
                row["bytes_up"] += up
                row["bytes_down"] += down
            else:
                at[job.node] = len(node_rows)
                add_client(traffic, node_rows, job.node, up, down, n, loss, cls, pol)
            staleness = self.version - job.version
            by_node[str(job.node)].append(staleness)
            if reply is not None:
                try:
                    delta = self.strategy.parse_update(reply, start)  # the server's own reading
                except PayloadError as exc:
                    _reject(self.notes, node_rows[at[job.node]], job.node, str(exc), clean_reason(exc))
                    continue
            elif not bool(torch.isfinite(new).all()):
                reject_diverged(self.notes, node_rows, job.node, new, n, row=at[job.node])
                continue
            else:
                delta = new - start
            try:
                self.buffer.add(delta, staleness)
            except Stale as exc:
                _reject(self.notes, node_rows[at[job.node]], job.node, str(exc), str(exc))
                continue
        privatize = None
        if self.dp is not None:
            self.dp.before_round()
            privatize = self.dp.privatize
        self.model, metrics = self.buffer.fold(self.model, privatize)
        self.version += 1
        in_use = {j.version for j in self.sched.flying}
        for v in [v for v in self.sent if v not in in_use]:
            del self.sent[v]
        self.run.meter.traffic = traffic
        # the round's loss as the recorder takes it: each node's first reply, the refused nodes' left out
        kept = [r for r in node_rows if "status" not in r and r.get("train_loss") is not None]
        n_sum = sum(r["num_examples"] for r in kept)
        loss = sum(r["train_loss"] * r["num_examples"] for r in kept) / n_sum if n_sum else None
        row = {"train_loss": loss, "num_clients": len(node_rows), **metrics,
               "model_version": self.version, "in_flight": self.sched.in_flight, "lost": len(lost),
               "staleness_by_node": dict(by_node)}
        if self.timed:
            row.update(sim_time_s=self.sched.now - self.t_last, sim_clock_s=self.sched.now)
            self.t_last = self.sched.now
        # a given-up node with no update in this aggregation: failed, as the recorder writes a node that
        # was sent a message and never answered (counted in num_clients, as the recorder counts it)
        for node in sorted(set(lost) & set(at)):  # ... or one that arrived again: its row has the bytes
            node_rows[at[node]]["bytes_down"] += lost_down[node]
        for node in sorted(set(lost) - set(at)):
            node_rows.append({"node_id": str(node), "bytes_up": 0, "bytes_down": lost_down[node], "status": "failed",
                              "reason": "no reply before the round's timeout"})
            row["num_clients"] += 1
        if self.rules is not None:  # the nodes passed over (not counted in num_clients, as in-process)
            node_rows += self.rules.rows(lambda n: str(n) in by_node)
        return row, node_rows


def _reject(notes, row: dict, node: int, note: str, reason: str) -> None:
    """Refuse ``node``'s update: ``note`` to the recorder's rejections, ``reason`` on its row (no loss)."""
    notes.reject(node, note)
    row.update(status="rejected", reason=reason)
    row.pop("train_loss", None)
