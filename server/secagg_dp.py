"""The server's half of distributed DP under secure aggregation (``--dp`` with ``--secagg``):
each round's protocol parameters leave the field room for the nodes' noise
(:func:`~fedswarm.algorithms.privacy.distributed.secagg_with_dp`), and the round is accounted
with the nodes whose noise reached the unmasked sum (the ones that sent a masked input);
``epsilon`` and ``delta`` go into the round's row as DP-FedAvg's do. The server adds no noise
and clips nothing: the nodes did both (:mod:`fedswarm.client.secagg_dp`). A round that fails
unmasks nothing and spends nothing.
"""

from __future__ import annotations

from fedswarm.algorithms.privacy.accountant import PrivacyBudgetExceeded
from fedswarm.algorithms.privacy.distributed import DistributedAccountant, DistributedDP, secagg_with_dp
from fedswarm.algorithms.privacy.dp_spec import DPSpec
from fedswarm.algorithms.secagg import SecAggParams
from fedswarm.errors import ConfigError

__all__ = ["SecAggDP", "check_distributed_dp"]


def check_distributed_dp(spec: DPSpec) -> None:
    """Refuse, in one line, a ``--dp`` spec distributed DP cannot serve."""
    if spec.noise_multiplier is None:
        raise ConfigError("--dp under --secagg needs noise_multiplier=N (the nodes add the noise; target_epsilon alone "
                          "is not calibrated there): target_epsilon=E then stops the run at that budget")
    if spec.adaptive:
        raise ConfigError("--dp adaptive=true under --secagg: adaptive clipping counts each node's clipped update, "
                          "which secure aggregation never shows the server")


class SecAggDP:
    """The run's distributed DP: round parameters and the accountant across rounds."""

    def __init__(self, spec: DPSpec, seed: int):
        check_distributed_dp(spec)
        self.spec, self.seed = spec, int(seed)
        self.accountant = DistributedAccountant(spec.delta)
        self._round: DistributedDP | None = None

    def round_params(self, params: SecAggParams, nodes: int, dim: int) -> SecAggParams:
        """``params`` with room for the noise of ``nodes`` nodes on ``dim`` values (this round's)."""
        out, self._round = secagg_with_dp(params, nodes, dim, mechanism=self.spec.mechanism or "dgauss",
                                          noise_multiplier=float(self.spec.noise_multiplier), dp_clip=self.spec.clip,
                                          delta=self.spec.delta, seed=self.seed, accountant=self.accountant)
        t = self.spec.target_epsilon
        if t is not None and self._round.epsilon_after(1) > t * (1 + 1e-9):
            raise PrivacyBudgetExceeded(f"one more round would spend epsilon={self._round.epsilon_after(1):.3f} > "
                                        f"target_epsilon={t:g} (delta={self.spec.delta:g}): stopped after "
                                        f"epsilon={self.accountant.epsilon():.3f}")
        return out

    def account(self, survivors: int) -> dict[str, float]:
        """Account the round whose sum held ``survivors`` nodes' noise; its metrics."""
        if self._round is None:
            raise RuntimeError("SecAggDP.account before round_params")
        return self._round.account(survivors)

    def state_dict(self) -> dict:
        return {"accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.accountant.load_state_dict(state["accountant"])
