"""FedAvg (McMahan et al. 2017), Flower's own strategy, registered as ``fedavg``.

Clients run plain local SGD on Flower's ``train`` message; the server averages their
models weighted by ``num-examples``. Wire: the full model, 4d bytes each way per client.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from fedswarm.strategies.registry import BuildContext, StrategyEntry, register


def build(params: dict, ctx: BuildContext) -> FedAvg:
    cfg = ctx.config
    return FedAvg(
        fraction_train=cfg.fraction,
        fraction_evaluate=0.0,  # the server evaluates the global model on the held-out test set
        min_train_nodes=1,
        min_evaluate_nodes=0,
        min_available_nodes=cfg.clients,
    )


ENTRY = register(StrategyEntry(
    name="fedavg",
    description="FedAvg: average of client models weighted by examples (Flower's own strategy).",
    build=build,
    paper="McMahan et al., AISTATS 2017",
))
