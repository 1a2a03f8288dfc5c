"""Records every round to the run store and obeys controls between rounds.

:class:`RoundRecorder` is passed to ``Strategy.start`` as its ``evaluate_fn``: Flower
calls it after every round with the new global arrays. It evaluates the model on the
held-out test set, reads what crossed the :class:`MeteredGrid` that round, writes the
round with its per-node rows (those of the replies and those an engine made itself,
:meth:`RoundRecorder.node_rows`) in one transaction, tells listeners (progress bars),
and then applies pending controls from the store (pause blocks until resume, stop ends
the run, add_rounds extends it).

It is also the strategies' :class:`~fedswarm.strategies.strategy_utils.RoundNotes`: what a
strategy notes goes into the round's row, and every reply it rejects (with its reason) into
the store's ``rejections`` table, the node's row (``status = rejected``) and the round's
``rejected`` count and ``rejected_reasons``.

Federated evaluation (:mod:`fedswarm.server.fed_eval`): every ``eval_every``-th round, when
``fed_eval`` is set, the round's cohort scores the model on its own validation data; the
round row gets ``fed_loss``, ``fed_accuracy``, ``fed_examples`` (and the evaluate messages'
bytes as ``eval_bytes_up``/``eval_bytes_down``, apart from the round's training bytes), each
node's row its own values. With ``central_eval`` off the server holds no test set: ``evaluate``
is None and ``test_loss``/``test_accuracy`` stay null. Each node's device telemetry (the
``report.telemetry`` record of its reply, :mod:`fedswarm.telemetry`) goes into its row as
``telemetry``; the round's telemetry bytes are ``bytes_telemetry``.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from typing import Any, Callable

from flwr.app import ArrayRecord, MetricRecord

from fedswarm.algorithms.privacy.accountant import PrivacyBudgetExceeded
from fedswarm.policy import PolicyBook
from fedswarm.store import Store
from fedswarm.store.liveness import owner_fields
from fedswarm.store.rows import NOT_PICKED
from fedswarm.server.fed_eval import aggregate, merge_into_rows
from fedswarm.protocol import TELEMETRY_RECORD
from fedswarm.server.metered_grid import MeteredGrid
from fedswarm.strategies.strategy_utils import RoundNotes

log = logging.getLogger("fedswarm.server")

__all__ = ["RoundRecorder", "StopRun", "RoundListener", "run_recorded"]

RoundListener = Callable[[int, dict[str, Any]], None]


class StopRun(Exception):
    """Raised between rounds when a stop control arrives."""


class RoundRecorder(RoundNotes):
    def __init__(
        self,
        store: Store,
        run_id: str,
        grid: MeteredGrid,
        evaluate: Callable[[Any], tuple[float, float]] | None,
        *,
        listeners: list[RoundListener] | None = None,
        sim_time: Callable[[int, Any], float | None] | None = None,
        policies: PolicyBook | None = None,
        node_kind: str = "sim",
        train_config: Any = None,
        poll_s: float = 0.2,
        observers: list[Callable[[Any], dict[str, Any]]] | None = None,
    ):
        super().__init__()
        self.store = store
        self.run_id = run_id
        self.grid = grid
        self.evaluate = evaluate
        self.listeners = list(listeners or [])
        self.sim_time = sim_time
        self.policies = policies if policies is not None else PolicyBook()
        self.train_config = train_config  # the ConfigRecord every train message carries
        self.node_kind = node_kind  # "sim" (virtual nodes) or "supernode" (real SuperNodes)
        self.poll_s = poll_s
        self.observers = list(observers or [])  # observer(traffic) -> metrics for the round's row
        self.offset = 0  # rounds done by earlier calls of Strategy.start (add_rounds, resume)
        # checkpoint(round, arrays) after every checkpoint_every-th recorded round, the final round
        # (final_round: the store then holds the run's last model) and after a control changed the run
        # (fedswarm.server.checkpoint); with checkpoint_at_round_end the strategy calls round_done()
        # when its round's own updates are made (HL evaluates before it learns from the round)
        self.checkpoint: Callable[[int, ArrayRecord], Any] | None = None
        self.checkpoint_every = 1
        self.final_round: int | None = None
        self.checkpoint_at_round_end = False
        self._unsaved: tuple[int, ArrayRecord] | None = None
        self.min_train_nodes: int | None = None  # the strategy's minimum, said in rounds that lost nodes
        # a resumed run with client state: the node ids asked for their state (server.client_state)
        # and the checkpoint's round; a node first seen after that query is named (late_nodes)
        self.resume_asked: set[str] | None = None
        self.resume_round = 0
        self.extra_rounds = 0
        self.last_round = 0
        # federated evaluation: fed_eval(round, arrays, cohort) -> {node_id: values}, every eval_every rounds
        self.fed_eval: Callable[[int, Any, list[int]], dict[str, dict]] | None = None
        self.eval_every = 1
        self._engine_rows: list[dict] = []  # node_rows(): written with the next recorded round
        self._t_last = time.perf_counter()

    def node_rows(self, rows: list[dict]) -> None:
        """Per-node rows an engine made itself (batched, array, virtual clock) for the round it
        records next: written in that round's transaction, as the rows read from replies are."""
        self._engine_rows.extend(rows)

    def reset_clock(self) -> None:
        self._t_last = time.perf_counter()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        rnd = self.offset + server_round
        if server_round == 0 and self.offset > 0:
            return None  # round 0 of a continuation is the last round, already recorded
        traffic = self.grid.take()
        wall_s = time.perf_counter() - self._t_last
        test_loss, test_acc = self.evaluate(arrays) if self.evaluate is not None else (None, None)
        notes, rejections = self.take()
        # eval_cohort (noted by FedBuff: the nodes whose updates arrived, idle now) is not a figure of the round
        eval_cohort = notes.pop("eval_cohort", None)
        train_loss, num_examples, node_rows = self._replies(traffic, rejections)
        fed: dict[str, Any] = {}
        if server_round > 0 and self.fed_eval is not None and self.eval_due(rnd):
            gone = {r["node_id"] for r in self._engine_rows}  # late or dropped (server.fleet_grid): not asked
            cohort = eval_cohort if eval_cohort is not None else traffic.node_down
            fed = self.federated(rnd, arrays, [n for n in sorted(cohort) if str(n) not in gone], node_rows)
            spent = getattr(self.fed_eval, "traffic", None)  # the evaluate messages, metered apart
            if fed and spent is not None:
                fed.update(eval_bytes_up=spent.bytes_up, eval_bytes_down=spent.bytes_down)
        row = {
            "train_loss": train_loss,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "bytes_up": traffic.bytes_up,
            "bytes_down": traffic.bytes_down,
            "wall_s": wall_s if server_round > 0 else 0.0,
            "sim_time_s": self.sim_time(rnd, traffic) if (self.sim_time and server_round > 0) else None,
            "num_clients": len(node_rows),
        }
        if server_round > 0:
            row.update(self.failed_nodes(rnd, node_rows))
        if getattr(traffic, "report_up", 0):  # monitoring (report.* records), apart from bytes_up
            row["bytes_report"] = traffic.report_up
        if getattr(traffic, "telemetry_up", 0):  # the nodes' telemetry records, apart from both
            row["bytes_telemetry"] = traffic.telemetry_up
        row.update(fed)
        for observe in self.observers:
            row.update(observe(traffic))
        row.update(notes)
        if rejections or server_round > 0:  # every strategy's rounds count what they rejected
            row["rejected"] = len(rejections)
            row["rejected_reasons"] = dict(rejections)
        # one transaction: a crash leaves the round with its node rows and rejections, or none of them
        nodes, self._engine_rows = node_rows + self._engine_rows, []
        self.store.add_round(self.run_id, rnd, nodes=nodes, rejections=rejections, **row)
        if node_rows:
            self._seen_nodes(node_rows)
            self.late_nodes(rnd, node_rows)
        not_picked = [r for r in nodes if r.get("status") in NOT_PICKED]
        if not_picked:  # the Nodes page says why they were not picked (their last round's row has the reason)
            self._seen_nodes(not_picked)
        self.last_round = rnd
        if server_round > 0 and self.checkpoint is not None and (rnd % self.checkpoint_every == 0
                                                                  or rnd == self.final_round):
            self._unsaved = (rnd, arrays)
            if not self.checkpoint_at_round_end:
                self.round_done()
        for listener in self.listeners:
            listener(rnd, row)
        if self._apply_controls() and self.checkpoint is not None:
            # a policy or more rounds: the checkpoint carries them, whatever checkpoint_every says
            if self.checkpoint_at_round_end and server_round > 0:
                self._unsaved = (rnd, arrays)  # written by round_done(), with the strategy's own updates
            else:
                self._unsaved = None
                self.checkpoint(rnd, arrays)
        self._t_last = time.perf_counter()  # time paused does not count as round time
        out = {"test_loss": test_loss, "test_accuracy": test_acc, "fed_loss": row.get("fed_loss"),
               "fed_accuracy": row.get("fed_accuracy")}
        return MetricRecord({k: v for k, v in out.items() if v is not None})

    def eval_due(self, rnd: int) -> bool:
        """Whether round ``rnd`` gets a federated evaluation (every ``eval_every``-th round)."""
        return rnd % max(1, int(self.eval_every)) == 0

    def federated(self, rnd: int, arrays: Any, cohort: list[int], node_rows: list[dict] | None,
                  fed_eval: Callable[[int, Any, list[int]], dict[str, dict]] | None = None) -> dict[str, Any]:
        """Round ``rnd``'s federated evaluation by ``cohort`` (through ``fed_eval``, default the
        recorder's): each node's values merged into its row of ``node_rows``, the round's
        aggregate returned. An engine that writes its own node rows calls it itself (the batched engine
        computes the same from arrays: :mod:`fedswarm.sim.batched_eval`)."""
        fed_eval = fed_eval if fed_eval is not None else self.fed_eval
        if not cohort or fed_eval is None:
            return {}
        results = fed_eval(rnd, arrays, [int(n) for n in cohort])
        merge_into_rows(results, node_rows)
        return aggregate(results)

    def round_done(self, *_: Any) -> None:
        """The round's state is complete: write the checkpoint of the last recorded round."""
        if self._unsaved is not None and self.checkpoint is not None:
            rnd, arrays = self._unsaved
            self._unsaved = None
            self.checkpoint(rnd, arrays)

    def failed_nodes(self, rnd: int, node_rows: list[dict]) -> dict:
        """A node that vanished or failed mid-round costs the round its update (docs/architecture.md): the
        round row's fields that say so, with the minimum the strategy needed to go on without
        it (empty if no node failed), and an event."""
        failed = sum(1 for r in node_rows if r.get("status") == "failed")
        if not failed:
            return {}
        reasons = sorted({r["reason"].strip().split("\n")[0][:200] for r in node_rows
                          if r.get("status") == "failed" and (r.get("reason") or "").strip()})
        why = f" ({'; '.join(reasons)})" if reasons else ""
        message = (f"round {rnd}: {failed} of {len(node_rows)} nodes failed{why}; aggregated the "
                   f"{len(node_rows) - failed} others (strategy minimum {self.min_train_nodes})")
        self.store.add_event(self.run_id, "nodes_failed", message,
                             data={"round": rnd, "failed": failed, "min_train_nodes": self.min_train_nodes})
        log.warning("run %s: %s", self.run_id, message)  # the console's warning (fedswarm.cli.common.route_logs)
        return {"nodes_failed": failed, "min_train_nodes": self.min_train_nodes}

    def _replies(self, traffic, rejections: dict[str, str]) -> tuple[float | None, int, list[dict]]:
        loss_sum, n_sum, rows = 0.0, 0, []
        seen: set[int] = set()
        for msg in traffic.replies:
            node = traffic.node_of(msg) if hasattr(traffic, "node_of") else msg.metadata.src_node_id
            if node in seen:
                continue  # a two-phase round's second reply: one row per node per round
            seen.add(node)
            row: dict[str, Any] = {
                "node_id": str(node),
                "bytes_up": int(traffic.node_up.get(node, 0)),
                "bytes_down": int(traffic.node_down.get(node, 0)),
            }
            if msg.has_error():
                row.update(status="failed", reason=msg.error.reason[:2000])
            else:
                telemetry = msg.content.config_records.get(TELEMETRY_RECORD)
                if telemetry is not None:
                    row["telemetry"] = {str(k): v for k, v in telemetry.items()
                                        if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
                node = msg.content.config_records.get("node")
                if node is not None:
                    row["device_class"] = str(node.get("device_class", ""))[:64] or None
                    try:
                        row["policy"] = json.loads(node.get("policy", "{}"))
                        if "probe" in node:
                            row["probe"] = json.loads(node["probe"])
                    except (TypeError, ValueError):
                        row["policy"] = {}
                metrics = next(iter(msg.content.metric_records.values()), None)
                if metrics is not None:
                    n = int(metrics.get("num-examples", 0))
                    loss = metrics.get("train_loss")
                    row["num_examples"] = n
                    if loss is not None:
                        row["train_loss"] = float(loss)
                        loss_sum += float(loss) * n
                        n_sum += n
                    if "rejected" in metrics and metrics["rejected"]:
                        reason = node.get("rejected_reason", "rejected") if node is not None else "rejected"
                        row.update(status="rejected", reason=str(reason)[:2000])
            if str(row["node_id"]) in rejections:
                row.update(status="rejected", reason=rejections[str(row["node_id"])])
                if "train_loss" in row and row.get("num_examples"):  # its loss is not the round's
                    loss_sum -= row["train_loss"] * row["num_examples"]
                    n_sum -= row["num_examples"]
                    del row["train_loss"]
            rows.append(row)
        # a node sent a message that never answered (cut off, frozen past the round's timeout): failed,
        # unless the engine or the fleet grid said what became of it (late for a quorum, dropped)
        seen.update(int(r["node_id"]) for r in self._engine_rows if str(r.get("node_id", "")).isdigit())
        for node in sorted(set(traffic.sent_to.values()) if getattr(traffic, "sent_to", None) else ()):
            if node not in seen:
                seen.add(node)
                rows.append({"node_id": str(node), "bytes_up": 0, "bytes_down": int(traffic.node_down.get(node, 0)),
                             "status": "failed", "reason": "no reply before the round's timeout"})
        return (loss_sum / n_sum if n_sum else None), n_sum, rows

    def late_nodes(self, rnd: int, rows: list[dict]) -> list[str]:
        """After a resume that asked the nodes for their state: a node first seen in round
        ``rnd`` was not asked (it connected later), so it restored nothing and the strategy
        took it as a new node, resynchronised by the protocol. Each is named once in a
        ``client_resync`` event; returns their ids."""
        if self.resume_asked is None:
            return []
        late = [str(r["node_id"]) for r in rows if str(r["node_id"]) not in self.resume_asked]
        for node in late:
            self.resume_asked.add(node)
            message = (f"node {node} joined after the resume query (first seen in round {rnd}): it was not asked "
                       f"for its state of round {self.resume_round}, so it was resynchronised by the protocol")
            self.store.add_event(self.run_id, "client_resync", message,
                                 data={"node_id": node, "round": int(self.resume_round), "late": True,
                                       "first_round": int(rnd)})
            log.warning("run %s: %s", self.run_id, message)
        return late

    def _seen_nodes(self, rows: list[dict]) -> None:
        """Keep the nodes table current, in one commit: class, status of the last round, last
        seen, what it runs on, and the telemetry it sent with the round (``row["telemetry"]``)."""
        nodes: dict[str, dict[str, Any]] = {}
        for row in rows:
            node_id = f"{self.run_id}:{row['node_id']}" if self.node_kind == "sim" else str(row["node_id"])
            fields: dict[str, Any] = {"kind": self.node_kind, "run_id": self.run_id,
                                      "status": "online" if row.get("status", "ok") == "ok" else row["status"]}
            if row.get("device_class"):
                fields["device_class"] = row["device_class"]
            if row.get("probe"):
                fields["info"] = row["probe"]
            if isinstance(row.get("telemetry"), dict) and row["telemetry"]:
                fields["telemetry"] = row["telemetry"]
            nodes[node_id] = fields
        self.store.upsert_nodes(nodes)

    # -- controls ----------------------------------------------------------------------
    def _apply_policy(self, payload: dict) -> None:
        """A policy change: folded into the book and written into the train config, so
        every message of the next round carries it."""
        device_class = str(payload.get("device_class", ""))
        try:
            new = self.policies.update(device_class, dict(payload.get("policy") or {}))
        except ValueError as exc:
            self.store.add_event(self.run_id, "policy_rejected", str(exc), data=payload)
            return
        if self.train_config is not None:
            self.policies.write(self.train_config)
        self.store.add_event(self.run_id, "policy_applied",
                             f"policy of '{device_class}' is now {new}; applies from round {self.last_round + 1}",
                             data={"device_class": device_class, "policy": new})

    def _apply_controls(self) -> bool:
        """Apply pending controls; True if one changed what a checkpoint holds."""
        paused = changed = False
        while True:
            for c in self.store.pending_controls(self.run_id):
                self.store.mark_applied(c.id)
                if c.kind == "stop":
                    raise StopRun(f"stopped by {c.actor or 'a control'} after round {self.last_round}")
                if c.kind == "pause" and not paused:
                    paused = True
                    self.store.set_status(self.run_id, "paused")
                elif c.kind == "resume" and paused:
                    paused = False
                    self.store.set_status(self.run_id, "running")
                elif c.kind == "policy":
                    self._apply_policy(c.payload)
                    changed = True
                elif c.kind == "add_rounds":
                    n = int(c.payload.get("rounds", 0))
                    if n > 0:
                        self.extra_rounds += n
                        run = self.store.get_run(self.run_id)
                        self.store.update_run(self.run_id, total_rounds=(run.total_rounds if run else 0) + n)
                        self.store.add_event(self.run_id, "rounds_added", f"{n} rounds added")
            if not paused:
                return changed
            time.sleep(self.poll_s)


def run_recorded(store: Store, run_id: str, loop: Callable[[], None]) -> str:
    """Run ``loop`` as run ``run_id``: the one run lifecycle of every engine and of the ServerApp.

    Records this process as the run's owner (:func:`fedswarm.store.liveness.owner_fields`: a
    killed process shows its run as lost) and status ``running``; then ``finished``, or
    ``stopped`` on a stop control (:class:`StopRun`) or on reaching the privacy budget
    (:class:`PrivacyBudgetExceeded`, a ``privacy_budget`` event), or ``stopped`` and re-raised
    on an interrupt from the keyboard, or ``failed`` with the traceback as an ``error`` event
    and re-raised; returns the final status."""
    store.update_run(run_id, **owner_fields())
    store.set_status(run_id, "running")
    try:
        loop()
    except StopRun as stop:
        store.set_status(run_id, "stopped")
        store.add_event(run_id, "stopped", str(stop))
        return "stopped"
    except PrivacyBudgetExceeded as exc:  # --dp target_epsilon: the next round would exceed it
        store.set_status(run_id, "stopped")
        store.add_event(run_id, "privacy_budget", str(exc))
        log.warning("run %s stopped: %s", run_id, exc)
        return "stopped"
    except KeyboardInterrupt:
        store.set_status(run_id, "stopped", error="interrupted from the keyboard")
        raise
    except BaseException as exc:
        store.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}")
        store.add_event(run_id, "error", traceback.format_exc()[-4000:])
        raise
    store.set_status(run_id, "finished")
    return "finished"
