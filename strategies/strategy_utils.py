"""Helpers shared by fedswarm's Flower strategies and their client halves.

In the spirit of Flower's own ``flwr.serverapp.strategy.strategy_utils``: what more than
one strategy needs lives here once, rather than being copied between strategy modules.

**Round notes.** A strategy tells whoever records its rounds two kinds of things: extra
metrics for the round's row (``note``) and replies it refused (``reject``). Both go through
a :class:`RoundNotes` object, bound once in ``start()`` with :func:`notes_for`: fedswarm's
recorder (:class:`fedswarm.server.recorder.RoundRecorder`) *is* a ``RoundNotes`` and writes
them to the run store; with any other ``evaluate_fn`` (a user's plain function) the
strategy keeps them in a plain ``RoundNotes`` that logs rejections and holds the last
round's notes for inspection.

**Rejection.** :meth:`ReportsRounds.reject` is the one way a strategy refuses a reply: the
reply never touches the model, the reason is logged, recorded (``notes.reject``) and written
into the reply itself (``rejected = 1`` in its first MetricRecord, ``rejected_reason`` in its
``node`` record) so per-node rows read it too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, MutableMapping
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState
from fedswarm.algorithms.selection.cohort import sample_positions
from fedswarm.params import ParamLayout
from fedswarm.payload import PayloadError
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["pull_replies", "load_vector", "save_vector", "load_error_feedback", "save_error_feedback",
           "layout_of_arrays",
           "layout_json", "layout_from_json", "RoundNotes", "ReportsRounds", "notes_for", "clean_reason",
           "check_model_reply", "sample_train_nodes", "wait_for_nodes", "SamplesAfterWait"]

MAX_REASON = 500
NODE_WAIT_S = 600.0  # how long a strategy waits for the nodes it needs, by default


def wait_for_nodes(grid: Any, num_nodes: int, timeout_s: float) -> list[int]:
    """Wait until ``num_nodes`` nodes are connected; their sorted ids (all connected ones).

    Raises ``RuntimeError`` naming how many came if fewer than ``num_nodes`` connect within
    ``timeout_s`` seconds (nodes register with the SuperLink one by one after it starts).
    """
    deadline = time.monotonic() + timeout_s
    while len(ids := sorted(int(n) for n in grid.get_node_ids())) < num_nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ids)} of {num_nodes} nodes connected within {timeout_s:.0f} s")
        log(INFO, "Waiting for nodes: %d of %d connected", len(ids), num_nodes)
        time.sleep(1.0)  # polling the grid, as Flower's own sample_nodes does: it has no connect event
    return ids


def pull_replies(grid, waiting: Iterable[str], *, timeout: float | None = None,
                 enough: Callable[[list[Message]], bool] | None = None,
                 first_s: float = 0.05, max_s: float = 0.5) -> list[Message]:
    """Pull the replies to the pushed messages ``waiting`` (their ids) from ``grid``, at a growing
    interval (``first_s``, times 1.5, at most ``max_s``), until every one is in, ``enough(replies so
    far)`` says so (a quorum), or ``timeout`` seconds have passed. The ids still missing are asked for
    in the order given (the order they were pushed, for a caller that passes them so): a grid that
    answers in the order asked, as the in-process engine's does (it runs each node as its message is
    pulled), then hands them back in that order, never in a ``set``'s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    pause = first_s
    pending = dict.fromkeys(waiting)  # (ordered: the caller's order)
    while pending:
        got = list(grid.pull_messages(list(pending)))
        replies.extend(got)
        for m in got:
            pending.pop(m.metadata.reply_to_message_id, None)
        if not pending or (enough is not None and enough(replies)):
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 1.5, max_s)
    return replies


def sample_train_nodes(grid: Any, fraction: float, min_train_nodes: int,
                       min_available_nodes: int) -> tuple[list[int], list[int]]:
    """Sample ``max(fraction · available, min_train_nodes)`` nodes once ``min_available_nodes`` are connected.

    Flower's strategies count the fraction on the nodes connected *before* waiting, so a
    round that starts while nodes are still registering trains on fewer than asked; here the
    count is taken after the wait. Returns the sampled node ids and all connected ones.

    The draw is :func:`~fedswarm.algorithms.selection.cohort.sample_positions` (one call for the
    whole cohort, the batched engine's too), not Flower's per-node ``random.sample``.
    """
    _, available = sample_nodes(grid, min_available_nodes, 0)  # Flower's wait; a sample of 0 draws nothing
    num = max(int(len(available) * fraction), min_train_nodes)
    _, available = sample_nodes(grid, max(min_available_nodes, num), 0)  # the nodes now, at least num of them
    return [available[i] for i in sample_positions(len(available), num).tolist()], available


