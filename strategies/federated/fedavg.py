"""FedAvg (McMahan et al. 2017), Flower's own strategy, registered as ``fedavg``.

Clients run plain local SGD on Flower's ``train`` message; the server averages their
models weighted by ``num-examples``. Wire: the full model, 4d bytes each way per client.
"""

from __future__ import annotations

import torch
from flwr.serverapp.strategy import FedAvg

from fedswarm.algorithms.averaging import WeightedSum
from fedswarm.payload import PayloadError
from fedswarm.strategies.registry import Batched, BuildContext, StrategyEntry, register
from fedswarm.strategies.strategy_utils import ReportsRounds, SamplesAfterWait, check_model_reply
from fedswarm.wire import array_keys, arrayrecord_to_vector, vector_to_arrays_like


class CheckedFedAvg(ReportsRounds, SamplesAfterWait, FedAvg):
    """Flower's FedAvg, except that a reply whose model is malformed (missing, wrong size,
    not floating point, non-finite) is rejected (``reject``, recorded with its reason)
    instead of averaged in: one such reply would otherwise turn the global model into NaN;
    and a round's fraction is counted on the nodes connected after the wait (:class:`SamplesAfterWait`).
    A *well-formed* lie still moves the average anywhere (that is what the robust
    strategies are for). The average is :class:`~fedswarm.algorithms.averaging.WeightedSum`'s,
    the batched engine's, in float64."""

    _d: int | None = None

    def start(self, grid, initial_arrays, num_rounds=3, timeout=3600, train_config=None, evaluate_config=None,
              evaluate_fn=None):
        self.bind_notes(evaluate_fn)
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def configure_train(self, server_round, arrays, config, grid):
        self._d = arrayrecord_to_vector(arrays).numel()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        kept, models = [], {}
        for msg in replies:
            if not msg.has_error():
                try:
                    models[id(msg)] = check_model_reply(msg, self._d)
                except PayloadError as exc:
                    self.reject(msg, exc)
                    continue
            kept.append(msg)
        valid, _ = self._check_and_log_replies(kept, is_train=True)  # Flower's own checks, and its log
        if not valid:
            return None, None
        # the mean: fedswarm's one FedAvg aggregate (the batched engine's), not Flower's aggregate_arrayrecords
        acc = WeightedSum(self._d)
        for msg in valid:
            weight = float(next(iter(msg.content.metric_records.values()))[self.weighted_by_key])
            acc.add(models[id(msg)][None], torch.tensor([weight], dtype=torch.float32))
        arrays = vector_to_arrays_like(acc.mean(), array_keys(valid[0].content.array_records["arrays"]))
        return arrays, self.train_metrics_aggr_fn([msg.content for msg in valid], self.weighted_by_key)


    # -- checkpoint (fedswarm.strategies.resumable): FedAvg keeps nothing between rounds
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"FedAvg keeps no state between rounds; got {sorted(state)}")

def build(params: dict, ctx: BuildContext) -> FedAvg:
    cfg = ctx.config
    kwargs = dict(
        fraction_train=cfg.fraction,
        fraction_evaluate=0.0,  # the server evaluates the global model on the held-out test set
        min_train_nodes=1,
        min_evaluate_nodes=0,
        min_available_nodes=cfg.clients,
    )
    if cfg.dp and not getattr(cfg, "secagg", False):  # DP-FedAvg: clip each change, Gaussian noise on the sum
        # (under --secagg the nodes clip and add the noise: distributed DP, fedswarm/server/secagg_dp.py)
        from fedswarm.strategies.federated.dp import DPFedAvg, client_dp

        return DPFedAvg(client_dp(cfg), **kwargs)
    return CheckedFedAvg(**kwargs)


ENTRY = register(StrategyEntry(
    name="fedavg",
    description="FedAvg: average of client models weighted by examples (Flower's own strategy).",
    build=build,
    paper="McMahan et al., AISTATS 2017",
    # its own batched round (chunks folded into the weighted sum); no --byzantine there: its replies are its own
    batched=Batched("weighted_mean", dp=True),
    dp=True,
    secagg=True,  # its aggregate is a weighted mean of the nodes' models: SecAggGrid hands it the mean
))
