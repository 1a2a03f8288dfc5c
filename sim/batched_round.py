"""One round of the batched engine, the parts every strategy shares: who trains and how
(:func:`round_schedule`, the device classes' policies read as the in-process clients read
them), and the bytes of the real messages (:class:`ByteCounter`, :class:`Meter`)."""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Sequence
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

__all__ = ["ClientRows", "NodeIds", "Meter", "ByteCounter", "round_schedule", "strategy_round",
           "varint_len",
           "make_reply", "reply_size", "mark_rejected", "reject_diverged", "NODE_ROWS_MAX",
           "add_client", "add_clients", "cohort_rows", "cohort_schedule", "CohortSchedule", "round_seeds",
           "varint_lens", "CohortBytes", "cohort_nodes"]


class ClientRows:
    """Per-client state that is one ``[d]`` row (an error-feedback residual), held in arrays for
    the clients that have state only: their rows in one ``[capacity, d]`` tensor that grows by
    doubling, and each partition's slot in it (an int32 array over the population, -1 for a
    client with no state yet, whose row reads as zeros, what its ClientApp starts from). Its
    memory: ``4 x population`` bytes of slots plus ``4 x d`` bytes per client that has state
    (:data:`fedswarm.sim.batched_memory.STATE_BYTES`). :meth:`stack` reads a chunk's clients as
    one tensor, :meth:`keep_stacked` writes them back. The other multi-row memories build on it:
    gTop-k's :class:`~fedswarm.sim.batched_gtopk.GTopKRows`, the sketch clients'
    :class:`~fedswarm.sim.batched_sketched.SketchRows`."""

    def __init__(self, d: int, population: int, dtype: torch.dtype = torch.float32):
        self.d = d
        self._slot = np.full(population, -1, dtype=np.int32)
        self._rows = torch.zeros((0, d), dtype=dtype)
        self._used = 0

    def __len__(self) -> int:
        return self._used

    def __contains__(self, pid: int) -> bool:
        return bool(self._slot[pid] >= 0)

    def __iter__(self):
        """The partition ids of the clients that have state."""
        return iter(np.flatnonzero(self._slot >= 0).tolist())

    def __getitem__(self, pid: int) -> torch.Tensor:
        return self.stack([pid])[0]

    def nbytes(self) -> int:
        """Bytes held: the slots and the rows' storage."""
        return self._slot.nbytes + self._rows.numel() * self._rows.element_size()

    def stack(self, pids: Sequence[int]) -> torch.Tensor:
        """Clients ``pids``' rows as a new ``[len(pids), d]`` tensor (zeros for those with no state)."""
        slots = torch.from_numpy(self._slot[np.asarray(pids, dtype=np.int64)].astype(np.int64))
        out = self._rows[slots.clamp_min(0)] if self._used else torch.zeros((len(slots), self.d),
                                                                            dtype=self._rows.dtype)
        out[slots < 0] = 0
        return out

    def keep_stacked(self, pids: Sequence[int], rows: torch.Tensor) -> None:
        """Clients ``pids``' rows after their round (``rows``: ``[len(pids), d]``), copied in."""
        p = np.asarray(pids, dtype=np.int64)
        if len(np.unique(p)) != len(p):
            raise ValueError("ClientRows.keep_stacked: a client given twice")
        new = p[self._slot[p] < 0]
        if len(new):
            need = self._used + len(new)
            if need > self._rows.shape[0]:  # grow by doubling: amortised copies
                # empty: a row past the used ones is never read, and its pages are not resident until written
                grown = torch.empty((max(need, 2 * self._rows.shape[0], 16), self.d), dtype=self._rows.dtype)
                grown[:self._used] = self._rows[:self._used]
                self._rows = grown
            self._slot[new] = np.arange(self._used, need, dtype=np.int32)
            self._used = need
        self._rows[torch.from_numpy(self._slot[p].astype(np.int64))] = rows.to(self._rows.dtype)


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


