"""The in-process engine: fedswarm's ServerApp and ClientApp in one process, no Ray.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes are virtual: pushing a message
queues it, pulling runs the ClientApp on it directly with that node's ``Context`` (its
``state`` persists across rounds, as on a SuperNode). Nothing is pickled or sent over
a socket, so per-round overhead is the ClientApp's own work plus serializing messages
once to count their bytes.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.server.app import PreparedStrategy, run_server
from fedswarm.server.checkpoint import ServerCheckpoint
from fedswarm.server.recorder import RoundListener
from fedswarm.sim.simtime import make_node_timer, make_round_timer

__all__ = ["InProcessGrid", "client_error_reply", "run_inprocess"]

_run_ids = itertools.count(1)


def client_error_reply(msg: Message, exc: BaseException) -> Message:
    """The reply of a client whose code raised ``exc`` on ``msg`` (call it in the ``except``
    block: the reason carries the traceback): an error reply, which costs the node its update
    in that round, not the run. The batched engine's clients fail with the same reply."""
    reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


class InProcessGrid(Grid):
    """A Grid of ``num_nodes`` virtual SuperNodes that run ``client_app`` in this process.

    Node ``i`` has node id ``i + 1`` and node config ``partition-id = i``,
    ``num-partitions = num_nodes`` (plus ``node_configs[i]`` if given)."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict | None = None,
                 node_configs: list[dict] | None = None):
        self.client_app = client_app
        self._run = Run.create_empty(run_id=next(_run_ids))
        self.contexts: dict[int, Context] = {}
        for i in range(num_nodes):
            node_config = {"partition-id": i, "num-partitions": num_nodes}
            if node_configs is not None:
                node_config.update(node_configs[i])
            self.contexts[i + 1] = Context(run_id=self._run.run_id, node_id=i + 1, node_config=node_config,
                                           state=RecordDict(), run_config=dict(run_config or {}))
        self._queue: dict[str, Message] = {}

    # -- checkpoint (fedswarm.server.checkpoint): the virtual nodes' own state ------------
    def state_dict(self) -> dict:
        """Every node's ``Context.state`` (residuals, replicas, local models), serialized
        as Flower serializes records, so a resumed run's nodes hold what they held."""
        return {"nodes": {nid: recorddict_to_proto(ctx.state).SerializeToString()
                          for nid, ctx in self.contexts.items()}}

    def load_state_dict(self, state: dict) -> None:
        nodes = state["nodes"]
        if set(nodes) != set(self.contexts):
            raise ValueError(f"the checkpoint has the state of nodes {sorted(nodes)}, this grid has "
                             f"{sorted(self.contexts)}: was the number of clients changed?")
        for nid, data in nodes.items():
            proto = ProtoRecordDict()
            proto.ParseFromString(data)
            self.contexts[nid].state = recorddict_from_proto(proto)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if msg.metadata.dst_node_id not in self.contexts:
                raise ValueError(f"message for unknown node {msg.metadata.dst_node_id}")
            mid = str(uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self._queue[mid] = msg
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for mid in message_ids:
            msg = self._queue.pop(mid, None)
            if msg is not None:
                replies.append(self._execute(msg))
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _execute(self, msg: Message) -> Message:
        node_id = msg.metadata.dst_node_id
        TaskIdentity.node_id = node_id
        try:
            reply = self.client_app(msg, self.contexts[node_id])
        except Exception as exc:  # a failing client costs its update, not the run
            reply = client_error_reply(msg, exc)
        finally:
            TaskIdentity.node_id = 0
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        return reply


def run_inprocess(cfg: RunConfig, *, store: Store, run_id: str,
                  listeners: list[RoundListener] | None = None, resume: ServerCheckpoint | None = None,
                  prepared: PreparedStrategy | None = None) -> str:
    """Run one simulation on the in-process engine; returns the final run status.
    ``resume``: continue the run from this checkpoint (the nodes' state included); ``prepared``: the
    strategy the config check built."""
    from fedswarm.client.app import app as client_app

    grid = InProcessGrid(client_app, cfg.clients, run_config=cfg.to_flat())
    TaskIdentity.run_id = grid.run.run_id
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = 0
    return run_server(grid, cfg, store=store, run_id=run_id, listeners=listeners,
                      sim_time=make_round_timer(cfg), resume=resume, prepared=prepared,
                      node_time=make_node_timer(cfg), partition_of=lambda node: node - 1)
