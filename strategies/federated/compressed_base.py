"""What the compressed strategies share: the server's round loop and the client's frame.

Server (:class:`CompressedStrategy`, a Flower ``Strategy``): sample nodes as Flower's
FedAvg does; send each one the strategy's knobs (a ``compress`` ConfigRecord), the sync
body that brings its replica to the public model (:mod:`.compressed_sync`) and, for
strategies whose clients keep a residual, which of its last coordinates the server used
(``select``); validate every reply before it can touch anything; aggregate; commit the
update. Subclasses implement ``parse_reply`` (validate one reply, raise PayloadError) and
``aggregate`` (accepted replies -> the update and, if it is coded, its payload).

A reply that is malformed or non-finite is **rejected** with
:meth:`~fedswarm.strategies.strategy_utils.ReportsRounds.reject`: it never reaches the model
and the recorder stores the reason (the ``rejections`` table, the node's row, the round's
``rejected`` count).

Client (:func:`begin` ... :func:`finish`): sync the replica, run the shared local SGD
(:func:`fedswarm.local.local_fit`, so device-class policies apply), let the algorithm
compress, then write all state at the end (a failure mid-round keeps the old state) and
reply with the payload, ``metrics`` and the ``node`` report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedswarm.params import ParamLayout, all_finite
# The client half (begin/train/finish) lives in compressed_client; its names stay importable from here.
from fedswarm.strategies.federated.compressed_client import (KNOBS, SELECT, ClientRound, UserTraining, begin,
                                                             finish, save_sent, train, user_training)
from fedswarm.strategies.federated.compressed_sync import ReplicaSync
from fedswarm.strategies.registry import message_type_of
from fedswarm.strategies.resumable import capture, restore
from fedswarm.strategies.strategy_utils import (ReportsRounds, layout_json, layout_of_arrays,
                                                sample_train_nodes)
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import (array_keys, arrayrecord_to_vector, payload_from_records, vector_to_arrays_like)

__all__ = ["CompressedStrategy", "TrainPlan", "Accepted", "Step", "ClientRound", "begin", "train", "finish",
           "save_sent", "read_payload", "KNOBS", "UserTraining", "user_training"]



@dataclass
class Accepted:
    """One reply that passed validation."""

    node_id: int
    message: Message | None  # None: an engine computed the value without a message (--engine batched)
    weight: float  # num-examples
    value: Any  # what parse_reply returned


@dataclass
class Step:
    """The update a round commits: ``x̂ ← x̂ + update``; ``payload`` decodes to it exactly
    when the downlink is coded (else the server sends the changed coordinates)."""

    update: torch.Tensor
    payload: Payload | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class CompressedStrategy(ReportsRounds, Strategy):
    """Base class: Flower's round loop with replica sync, validation and rejection.

    Parameters
    ----------
    layout : ParamLayout, optional
        Names, shapes and offsets of the model's tensors (codecs work per column/tensor).
        Leave it out to run a Flower user's own ClientApp (with
        :data:`fedswarm.client.compression_mod`): the layout is then read from the
        ``initial_arrays`` given to ``start`` and the train messages are Flower's plain
        ``train`` type, which carries the strategy's name, seed and layout in its knobs.
    server_lr : float (default: 1.0)
        Scale of the aggregated update applied to the model (1 with the ``none`` codec is
        FedAvg).
    fraction_train : float (default: 1.0)
        Fraction of nodes sampled per round (at least ``min_train_nodes``).
    min_train_nodes, min_available_nodes : int (default: 1)
        As in Flower's FedAvg.
    seed : int (default: 0)
        Seeds what the algorithm draws (hashes of sketches, codec randomness).
    history : int (default: 8)
        Past downlink payloads kept to update stale replicas.
    """

    name = ""
    #: True for strategies whose aggregate is an average of the parsed per-client vectors,
    #: so DP-FedAvg's clip and noise (``dp``) can replace them by their private average.
    supports_dp = False

    def __init__(self, layout: ParamLayout | None = None, *, server_lr: float = 1.0, fraction_train: float = 1.0,
                 min_train_nodes: int = 1, min_available_nodes: int = 1, seed: int = 0, history: int = 8):
        if layout is not None and not isinstance(layout, ParamLayout):
            raise TypeError("layout must be a fedswarm ParamLayout (ParamLayout.from_module(model)) or None "
                            "(read from the initial ArrayRecord)")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        self.layout = layout
        #: Train messages are Flower's plain ``train`` (a user's ClientApp with compression_mod)
        #: rather than fedswarm's ``train.<name>``: chosen by leaving ``layout`` out.
        self.plain_train = layout is None
        self.server_lr = float(server_lr)
        self.fraction_train = float(fraction_train)
        self.min_train_nodes = int(min_train_nodes)
        self.min_available_nodes = int(min_available_nodes)
        self.seed = int(seed)
        self.sync = ReplicaSync(history)
        self.pending: dict[int, tuple[int, str, bytes]] = {}  # node -> (round, kind, data) for SELECT
        self._grid: Grid | None = None
        self._timeout: float | None = None
        self._keys: list[tuple[str, tuple[int, ...]]] | None = None
        self._rejected: dict[str, str] = {}
        self.round = 0  # rounds configured by this object (see configure_train)
        self.dp = None  # a fedswarm.algorithms.privacy.dp_fedavg.ClientLevelDP (strategies.federated.dp)

    @property
    def message_type(self) -> str:
        return "train" if self.plain_train else message_type_of(self.name)

    def on_layout(self) -> None:
        """Called once the layout is known (at construction, or at ``start`` when it is read
        from the initial arrays): subclasses size what depends on it here."""

    # -- subclass hooks ------------------------------------------------------------------
    def knobs(self, server_round: int) -> dict[str, Any]:
        """What the clients need to know (sent in the ``compress`` record). ``server_round``
        here and in ``aggregate`` is this object's own round count (see ``round``)."""
        return {}

    def parse_reply(self, msg: Message) -> Any:
        """Validate one reply; return what ``aggregate`` needs. Raise PayloadError."""
        raise NotImplementedError

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step | None:
        raise NotImplementedError

    def summary_lines(self) -> list[str]:
        return []

    # -- Flower's Strategy ---------------------------------------------------------------
    def summary(self) -> None:
        log(INFO, "\t├──> %s (%s)", type(self).__name__, self.name)
        for line in self.summary_lines():
            log(INFO, "\t│\t├── %s", line)
        log(INFO, "\t│\t└── server_lr=%g, fraction_train=%.2f, min nodes: train %d, available %d",
            self.server_lr, self.fraction_train, self.min_train_nodes, self.min_available_nodes)
        log(INFO, "\t└──> Clients keep a replica of the model; the server sends each the smallest update that syncs it")

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop; kept as is, with the timeout remembered (the two-phase
        strategies use the grid again inside a round) and the round notes bound to
        ``evaluate_fn`` when it is fedswarm's recorder."""
        self._timeout = timeout
        self.bind_notes(evaluate_fn)
        self._ensure_model(initial_arrays)
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return list(self.plan_train(server_round, arrays, config, grid))  # every message built

    def plan_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> TrainPlan:
        """:meth:`configure_train`'s work (sampling, the round's knobs, each node's sync
        bookkeeping and pending selection) with the messages left unbuilt: a
        :class:`TrainPlan` builds node ``k``'s when it is read (``--engine batched`` reads few)."""
        self._grid = grid
        self._ensure_model(arrays)
        if self.dp is not None:
            self.dp.before_round()  # refuses a round past the privacy budget
        node_ids, available = sample_train_nodes(grid, self.fraction_train, self.min_train_nodes,
                                                 self.min_available_nodes)
        log(INFO, "configure_train: sampled %s nodes (out of %s)", len(node_ids), len(available))
        config["server-round"] = server_round
        # Rounds of this strategy object, counted across calls of start() (Flower restarts
        # server_round at 1 when rounds are added): tags replies, selections and seeds.
        self.round += 1
        knobs = ConfigRecord({"round": self.round, **self.knobs(self.round)})
        if self.plain_train:  # what compression_mod needs to run this strategy's client half
            knobs.update({"strategy": self.name, "seed": self.seed, "layout": layout_json(self.layout)})
        bases = self.sync.send_all(node_ids)
        bodies = {base: self.sync.body(base) for base in set(bases)}
        pending = {nid: self.pending[nid] for nid in node_ids if nid in self.pending} if self.pending else {}
        return TrainPlan(node_ids, config, knobs, bases, bodies, pending, self.message_type)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._rejected = {}
        accepted: list[Accepted] = []
        failed = 0
        for msg in replies:
            nid = msg.metadata.src_node_id
            if msg.has_error():
                failed += 1
                self.sync.forget(nid)  # its replica may be gone: full model next time
                log(WARNING, "node %s failed this round: %s", nid, (msg.error.reason.splitlines() or [""])[0][:300])
                continue
            self.sync.ack(nid)  # a content reply: the client saved its replica
            self.pending.pop(nid, None)  # ... and applied the selection it was sent
            try:
                weight = _num_examples(msg)
                value = self.parse_reply(msg)
            except (PayloadError, KeyError, TypeError, ValueError) as exc:
                self.reject(msg, str(exc) or type(exc).__name__)
                continue
            accepted.append(Accepted(nid, msg, weight, value))
        accepted.sort(key=lambda a: a.node_id)
        metrics: dict[str, float] = {"accepted": len(accepted), "rejected": len(self._rejected), "failed": failed}
        metrics.update(self.apply_accepted(server_round, accepted))
        losses = [(a.weight, a.message.content.metric_records["metrics"].get("train_loss")) for a in accepted]
        losses = [(w, float(v)) for w, v in losses if isinstance(v, (int, float)) and math.isfinite(v)]
        if losses:
            metrics["train_loss"] = sum(w * v for w, v in losses) / sum(w for w, _ in losses)
        return self.model_arrays(), MetricRecord(metrics)

    def apply_accepted(self, server_round: int, accepted: list[Accepted]) -> dict[str, float]:
        """The server's half of a round once its replies are validated: DP (if attached),
        the subclass's ``aggregate``, and the commit of a finite update; returns the round's
        metrics. ``accepted`` is sorted by node id. Engines that produce the clients'
        parsed values themselves (``--engine batched``) call this with ``message=None``."""
        metrics: dict[str, float] = {}
        if self.dp is not None and accepted:
            # DP-FedAvg: the clipped, noised average replaces every client's vector, with
            # equal weights, so the subclass's (linear) aggregate of them is that average.
            private, dp_metrics = self.dp.privatize(torch.stack([a.value for a in accepted]))
            for a in accepted:
                a.value, a.weight = private, 1.0
            self.note(**dp_metrics)
        step = self.aggregate(self.round, accepted) if accepted else None
        if step is not None:
            if not all_finite(step.update):  # never commit a non-finite model
                log(WARNING, "round %s: the aggregate is not finite; the model is left as it was", server_round)
                metrics["nonfinite_aggregate"] = 1
                for a in accepted:  # nothing was applied: clients keep all they sent
                    self.pending.pop(a.node_id, None)
            else:
                self.sync.commit(step.update, step.payload)
                metrics.update(step.metrics)
        return metrics

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # the server evaluates the global model on the held-out test set

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    # -- helpers for subclasses ----------------------------------------------------------
    def reject(self, reply: Message, reason: object) -> str:
        """Refuse ``reply`` (see ``ReportsRounds.reject``) and count it in the round's metrics."""
        text = super().reject(reply, reason)
        self._rejected[str(reply.metadata.src_node_id)] = text
        return text

    def weights(self, accepted: list[Accepted]) -> torch.Tensor:
        w = torch.tensor([a.weight for a in accepted], dtype=torch.float64)
        return (w / w.sum()).to(torch.float32)

    def send_and_receive(self, messages: list[Message]) -> list[Message]:
        """A second exchange inside a round (metered like the first)."""
        if self.plain_train:  # the mod finds the strategy by name in every message's knobs
            for m in messages:
                knobs = m.content.config_records.get(KNOBS)
                if knobs is not None and "strategy" not in knobs:
                    knobs["strategy"], knobs["seed"] = self.name, self.seed
        return list(self._grid.send_and_receive(messages, timeout=self._timeout))

    def select(self, node_id: int, server_round: int, *, mask: np.ndarray | None = None,
               indices: np.ndarray | None = None) -> None:
        """Tell ``node_id`` next time which coordinates of its round-``server_round``
        message were used: a bit mask over the indices it sent, or explicit indices."""
        if mask is not None:
            self.pending[node_id] = (server_round, "mask", np.packbits(mask.astype(bool), bitorder="little").tobytes())
        else:
            self.pending[node_id] = (server_round, "indices", np.asarray(indices, dtype="<i4").tobytes())

    @property
    def model(self) -> torch.Tensor:
        return self.sync.x

    def model_arrays(self) -> ArrayRecord:
        """The public model as an ArrayRecord shaped like the one ``start`` was given."""
        return vector_to_arrays_like(self.sync.x, self._keys)

    # -- checkpoint (fedswarm.strategies.resumable) --------------------------------------
    #: What changes from round to round; subclasses with more state add their attributes.
    state_attrs: tuple[str, ...] = ("round", "sync", "pending", "_keys", "dp")

    def state_dict(self) -> dict[str, Any]:
        """The public model and replica bookkeeping, pending selections, the round count
        and the DP mechanism's state (clip, accountant, noise generator)."""
        return capture(self, self.state_attrs)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore(self, state, self.state_attrs)

    def resync_clients(self) -> None:
        """The clients' replicas may be gone: every node gets the full model next round,
        and no pending selection refers to a residual it may no longer hold."""
        self.sync.nodes.clear()
        self.sync.sent.clear()
        self.pending.clear()

    #: What resynchronising one node does (named in the ``client_resync`` event).
    resync_what = "the full model next round and a zero residual"

    def rejoin_clients(self, reports: list) -> None:
        """A resumed run's nodes answered the resume query (:mod:`fedswarm.server.client_state`):
        what the server knows of each node that restored its state (the replica version it
        holds, the selection it is owed) moves to the node's current id; a node without state
        gets the full model next round and owes nothing (its residual starts at zero)."""
        moved = {r.old_node_id: r.node_id for r in reports if r.restored and r.old_node_id is not None}
        self.sync.nodes = {moved[old]: v for old, v in self.sync.nodes.items() if old in moved}
        self.sync.sent.clear()
        self.pending = {moved[old]: v for old, v in self.pending.items() if old in moved}
        self.rename_nodes(moved)

    def rename_nodes(self, moved: dict[int, int]) -> None:
        """Subclasses that key more by node id carry it over here (old id -> current id)."""

    def _ensure_model(self, arrays: ArrayRecord) -> None:
        if self.sync.x is not None:
            return
        if self.layout is None:
            self.layout = layout_of_arrays(arrays)
            self.on_layout()
        self._keys = array_keys(arrays)
        self.sync.reset(arrayrecord_to_vector(arrays, self.layout.d))


