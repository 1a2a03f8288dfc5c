"""One round of the batched engine, the parts every strategy shares: who trains and how
(:func:`round_schedule`, the device classes' policies read as the in-process clients read
them), and the bytes of the real messages (:class:`ByteCounter`, :class:`Meter`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence
from uuid import uuid4

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.config import RunConfig
from fedswarm.local import node_report, round_seed, train_reply
from fedswarm.policy import DEFAULT_CLASS, policy_for
from fedswarm.server.metered_grid import Traffic, serialized_size
from fedswarm.sim.batched_trainer import ClientSchedule
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["ClientMemory", "NodeIds", "Meter", "ByteCounter", "round_schedule", "strategy_round", "varint_len",
           "make_reply", "reply_size", "mark_rejected", "reject_diverged", "NODE_ROWS_MAX",
           "add_client"]


class ClientMemory(dict):
    """What the batched engine keeps of each client between rounds, by partition id: the one
    form of per-client state of every round runner (an error-feedback residual row, a gTop-k
    :class:`~fedswarm.strategies.federated.gtopk.GTopKClientState` row, a sketch client's
    Flower ``Context``). A client's first use makes its state with ``empty(pid)``, what its
    ClientApp starts from; :meth:`rows` reads a chunk's clients, :meth:`keep` writes them back."""

    def __init__(self, empty: Callable[[int], Any]):
        super().__init__()
        self.empty = empty

    def __missing__(self, pid: int) -> Any:
        state = self[pid] = self.empty(pid)
        return state

    def rows(self, pids: Sequence[int]) -> list:
        """The states of clients ``pids``, in order."""
        return [self[pid] for pid in pids]

    def keep(self, pids: Sequence[int], states: Sequence) -> None:
        """Clients ``pids``' states after their round."""
        self.update(zip(pids, states, strict=True))


# Rounds with more clients than this record the round's totals but no per-node rows:
# 10,000 rows a round would cost the store more than the training does.
NODE_ROWS_MAX = 2000


class NodeIds:
    """What a strategy's ``configure_train`` (and the Byzantine grid) ask of a grid on this
    engine: the node ids, 1..N as the in-process grid numbers them, and, for the Byzantine
    grid, the round's replies."""

    def __init__(self, n: int):
        self._ids = list(range(1, n + 1))
        self.replies: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return self._ids

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        return self.replies


class Meter:
    """What :class:`RoundRecorder` reads after a round: the bytes this engine measured."""

    def __init__(self):
        self.traffic = Traffic()

    def take(self) -> Traffic:
        t, self.traffic = self.traffic, Traffic()
        return t


def add_client(traffic: Traffic, node_rows: list[dict] | None, node_id: int, up: int, down: int, n: int,
               loss: float, device_class: str, policy: dict) -> None:
    """Count one client's message and reply, and its per-node row (if rows are kept)."""
    traffic.bytes_down += down
    traffic.bytes_up += up
    traffic.node_down[node_id] += down
    traffic.node_up[node_id] += up
    if node_rows is not None:
        node_rows.append({"node_id": str(node_id), "bytes_up": up, "bytes_down": down, "num_examples": n,
                          "train_loss": loss, "device_class": device_class, "policy": policy})


