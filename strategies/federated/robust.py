"""Byzantine-robust aggregation as Flower strategies: coordinate-wise median, trimmed
mean, Krum, Multi-Krum, Bulyan and majority-vote signSGD (Signum).

Thin strategies over the rules of :mod:`fedswarm.algorithms.robust`: clients run local
SGD from the public model and send their model change (float32; signs for Signum) as a
codec payload, exactly as ``compressed_fedavg``'s clients do; the server validates each
reply, stacks the accepted ones ``[K, d]`` and applies the rule::

    x̂ ← x̂ + server_lr · rule(δ_1, …, δ_K)

Each rule's tolerance (its paper's bound on f for K clients) is checked when the strategy
is built (a clear error naming the bound when ``--byzantine`` exceeds it) and again each
round on the replies that arrived (a round with too few is skipped, and says why).
Wire: 4d bytes up per client (ceil(d/8) + 4 for Signum), the model or its changed
coordinates down (1 bit a coordinate for Signum).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.common import log
from logging import WARNING

from fedswarm.algorithms.robust.aggregators import RULES, RobustRule, ToleranceError, make_rule
from fedswarm.algorithms.robust.signum import MajorityVote
from fedswarm.errors import ConfigError
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.params import ParamLayout
from fedswarm.strategies.federated.compressed_base import Accepted, Step
from fedswarm.strategies.federated.compressed_fedavg import CompressedFedAvg, client_update
from fedswarm.strategies.registry import Batched, BuildContext, StrategyEntry, register

__all__ = ["RobustAggregation", "Signum", "check_tolerance"]


class RobustAggregation(CompressedFedAvg):
    """FedAvg whose average is replaced by a robust rule on the client axis.

    Parameters
    ----------
    layout : ParamLayout
    rule : RobustRule
        The aggregation rule, built for ``f`` Byzantine clients.
    server_lr, fraction_train, min_train_nodes, min_available_nodes, seed, history
        See :class:`~fedswarm.strategies.federated.compressed_base.CompressedStrategy`.
    """

    supports_dp = False  # a robust rule's output is not an average: no clip-norm sensitivity

    def __init__(self, layout: ParamLayout | None = None, rule: RobustRule | None = None, *, codec: str = "none",
                 **kwargs: Any):
        if rule is None:
            raise TypeError("RobustAggregation needs a rule (fedswarm.algorithms.robust.aggregators)")
        super().__init__(layout, codec=codec, error_feedback=False, **kwargs)
        self.rule = rule
        self.name = rule.name

    def summary_lines(self) -> list[str]:
        return [f"rule: {self.rule.name} with f={self.rule.f} ({self.rule.bound}; {self.rule.paper})"]

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step | None:
        x = torch.stack([a.value for a in accepted])
        try:
            self.rule.check(x.shape[0])
        except ToleranceError as exc:
            log(WARNING, "round %s skipped: %s", server_round, exc)
            self.note(robust_skipped=str(exc))
            return None
        u = self.rule(x)
        return Step(u if self.server_lr == 1.0 else u * self.server_lr)


class Signum(RobustAggregation):
    """signSGD with majority vote: clients send the sign of their model change (1 bit a
    coordinate), the server steps ``server_lr · sign(Σ_i sign(δ_i))`` and sends the vote
    down as 1 bit a coordinate (Bernstein et al., ICLR 2019; see
    :mod:`fedswarm.algorithms.robust.signum`). ``server_lr`` is a step per coordinate, not the
    scale of an average: hence its small default."""

    def __init__(self, layout: ParamLayout | None = None, f: int = 0, server_lr: float = 0.005, **kwargs: Any):
        super().__init__(layout, MajorityVote(f), codec="sign", server_lr=server_lr, **kwargs)
        from fedswarm.algorithms.compression.codecs import make_codec

        self.downlink = make_codec("sign")

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step | None:
        step = super().aggregate(server_round, accepted)
        if step is None:
            return None
        vote = torch.sign(step.update)
        vote[vote == 0] = 1.0  # the 1-bit downlink has no zero; ties are rare with odd K
        q = self.downlink.encode((vote * self.server_lr)[None], self.layout, seed=server_round)
        return Step(self.downlink.decode(q, self.layout)[0], q)


def check_tolerance(rule: RobustRule, ctx: BuildContext) -> None:
    """Refuse, at build time, a run whose ``--byzantine`` (or f) exceeds what the rule
    tolerates with the clients of a round."""
    cfg = ctx.config
    n = max(1, int(cfg.clients * cfg.fraction))
    try:
        rule.check(n, cfg.byzantine)
    except ToleranceError as exc:
        raise ConfigError(str(exc)) from None


def _f(params: dict, ctx: BuildContext) -> int:
    f = params.get("f", -1)
    return ctx.config.byzantine if f < 0 else f


def _builder(rule_name: str):
    def build(params: dict, ctx: BuildContext) -> RobustAggregation:
        cfg = ctx.config
        extra = {"m": params["m"] or None} if rule_name == "multikrum" else {}
        rule = make_rule(rule_name, _f(params, ctx), **extra)
        check_tolerance(rule, ctx)
        return RobustAggregation(ctx.layout, rule, server_lr=params["server_lr"], fraction_train=cfg.fraction,
                                 min_available_nodes=cfg.clients, seed=cfg.seed)
    return build


def _build_signum(params: dict, ctx: BuildContext) -> Signum:
    cfg = ctx.config
    s = Signum(ctx.layout, _f(params, ctx), server_lr=params["server_lr"], fraction_train=cfg.fraction,
               min_available_nodes=cfg.clients, seed=cfg.seed)
    check_tolerance(s.rule, ctx)
    return s


# f = -1 stands for the run's --byzantine, which the builder puts in its place: no constructor
# takes it (Signum's own f defaults to 0), so its default is written here (kept).
_F = HyperParam("f", -1, "Byzantine clients the rule is built for (-1: the run's --byzantine)", ge=-1, le=100_000)
_LR = HyperParam("server_lr", SIGNATURE, "scale of the aggregated update", gt=0.0, le=100.0)

for _name, _desc, _extra in (
    ("median", "Coordinate-wise median of client updates (f < n/2).", ()),
    ("trimmed_mean", "Coordinate-wise mean after dropping the f largest and f smallest values (n > 2f).", ()),
    ("krum", "Krum: the update closest to its n-f-2 nearest neighbours (n > 2f+2).", ()),
    ("multikrum", "Multi-Krum: the mean of the m best Krum scores (n > 2f+2).",
     (HyperParam("m", 0, "updates averaged (0: n - f)", ge=0, le=100_000),)),  # the rule's (0: None), not the class's
    ("bulyan", "Bulyan: iterated Krum selects n-2f, then a trimmed mean around the median (n >= 4f+3).", ()),
):
    register(StrategyEntry(name=_name, description=_desc, build=_builder(_name),
                           hyperparams=defaults_from(RobustAggregation, (_F, *_extra, _LR)),
                           client_update=client_update, paper=RULES[_name].paper,
                           batched=Batched("codec", byzantine=True)))

register(StrategyEntry(
    name="signum",
    description="signSGD with majority vote: 1-bit client updates, the sign of their sum (f < n/2, blind adversaries).",
    build=_build_signum,
    hyperparams=defaults_from(Signum, (_F, HyperParam("server_lr", SIGNATURE, "step per coordinate: x <- x + "
                                                      "server_lr * vote", gt=0.0, le=100.0)), kept=("f",)),
    client_update=client_update,
    paper=MajorityVote.paper,
    batched=Batched("codec", byzantine=True),
))
