"""ProgFed (progressive training) on the batched engine.

Server half: the strategy object itself (:class:`~fedswarm.strategies.edge.progfed.ProgFed`,
built as :func:`fedswarm.server.app.build_strategy` builds it): its ``configure_train``
picks the stage, samples the nodes and writes the train messages (the stage's sub-model,
the heads kept for capped classes), its ``aggregate_train`` validates every reply (a
diverged client's non-finite delta is rejected there, with the reason the in-process run
records) and averages each parameter over the clients that trained it; after the round
its ``evaluate_stage`` notes the stage sub-model's test metrics, as the evaluation that
``ProgFed.start`` wraps does.

Client half: what each device class trains is the client's own reading of the message
(:func:`~fedswarm.strategies.edge.progfed.stage_start`: the round's stage or the class's
cap, that stage's sub-model and start parameters). The clients of one trained stage are
trained at once by a :class:`~fedswarm.sim.batched_trainer.BatchedTrainer` over that
stage's sub-model (one trainer, and so one ``[C, d_s]`` layout, per stage). Each client's
reply is the client's own (:func:`~fedswarm.strategies.edge.progfed.reply_content`: the
delta, ``num-examples``, ``train_loss``, ``steps``, ``stage``, and ``flops`` from
:func:`~fedswarm.strategies.edge.progfed.flops_per_sample` ×
:func:`~fedswarm.algorithms.selection.progfed.samples_processed`), built and measured
for every client.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import torch
from fedswarm.local import node_report

from fedswarm.algorithms.selection.progfed import samples_processed
from fedswarm.server.metered_grid import Traffic, serialized_size
from fedswarm.sim.batched_fleet import fleet_of
from fedswarm.sim.batched_round import (NODE_ROWS_MAX, NodeIds, add_client, make_reply, mark_rejected,
                                        strategy_round, varint_len)
from fedswarm.sim.batched_trainer import BatchedTrainer, ClientSchedule
from fedswarm.strategies.edge.progfed import stage_submodel, flops_per_sample, reply_content, stage_start
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["ProgFedRounds"]


def _rows(sched: ClientSchedule, idx: torch.Tensor) -> ClientSchedule:
    """The schedule of the clients at positions ``idx``."""
    return ClientSchedule(sched.partitions[idx], sched.steps[idx], sched.batch_size[idx], sched.lr[idx],
                          sched.seeds[idx])


class ProgFedRounds:
    """Rounds of ``progfed``; ``model`` is the global (full) model."""

    def __init__(self, run, model: torch.Tensor, notes=None):
        self.run = run
        self.strategy = run.strategy()
        self.strategy.bind_notes(notes)
        self.model = model
        self.grid = NodeIds(run.cfg.clients)
        self.fleet = fleet_of(run, self.strategy)  # --quorum, --over-select, --eligible, --availability
        self.staged = run.trainer.task.model(run.cfg.seed)  # the clients' model: its stages' sub-models
        self._trainers: dict[int, BatchedTrainer] = {}
        self._samples: dict[tuple[int, int, int], int] = {}

    def _trainer(self, stage: int) -> BatchedTrainer:
        """The batched trainer of ``stage``'s sub-model over the run's partition."""
        if stage not in self._trainers:
            t = self.run.trainer
            self._trainers[stage] = BatchedTrainer(t.task, t.x, t.y, t.flat_idx, t.offsets, t.device,
                                                   model=stage_submodel(self.staged, stage))
        return self._trainers[stage]

    def _flops(self, stage: int, n: int, batch_size: int, steps: int) -> float:
        """A client's training FLOPs, as its ``client_update`` counts them."""
        key = (n, batch_size, steps)
        if key not in self._samples:
            self._samples[key] = samples_processed(n, batch_size, steps)
        t = self.run.trainer
        sub = stage_submodel(self.staged, stage)
        return float(flops_per_sample(sub, t.task.objective, t.x[:1], t.y[:1]) * self._samples[key])

    def round(self, server_round: int) -> tuple[dict, list[dict]]:
        run, strategy, arrays = self.run, self.strategy, vector_to_arrayrecord(self.model)
        fleet = self.fleet.start(server_round) if self.fleet is not None else None  # the pool it samples from
        grid = self.grid if fleet is None else self.fleet
        messages, node_ids, sched, classes, pols = strategy_round(run, strategy, grid, arrays, server_round)
        total = len(node_ids)
        start = arrayrecord_to_vector(messages[0].content.array_records["arrays"])  # every message's arrays
        # what each class trains (one reading of the message per class: they all carry the same records)
        per_class: dict[str, tuple] = {}
        by_stage: dict[int, list[int]] = defaultdict(list)
        for k, c in enumerate(classes):
            if c not in per_class:
                trains, _, vec = stage_start(messages[k], self.staged, pols[k], start)
                per_class[c] = (trains, vec)
            by_stage[per_class[c][0]].append(k)
        policy_json = {c: json.dumps(p, sort_keys=True) for c, p in zip(classes, pols)}
        down_cache: dict[int, int] = {}
        for ins in messages:  # measured as sent: before a reply gives the message its id
            key = varint_len(ins.metadata.dst_node_id)  # every train message carries the same records
            if key not in down_cache:
                down_cache[key] = serialized_size(ins)
        downs = [down_cache[varint_len(nid)] for nid in node_ids]
        replies: list = [None] * total
        ups = [0] * total
        progress = run.progress(total)
        for trains, members in sorted(by_stage.items()):
            idx = torch.tensor(members)
            sub_sched = _rows(sched, idx)
            vec = per_class[classes[members[0]]][1]
            for rows, new, loss, n in self._trainer(trains).fit(vec, sub_sched, momentum=run.cfg.momentum,
                                                                chunk_size=run.chunk_size,
                                                                memory_budget=run.memory_budget, on_chunk=progress):
                delta = (new.cpu() - vec).numpy()
                n_list, loss_list = n.tolist(), loss.tolist()
                steps_list, bs_list = sub_sched.steps[rows].tolist(), sub_sched.batch_size[rows].tolist()
                for j, i in enumerate(range(rows.start, rows.stop)):
                    k = members[i]
                    node = node_report(classes[k], policy_json[classes[k]])
                    flops = self._flops(trains, n_list[j], bs_list[j], steps_list[j])
                    content = reply_content(np.ascontiguousarray(delta[j]), n_list[j], loss_list[j], steps_list[j],
                                            trains, flops, node)
                    replies[k] = make_reply(messages[k], content)
                    ups[k] = serialized_size(replies[k])  # measured before the server reads (and marks) it
        traffic = Traffic()
        node_rows: list[dict] | None = [] if total <= NODE_ROWS_MAX else None
        kept = list(range(total))
        if fleet is not None:  # every sampled client trained; the strategy gets the replies the fleet keeps
            kept, lost, lost_down = self.fleet.kept_messages(replies, downs, ups, server_round, fleet[2])
        for k in kept:
            metrics = replies[k].content.metric_records["metrics"]
            add_client(traffic, node_rows, node_ids[k], ups[k], downs[k], int(metrics["num-examples"]),
                       float(metrics["train_loss"]), classes[k], pols[k])
        replies = [replies[k] for k in kept]
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        mark_rejected(node_rows, replies)
        if arrays is not None:
            self.model = arrayrecord_to_vector(arrays, run.trainer.layout.d)
        strategy.evaluate_stage(self.model)  # as the evaluation ProgFed.start wraps: the stage's sub-model
        run.meter.traffic = traffic
        train_loss = float(metrics["train_loss"]) if metrics is not None else None
        row = {"train_loss": train_loss, "num_clients": len(kept)}
        if fleet is not None:  # sent, never answered in time: their bytes down count
            traffic.bytes_down += lost_down
            return row, self.fleet.close(row, node_rows or [], fleet[1], fleet[2], lost)
        return row, node_rows or []
