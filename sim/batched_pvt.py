"""PVT (Partial Variable Training) on the batched engine.

Server half: the strategy object itself (:class:`~fedswarm.strategies.edge.pvt.PartialVariableTraining`,
built as :func:`fedswarm.server.app.build_strategy` builds it): its ``configure_train``
samples and writes the train messages, its ``aggregate_train`` validates every reply and
averages each variable over the clients that trained it, exactly as over any grid.

Client half: each client's subset of variables is the client's own draw
(:func:`~fedswarm.strategies.edge.pvt.client_variables`: from the run seed, the round and the
node id; a class policy's ``pvt_fraction`` first), and the batched trainer trains every
sampled client at once with the other variables frozen (a ``[K, d]`` mask: no gradient step,
no momentum, as ``requires_grad = False``). The reply is the client's own
(:func:`~fedswarm.strategies.edge.pvt.reply_content`: the trained tensors' deltas in layout
order and their ids, its metrics and node report); it is built and measured for every
client (PVT's replies differ in size from class to class).
"""

from __future__ import annotations

import json

import torch
from fedswarm.local import node_report

from fedswarm.server.metered_grid import Traffic, serialized_size
from fedswarm.sim.batched_fleet import fleet_of
from fedswarm.sim.batched_round import (NODE_ROWS_MAX, NodeIds, add_client, make_reply, mark_rejected,
                                        strategy_round, varint_len)
from fedswarm.strategies.edge.pvt import client_variables, reply_content
from fedswarm.strategies.registry import resolve_params
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["PVTRounds"]


class PVTRounds:
    """Rounds of ``pvt``; ``model`` is the global model."""

    def __init__(self, run, model: torch.Tensor, notes=None):
        self.run = run
        self.layout = run.trainer.layout
        self.strategy = run.strategy()
        self.strategy.bind_notes(notes)
        self.params = resolve_params(run.cfg.strategy, run.cfg.params)
        self.model = model
        self.grid = NodeIds(run.cfg.clients)
        self.fleet = fleet_of(run, self.strategy)  # --quorum, --over-select, --eligible, --availability

    def _selection(self, node_ids: list[int], pols: list[dict], server_round: int) -> tuple[list, torch.Tensor]:
        """Each client's variable ids (as its ``client_update`` draws them) and the ``[K, d]`` mask of them."""
        n_vars = len(self.layout)
        ids, mask = [], torch.zeros(len(node_ids), self.layout.d, dtype=torch.bool)
        for i, (nid, pol) in enumerate(zip(node_ids, pols)):
            chosen = client_variables(n_vars, pol, self.params, self.run.cfg.seed, server_round, nid)
            for sl in self.layout.coords(chosen):
                mask[i, sl] = True
            ids.append(chosen)
        return ids, mask

    def round(self, server_round: int) -> tuple[dict, list[dict]]:
        run, strategy, arrays = self.run, self.strategy, vector_to_arrayrecord(self.model)
        fleet = self.fleet.start(server_round) if self.fleet is not None else None  # the pool it samples from
        grid = self.grid if fleet is None else self.fleet
        messages, node_ids, sched, classes, pols = strategy_round(run, strategy, grid, arrays, server_round)
        total = len(node_ids)
        ids, mask = self._selection(node_ids, pols, server_round)
        x = self.model
        traffic = Traffic()
        node_rows: list[dict] | None = [] if total <= NODE_ROWS_MAX else None
        down_cache: dict[int, int] = {}
        replies, downs, ups, metrics_of = [], [], [], []
        for rows, new, loss, n in run.trainer.fit(x, sched, momentum=run.cfg.momentum, chunk_size=run.chunk_size,
                                                  memory_budget=run.memory_budget, on_chunk=run.progress(total),
                                                  trained=mask):
            new = new.cpu()
            n_list, loss_list, steps_list = n.tolist(), loss.tolist(), sched.steps[rows].tolist()
            for j, k in enumerate(range(rows.start, rows.stop)):
                delta = self.layout.take(new[j], ids[k]) - self.layout.take(x, ids[k])  # as client_update's
                node = node_report(classes[k], json.dumps(pols[k], sort_keys=True))
                content = reply_content(delta, ids[k], self.params["send_ids"], n_list[j], loss_list[j],
                                        steps_list[j], node)
                ins = messages[k]
                key = varint_len(ins.metadata.dst_node_id)  # every train message carries the same records
                if key not in down_cache:
                    down_cache[key] = serialized_size(ins)
                reply = make_reply(ins, content)
                replies.append(reply)
                downs.append(down_cache[key])
                ups.append(serialized_size(reply))
                metrics_of.append((n_list[j], loss_list[j]))
        kept = list(range(total))
        if fleet is not None:  # every sampled client trained; the strategy gets the replies the fleet keeps
            kept, lost, lost_down = self.fleet.kept_messages(replies, downs, ups, server_round, fleet[2])
        for k in kept:
            add_client(traffic, node_rows, node_ids[k], ups[k], downs[k], metrics_of[k][0], metrics_of[k][1],
                       classes[k], pols[k])
        replies = [replies[k] for k in kept]
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        mark_rejected(node_rows, replies)  # a diverged client's non-finite reply, refused by the strategy
        if arrays is not None:
            self.model = arrayrecord_to_vector(arrays, self.layout.d)
        run.meter.traffic = traffic
        train_loss = float(metrics["train_loss"]) if metrics is not None else None
        row = {"train_loss": train_loss, "num_clients": len(kept)}
        if fleet is not None:  # sent, never answered in time: their bytes down count
            traffic.bytes_down += lost_down
            return row, self.fleet.close(row, node_rows or [], fleet[1], fleet[2], lost)
        return row, node_rows or []
