"""FedAvg with any codec on the uplink (and optionally the downlink), and 1-bit SGD.

Registered as ``compressed_fedavg`` and ``onebit``. Both use one client update: local SGD
from the public model, then compress the model change with error feedback
(:func:`client_step`, on C clients at once: a Flower client runs it with C = 1, the batched
engine with the cohort).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict

from fedswarm.errors import ConfigError
from fedswarm.kv import parse_pairs
from fedswarm.params import ParamLayout, all_finite
from fedswarm.algorithms.compression.base import Codec
from fedswarm.algorithms.compression.codecs import CODECS, decode_payload, make_codec
from fedswarm.strategies.federated.compressed_base import (Accepted, CompressedStrategy, Step, begin,
                                                           finish, read_payload, train)
from fedswarm.strategies.strategy_utils import load_error_feedback, save_error_feedback
from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState, error_feedback_step
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.strategies.registry import Batched, BuildContext, StrategyEntry, register
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import payload_to_records

__all__ = ["CompressedFedAvg", "OneBitSGD", "parse_codec_params", "Uplink", "uplink_of", "client_step",
           "client_update", "client_codec", "uplink_seed", "decode_reply"]


def parse_codec_params(text: str | dict | None) -> dict[str, Any]:
    """Codec hyperparameters from ``--set``: JSON (``{"ratio": 0.05}``) or ``ratio=0.05,levels=4``."""
    if not text:
        return {}
    if isinstance(text, dict):
        return dict(text)
    text = text.strip()
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"invalid codec parameters {text!r}: {exc}") from None
        if not isinstance(out, dict):
            raise ConfigError(f"invalid codec parameters {text!r}: expected a JSON object")
        return out
    try:
        return parse_pairs(text, what=f"invalid codec parameters {text!r}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class CompressedFedAvg(CompressedStrategy):
    """FedAvg whose clients send compressed model changes, with error feedback.

    Client ``i`` starts from the public model x̂, trains locally to x_i and sends
    ``C(δ_i + e_i)`` with ``δ_i = x_i − x̂``; with error feedback it keeps
    ``e_i ← δ_i + e_i − D(C(δ_i + e_i))`` in its ``Context.state`` (Seide et al. 2014;
    Karimireddy et al. 2019). The server decodes and validates each payload, averages
    weighted by examples and steps::

        u = server_lr · Σ_i n_i D(C(δ_i + e_i)) / Σ_i n_i
        x̂ ← x̂ + u                                  (no downlink codec)
        q = C_down(u + e_s); e_s ← u + e_s − D(q); x̂ ← x̂ + D(q)   (downlink codec)

    With the ``none`` codec and ``server_lr = 1`` this is FedAvg. A device-class policy
    may set ``codec``/``codec_params`` for its nodes: the server decodes any codec.

    State: per client the residual e_i (d floats) and the model replica; on the server
    the public model, e_s (d floats, with a downlink codec) and the sync bookkeeping.

    Wire: up, the codec's payload per client (``codec.wire_bytes``: 8k for top-k, d/8 + 8C
    for 1-bit, 4rc for a sketch, ...) plus message framing; down, the smallest of the
    full model, the changed coordinates, or the downlink payloads the node missed.

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    codec : str (default: "topk")
        Uplink codec, one of :data:`fedswarm.algorithms.compression.codecs.CODECS`.
    codec_params : dict, optional
        Its hyperparameters (defaults for the rest).
    error_feedback : bool (default: True)
        Keep residuals (clients' and, with a downlink codec, the server's).
    downlink_codec : str (default: "none")
        Codec of the update sent down; ``none`` sends the model or its changed coordinates.
    downlink_codec_params : dict, optional
    server_lr, fraction_train, min_train_nodes, min_available_nodes, seed, history
        See :class:`~fedswarm.strategies.federated.compressed_base.CompressedStrategy`.

    Paper: McMahan et al. 2017 (FedAvg); Seide et al. 2014 and Karimireddy et al. 2019
    (error feedback).
    """

    name = "compressed_fedavg"
    supports_dp = True

    state_attrs = CompressedStrategy.state_attrs + ("server_ef",)  # the downlink's error feedback

    def __init__(self, layout: ParamLayout | None = None, codec: str = "topk", codec_params: dict | None = None,
                 error_feedback: bool = True, downlink_codec: str = "none",
                 downlink_codec_params: dict | None = None, **kwargs: Any):
        super().__init__(layout, **kwargs)
        self.codec = make_codec(codec, **(codec_params or {}))
        self.error_feedback = bool(error_feedback)
        self.downlink = (None if downlink_codec == "none"
                         else make_codec(downlink_codec, **(downlink_codec_params or {})))
        self.server_ef = ErrorFeedbackState()  # the server's memory of its downlink compression

    def summary_lines(self) -> list[str]:
        down = self.downlink.summary() if self.downlink else "none (model or changed coordinates)"
        return [f"uplink codec: {self.codec.summary()} ({self.codec.ratio(self.layout):.1f}x of float32)",
                f"error feedback: {self.error_feedback}", f"downlink codec: {down}"]

    def knobs(self, server_round: int) -> dict[str, Any]:
        knobs = {"codec": self.codec.name, "codec_params": json.dumps(self.codec.params),
                 "error_feedback": self.error_feedback}
        if self.dp is not None:
            knobs["dp_clip"] = self.dp.clip  # clients clip before they compress
        return knobs

    def parse_reply(self, msg: Message) -> torch.Tensor:
        return decode_reply(msg, self.layout)

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step:
        w = self.weights(accepted)
        avg = torch.zeros(self.layout.d, dtype=torch.float32)
        for wi, a in zip(w.tolist(), accepted, strict=True):
            avg.add_(a.value, alpha=wi)
        u = avg if self.server_lr == 1.0 else avg * self.server_lr
        if self.downlink is None:
            return Step(u)
        # The second compression, of the aggregate, with the server's own residual
        # (1-bit SGD's two-stage aggregation; DoubleSqueeze, Tang et al. 2019).
        state = self.server_ef if self.error_feedback else ErrorFeedbackState()
        q, state = error_feedback_step(state, self.downlink, u[None], self.layout, seed=server_round)
        dq = self.downlink.decode(q, self.layout)[0]
        if self.error_feedback:
            self.server_ef = state
        return Step(dq, q, {"server_residual_norm": self.server_ef.norm})

    @property
    def secagg_dim(self) -> int | None:
        """Under ``--secagg``, the length of the vector a node masks: its linear codec's one
        payload array (randk's k values, countsketch's r·c table); None for other codecs."""
        if self.layout is None or not self.codec.linear:
            return None
        specs = self.codec._array_specs(1, self.layout, self.codec.params)
        if len(specs) != 1:
            return None
        (_, shape), = specs.values()
        return math.prod(shape)

    @property
    def server_residual(self) -> torch.Tensor | None:
        """The server's downlink residual, ``[d]`` (None before the first compressed round)."""
        return None if self.server_ef.residual is None else self.server_ef.residual[0]


