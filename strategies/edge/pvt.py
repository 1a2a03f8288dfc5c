"""PVT: Partial Variable Training (Yang et al., ICASSP 2022; ``docs/algorithms.md`` §11).

Each client, each round, trains a random subset ``T_c`` of the model's *variables* (whole
tensors of the :class:`~fedswarm.params.ParamLayout`) and freezes the rest: frozen
tensors get ``requires_grad = False``, so autograd computes no gradient for them and the
optimizer holds no state (momentum) for them, and activations that only feed frozen
tensors are not kept. The client uploads only the trained tensors' deltas and their ids::

    server round t: sample M clients; broadcast the full model x (4d bytes down)
    client c:       k = max(1, round(f·V)) of the V tensors, chosen at random from
                    seed(run seed, t, node id); f = its class policy's ``pvt_fraction``,
                    else the ``fraction`` hyperparameter; E local steps (more than for
                    all-variable training: a policy's ``local_steps``)
                    upload {Δ_v : v ∈ T_c} as one float32 vector, plus the ids (int32)
    server:         Δ̄_v = Σ_{c: v ∈ T_c} n_c Δ_{c,v} / Σ_{c: v ∈ T_c} n_c   (weighted by examples)
                    x_v ← x_v + server_lr · Δ̄_v ;   a variable no client trained keeps its value

State: the server keeps the model it sent (to add the averaged deltas to); clients are
stateless. Wire: down 4d, up 4·Σ_{v ∈ T_c}|v| bytes plus the ids, 4·k bytes and about
180 bytes of ``.npy`` framing in Flower's ``Array`` (``send_ids``; with ``send_ids =
false`` the server re-derives T_c from the shared seed and the count k the client
reports, and the ids cost nothing). Sizes are measured on the serialized messages.

``server_lr``: each client's delta is made with the other variables frozen at the global
values, and the deltas of different subsets add up at the server; with plain averaging
(1) and a few clients per variable they can overshoot together. On ``digits-cnn4`` with
momentum 0.9 and 20 local steps, accuracy oscillated around 0.2 at server_lr 1 and
reached FedAvg's within about a point at 0.3 (``fedswarm bench edge``).

The node-side helper here (:func:`frozen`; the setup is :func:`fedswarm.local.prepare_local`) is shared with
ProgFed (``strategies/edge/progfed.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedswarm.local import prepare_local, server_round, train_reply
from fedswarm.algorithms.selection.pvt import num_selected, select_variables, selection_seed
from fedswarm.params import ParamLayout, set_flat
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.strategies.registry import (LOCAL_POLICY_KEYS, Batched, BuildContext, StrategyEntry, message_type_of,
                                          register, resolve_params)
from fedswarm.payload import PayloadError
from fedswarm.strategies.strategy_utils import ReportsRounds, sample_train_nodes
from fedswarm.wire import arrayrecord_to_vector, read_array, vector_to_arrayrecord

__all__ = [
    "PartialVariableTraining",
    "frozen",
    "client_update",
    "client_variables",
    "reply_content",
    "HYPERPARAMS",
]

UPDATE = "update"  # the reply's ArrayRecord: "values" (float32 deltas) and "ids" (int32)


# --------------------------------------------------------------------------- node side


@contextlib.contextmanager
def frozen(model: torch.nn.Module, trained: Sequence[str]):
    """Freeze every parameter of ``model`` not named in ``trained`` (``requires_grad =
    False``: no gradient, no optimizer state; a stale ``.grad`` is dropped) and restore
    ``requires_grad`` on exit. While frozen, ``get_flat``/``set_flat`` see only the
    trained tensors, in layout order."""
    keep = set(trained)
    params = dict(model.named_parameters())
    unknown = keep - set(params)
    if unknown:
        raise ValueError(f"unknown variables: {sorted(unknown)}")
    before = {n: p.requires_grad for n, p in params.items()}
    try:
        for n, p in params.items():
            p.requires_grad_(n in keep and before[n])
            if n not in keep:
                p.grad = None  # a gradient left from an earlier round is memory, and not this round's
        yield model
    finally:
        for n, p in params.items():
            p.requires_grad_(before[n])


def client_variables(num_variables: int, policy: dict, params: dict, seed: int, server_round: int,
                     node_id: int) -> torch.Tensor:
    """The ids of the variables node ``node_id`` trains in ``server_round``: ``k`` from its
    class policy's ``pvt_fraction`` (else the ``fraction`` hyperparameter), drawn from the
    shared seed (:mod:`fedswarm.algorithms.selection.pvt`)."""
    k = num_selected(num_variables, float(policy.get("pvt_fraction", params["fraction"])))
    return select_variables(num_variables, k, selection_seed(seed, server_round, node_id))


def client_update(msg: Message, context: Context) -> RecordDict:
    """Train a random subset of variables; reply with their deltas (and ids)."""
    setup = prepare_local(msg, context)
    params = resolve_params("pvt", setup.cfg.params)
    trainer, layout = setup.trainer, setup.trainer.layout
    ids = client_variables(len(layout), setup.policy, params, setup.cfg.seed, server_round(msg), context.node_id)
    names = [layout.specs[i].name for i in ids.tolist()]
    set_flat(trainer.model, setup.start.to(trainer.device))  # frozen tensors hold the global values
    # The trained tensors' coordinates, in layout order (what get_flat returns while frozen);
    # slices, as a client's memory is what PVT saves.
    start = layout.take(setup.start, ids)
    with frozen(trainer.model, names):
        res = trainer.fit(start, **setup.fit_kwargs)
    delta = res.flat.sub_(start)  # in place
    return reply_content(delta, ids, params["send_ids"], res.num_examples, res.loss, res.steps, setup.report(res))


def reply_content(delta: torch.Tensor, ids: torch.Tensor, send_ids: bool, num_examples: int, loss: float,
                  steps: int, node: ConfigRecord) -> RecordDict:
    """A node's reply: the trained variables' deltas (float32, in layout order) and, with
    ``send_ids``, their ``ids``; its metrics (``variables`` k, ``trained_params``) and its
    ``node`` report."""
    arrays = ArrayRecord({"values": Array(np.ascontiguousarray(delta.numpy()))})
    if send_ids:
        arrays["ids"] = Array(ids.numpy().astype(np.int32))
    return train_reply(RecordDict({UPDATE: arrays}), num_examples, loss, steps, node, variables=int(ids.numel()),
                       trained_params=int(delta.numel()))


# --------------------------------------------------------------------------- server side


class PartialVariableTraining(ReportsRounds, FedAvg):
    """Average each variable over the clients that trained it (PVT, §11).

    Parameters
    ----------
    layout : ParamLayout
        The model's layout: its tensors are PVT's variables.
    fraction : float
        Share of variables a client trains when its class policy sets no
        ``pvt_fraction``; the clients read it from the run config.
    server_lr : float
        Server step on the averaged deltas (1 = plain averaging).
    send_ids : bool
        Clients send the ids of the variables they trained (``False``: the server
        re-derives them from the shared seed and the count each client reports).
    seed : int
        The run seed (the shared selection seeds derive from it).
    fraction_train, min_train_nodes, min_available_nodes
        Node sampling, as in Flower's ``FedAvg``.
    """

    message_type = message_type_of("pvt")

    def __init__(self, layout: ParamLayout, fraction: float = 0.25, server_lr: float = 1.0, send_ids: bool = True,
                 seed: int = 0, *, fraction_train: float = 1.0, min_train_nodes: int = 1,
                 min_available_nodes: int = 2):
        super().__init__(fraction_train=fraction_train, fraction_evaluate=0.0, min_train_nodes=min_train_nodes,
                         min_evaluate_nodes=0, min_available_nodes=min_available_nodes)
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.layout = layout
        self.fraction = float(fraction)
        self.server_lr = float(server_lr)
        self.send_ids = bool(send_ids)
        self.seed = int(seed)
        # Flat indices of each variable: what index_add_ scatters a client's values into.
        self._ranges = [torch.arange(s.offset, s.end) for s in layout.specs]
        self._sent: torch.Tensor | None = None  # the model of the round in flight

    def summary(self) -> None:
        log(INFO, "\t├── PVT: fraction %.3g of %d variables (policies may override), server_lr %.3g, ids %s",
            self.fraction, len(self.layout), self.server_lr, "sent" if self.send_ids else "from the seed")
        super().summary()

    # -- checkpoint (fedswarm.strategies.resumable): the subsets are drawn from (seed,
    # round, node), so nothing but the round number (the server's) carries over
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"PVT keeps no state between rounds; got {sorted(state)}")

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop; a recorder passed as ``evaluate_fn`` gets each round's
        ``coverage`` (share of parameters some client trained) through its ``note``."""
        self.bind_notes(evaluate_fn)
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        node_ids, _ = sample_train_nodes(grid, self.fraction_train, self.min_train_nodes, self.min_available_nodes)
        config["server-round"] = server_round
        # What clients read (run config keys): set here too, so the strategy works in any
        # ServerApp, not only fedswarm's (whose run config already carries them).
        config["params.fraction"], config["params.send_ids"] = self.fraction, self.send_ids
        self._sent = arrayrecord_to_vector(arrays, self.layout.d)
        content = RecordDict({"arrays": arrays, "config": config})
        return [Message(content=content, message_type=self.message_type, dst_node_id=nid) for nid in node_ids]

    def _parse(self, server_round: int, reply: Message) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """(flat indices, values, weight, loss) of one reply; raises PayloadError."""
        try:
            rec = reply.content.array_records[UPDATE]
            metrics = reply.content.metric_records["metrics"]
            weight = float(metrics["num-examples"])
            loss = float(metrics.get("train_loss", 0.0))
        except KeyError as exc:
            raise PayloadError(f"reply lacks {exc}") from None
        V = len(self.layout)
        if "ids" in rec:
            ids = read_array("ids", rec["ids"])  # checked before numpy allocates what its header declares
            if ids.dtype.kind not in "iu" or ids.ndim != 1:
                raise PayloadError(f"ids must be a 1-d integer array, got {ids.dtype} {ids.shape}")
            ids = torch.from_numpy(ids.astype(np.int64))
            if ids.numel() == 0 or ids.min() < 0 or ids.max() >= V or not bool((ids[1:] > ids[:-1]).all()):
                raise PayloadError(f"ids must be sorted, distinct and in 0..{V - 1}")
        else:
            k = metrics.get("variables", 0)
            if not isinstance(k, (int, float)) or not 1 <= k <= V or k != int(k):  # inf, NaN, 2.5: no count
                raise PayloadError(f"reply sends no ids and a bad variable count {k}")
            ids = select_variables(V, int(k), selection_seed(self.seed, server_round, reply.metadata.src_node_id))
        idx = torch.cat([self._ranges[i] for i in ids.tolist()])
        values = arrayrecord_to_vector(ArrayRecord({"values": rec["values"]}), idx.numel())
        if not (weight > 0 and math.isfinite(weight)):  # an infinite weight makes the weighted mean NaN
            raise PayloadError(f"num-examples must be finite and > 0, got {weight}")
        return idx, values, weight, loss

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Per-variable weighted mean of the deltas over the clients that trained it."""
        if self._sent is None:
            raise RuntimeError("aggregate_train before configure_train")
        idxs, vals, wts, loss_sum = [], [], [], 0.0
        for reply in replies:
            if reply.has_error():
                log(WARNING, "node %s failed this round: %s", reply.metadata.src_node_id,
                    (reply.error.reason.splitlines() or [""])[0][:300])
                continue
            try:
                idx, values, w, loss = self._parse(server_round, reply)
            except (PayloadError, KeyError, ValueError, TypeError) as exc:
                self.reject(reply, exc)
                continue
            idxs.append(idx)
            vals.append(values * w)
            wts.append(torch.full((idx.numel(),), w))
            loss_sum += loss * w
        if not idxs:
            return None, None
        d = self.layout.d
        idx = torch.cat(idxs)
        num = torch.zeros(d, dtype=torch.float64).index_add_(0, idx, torch.cat(vals).double())
        den = torch.zeros(d, dtype=torch.float64).index_add_(0, idx, torch.cat(wts).double())
        trained = den > 0
        mean = torch.where(trained, num / den.clamp_min(1e-30), torch.zeros_like(num))
        new = self._sent + (self.server_lr * mean).to(torch.float32)
        total_w = sum(float(w[0]) for w in wts)
        coverage = float(trained.double().mean())
        self.note(coverage=coverage)
        metrics = MetricRecord({"train_loss": loss_sum / total_w, "num-examples": total_w, "coverage": coverage})
        return vector_to_arrayrecord(new), metrics


# --------------------------------------------------------------------------- registry

HYPERPARAMS = defaults_from(PartialVariableTraining, (  # defaults: the constructor's
    HyperParam("fraction", SIGNATURE, "share of variables (tensors) each client trains per round; "
               "a device class's policy 'pvt_fraction' overrides it", gt=0.0, le=1.0),
    HyperParam("server_lr", SIGNATURE, "server step size on the per-variable averaged deltas", gt=0.0, le=10.0),
    HyperParam("send_ids", SIGNATURE, "clients send the trained variables' ids (else the server re-derives "
               "them from the shared seed)"),
))


def build(params: dict, ctx: BuildContext) -> PartialVariableTraining:
    cfg = ctx.config
    return PartialVariableTraining(ctx.layout, params["fraction"], params["server_lr"], params["send_ids"], cfg.seed,
                                   fraction_train=cfg.fraction, min_train_nodes=1, min_available_nodes=cfg.clients)


ENTRY = register(StrategyEntry(
    name="pvt",
    description="PVT: each client trains a random subset of variables and uploads only their deltas; "
                "the server averages each variable over the clients that trained it.",
    build=build,
    hyperparams=HYPERPARAMS,
    client_update=client_update,
    paper="Yang, Guliani, Beaufays, Motta, ICASSP 2022 (arXiv 2110.05607)",
    batched=Batched("variable_subsets"),
    policy_keys=(*LOCAL_POLICY_KEYS, "pvt_fraction"),
))