class TrainPlan(Sequence):
    """A round's train messages (:meth:`CompressedStrategy.plan_train`), message ``k`` built
    when read, once: its content as :meth:`configure_train` writes it (``config``, the knobs,
    the sync body of the version its node holds, its pending selection as it was at planning).
    :meth:`fresh` builds one anew, :meth:`config_records` reads its configs without a message."""

    def __init__(self, node_ids: list[int], config: ConfigRecord, knobs: ConfigRecord, bases: list,
                 bodies: dict, pending: dict, message_type: str):
        self.node_ids, self.config, self.knobs, self.bases = node_ids, config, knobs, bases
        self.bodies, self.pending, self.message_type = bodies, pending, message_type
        self._built: dict[int, Message] = {}
        self._plain = {KNOBS: knobs}  # the config records of a node with no pending selection

    def __len__(self) -> int:
        return len(self.node_ids)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        msg = self._built.get(k)
        if msg is None:
            msg = self._built[k] = self.fresh(k)
        return msg

    def select(self, k: int) -> ConfigRecord | None:
        """Node ``k``'s ``select`` record (its pending selection), or None."""
        sel = self.pending.get(self.node_ids[k])
        return None if sel is None else ConfigRecord({"round": sel[0], sel[1]: sel[2]})

    def config_records(self, k: int) -> dict:
        """Node ``k``'s message's config records that the client step reads: the knobs and its
        ``select`` record's values as a dict (read as the record is, with no ConfigRecord built)."""
        sel = self.pending.get(self.node_ids[k])
        if sel is None:
            return self._plain
        return {KNOBS: self.knobs, SELECT: {"round": sel[0], sel[1]: sel[2]}}

    def fresh(self, k: int) -> Message:
        """Node ``k``'s message, built anew (no message id yet)."""
        nid = self.node_ids[k]
        content = RecordDict({"config": self.config, KNOBS: self.knobs})
        for key, rec in self.bodies[self.bases[k]].items():
            content[key] = rec
        sel = self.select(k)
        if sel is not None:
            content[SELECT] = sel
        return Message(content=content, message_type=self.message_type, dst_node_id=nid)


def _num_examples(msg: Message) -> float:
    metrics = msg.content.metric_records.get("metrics")
    if metrics is None or "num-examples" not in metrics:
        raise PayloadError("reply has no 'metrics' record with 'num-examples'")
    n = metrics["num-examples"]
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
        raise PayloadError(f"'num-examples' must be a positive number, got {n!r}")
    return float(n)


def read_payload(msg: Message, d: int) -> Payload:
    """The reply's payload, checked (keys, dtypes, finiteness, a size limit)."""
    return payload_from_records(msg.content, max_bytes=16 * d + (1 << 16))