class OneBitSGD(CompressedFedAvg):
    """1-bit SGD with error feedback and two-stage aggregation (Seide et al. 2014).

    Clients quantize ``δ_i + e_i`` per column with threshold 0 and two reconstruction values
    (the ``onebit`` codec) and keep the quantization error ``e_i``. The server plays every
    stripe owner of the paper's all-to-all (docs/algorithms.md §1): it sums the decoded
    stripes, ``A = Σ_i n_i D(Q_i) / Σ_i n_i``, quantizes the aggregate a second time with
    its own residual, ``QA = Q(server_lr·A + E)``, ``E ← server_lr·A + E − D(QA)``, and
    sends ``QA`` down: every client applies ``x̂ ← x̂ + D(QA)``. With ``error_feedback``
    off both residuals are dropped (the paper's ablation: visibly worse).

    State: e_i (d floats) per client, E (d floats) on the server (the paper's stripe
    residuals E_k together). Wire: ceil(d/8) + 8·C bytes each way per client (C = columns
    of all weight matrices), about 32x less than float32 for tall columns, plus framing.
    The paper's AdaGrad and double buffering are not reproduced: the clients run local
    SGD as in FedAvg.

    Parameters
    ----------
    layout : ParamLayout
    error_feedback : bool (default: True)
    scale : str (default: "auto")
        Values sharing one (a0, a1) pair, both ways: ``column`` (the paper's), ``tensor``,
        ``block`` (columns grouped to >= 256 values) or ``auto`` (columns of >= 256 rows,
        else the tensor; see
        :class:`~fedswarm.algorithms.compression.quant.OneBitCodec`). Per column, small
        layers pay 64 bits of scales per few bits of signs.
    server_lr, fraction_train, min_train_nodes, min_available_nodes, seed, history
        See :class:`~fedswarm.strategies.federated.compressed_base.CompressedStrategy`.

    Paper: Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
    """

    name = "onebit"

    def __init__(self, layout: ParamLayout | None = None, error_feedback: bool = True, scale: str = "auto",
                 **kwargs: Any):
        super().__init__(layout, codec="onebit", codec_params={"scale": scale}, error_feedback=error_feedback,
                         downlink_codec="onebit", downlink_codec_params={"scale": scale}, **kwargs)


