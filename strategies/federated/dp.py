"""Client-level differential privacy (DP-FedAvg) for fedswarm's federated strategies.

``--dp`` composes with:

- ``fedavg``: :class:`DPFedAvg`, Flower's FedAvg whose aggregation clips each client's
  model change and adds Gaussian noise to the sum (uniform weights: example counts are
  data too);
- the compressed strategies that average decoded vectors (``compressed_fedavg``,
  ``onebit``): their clients clip *before* compressing, the server clips again what it
  decodes, noises the sum, and the strategy goes on (a downlink codec compresses the
  noised average: post-processing costs no privacy).

Strategies whose aggregate is not an average of per-client vectors (robust rules, coded
schemes, sketches) refuse ``--dp`` with a clear error: their sensitivity to one client is
not the clip norm. The math and the accountant live in
:mod:`fedswarm.algorithms.privacy`; every round notes ``epsilon`` (for the run's delta),
the clip and the noise multiplier, which the recorder writes to the round's row.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedswarm.algorithms.privacy.dp_fedavg import ClientLevelDP
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.payload import PayloadError
from fedswarm.strategies.strategy_utils import ReportsRounds, SamplesAfterWait, check_model_reply
from fedswarm.wire import array_keys, arrayrecord_to_vector, vector_to_arrays_like

__all__ = ["DPFedAvg", "client_dp", "attach_dp"]


def client_dp(cfg: RunConfig) -> ClientLevelDP | None:
    """The server's DP-FedAvg mechanism for ``cfg.dp`` (None without ``--dp``). Raises
    :class:`~fedswarm.algorithms.privacy.accountant.PrivacyBudgetExceeded` for a run whose
    planned rounds would exceed ``target_epsilon``."""
    if not cfg.dp:
        return None
    return ClientLevelDP(cfg.dp, rounds=cfg.rounds, sample_rate=cfg.fraction, seed=cfg.seed)


class DPFedAvg(ReportsRounds, SamplesAfterWait, FedAvg):
    """FedAvg with DP-FedAvg's clipping and noise (McMahan et al., ICLR 2018)::

        x ← x + (Σ_i clip_C(x_i − x) + N(0, (z·C)² I)) / K

    Parameters
    ----------
    dp : ClientLevelDP
        Clip, noise, adaptive clipping and the accountant.
    **kwargs
        Flower's FedAvg arguments.
    """

    def __init__(self, dp: ClientLevelDP, **kwargs: Any):
        super().__init__(**kwargs)
        self.dp = dp
        self._global: torch.Tensor | None = None
        self._keys: list[tuple[str, tuple[int, ...]]] = []

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn=None) -> Result:
        self.bind_notes(evaluate_fn)
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.dp.before_round()
        self._global = arrayrecord_to_vector(arrays)
        self._keys = array_keys(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        deltas = []
        for msg in replies:
            if msg.has_error():
                continue
            try:
                x = check_model_reply(msg, self._global.numel())
            except PayloadError as exc:
                self.reject(msg, exc)
                continue
            deltas.append(x - self._global)
        if not deltas:
            return None, None
        mean, metrics = self.dp.privatize(torch.stack(deltas))
        self.note(**metrics)
        rec = vector_to_arrays_like(self._global + mean, self._keys)
        return rec, MetricRecord({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def state_dict(self) -> dict:
        return {"dp": self.dp.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dp.load_state_dict(state["dp"])


def attach_dp(strategy: Any, cfg: RunConfig) -> Any:
    """Give ``strategy`` the run's DP-FedAvg mechanism, or refuse clearly."""
    if not cfg.dp or isinstance(strategy, DPFedAvg) or getattr(strategy, "builds_own_dp", False):
        return strategy
    from fedswarm.strategies import registry
    from fedswarm.strategies.federated.compressed_base import CompressedStrategy

    if isinstance(strategy, CompressedStrategy) and getattr(strategy, "supports_dp", False):
        strategy.dp = client_dp(cfg)
        return strategy
    raise ConfigError(f"strategy '{cfg.strategy}' does not support --dp: its aggregate is not an average of "
                      f"per-client vectors, so one client's influence is not bounded by the clip norm "
                      f"(use {', '.join(e.name for e in registry.entries(registered=True) if e.dp)})")