class SamplesAfterWait:
    """For strategies built on Flower's FedAvg: each round trains on ``fraction_train`` of the
    nodes connected *after* waiting for ``min_available_nodes`` (:func:`sample_train_nodes`).
    Flower's ``configure_train`` counts the fraction on the nodes connected before it waits, so
    a round that starts while a node registers or rejoins samples too few and can leave the
    newcomer out (a restarted SuperNode missed its round this way). Otherwise as Flower's."""

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list[Message]:
        if self.fraction_train == 0.0:
            return []
        node_ids, available = sample_train_nodes(grid, self.fraction_train, self.min_train_nodes,
                                                 self.min_available_nodes)
        log(INFO, "configure_train: sampled %s nodes (out of %s)", len(node_ids), len(available))
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return list(self._construct_messages(record, node_ids, MessageType.TRAIN))


def clean_reason(reason: object) -> str:
    """A rejection reason as stored: its first line, at most ``MAX_REASON`` characters."""
    text = str(reason).strip()
    return text.splitlines()[0][:MAX_REASON] if text else "rejected"


def load_error_feedback(state: RecordDict, key: str, d: int) -> ErrorFeedbackState:
    """A node's error-feedback memory kept in ``Context.state`` under ``key``; the empty
    state if there is none or what is stored is unusable (see :func:`load_vector`)."""
    rec = state.array_records.get(key)
    if rec is None:
        return ErrorFeedbackState()
    try:
        return ErrorFeedbackState(arrayrecord_to_vector(rec, d))
    except (PayloadError, ValueError):
        return ErrorFeedbackState()


def save_error_feedback(state: RecordDict | MutableMapping[str, Any], key: str, ef: ErrorFeedbackState) -> None:
    """Keep one node's error-feedback memory under ``key`` (the inverse of :func:`load_error_feedback`)."""
    if ef.residual is not None:
        save_vector(state, key, ef.residual)


def layout_of_arrays(arrays: Any) -> ParamLayout:
    """The :class:`ParamLayout` of a model given as an ArrayRecord (e.g.
    ``ArrayRecord(model.state_dict())``): its arrays' names and shapes, in order. Every array
    must be floating point (a model with integer buffers, such as BatchNorm's step count,
    must leave them out: ``{k: v for k, v in sd.items() if v.is_floating_point()}``)."""
    shapes = []
    for key in arrays.keys():
        arr = arrays[key]
        if not str(arr.dtype).startswith(("float", "bfloat")):
            raise PayloadError(f"array '{key}' is {arr.dtype}: fedswarm's strategies train floating-point arrays "
                               f"only (leave integer buffers out of the initial ArrayRecord)")
        shapes.append((str(key), tuple(int(n) for n in arr.shape)))
    if not shapes:
        raise PayloadError("the initial ArrayRecord holds no arrays")
    return ParamLayout.from_shapes(shapes)


def layout_json(layout: ParamLayout) -> str:
    """A layout as compact JSON, ``[[name, [shape...]], ...]`` (what a plain ``train``
    message tells compression_mod)."""
    return json.dumps([[s.name, list(s.shape)] for s in layout.specs], separators=(",", ":"))


def layout_from_json(text: str, *, max_d: int = 1 << 31) -> ParamLayout:
    """The inverse of :func:`layout_json`, checked: PayloadError on anything else."""
    try:
        items = json.loads(text)
        shapes = [(str(name), tuple(int(n) for n in shape)) for name, shape in items]
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"'layout' must be JSON [[name, [shape...]], ...]: {exc}") from None
    if not shapes or any(n < 0 for _, shape in shapes for n in shape):
        raise PayloadError("'layout' must name at least one array, with non-negative dimensions")
    layout = ParamLayout.from_shapes(shapes)
    if layout.d > max_d:
        raise PayloadError(f"'layout' describes {layout.d} parameters, more than {max_d}")
    return layout


