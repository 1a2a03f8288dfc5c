"""Byzantine-robust aggregation rules on the client axis: ``x [K, d] -> [d]``.

Each rule is a small object with the number ``f`` of Byzantine inputs it is built to
survive, the bound its paper proves (``max_byzantine(n)``, checked by :meth:`check`), and
``__call__(x)`` on a ``[K, d]`` tensor of client updates (pure torch, no loop over
coordinates; a batched engine can call it on a stacked batch as is). The mean is here
too, as the rule that tolerates nobody.

============  ==========================================  =====================  ===========
rule          output                                      tolerates (n clients)  paper
============  ==========================================  =====================  ===========
mean          (1/n) Σ x_i                                 f = 0                  McMahan+17
median        coordinate-wise median                      f <= (n-1)/2           Yin+18
trimmed_mean  per coordinate, drop f largest and f        f <= (n-1)/2           Yin+18
              smallest, average the n-2f left
krum          x_i* minimizing Σ of squared distances to   n >= 2f+3              Blanchard+17
              its n-f-2 nearest neighbours
multikrum     average of the m best Krum scores           n >= 2f+3              Blanchard+17
bulyan        θ = n-2f vectors by iterated Krum, then     n >= 4f+3              El Mhamdi+18
              per coordinate the mean of the β = θ-2f
              values closest to the median
============  ==========================================  =====================  ===========

Server state: none. Wire: whatever carries the K updates (4d bytes each as float32).
Majority-vote signSGD lives in :mod:`.signum`, the coded schemes (Draco, Solon) in
:mod:`.coding`: they need more than a ``[K, d]`` stack.
"""

from __future__ import annotations

import torch

__all__ = ["ToleranceError", "RobustRule", "Mean", "CoordinateMedian", "TrimmedMean", "Krum", "MultiKrum",
           "Bulyan", "RULES", "make_rule", "pairwise_sq_distances"]


class ToleranceError(ValueError):
    """More Byzantine clients than a rule (or a code) can tolerate; the message names the
    bound."""


