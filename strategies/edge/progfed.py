"""ProgFed: progressive training (Wang, Stich, He, Fritz, ICML 2022; ``docs/algorithms.md`` §12).

The model is a :class:`~fedswarm.tasks.staged.StagedModel` ``M = G_S ∘ E_S ∘ … ∘ E_1``.
Stage ``s`` trains ``M_s = G_s ∘ E_s ∘ … ∘ E_1`` with a small local head ``G_s``; when
stage ``s + 1`` starts, ``G_s`` is dropped and ``E_1..E_s`` are kept (warm start). The
last stage is the full model (its head is the model's own classifier)::

    T_s = stage_rounds, by default T / (2S) (the official CIFAR-100 config: S = 4, T_s = 375, T = 3000)
    stage(t) = min(S, 1 + (t - 1) // T_s)     # stages 1..S-1 last T_s rounds, S runs to the end
    server → sampled clients: M_s's parameters (blocks 1..s, then G_s)
    client: local SGD on M_s; returns the delta of M_s's parameters
    server: FedAvg of the deltas, x_{M_s} ← x_{M_s} + server_lr · mean Δ

State: the server holds the full model (blocks not yet active sit idle at their initial
values) and the current head; clients are stateless. Wire: ``4·(|E_1..E_s| + |G_s|)``
bytes each way, measured on the serialized messages. Compute: each client reports the
FLOPs of its local training (``torch.utils.flop_counter`` per sample × samples it
processed); the round notes their sum as ``flops``.

**Device-class caps.** A class whose policy sets ``progfed_max_stage = m`` never trains
beyond stage ``m``: while the global stage ``s > m`` it trains ``G_m ∘ E_m ∘ … ∘ E_1``
with the head ``G_m``, which the server then keeps (and sends, alongside the stage-``s``
sub-model, to every sampled node: heads are small) instead of dropping it. Merging: each
parameter is averaged over the clients that trained it, weighted by examples, so blocks
``1..m`` average over every client, blocks ``m+1..s`` and ``G_s`` over the uncapped ones,
and ``G_m`` over the capped ones. Capped clients train the shared blocks under a
different head; that is a heuristic (as in HeteroFL-style partial training), not part of
the paper. A cap introduced after stage ``m`` ended gets a freshly initialized ``G_m``.

**Evaluation.** Flower's loop passes the full model to ``evaluate_fn``, and the recorder
evaluates it; before the last stage that model is mostly untrained. So after each round
of stage ``s < S`` the strategy evaluates ``M_s`` (the current prefix and its head) on
the task's test set and notes ``test_loss``/``test_accuracy`` (they replace the
recorder's values in the round's row) and ``eval_stage = s``. In the last stage the
recorder's full-model evaluation stands. Every round notes ``stage`` and ``flops``.
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedswarm.errors import ConfigError
from fedswarm.algorithms.selection.progfed import default_stage_rounds, samples_processed, stage_of
from fedswarm.params import ParamLayout, get_flat
from fedswarm.local import prepare_local, train_reply
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.strategies.registry import (LOCAL_POLICY_KEYS, Batched, BuildContext, StrategyEntry, message_type_of,
                                          register)
from fedswarm.strategies.resumable import capture, restore
from fedswarm.tasks.staged import StagedModel, StageModel, step_flops
from fedswarm.payload import PayloadError
from fedswarm.strategies.strategy_utils import ReportsRounds, sample_train_nodes
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["ProgFed", "flops_per_sample", "client_update", "stage_start", "stage_submodel", "reply_content",
           "HYPERPARAMS"]

UPDATE = "update"  # the reply's ArrayRecord: "delta", the change of the trained sub-model
HEADS = "heads"  # the message's ArrayRecord of heads kept for capped classes: "head.<m>"
_POLICY_PREFIX = "policy."


# FLOPs are linear in the batch for convolutions and matmuls: count one sample per
# (model, input shape) once and multiply.
_FLOPS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def flops_per_sample(model: torch.nn.Module, objective, x: torch.Tensor, y: torch.Tensor) -> int:
    """Training FLOPs (forward + backward) of ``model`` per example, counted on ``x[:1]``."""
    cache = _FLOPS.setdefault(model, {})
    key = tuple(x.shape[1:])
    if key not in cache:
        cache[key] = step_flops(model, objective, x[:1], y[:1])
    return cache[key]


# --------------------------------------------------------------------------- node side

_SUBMODELS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[int, StageModel]]" = weakref.WeakKeyDictionary()


def stage_submodel(model: StagedModel, stage: int) -> StageModel:
    """The node's (cached) sub-model of ``stage``; its head's initial values never matter,
    the message sets every parameter."""
    cache = _SUBMODELS.setdefault(model, {})
    if stage not in cache:
        with torch.random.fork_rng(devices=[]):
            cache[stage] = model.stage_model(stage)
    return cache[stage]


def stage_start(msg: Message, model: StagedModel, policy: dict,
                vec: torch.Tensor) -> tuple[int, StageModel, torch.Tensor]:
    """What a node of ``policy``'s class trains on ``msg`` (whose ``arrays`` are ``vec``):
    the stage (the round's, or the class's ``progfed_max_stage`` if lower), that stage's
    sub-model and its start parameters (for a capped stage: the prefix of the stage's
    blocks and the head the server kept for the cap)."""
    stage = int(msg.content.config_records["config"]["progfed.stage"])
    cap = policy.get("progfed_max_stage")
    trains = min(stage, int(cap)) if cap is not None else stage
    if trains < stage:  # the prefix of the stage's blocks, and the head kept for this cap
        heads = msg.content.array_records.get(HEADS)
        if heads is None or f"head.{trains}" not in heads:
            raise ValueError(f"the server sent no head for capped stage {trains}")
        head = arrayrecord_to_vector(ArrayRecord({"h": heads[f"head.{trains}"]}), model.head_numel(trains))
        vec = torch.cat([vec[: model.prefix_numel(trains)], head])
    sub = stage_submodel(model, trains)
    d = ParamLayout.from_module(sub).d
    if vec.numel() != d:
        raise PayloadError(f"stage {trains} has {d} parameters, the message {vec.numel()}")
    return trains, sub, vec


def client_update(msg: Message, context: Context) -> RecordDict:
    """Train the stage's sub-model (or the capped one of this node's class); reply with its delta."""
    vec = arrayrecord_to_vector(msg.content.array_records["arrays"])
    setup = prepare_local(msg, context, vector=vec)
    model = setup.trainer.model
    if not isinstance(model, StagedModel):
        raise ValueError(f"progfed needs a staged task, '{setup.cfg.task}' is not one")
    trains, sub, vec = stage_start(msg, model, setup.policy, vec)
    trainer = copy.copy(setup.trainer)  # the node's data and task, with the sub-model
    trainer.model, trainer.layout = sub, ParamLayout.from_module(sub)
    res = trainer.fit(vec, **setup.fit_kwargs)
    flops = flops_per_sample(sub, trainer.task.objective, trainer.x, trainer.y) * samples_processed(
        trainer.num_examples, setup.fit_kwargs["batch_size"], res.steps)
    delta = res.flat.sub_(vec).numpy()  # float32, in place
    return reply_content(delta, res.num_examples, res.loss, res.steps, trains, flops, setup.report(res))


def reply_content(delta: np.ndarray, num_examples: int, loss: float, steps: int, trained: int, flops: float,
                  node: ConfigRecord) -> RecordDict:
    """A node's reply: the trained sub-model's delta, its metrics (``stage`` it trained,
    ``flops`` of its local training) and its ``node`` report."""
    return train_reply(RecordDict({UPDATE: ArrayRecord({"delta": Array(np.ascontiguousarray(delta))})}), num_examples,
                       loss, steps, node, stage=trained, flops=float(flops))


# --------------------------------------------------------------------------- server side


def _caps(config: ConfigRecord) -> set[int]:
    """Every ``progfed_max_stage`` the current policies set."""
    caps = set()
    for key in config.keys():
        if key.startswith(_POLICY_PREFIX):
            try:
                cap = json.loads(config[key]).get("progfed_max_stage")
            except (TypeError, ValueError, AttributeError):
                continue
            if cap is not None:
                caps.add(int(cap))
    return caps


class ProgFed(ReportsRounds, FedAvg):
    """Progressive training: stage ``s`` trains blocks ``1..s`` with a local head (§12).

    Parameters
    ----------
    model : StagedModel
        A model of the task (its structure; the values come from ``start``'s arrays).
    total_rounds : int
        ``T``, for the default schedule.
    stage_rounds : int
        ``T_s``, rounds of each stage before the last; 0 for ``T / (2S)``.
    server_lr : float
        Server step on the averaged deltas (1 = FedAvg).
    head_seed : int
        Seed of the local heads' initialization.
    stage_evaluator : callable, optional
        ``(sub_model, vector) -> (loss, accuracy)`` on the test set; when given and
        ``evaluate_fn`` is fedswarm's recorder (a ``RoundNotes``), each round before the
        last stage notes the stage sub-model's test metrics.
    fraction_train, min_train_nodes, min_available_nodes
        Node sampling, as in Flower's ``FedAvg``.
    """

    message_type = message_type_of("progfed")

    def __init__(self, model: StagedModel, total_rounds: int, stage_rounds: int = 0, server_lr: float = 1.0,
                 head_seed: int = 0, stage_evaluator: Callable | None = None, *, fraction_train: float = 1.0,
                 min_train_nodes: int = 1, min_available_nodes: int = 2):
        super().__init__(fraction_train=fraction_train, fraction_evaluate=0.0, min_train_nodes=min_train_nodes,
                         min_evaluate_nodes=0, min_available_nodes=min_available_nodes)
        self.model = model
        self.num_stages = model.num_stages
        self.stage_rounds = stage_rounds or default_stage_rounds(total_rounds, self.num_stages)
        self.server_lr = float(server_lr)
        self.head_seed = int(head_seed)
        self.stage_evaluator = stage_evaluator
        self.d = ParamLayout.from_module(model).d
        self._prefix = [0] + [model.prefix_numel(s) for s in range(1, self.num_stages + 1)]
        self.heads: dict[int, torch.Tensor] = {}  # stage -> its local head (stages < S)
        self._full: torch.Tensor | None = None
        self._stage = 0  # stage of the round in flight
        self._sent_heads: set[int] = set()
        self._done = 0  # rounds run by earlier calls of start() (a run extended with more rounds)
        self._base = 0
        self._configured = 0  # the absolute round last configured (what a checkpoint has done)

    def summary(self) -> None:
        log(INFO, "\t├── ProgFed: %d stages, %d rounds each before the last, server_lr %.3g",
            self.num_stages, self.stage_rounds, self.server_lr)
        super().summary()

    # -- stages -------------------------------------------------------------------------
    def stage_of(self, server_round: int) -> int:
        return stage_of(server_round, self.stage_rounds, self.num_stages)

    def new_head(self, stage: int) -> torch.Tensor:
        """A freshly initialized local head of ``stage`` (deterministic in ``head_seed``)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.head_seed * 1009 + stage)
            return get_flat(self.model.make_head(stage))

    def sub_vector(self, full: torch.Tensor, stage: int) -> torch.Tensor:
        """The parameters of stage ``stage``'s sub-model: blocks ``1..stage``, then its head."""
        if stage == self.num_stages:
            return full
        return torch.cat([full[: self._prefix[stage]], self.heads[stage]])

    def _enter(self, stage: int, caps: set[int]) -> set[int]:
        """Drop heads no longer needed, create the stage's head and capped classes' heads;
        return the capped stages whose heads travel this round."""
        capped = {m for m in caps if 1 <= m < stage}
        for s in list(self.heads):
            if s != stage and s not in capped:
                del self.heads[s]  # the stage ended: its head is discarded
        for s in capped | ({stage} if stage < self.num_stages else set()):
            if s not in self.heads:
                self.heads[s] = self.new_head(s)
        return capped

    # -- checkpoint (fedswarm.strategies.resumable) ----------------------------------------
    #: configure_train numbers rounds across calls of start() itself (``_base``)
    counts_own_rounds = True

    def state_dict(self) -> dict:
        """The stage heads (local heads of the stage in flight and of capped classes),
        the stage and the rounds done: a resumed run continues the schedule, not restarts it."""
        state = capture(self, ("heads", "_stage", "_sent_heads"))
        state["done"] = self._configured
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        done = int(state.pop("done"))
        restore(self, state, ("heads", "_stage", "_sent_heads"))
        self._done = self._base = self._configured = done

    # -- Flower hooks -------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop over the full model; see the module docstring for what
        ``evaluate_fn`` gets."""
        notes = self.bind_notes(evaluate_fn)
        self._base = self._done  # Flower counts rounds from 1 in every call; stages must not restart
        wrapped = evaluate_fn
        if evaluate_fn is not None and notes is evaluate_fn and self.stage_evaluator is not None:
            def wrapped(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
                if rnd > 0:
                    self.evaluate_stage(arrayrecord_to_vector(arrays, self.d))
                return evaluate_fn(rnd, arrays)
        result = super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                               evaluate_config=evaluate_config, evaluate_fn=wrapped)
        self._done = self._base + num_rounds
        return result

    def evaluate_stage(self, full: torch.Tensor) -> None:
        """Before the last stage, note the test metrics of the stage's sub-model (blocks of
        ``full`` and the stage's head) for the round just aggregated; see the module docstring."""
        if self.stage_evaluator is None or not (self._stage < self.num_stages and self._stage in self.heads):
            return
        with torch.random.fork_rng(devices=[]):
            sub = self.model.stage_model(self._stage)
        loss, acc = self.stage_evaluator(sub, self.sub_vector(full, self._stage))
        self.note(test_loss=loss, test_accuracy=acc, eval_stage=self._stage)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        node_ids, _ = sample_train_nodes(grid, self.fraction_train, self.min_train_nodes, self.min_available_nodes)
        server_round += self._base
        self._configured = server_round
        stage = self.stage_of(server_round)
        full = arrayrecord_to_vector(arrays, self.d)
        capped = self._enter(stage, _caps(config))
        self._full, self._stage, self._sent_heads = full, stage, capped
        config["server-round"] = server_round
        config["progfed.stage"] = stage
        content = RecordDict({"arrays": vector_to_arrayrecord(self.sub_vector(full, stage)), "config": config})
        if capped:
            content[HEADS] = ArrayRecord({f"head.{m}": Array(self.heads[m].numpy()) for m in sorted(capped)})
        return [Message(content=content, message_type=self.message_type, dst_node_id=nid) for nid in node_ids]

    def _parse(self, reply: Message) -> tuple[int, torch.Tensor, float, float, float]:
        try:
            metrics = reply.content.metric_records["metrics"]
            trained = int(metrics["stage"])
            weight = float(metrics["num-examples"])
            loss, flops = float(metrics.get("train_loss", 0.0)), float(metrics.get("flops", 0.0))
            rec = reply.content.array_records[UPDATE]
        except KeyError as exc:
            raise PayloadError(f"reply lacks {exc}") from None
        if not (trained == self._stage or trained in self._sent_heads):
            raise PayloadError(f"trained stage {trained}, the round offered {self._stage} "
                               f"and caps {sorted(self._sent_heads)}")
        if not weight > 0:
            raise PayloadError(f"num-examples must be > 0, got {weight}")
        size = self.d if trained == self.num_stages else self._prefix[trained] + self.heads[trained].numel()
        return trained, arrayrecord_to_vector(rec, size), weight, loss, flops

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average each parameter over the clients that trained it (see caps above)."""
        if self._full is None:
            raise RuntimeError("aggregate_train before configure_train")
        num = torch.zeros(self.d, dtype=torch.float64)
        den = torch.zeros(self.d, dtype=torch.float64)
        head_num: dict[int, torch.Tensor] = {}
        head_den: dict[int, float] = {}
        total_w = loss_sum = flops = 0.0
        for reply in replies:
            if reply.has_error():
                log(WARNING, "node %s failed this round: %s", reply.metadata.src_node_id,
                    (reply.error.reason.splitlines() or [""])[0][:300])
                continue
            try:
                trained, delta, w, loss, f = self._parse(reply)
            except (PayloadError, KeyError, ValueError, TypeError) as exc:
                self.reject(reply, exc)
                continue
            p = self.d if trained == self.num_stages else self._prefix[trained]
            num[:p] += w * delta[:p].double()
            den[:p] += w
            if trained < self.num_stages:
                head_num[trained] = head_num.get(trained, 0.0) + w * delta[p:].double()
                head_den[trained] = head_den.get(trained, 0.0) + w
            total_w, loss_sum, flops = total_w + w, loss_sum + w * loss, flops + f
        if total_w == 0:
            return None, None
        step = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
        full = self._full + (self.server_lr * step).to(torch.float32)
        for s, hn in head_num.items():
            self.heads[s] = self.heads[s] + (self.server_lr * hn / head_den[s]).to(torch.float32)
        self.note(flops=flops, stage=self._stage)
        metrics = MetricRecord({"train_loss": loss_sum / total_w, "num-examples": total_w, "flops": flops})
        return vector_to_arrayrecord(full), metrics


# --------------------------------------------------------------------------- registry

HYPERPARAMS = defaults_from(ProgFed.__init__, (  # defaults: the constructor's
    HyperParam("stage_rounds", SIGNATURE, "rounds of each stage before the last (T_s); 0 = rounds / (2·stages), "
               "the paper's ResNet schedule (its ConvNet configs use rounds / stages)", ge=0, le=1_000_000),
    HyperParam("server_lr", SIGNATURE, "server step size on the averaged deltas", gt=0.0, le=10.0),
))


def build(params: dict, ctx: BuildContext) -> ProgFed:
    from fedswarm.tasks import get_task
    from fedswarm.train import evaluate_flat, resolve_device, task_data

    cfg = ctx.config
    task = get_task(cfg.task)
    model = task.model(cfg.seed)
    if not isinstance(model, StagedModel):
        raise ConfigError(f"invalid value for 'task': progfed needs a staged model (digits-cnn4, "
                          f"mnist-resnet, cifar10-resnet, femnist-resnet), '{cfg.task}' is not one")
    device = resolve_device(cfg.device)

    def stage_evaluator(sub: torch.nn.Module, vec: torch.Tensor) -> tuple[float, float]:
        data = task_data(cfg)
        return evaluate_flat(task, sub.to(device), vec, data.test_x, data.test_y, device)

    return ProgFed(model, cfg.rounds, params["stage_rounds"], params["server_lr"], head_seed=cfg.seed,
                   stage_evaluator=stage_evaluator, fraction_train=cfg.fraction, min_train_nodes=1,
                   min_available_nodes=cfg.clients)


ENTRY = register(StrategyEntry(
    name="progfed",
    description="ProgFed: train a growing prefix of the model's blocks with a local head, stage by stage; "
                "only the active sub-model travels (needs a staged task such as digits-cnn4).",
    build=build,
    hyperparams=HYPERPARAMS,
    client_update=client_update,
    paper="Wang, Stich, He, Fritz, ICML 2022 (arXiv 2110.05323)",
    run_defaults={"task": "digits-cnn4"},  # the smallest staged task
    batched=Batched("stages"),
    policy_keys=(*LOCAL_POLICY_KEYS, "progfed_max_stage"),
))