class RoundNotes:
    """The typed channel from a strategy to the recorder of its rounds.

    ``note(**metrics)`` adds metrics to the current round's row; ``reject(node_id, reason)``
    records that the node's reply of the current round was refused. The recorder takes both
    when it writes the round (``take``). This base class keeps them in memory; the run
    recorder subclasses it to write them to the store.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        self.rejections: dict[str, str] = {}

    def note(self, **metrics: Any) -> None:
        self.metrics.update(metrics)

    def reject(self, node_id: int | str, reason: str) -> None:
        self.rejections[str(node_id)] = clean_reason(reason)

    def take(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The round's notes and rejections, cleared for the next round."""
        out = (self.metrics, self.rejections)
        self.metrics, self.rejections = {}, {}
        return out


def notes_for(evaluate_fn: Callable | None) -> RoundNotes:
    """The notes object of a run: ``evaluate_fn`` itself when it is a :class:`RoundNotes`
    (fedswarm's recorder), else a fresh in-memory one."""
    return evaluate_fn if isinstance(evaluate_fn, RoundNotes) else RoundNotes()


class ReportsRounds:
    """Mixin of every fedswarm strategy: ``self.notes`` and ``self.reject(reply, reason)``."""

    _notes: RoundNotes | None = None

    @property
    def notes(self) -> RoundNotes:
        if self._notes is None:
            self._notes = RoundNotes()
        return self._notes

    def bind_notes(self, evaluate_fn: Callable | None) -> RoundNotes:
        """Called at the top of ``start()``: route notes to ``evaluate_fn`` if it records rounds."""
        self._notes = notes_for(evaluate_fn)
        return self._notes

    def note(self, **metrics: Any) -> None:
        self.notes.note(**metrics)

    def reject(self, reply: Message, reason: object) -> str:
        """Refuse ``reply`` (it must not touch the model) because of ``reason``; returns the
        reason as recorded."""
        nid = reply.metadata.src_node_id
        text = clean_reason(reason)
        log(WARNING, "%s: reply of node %s rejected: %s", type(self).__name__, nid, text)
        self.notes.reject(nid, text)
        if reply.has_content():
            content = reply.content
            metrics = next(iter(content.metric_records.values()), None)
            if metrics is None:
                content["metrics"] = metrics = MetricRecord()
            metrics["rejected"] = 1
            if "train_loss" in metrics:
                del metrics["train_loss"]  # a rejected node's loss is not the round's
            node = content.config_records.get("node")
            if node is not None:
                node["rejected_reason"] = text
        return text


def load_vector(state: RecordDict, key: str, d: int) -> torch.Tensor:
    """A ``[d]`` float32 vector kept in a node's ``Context.state`` under ``key`` (an
    error-feedback residual, a momentum buffer...); zeros if there is none, or if what is
    stored has the wrong size, dtype or non-finite values: a model change or a corrupted
    state must not poison the update."""
    rec = state.array_records.get(key)
    if rec is not None:
        try:
            return arrayrecord_to_vector(rec, d)
        except PayloadError:
            pass
    return torch.zeros(d, dtype=torch.float32)


def save_vector(state: RecordDict | MutableMapping[str, Any], key: str, x: torch.Tensor) -> None:
    """Store one node's ``[d]`` (or ``[1, d]``) vector under ``key`` as an ArrayRecord, the
    inverse of :func:`load_vector`."""
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1:
        raise ValueError(f"save one node's vector, [d] or [1, d]; got {tuple(x.shape)}")
    state[key] = vector_to_arrayrecord(x)


def check_model_reply(msg: Message, d: int | None) -> torch.Tensor:
    """The model of a plain ``train`` reply (``arrays`` and ``metrics`` with ``num-examples``)
    as a flat ``[d]`` vector; PayloadError naming what is missing or malformed."""
    if "arrays" not in msg.content.array_records:
        raise PayloadError("reply has no 'arrays' record")
    metrics = msg.content.metric_records.get("metrics")
    if metrics is None or "num-examples" not in metrics:
        raise PayloadError("reply has no 'metrics' record with 'num-examples'")
    return arrayrecord_to_vector(msg.content.array_records["arrays"], d)
