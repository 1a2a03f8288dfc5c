"""The client half of fedswarm's compressed strategies: the frame every client update runs in.

:func:`begin` reads the train message (run config, the strategy's knobs, the replica sync),
:func:`train` runs local SGD (fedswarm's own trainer, or a Flower user's ``@app.train()``
function under :func:`user_training`), :func:`finish` writes the reply and the client's state.
The server half is :mod:`fedswarm.strategies.federated.compressed_base`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedswarm.config import RunConfig
from fedswarm.local import LocalFit, local_fit, node_data, node_partition, run_config_of
from fedswarm.params import ParamLayout
from fedswarm.payload import PayloadError
from fedswarm.strategies.federated.compressed_sync import client_sync, save_replica
from fedswarm.strategies.strategy_utils import layout_from_json
from fedswarm.train import LocalTrainer, TrainResult, trainer_for
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["ClientRound", "begin", "train", "finish", "selected_indices", "sent_of", "save_sent",
           "KNOBS", "SELECT", "UserTraining", "user_training"]

KNOBS = "compress"  # the ConfigRecord of strategy knobs in every train message
SELECT = "select"


class _TrainView:
    """What :func:`fedswarm.local.local_fit` reads of a message: its content."""

    def __init__(self, content: RecordDict):
        self.content = content


@dataclass
class ClientRound:
    """One client round in progress; ``state`` collects what :func:`finish` writes."""

    msg: Message
    context: Context
    cfg: RunConfig
    trainer: LocalTrainer
    knobs: ConfigRecord
    model: torch.Tensor  # the public model, [d]
    version: int
    epoch: str
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> ParamLayout:
        return self.trainer.layout

    @property
    def round(self) -> int:
        return int(self.knobs["round"])


@dataclass
class UserTraining:
    """A Flower user's own ``train`` function standing in for fedswarm's local SGD: set by
    :data:`fedswarm.client.compression_mod` around a strategy's client half (see
    :func:`user_training`). ``call_next(msg, context)`` is the rest of the user's ClientApp."""

    call_next: Callable[[Message, Context], Message]


_USER: ContextVar[UserTraining | None] = ContextVar("fedswarm_user_training", default=None)


@contextmanager
def user_training(call_next: Callable[[Message, Context], Message]) -> Iterator[None]:
    """Inside this block, :func:`begin` and :func:`train` run the user's app, not a task."""
    token = _USER.set(UserTraining(call_next))
    try:
        yield
    finally:
        _USER.reset(token)


@dataclass
class _UserModel:
    """What a client round needs of a trainer when the user's app trains: the layout."""

    layout: ParamLayout


def begin(msg: Message, context: Context) -> ClientRound:
    """Read config and knobs and bring this node's replica to the server's model."""
    if KNOBS not in msg.content.config_records:
        raise PayloadError(f"train message has no '{KNOBS}' record")
    knobs = msg.content.config_records[KNOBS]
    if _USER.get() is not None:  # a user's own app: no fedswarm task, the layout comes from the server
        if "layout" not in knobs:
            raise PayloadError(f"the '{KNOBS}' record has no 'layout': build the strategy without a layout "
                               "(from the initial ArrayRecord) to serve a user's ClientApp")
        layout = layout_from_json(str(knobs["layout"]))
        cfg = RunConfig(seed=int(knobs.get("seed", 0)))
        model, version, epoch = client_sync(msg.content, context.state, layout)
        return ClientRound(msg, context, cfg, _UserModel(layout), knobs, model, version, epoch)
    cfg = run_config_of(msg, context)
    pid, n = node_partition(context, cfg)
    trainer = trainer_for(cfg, pid, n, local=node_data(context))
    model, version, epoch = client_sync(msg.content, context.state, trainer.layout)
    return ClientRound(msg, context, cfg, trainer, knobs, model, version, epoch)


def train(cr: ClientRound) -> LocalFit:
    """Local SGD from the public model (policies apply); returns the LocalFit. Under
    :func:`user_training`, the user's own ``train`` function trains instead: it gets the
    public model as an ArrayRecord shaped like the initial one and must reply with its new
    ``arrays`` (same names and shapes) and a MetricRecord with ``num-examples``."""
    user = _USER.get()
    if user is not None:
        return _user_fit(cr, user)
    content = RecordDict({"arrays": vector_to_arrayrecord(cr.model), "config": cr.msg.content.config_records["config"]})
    if "byzantine" in cr.msg.content.config_records:  # a data-poisoning attacker trains on what it was told
        content["byzantine"] = cr.msg.content.config_records["byzantine"]
    return local_fit(_TrainView(content), cr.context)


