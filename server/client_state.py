"""The server half of exact resume: get the nodes' own state back, or resynchronise them.

A resumed run on an engine whose nodes start empty (a deployment: a new Flower run on the
SuperLink; Flower's simulation engine: new virtual nodes) first asks every connected node,
with a ``query.fedswarm_resume`` message, to restore its state of the checkpoint's round from
its own disk (:mod:`fedswarm.client.persist`). Each node answers whether it did, its
partition and the node id it had then. The strategy's ``rejoin_clients(reports)`` then
carries what it knows per node (replica versions, pending selections, which node holds which
topology index) over to the nodes' current ids, and resynchronises by its protocol each node
that has no state (a compressed strategy: the full model and a zero residual; a decentralized
one: the node restarts from the checkpointed model). Each such node is named in a
``client_resync`` event.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict

from fedswarm.protocol import RESUME_ACTION, RESUME_RECORD
from fedswarm.store import Store
from fedswarm.strategies.resumable import resync_clients

__all__ = ["NodeReport", "restore_clients"]

log = logging.getLogger("fedswarm.server")

#: Seconds the resumed server waits for the run's nodes to connect before it asks them.
NODE_WAIT_S = 120.0


@dataclass
class NodeReport:
    """What one node answered to the resume query."""

    node_id: int  # its id in this (resumed) Flower run
    partition: int  # -1: unknown (the node failed to answer)
    restored: bool
    round: int = -1  # the round of the snapshot it restored
    old_node_id: int | None = None  # its id when the snapshot was written
    why: str = ""  # why it has no state

    def name(self) -> str:
        return f"node {self.node_id} (partition {self.partition})" if self.partition >= 0 else f"node {self.node_id}"


def restore_clients(grid: Any, strategy: Any, *, store: Store, run_id: str, checkpoint_round: int,
                    num_nodes: int, timeout: float = 600.0, node_wait_s: float = NODE_WAIT_S,
                    asked: set[str] | None = None) -> tuple[str, list[str]]:
    """Ask the nodes for their state of ``checkpoint_round`` and let the strategy take them
    back (see the module docstring). Returns (what happened, in a few words; the names of the
    nodes resynchronised). A strategy without ``rejoin_clients`` resynchronises everyone.
    ``asked``: filled with the ids of the nodes asked (a node that connects later is named by
    :meth:`~fedswarm.server.recorder.RoundRecorder.late_nodes`)."""
    rejoin = getattr(strategy, "rejoin_clients", None)
    if not callable(rejoin):
        return ("resynchronised by the strategy" if resync_clients(strategy) else "stateless"), []
    deadline = time.monotonic() + node_wait_s
    while len(ids := sorted(int(n) for n in grid.get_node_ids())) < num_nodes and time.monotonic() < deadline:
        time.sleep(0.5)  # polling the grid, as Flower's own sample_nodes does: it has no connect event
    if asked is not None:
        asked.update(str(nid) for nid in ids)
    request = ConfigRecord({"run": run_id, "round": int(checkpoint_round)})
    messages = [Message(RecordDict({RESUME_RECORD: request}), message_type=f"query.{RESUME_ACTION}", dst_node_id=nid)
                for nid in ids]
    replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
    reports = {nid: NodeReport(nid, -1, False, why="it did not answer the resume query") for nid in ids}
    for reply in replies:
        nid = int(reply.metadata.src_node_id)
        if reply.has_error():
            reports[nid] = NodeReport(nid, -1, False, why=f"its resume query failed: {reply.error.reason[:300]}")
            continue
        info, extra = reply.content.metric_records["metrics"], reply.content.config_records[RESUME_RECORD]
        old = str(extra.get("old-node-id", ""))
        reports[nid] = NodeReport(nid, int(info["partition-id"]), bool(info["restored"]), int(info["round"]),
                                  int(old) if old else None, str(extra.get("why", "")))
    ordered = [reports[nid] for nid in ids]
    rejoin(ordered)
    lost = [r for r in ordered if not r.restored]
    for r in lost:
        message = (f"{r.name()} has no state of round {checkpoint_round}: {r.why}; resynchronised by the protocol "
                   f"({getattr(strategy, 'resync_what', 'it restarts from the server')})")
        store.add_event(run_id, "client_resync", message, data={"node_id": str(r.node_id), "partition": r.partition,
                                                               "round": int(checkpoint_round), "why": r.why})
        log.warning("run %s: %s", run_id, message)
    restored = len(ordered) - len(lost)
    what = f"restored from the nodes' own disks on {restored} of {len(ordered)} nodes"
    if lost:
        what += "; resynchronised by the protocol: " + ", ".join(r.name() for r in lost)
    return what, [r.name() for r in lost]