def varint_len(n: int) -> int:
    return max(1, (int(n).bit_length() + 6) // 7)


def round_schedule(cfg: RunConfig, node_ids: list[int], train_config: ConfigRecord, n_examples: np.ndarray,
                   server_round: int) -> tuple[ClientSchedule, list[str], list[dict]]:
    """Each sampled node's local-SGD arguments, read from its device class's policy the
    way :func:`fedswarm.local.prepare_local` reads them."""
    pids = np.asarray(node_ids, dtype=np.int64) - 1
    classes = [DEFAULT_CLASS] * len(pids)
    if cfg.devices:  # device_class_of's reading of --devices, parsed once for all nodes
        from fedswarm.timemodel import parse_devices

        every = parse_devices(cfg.devices, cfg.clients)
        classes = [every[p] for p in pids.tolist()]
    per_class: dict[str, dict] = {c: policy_for(train_config, c) for c in set(classes)}
    steps = np.empty(len(pids), dtype=np.int64)
    bss = np.empty(len(pids), dtype=np.int64)
    lrs = np.empty(len(pids), dtype=np.float32)
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(classes):
        by_class[c].append(i)
    for c, members in by_class.items():
        pol = per_class[c]
        m = np.asarray(members)
        bs = int(pol.get("batch_size", cfg.batch_size))
        fixed = pol.get("local_steps", None if "local_epochs" in pol else cfg.local_steps)
        epochs = int(pol.get("local_epochs", cfg.local_epochs))
        n = n_examples[pids[m]]
        steps[m] = fixed if fixed is not None else epochs * np.maximum(1, -(-n // bs))
        bss[m] = bs
        lrs[m] = float(pol.get("lr", cfg.lr))
    seeds = [round_seed(cfg.seed, server_round, int(p)) for p in pids]
    sched = ClientSchedule(torch.from_numpy(pids), torch.from_numpy(steps), torch.from_numpy(bss),
                           torch.from_numpy(lrs), torch.tensor(seeds, dtype=torch.int64))
    return sched, classes, [per_class[c] for c in classes]


def strategy_round(run, strategy, grid: NodeIds, arrays, server_round: int
                   ) -> tuple[list[Message], list[int], ClientSchedule, list[str], list[dict]]:
    """A round's start on a strategy object's own sampling: its ``configure_train`` messages
    (to ``arrays``), their node ids, and each node's :func:`round_schedule` (schedule,
    device classes, policies). ``run`` is the engine's :class:`~fedswarm.sim.batched.BatchedRun`."""
    messages = list(strategy.configure_train(server_round, arrays, run.train_config, grid))
    node_ids = [m.metadata.dst_node_id for m in messages]
    sched, classes, pols = round_schedule(run.cfg, node_ids, run.train_config, run.n_examples, server_round)
    return messages, node_ids, sched, classes, pols


class ByteCounter:
    """Serialized sizes of real train messages and replies, one per size class."""

    def __init__(self, train_config: ConfigRecord):
        self.train_config = train_config
        self._cache: dict[tuple, tuple[int, int]] = {}

    def sizes(self, arrays, new_vec: torch.Tensor, node_id: int, pid: int, n: int, steps: int, loss: float,
              device_class: str, policy_json: str, server_round: int) -> tuple[int, int]:
        key = (varint_len(node_id), varint_len(pid), varint_len(2 * pid), n, steps, device_class, policy_json,
               varint_len(server_round))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        config = ConfigRecord(dict(self.train_config))
        config["server-round"] = server_round
        # As Flower's FedAvg builds it (no group id), measured before the grid gives it an id.
        ins = Message(RecordDict({"arrays": arrays, "config": config}), node_id, "train")
        down = serialized_size(ins)
        # the ClientApp's reply (fedswarm.client.app.train), built as it builds it
        node = node_report(device_class, policy_json, **{"partition-id": pid})
        up = reply_size(ins, train_reply(RecordDict({"arrays": vector_to_arrayrecord(new_vec)}), n, loss, steps, node))
        out = (down, up)
        self._cache[key] = out
        return out


def make_reply(ins: Message, content: RecordDict) -> Message:
    """The reply with ``content`` from the node ``ins`` went to, as the grid hands it to the
    server (both messages carry ids)."""
    if not ins.metadata.message_id:
        ins.metadata.__dict__["_message_id"] = str(uuid4())  # what the grid gives it on push
    TaskIdentity.node_id = ins.metadata.dst_node_id  # the reply's source, as on a SuperNode
    try:
        reply = Message(content, reply_to=ins)
    finally:
        TaskIdentity.node_id = 0
    reply.metadata.__dict__["_message_id"] = str(uuid4())
    return reply


def reply_size(ins: Message, content: RecordDict) -> int:
    """Serialized bytes of the reply with ``content`` to ``ins``, as the grid meters it."""
    return serialized_size(make_reply(ins, content))


def mark_rejected(node_rows: list[dict] | None, replies: list[Message]) -> None:
    """After the strategy read ``replies`` (one per row of ``node_rows``, in order): the
    rows of the replies it rejected (``reject`` marks them) say so with its reason, and
    lose their loss, as :class:`~fedswarm.server.recorder.RoundRecorder` writes them."""
    if node_rows is None:
        return
    for row, reply in zip(node_rows, replies):
        metrics = reply.content.metric_records.get("metrics")
        if metrics is not None and metrics.get("rejected"):
            node = reply.content.config_records.get("node")
            row.update(status="rejected", reason=str(node.get("rejected_reason", "rejected"))[:2000]
                       if node is not None else "rejected")
            row.pop("train_loss", None)


def reject_diverged(notes, node_rows: list[dict] | None, node_id: int, model: torch.Tensor, n: int) -> str:
    """A client whose local SGD diverged: its reply (``model`` not finite) is refused as
    FedAvg's server refuses it (:func:`~fedswarm.strategies.strategy_utils.check_model_reply`,
    the same reason), noted as a rejection and marked on its row (the last one); returns the reason."""
    from fedswarm.payload import PayloadError
    from fedswarm.strategies.strategy_utils import check_model_reply, clean_reason

    content = RecordDict({"arrays": vector_to_arrayrecord(model), "metrics": MetricRecord({"num-examples": n})})
    try:
        check_model_reply(Message(content, node_id, "train"), model.numel())
        reason = "rejected"  # not reached: a diverged model is not finite
    except PayloadError as exc:
        reason = clean_reason(exc)
    notes.reject(node_id, reason)
    if node_rows is not None:
        node_rows[-1].update(status="rejected", reason=reason)
        node_rows[-1].pop("train_loss", None)
    return reason