def decode_reply(msg: Message, layout: ParamLayout) -> torch.Tensor:
    """One client's update ``[d]`` from its reply's payload, decoded with the codec its meta names;
    PayloadError when it is malformed, holds more than one client's or decodes to non-finite values."""
    x = decode_payload(read_payload(msg, layout.d), layout)
    if x.shape[0] != 1:
        raise PayloadError(f"payload holds {x.shape[0]} clients' updates, expected 1")
    if not all_finite(x):
        raise PayloadError("payload decodes to non-finite values")
    return x[0]


# -- the client half -----------------------------------------------------------------------

# Codecs whose randomness is per row (row i of a batch uses seed + i): each client gets its
# own stream, so the noise of different clients is independent. The others share one seed
# per round (randk's coordinates, countsketch's hashes), as all rows of one batch do.
_PER_CLIENT_SEED = {"qsgd"}


def client_codec(knobs: Any, policy: dict) -> tuple[str, dict[str, Any]]:
    """The uplink codec a client uses: the strategy's (``knobs``), unless its device-class
    policy names another ``codec`` (its defaults then) or adds ``codec_params``."""
    name, params = str(knobs["codec"]), json.loads(str(knobs.get("codec_params", "{}")))
    if "codec" in policy and policy["codec"] != name:
        name, params = policy["codec"], {}
    params.update(policy.get("codec_params") or {})
    return name, params


def uplink_seed(seed: int, server_round: int, codec_name: str, partition_id: int) -> int:
    """The seed of a client's uplink encode in round ``server_round`` (the strategy's own
    round count): one per round, plus the partition id for codecs whose randomness is per
    client (as row ``partition-id`` of one batch of all clients)."""
    out = (seed * 1_000_003 + server_round * 10_007) % (2**31 - 1)
    return out + partition_id if codec_name in _PER_CLIENT_SEED else out


@dataclass(frozen=True)
class Uplink:
    """How a client sends its update in a round, read by :func:`uplink_of` from the train
    message's knobs and the client's policy. Equal values encode in one batch."""

    codec: str
    params: str  # the codec's parameters, JSON with sorted keys
    seed: int  # of the encode (:func:`uplink_seed`)
    error_feedback: bool = True
    dp_clip: float | None = None  # DP-FedAvg: each client clips its change to this norm first

    def make_codec(self) -> Codec:
        return make_codec(self.codec, **json.loads(self.params))


def uplink_of(knobs: Any, policy: dict, run_seed: int, partition_id: int) -> Uplink:
    """A client's :class:`Uplink` this round: ``knobs`` (the train message's ``compress``
    record), its device class's ``policy``, the run's seed and its partition id."""
    name, params = client_codec(knobs, policy)
    seed = uplink_seed(run_seed, int(knobs["round"]), name, partition_id)
    dp_clip = float(knobs["dp_clip"]) if "dp_clip" in knobs else None
    return Uplink(name, json.dumps(params, sort_keys=True), seed, bool(knobs.get("error_feedback", True)), dp_clip)


def client_step(uplink: Uplink, state: ErrorFeedbackState, delta: torch.Tensor,
                layout: ParamLayout) -> tuple[Payload, ErrorFeedbackState]:
    """The client half after local training, for C clients of one uplink: ``delta`` ``[C, d]``
    their model changes, ``state`` their residuals (``[C, d]``, or ``[d]`` for one, or none).
    Clips each row (DP-FedAvg; the server clips again), then sends ``C(δ + e)`` and returns the
    new residuals (error feedback), or sends ``C(δ)`` and returns ``state`` as it was. A Flower
    client runs it with C = 1; the batched engine with the chunk's clients of one uplink."""
    if delta.dim() != 2:
        raise ValueError(f"client_step takes the model changes as [C, d], got {tuple(delta.shape)}")
    codec = uplink.make_codec()
    if uplink.dp_clip is not None:
        from fedswarm.algorithms.privacy.dp_fedavg import clip_rows

        delta = clip_rows(delta, uplink.dp_clip)[0]
    if not uplink.error_feedback:
        return codec.encode(delta, layout, seed=uplink.seed), state
    return error_feedback_step(state, codec, delta, layout, seed=uplink.seed)


