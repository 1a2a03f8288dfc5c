"""Federated evaluation: the round's cohort scores the model on the nodes' own validation data.

A real server usually holds no data, so after a round the server asks the round's cohort
(every node it sent a message to that round: the nodes sampled for training, or, for a
decentralized strategy, all nodes) to score the model on their local validation split
(the ClientApp's ``evaluate`` handler, :mod:`fedswarm.client.evaluate`). A federated
strategy's nodes score the new global model the message carries; a decentralized node
(``own_model``) scores its own model, from its state. This is done by the round recorder
(:class:`~fedswarm.server.recorder.RoundRecorder`), which every strategy already calls after
each round, so no strategy class knows about it; the batched engine, which has no grid,
computes the same numbers itself (:func:`cohort_on_partitions`).

The round's ``fed_loss``/``fed_accuracy`` are the nodes' values weighted by their example
counts, ``fed_examples`` the examples scored; each node's own values go into its node-round row.
A node that fails to answer is left out (``fed_failed`` counts them).
"""

from __future__ import annotations

from typing import Any, Callable

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedswarm.protocol import OWN_MODEL_KEY

__all__ = ["NodeEval", "GridEvaluator", "aggregate", "merge_into_rows", "cohort_on_partitions"]


NodeEval = dict  # {"fed_loss": float, "fed_accuracy": float, "fed_examples": int} or {"error": str}


def aggregate(results: dict[str, NodeEval]) -> dict[str, Any]:
    """The round row's federated fields: example-weighted loss and accuracy over the nodes
    that answered (None when none did), examples scored, nodes that failed."""
    ok = [r for r in results.values() if "error" not in r and r.get("fed_examples", 0) > 0]
    n = sum(int(r["fed_examples"]) for r in ok)
    row: dict[str, Any] = {
        "fed_loss": sum(r["fed_loss"] * r["fed_examples"] for r in ok) / n if n else None,
        "fed_accuracy": sum(r["fed_accuracy"] * r["fed_examples"] for r in ok) / n if n else None,
        "fed_examples": n,
    }
    failed = len(results) - len(ok)
    if failed:
        row["fed_failed"] = failed
    return row


def merge_into_rows(results: dict[str, NodeEval], node_rows: list[dict] | None) -> None:
    """Each node's own federated values into its node-round row (a row per node of the round)."""
    for row in node_rows or []:
        res = results.get(str(row["node_id"]))
        if res is not None and "error" not in res:
            row.update(fed_loss=res["fed_loss"], fed_accuracy=res["fed_accuracy"], fed_examples=res["fed_examples"])


class GridEvaluator:
    """Sends the round's evaluate messages to the nodes through its own meter over ``grid`` (the
    nodes themselves: a ``--byzantine`` attack rewrites training replies, not these), so their
    bytes are apart from the round's training bytes (``traffic``: the last call's), and reads the replies."""

    def __init__(self, grid: Grid, train_config: ConfigRecord | None, *, own_model: bool, timeout: float):
        from fedswarm.server.metered_grid import MeteredGrid, Traffic

        self.grid = MeteredGrid(grid)
        self.traffic = Traffic()
        self.train_config = train_config
        self.own_model = own_model
        self.timeout = timeout

    def __call__(self, rnd: int, arrays: ArrayRecord | None, cohort: list[int]) -> dict[str, NodeEval]:
        config = ConfigRecord(dict(self.train_config or {}))
        config["server-round"] = int(rnd)
        if self.own_model:
            config[OWN_MODEL_KEY] = True
        content: dict[str, Any] = {"config": config}
        if not self.own_model and arrays is not None:
            content["arrays"] = arrays
        record = RecordDict(content)
        messages = [Message(record, int(node), "evaluate", group_id=str(rnd)) for node in cohort]
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))
        self.traffic = self.grid.take()
        sent = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages if m.metadata.message_id}
        results: dict[str, NodeEval] = {str(node): {"error": "no reply before the round timeout"} for node in cohort}
        for reply in replies:
            node = sent.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            if reply.has_error():
                results[str(node)] = {"error": reply.error.reason[:500]}
                continue
            metrics = reply.content.metric_records.get("metrics")
            try:
                results[str(node)] = {"fed_loss": float(metrics["eval_loss"]),
                                      "fed_accuracy": float(metrics["eval_accuracy"]),
                                      "fed_examples": int(metrics["num-examples"])}
            except (TypeError, KeyError, ValueError):
                results[str(node)] = {"error": "malformed evaluate reply"}
        return results


def cohort_on_partitions(cohort: list[int], evaluate_pid: Callable[[int], tuple[float, float, int]]
                         ) -> dict[str, NodeEval]:
    """For engines with virtual nodes and no grid (batched): node ``i`` (partition ``i - 1``)
    scored by ``evaluate_pid(partition) -> (loss, accuracy, examples)``, as its ClientApp would."""
    out: dict[str, NodeEval] = {}
    for node in cohort:
        loss, acc, n = evaluate_pid(int(node) - 1)
        out[str(node)] = {"fed_loss": float(loss), "fed_accuracy": float(acc), "fed_examples": int(n)}
    return out