class RobustRule:
    """Base class: ``f`` is the number of Byzantine inputs the rule is built for."""

    name = ""
    paper = ""
    bound = ""  # the tolerance in words, e.g. "n >= 4f + 3"

    def __init__(self, f: int = 0):
        if isinstance(f, bool) or int(f) != f or f < 0:
            raise ValueError(f"{self.name}: f must be an integer >= 0, got {f!r}")
        self.f = int(f)

    @staticmethod
    def max_byzantine(n: int) -> int:
        """The most Byzantine inputs out of ``n`` the rule's guarantee covers."""
        raise NotImplementedError

    def check(self, n: int, byzantine: int | None = None) -> None:
        """Raise :class:`ToleranceError` if ``n`` inputs cannot carry this rule with ``f``
        (or ``byzantine``, when given, exceeds what ``n`` inputs tolerate)."""
        k = self.f if byzantine is None else max(int(byzantine), self.f)
        top = self.max_byzantine(n)
        if k > top:
            raise ToleranceError(
                f"{self.name} tolerates at most {top} Byzantine of {n} clients ({self.bound}, {self.paper}); "
                f"asked for {k}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            raise ValueError(f"{self.name} needs a [K, d] float tensor")
        self.check(x.shape[0])
        return x


class Mean(RobustRule):
    """The plain average (FedAvg with equal weights): one Byzantine input moves it anywhere."""

    name, paper, bound = "mean", "McMahan et al., AISTATS 2017", "f = 0"

    @staticmethod
    def max_byzantine(n: int) -> int:
        return 0

    def __call__(self, x):
        return self._input(x).mean(dim=0)


class CoordinateMedian(RobustRule):
    """Coordinate-wise median (the mean of the two middle values when n is even).

    Paper: Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning:
    Towards Optimal Statistical Rates", ICML 2018 (breakdown point: f < n/2)."""

    name, paper, bound = "median", "Yin et al., ICML 2018", "f < n/2"

    @staticmethod
    def max_byzantine(n: int) -> int:
        return (n - 1) // 2

    def __call__(self, x):
        x = self._input(x)
        s = torch.sort(x, dim=0).values
        n = s.shape[0]
        if n % 2:
            return s[n // 2].clone()
        return 0.5 * (s[n // 2 - 1] + s[n // 2])


class TrimmedMean(RobustRule):
    """Coordinate-wise trimmed mean: per coordinate, drop the ``f`` largest and ``f``
    smallest values and average the ``n - 2f`` left.

    Paper: Yin et al., ICML 2018 (β-trimmed mean with β = f/n; needs n > 2f)."""

    name, paper, bound = "trimmed_mean", "Yin et al., ICML 2018", "n > 2f"

    @staticmethod
    def max_byzantine(n: int) -> int:
        return (n - 1) // 2

    def __call__(self, x):
        x = self._input(x)
        s = torch.sort(x, dim=0).values
        return s[self.f: s.shape[0] - self.f].mean(dim=0)


def pairwise_sq_distances(x: torch.Tensor) -> torch.Tensor:
    """``D[i, j] = ||x_i - x_j||²`` in float64 (the Gram trick in float32 cancels badly
    for close vectors)."""
    x64 = x.to(torch.float64)
    sq = (x64 * x64).sum(dim=1)
    d = sq[:, None] + sq[None, :] - 2.0 * (x64 @ x64.T)
    d.clamp_(min=0.0)
    d.fill_diagonal_(0.0)
    return d


def krum_scores(x: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each row: the sum of squared distances to its ``n - f - 2`` nearest
    other rows (at least one)."""
    n = x.shape[0]
    d = pairwise_sq_distances(x)
    d.fill_diagonal_(float("inf"))  # a vector is not its own neighbour
    nb = max(1, n - f - 2)
    nb = min(nb, n - 1)
    return torch.topk(d, nb, dim=1, largest=False).values.sum(dim=1)


class Krum(RobustRule):
    """Krum: the input whose ``n - f - 2`` nearest neighbours are closest (squared
    distances summed); ties go to the lowest index.

    Paper: Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries:
    Byzantine Tolerant Gradient Descent", NeurIPS 2017 (needs n > 2f + 2)."""

    name, paper, bound = "krum", "Blanchard et al., NeurIPS 2017", "n > 2f + 2"

    @staticmethod
    def max_byzantine(n: int) -> int:
        return max(0, (n - 3) // 2)

    def select(self, x: torch.Tensor, m: int = 1) -> torch.Tensor:
        """Indices of the ``m`` best-scored rows, best first."""
        scores = krum_scores(x, self.f)
        order = torch.sort(scores, stable=True).indices
        return order[:m]

    def __call__(self, x):
        x = self._input(x)
        if x.shape[0] == 1:
            return x[0].clone()
        return x[self.select(x, 1)[0]].clone()


class MultiKrum(Krum):
    """Multi-Krum: the average of the ``m`` inputs with the best Krum scores (``m``
    defaults to ``n - f``; ``m = 1`` is Krum).

    Paper: Blanchard et al., NeurIPS 2017, §5 (Multi-Krum)."""

    name = "multikrum"

    def __init__(self, f: int = 0, m: int | None = None):
        super().__init__(f)
        if m is not None and (int(m) != m or m < 1):
            raise ValueError(f"multikrum: m must be an integer >= 1, got {m!r}")
        self.m = None if m is None else int(m)

    def __call__(self, x):
        x = self._input(x)
        m = (x.shape[0] - self.f) if self.m is None else min(self.m, x.shape[0])
        if x.shape[0] == 1:
            return x[0].clone()
        return x[self.select(x, m)].mean(dim=0)


class Bulyan(RobustRule):
    """Bulyan: select θ = n - 2f inputs by running Krum repeatedly (each time on what is
    left, removing the winner), then per coordinate average the β = θ - 2f selected values
    closest to that coordinate's median.

    Paper: El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed
    Learning in Byzantium", ICML 2018 (needs n >= 4f + 3)."""

    name, paper, bound = "bulyan", "El Mhamdi et al., ICML 2018", "n >= 4f + 3"

    @staticmethod
    def max_byzantine(n: int) -> int:
        return max(0, (n - 3) // 4)

    def selection(self, x: torch.Tensor) -> list[int]:
        """Indices (into ``x``) of the θ inputs iterated Krum keeps, in the order chosen."""
        n = x.shape[0]
        theta = n - 2 * self.f
        left = list(range(n))
        chosen: list[int] = []
        krum = Krum(0)
        krum.f = self.f  # the same f, on a shrinking set (the paper's recursion)
        while len(chosen) < theta:
            if len(left) == 1:
                chosen.append(left.pop())
                break
            best = int(krum.select(x[left], 1)[0])
            chosen.append(left.pop(best))
        return chosen

    def __call__(self, x):
        x = self._input(x)
        sel = x[self.selection(x)]
        theta = sel.shape[0]
        beta = max(1, theta - 2 * self.f)
        med = CoordinateMedian(0)(sel)
        # the β values of each coordinate closest to its median (stable: ties by index)
        dist = (sel - med[None, :]).abs()
        idx = torch.sort(dist, dim=0, stable=True).indices[:beta]
        return torch.gather(sel, 0, idx).mean(dim=0)


RULES: dict[str, type[RobustRule]] = {c.name: c for c in (Mean, CoordinateMedian, TrimmedMean, Krum, MultiKrum, Bulyan)}


def make_rule(name: str, f: int = 0, **kwargs) -> RobustRule:
    try:
        cls = RULES[name]
    except KeyError:
        raise ValueError(f"unknown robust rule {name!r} (available: {', '.join(RULES)})") from None
    return cls(f, **kwargs)