def client_update(msg: Message, context: Context) -> RecordDict:
    """Local SGD from the public model, then :func:`client_step` with C = 1: send
    ``C(δ + e)`` and keep the new residual. The node's device-class policy may choose
    another codec (``codec``/``codec_params``)."""
    cr = begin(msg, context)
    fit = train(cr)
    uplink = uplink_of(cr.knobs, fit.policy, cr.cfg.seed, int(context.node_config.get("partition-id", 0)))
    key = f"{msg.metadata.message_type}.residual"
    ef = load_error_feedback(context.state, key, cr.layout.d) if uplink.error_feedback else ErrorFeedbackState()
    payload, ef = client_step(uplink, ef, (fit.result.flat - fit.start)[None], cr.layout)
    if uplink.error_feedback:
        save_error_feedback(cr.state, key, ef)  # written by finish(), with the rest of the round's state
    return finish(cr, fit, payload_to_records(payload, RecordDict()))


# -- registry --------------------------------------------------------------------------------

_COMMON = (
    HyperParam("server_lr", SIGNATURE, "scale of the averaged update applied to the model", gt=0.0, le=100.0),
)


def _build_cfa(params: dict, ctx: BuildContext) -> CompressedFedAvg:
    cfg = ctx.config
    return CompressedFedAvg(
        ctx.layout, codec=params["codec"], codec_params=parse_codec_params(params["codec_params"]),
        error_feedback=params["error_feedback"], downlink_codec=params["downlink_codec"],
        downlink_codec_params=parse_codec_params(params["downlink_codec_params"]), server_lr=params["server_lr"],
        fraction_train=cfg.fraction, min_available_nodes=cfg.clients, seed=cfg.seed)


def _build_onebit(params: dict, ctx: BuildContext) -> OneBitSGD:
    cfg = ctx.config
    return OneBitSGD(ctx.layout, error_feedback=params["error_feedback"], scale=params["scale"],
                     server_lr=params["server_lr"],
                     fraction_train=cfg.fraction, min_available_nodes=cfg.clients, seed=cfg.seed)


register(StrategyEntry(
    name="compressed_fedavg",
    description="FedAvg with any codec on the uplink (error feedback on clients) and optionally the downlink.",
    build=_build_cfa,
    # The codec parameters are a 'k=v' string here, which the builder parses into the constructor's
    # dict (None: none): their default, '', is written here (kept).
    hyperparams=defaults_from(CompressedFedAvg, (
        HyperParam("codec", SIGNATURE, "uplink codec", choices=tuple(CODECS)),
        HyperParam("codec_params", "", "codec hyperparameters: 'ratio=0.05,levels=4' or JSON "
                   "(the codecs' are listed by `fedswarm strategies`)"),
        HyperParam("error_feedback", SIGNATURE, "keep the untransmitted part (client and server residuals)"),
        HyperParam("downlink_codec", SIGNATURE, "codec of the update sent down (none: model or changed coordinates)",
                   choices=tuple(CODECS)),
        HyperParam("downlink_codec_params", "", "downlink codec hyperparameters, as codec_params"),
        *_COMMON,
    ), kept=("codec_params", "downlink_codec_params")),
    client_update=client_update,
    paper="McMahan et al. 2017; Karimireddy et al., ICML 2019",
    batched=Batched("codec", dp=True, byzantine=True),
    dp=True,
    secagg=True,  # with a linear codec (randk, countsketch, none): SecAggGrid sums the payloads (secagg_payload.py)
))

register(StrategyEntry(
    name="onebit",
    description="1-bit SGD: 1-bit quantization (per column or tensor) with error feedback, 1-bit aggregate sent down.",
    build=_build_onebit,
    hyperparams=defaults_from(OneBitSGD, (
        HyperParam("error_feedback", SIGNATURE, "keep client and server quantization residuals"),
        HyperParam("scale", SIGNATURE, "values sharing one pair of reconstruction values: column (the paper's), "
                   "tensor, auto (columns of >= 256 rows, else the tensor) or block (columns grouped to >= 256 values)",
                   choices=("column", "tensor", "auto", "block")),
        *_COMMON)),
    client_update=client_update,
    paper="Seide et al., Interspeech 2014",
    batched=Batched("codec", dp=True, byzantine=True),
    dp=True,
))