_VARINT_STEPS = np.array([1 << (7 * j) for j in range(1, 9)], dtype=np.int64)


def varint_lens(values) -> np.ndarray:
    """:func:`varint_len` of every entry of ``values`` (non-negative integers) at once."""
    x = np.asarray(values, dtype=np.int64)
    # one more byte for every 7 bits past the first 7 (at most 9 bytes): the thresholds 2**7, 2**14, ...
    return np.searchsorted(_VARINT_STEPS, x, side="right").astype(np.int64) + 1


class CohortBytes(MutableMapping):
    """A :class:`~fedswarm.server.metered_grid.Traffic`'s per-node bytes (``node_up`` or
    ``node_down``: node id -> bytes) held as two arrays over a cohort, ``ids`` and ``values``
    (a node given twice counts the sum). Nothing is built per node until a node is looked up
    or the mapping changed: then it becomes the ``defaultdict(int)`` a Traffic holds, once.
    :func:`cohort_nodes` reads the nodes as an array without that."""

    def __init__(self, ids: np.ndarray, values: np.ndarray):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.int64)
        self._dict: defaultdict[int, int] | None = None

    def _table(self) -> defaultdict[int, int]:
        if self._dict is None:
            table: defaultdict[int, int] = defaultdict(int)
            for node, v in zip(self.ids.tolist(), self.values.tolist()):
                table[node] += v
            self._dict = table
        return self._dict

    def __getitem__(self, node: int) -> int:
        return self._table().get(node, 0)  # a node with no bytes reads 0, as from a defaultdict(int), and is not added

    def __contains__(self, node: object) -> bool:
        return node in self._table()

    def get(self, node: int, default=None):
        return self._table().get(node, default)

    def __setitem__(self, node: int, value: int) -> None:
        self._table()[node] = value

    def __delitem__(self, node: int) -> None:
        del self._table()[node]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table()) if self._dict is not None else int(np.unique(self.ids).size)


def cohort_nodes(counts) -> np.ndarray:
    """The sorted distinct node ids of a Traffic's ``node_up``/``node_down`` (a dict or a
    :class:`CohortBytes`) as an int64 array."""
    if isinstance(counts, CohortBytes) and counts._dict is None:
        ids = counts.ids
        if ids.size and ids.min() >= 0 and ids.max() < 16 * ids.size + (1 << 20):  # node ids 1..N: a mask, no sort
            seen = np.zeros(int(ids.max()) + 1, dtype=bool)
            seen[ids] = True
            return np.flatnonzero(seen)
        return np.unique(ids)
    return np.sort(np.fromiter(counts, dtype=np.int64, count=len(counts)))


def add_clients(traffic: Traffic, node_ids: Sequence[int], up: np.ndarray, down: np.ndarray) -> None:
    """:func:`add_client`'s bytes of a whole cohort at once (``up``/``down``: int arrays in
    the order of ``node_ids``); the per-node rows are :func:`cohort_rows`'. Into a Traffic that
    has no per-node bytes yet they go as :class:`CohortBytes` (no Python work per node)."""
    traffic.bytes_down += int(down.sum())
    traffic.bytes_up += int(up.sum())
    if not traffic.node_down and not traffic.node_up:
        ids = np.asarray(node_ids, dtype=np.int64)
        traffic.node_down = CohortBytes(ids, down)
        traffic.node_up = CohortBytes(ids, up)
        return
    ids = [int(i) for i in node_ids] if not isinstance(node_ids, list) else node_ids
    for node, d, u in zip(ids, down.tolist(), up.tolist()):
        traffic.node_down[node] += d
        traffic.node_up[node] += u