def _user_fit(cr: ClientRound, user: UserTraining) -> LocalFit:
    layout = cr.layout
    arrays = ArrayRecord()
    for spec in layout.specs:
        arrays[spec.name] = Array(np.ascontiguousarray(cr.model[spec.offset:spec.end].reshape(spec.shape).numpy()))
    config = cr.msg.content.config_records.get("config") or ConfigRecord()
    msg = Message(RecordDict({"arrays": arrays, "config": config}), metadata=cr.msg.metadata)
    reply = user.call_next(msg, cr.context)
    if reply.has_error():
        raise RuntimeError(f"the ClientApp's train function failed: {reply.error.reason}")
    recs = reply.content.array_records
    rec = recs.get("arrays") if "arrays" in recs else (next(iter(recs.values())) if len(recs) == 1 else None)
    if rec is None:
        raise PayloadError(f"the train function must reply with one ArrayRecord ('arrays'), got {list(recs.keys())}")
    names = [spec.name for spec in layout.specs]
    if list(rec.keys()) != names:
        raise PayloadError(f"the train function replied with arrays {list(rec.keys())[:8]}, expected the model's "
                           f"{names[:8]} (same names, same order)")
    flat = arrayrecord_to_vector(rec, layout.d)
    metrics = next(iter(reply.content.metric_records.values()), None)
    if metrics is None or "num-examples" not in metrics:
        raise PayloadError("the train function must reply with a MetricRecord holding 'num-examples'")
    loss = metrics.get("train_loss", metrics.get("loss", float("nan")))
    result = TrainResult(flat=flat, loss=float(loss), num_examples=int(metrics["num-examples"]), steps=0)
    return LocalFit(cr.cfg, cr.trainer, cr.model, result, device_class="", policy={})


def finish(cr: ClientRound, fit: LocalFit, reply: RecordDict, **metrics: float) -> RecordDict:
    """Write the replica and the algorithm's state (``cr.state``), then complete the reply."""
    state = cr.context.state
    save_replica(state, cr.model, cr.version, cr.epoch)
    for key, value in cr.state.items():
        state[key] = value
    return fit.reply(reply, **metrics)


def save_sent(cr: ClientRound, key: str, indices: torch.Tensor | None = None) -> None:
    """Remember this round's tag (and the indices sent) to match the server's ``select``."""
    cr.state[key + ".sent"] = ConfigRecord({"round": cr.round})
    if indices is not None:
        idx = np.ascontiguousarray(indices.cpu().numpy().astype(np.int32))
        cr.state[key + ".sent_idx"] = ArrayRecord({"indices": Array(idx)})


def sent_of(state: RecordDict, key: str) -> tuple[int | None, torch.Tensor | None]:
    """The round tag and the indices of this node's last message kept under ``key`` by
    :func:`save_sent` in its ``Context.state`` (None for what is not kept)."""
    sent = state.config_records.get(key + ".sent")
    rec = state.array_records.get(key + ".sent_idx")
    idx = None if rec is None else torch.from_numpy(next(iter(rec.values())).numpy().astype(np.int64))
    return (None if sent is None else int(sent["round"])), idx


def selected_indices(select: ConfigRecord | None, sent_round: int | None, sent_idx: torch.Tensor | None,
                     d: int) -> torch.Tensor | None:
    """Coordinates of a node's last message that the server used: its ``select`` record read
    against the round tag and the indices it sent. None: nothing used, or the server's note
    is about another message."""
    if select is None or sent_round is None or int(select.get("round", -1)) != sent_round:
        return None
    if "mask" in select:
        if sent_idx is None:
            return None
        bits = np.unpackbits(np.frombuffer(select["mask"], dtype=np.uint8), bitorder="little")
        if bits.size < sent_idx.numel():
            raise PayloadError(f"selection mask has {bits.size} bits for {sent_idx.numel()} sent indices")
        return sent_idx[torch.from_numpy(bits[: sent_idx.numel()].astype(bool))]
    raw = select.get("indices", b"")
    if len(raw) % 4:
        raise PayloadError("selection indices are not int32")
    idx = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64))
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= d):
        raise PayloadError(f"selection indices must lie in [0, {d})")
    return idx