def cohort_rows(node_ids: Sequence[int], up: np.ndarray, down: np.ndarray, n: Sequence[int],
                loss: Sequence[float], classes: Sequence[str], policies: Sequence[dict]) -> list[dict]:
    """The cohort's per-node rows, as :func:`add_client` writes them one by one."""
    return [{"node_id": str(i), "bytes_up": u, "bytes_down": d, "num_examples": k, "train_loss": lo,
             "device_class": c, "policy": p}
            for i, u, d, k, lo, c, p in zip(node_ids, up.tolist(), down.tolist(), n, loss, classes, policies)]


def round_schedule(cfg: RunConfig, node_ids: list[int], train_config: ConfigRecord, n_examples: np.ndarray,
                   server_round: int) -> tuple[ClientSchedule, list[str], list[dict]]:
    """Each sampled node's local-SGD arguments, read from its device class's policy the
    way :func:`fedswarm.local.prepare_local` reads them: :func:`cohort_schedule`'s, with
    each node's device class and policy as lists."""
    cohort = cohort_schedule(cfg, node_ids, train_config, n_examples, server_round)
    return cohort.sched, cohort.classes(), cohort.policies()


@dataclass
class CohortSchedule:
    """A round's schedule as arrays over the cohort: the trainer's :class:`ClientSchedule`, and
    each node's device class as an index ``class_of [K]`` into the round's distinct classes
    (``class_names``, their policies ``class_policies``)."""

    sched: ClientSchedule
    class_names: list[str]
    class_of: np.ndarray
    class_policies: list[dict]

    def classes(self) -> list[str]:
        """Each node's device class (a list over the cohort, built without a Python loop)."""
        return _pick(self.class_names, self.class_of)

    def policies(self) -> list[dict]:
        """Each node's policy (the same dict object for the nodes of one class)."""
        return _pick(self.class_policies, self.class_of)


def _pick(values: list, index: np.ndarray) -> list:
    if len(values) == 1:
        return values * len(index)
    table = np.empty(len(values), dtype=object)
    table[:] = values
    return table[index].tolist()


@functools.lru_cache(maxsize=4)
def _device_classes(spec: str, clients: int) -> tuple[list[str], np.ndarray]:
    """``--devices`` read once per run as (distinct classes, each partition's index into them)."""
    from fedswarm.timemodel import parse_devices

    names, codes = np.unique(np.asarray(parse_devices(spec, clients), dtype=object).astype(str), return_inverse=True)
    return [str(n) for n in names], codes.astype(np.int32)


def round_seeds(seed: int, server_round: int, pids: np.ndarray) -> np.ndarray:
    """:func:`fedswarm.local.round_seed` of every partition in ``pids`` at once (int64)."""
    modulus = 2**31 - 1
    base = round_seed(seed, server_round, 0)  # (seed * a + round * b) mod m, then + pid mod m: the same residue
    pids = np.asarray(pids, dtype=np.int64)
    if pids.size and (pids.min() < 0 or pids.max() >= modulus):
        return (np.int64(base) + pids % modulus) % modulus
    out = pids + np.int64(base)  # both in [0, m): one subtraction is the residue (no int64 division)
    out[out >= modulus] -= modulus
    return out


def cohort_schedule(cfg: RunConfig, node_ids, train_config: ConfigRecord, n_examples: np.ndarray,
                    server_round: int) -> CohortSchedule:
    """:func:`round_schedule` as arrays: one policy read per distinct device class, every
    per-node value (steps, batch size, lr, round seed) computed over the cohort at once."""
    pids = np.asarray(node_ids, dtype=np.int64) - 1
    if cfg.devices:  # device_class_of's reading of --devices, parsed once per run
        every_name, every_code = _device_classes(cfg.devices, cfg.clients)
        used, class_of = np.unique(every_code[pids], return_inverse=True)
        names = [every_name[c] for c in used.tolist()]
    else:
        names, class_of = [DEFAULT_CLASS], np.zeros(len(pids), dtype=np.int64)
    class_of = class_of.astype(np.int64).reshape(-1)
    pols = [policy_for(train_config, c) for c in names]
    steps = np.empty(len(pids), dtype=np.int64)
    bss = np.empty(len(pids), dtype=np.int64)
    lrs = np.empty(len(pids), dtype=np.float32)
    for code, pol in enumerate(pols):
        m = class_of == code if len(pols) > 1 else slice(None)
        bs = int(pol.get("batch_size", cfg.batch_size))
        fixed = pol.get("local_steps", None if "local_epochs" in pol else cfg.local_steps)
        epochs = int(pol.get("local_epochs", cfg.local_epochs))
        n = n_examples[pids[m]]
        steps[m] = fixed if fixed is not None else epochs * np.maximum(1, -(-n // bs))
        bss[m] = bs
        lrs[m] = float(pol.get("lr", cfg.lr))
    seeds = round_seeds(cfg.seed, server_round, pids)
    sched = ClientSchedule(torch.from_numpy(pids), torch.from_numpy(steps), torch.from_numpy(bss),
                           torch.from_numpy(lrs), torch.from_numpy(seeds))
    return CohortSchedule(sched, names, class_of, pols)


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


    def cohort_sizes(self, arrays, new_vec: torch.Tensor, node_ids: np.ndarray, n: np.ndarray, steps: np.ndarray,
                     cohort: CohortSchedule, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`sizes` of every node of a cohort (``node_ids``, ``n`` and ``steps``: arrays over
        it; classes and policies from ``cohort``) as ``(down, up)`` int64 arrays: one measured
        message per distinct size key, read back for every node by the key's index."""
        node_ids = np.asarray(node_ids, dtype=np.int64)
        pids = node_ids - 1
        n = np.asarray(n, dtype=np.int64)
        steps = np.asarray(steps, dtype=np.int64)
        lens = (varint_lens(node_ids) * 16 + varint_lens(pids)) * 16 + varint_lens(2 * pids)  # < 2**12
        small = lens * 65536 + cohort.class_of
        n_span, s_span = int(n.max(initial=0)) + 1, int(steps.max(initial=0)) + 1
        if n_span * s_span < 2**34:  # small < 2**28: one int64 key
            _, first, inverse = np.unique((small * n_span + n) * s_span + steps, return_index=True, return_inverse=True)
        else:
            _, first, inverse = np.unique(np.stack([small, n, steps], axis=1), axis=0, return_index=True,
                                          return_inverse=True)
        jsons = [json.dumps(p, sort_keys=True) for p in cohort.class_policies]
        down_u = np.empty(len(first), dtype=np.int64)
        up_u = np.empty(len(first), dtype=np.int64)
        for u, i in enumerate(first.tolist()):
            c = int(cohort.class_of[i])
            down_u[u], up_u[u] = self.sizes(arrays, new_vec, int(node_ids[i]), int(pids[i]), int(n[i]), int(steps[i]),
                                            0.0, cohort.class_names[c], jsons[c], server_round)
        inverse = inverse.reshape(-1)
        return down_u[inverse], up_u[inverse]


def as_pushed(msg: Message) -> Message:
    """``msg`` with the id the grid gives a message on push (it counts in its serialized size)."""
    if not msg.metadata.message_id:
        msg.metadata.__dict__["_message_id"] = str(uuid4())
    return msg


def make_reply(ins: Message, content: RecordDict) -> Message:
    """The reply with ``content`` from the node ``ins`` went to, as the grid hands it to the
    server (both messages carry ids)."""
    as_pushed(ins)
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


def reject_diverged(notes, node_rows: list[dict] | None, node_id: int, model: torch.Tensor, n: int,
                    row: int = -1) -> str:
    """A client whose local SGD diverged: its reply (``model`` not finite) is refused as
    FedAvg's server refuses it (:func:`~fedswarm.strategies.strategy_utils.check_model_reply`,
    the same reason), noted as a rejection and marked on its row (``node_rows[row]``, the last
    one unless told); returns the reason."""
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
        node_rows[row].update(status="rejected", reason=reason)
        node_rows[row].pop("train_loss", None)
    return reason
