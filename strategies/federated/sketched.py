"""Count-Sketch strategies: Sketched-SGD, FetchSGD and gs-SGD (docs/algorithms.md §6b-6d).

Every client sketches a d-vector into an r x c table with hashes shared through a seed
(the ``countsketch`` codec); sketches are linear, so the server's weighted sum of the
tables is the sketch of the weighted sum of the vectors. They differ in what is
sketched, where momentum and error live, and how the k coordinates are chosen.
Registered as ``sketched_sgd``, ``fetchsgd`` and ``gs_sgd``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.kernels import topk_abs_indices
from fedswarm.algorithms.compression.sketched import fetchsgd_step
from fedswarm.strategies.federated.sketch_base import SketchClient, SketchStrategy
from fedswarm.strategies.federated.compressed_base import (KNOBS, Accepted, Step, read_payload)
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.strategies.registry import Batched, BuildContext, StrategyEntry, register
from fedswarm.strategies.secagg_payload import SUM_KEY
from fedswarm.payload import PayloadError

__all__ = ["SketchStrategy", "SketchedSGD", "FetchSGD", "GlobalSketchSGD", "SketchClient", "SKETCH_CLIENTS"]


# -- Sketched-SGD ----------------------------------------------------------------------------

_SK = "sketched_sgd"


class SketchedSGD(SketchStrategy):
    """Sketched-SGD: sketch up, candidates down, exact values up, sparse update down.

    Client i keeps momentum and an error accumulator, ``u_i ← ρ u_i + δ_i``,
    ``v_i ← v_i + u_i`` (δ_i its local model change), and sends S(v_i). Phase 2 of the
    same round (a second exchange through the grid): the server sums the sketches, takes
    the p2·k coordinates H with the largest estimates, asks the same clients for their
    exact v_i[H], and keeps the top k of Σ_i n_i v_i[H] / Σ n_i::

        x̂ ← x̂ + server_lr · Δ,     u_i[supp Δ] ← 0,  v_i[supp Δ] ← 0

    Clients learn supp Δ (a p2·k-bit mask over H) at the start of their next round. A
    client whose phase-2 reply is missing or rejected keeps its u_i, v_i untouched; its
    sketch only influenced which candidates were asked for, never the values applied.

    State: u_i, v_i (2d floats) per client. Wire up: 4rc + 4·p2·k bytes per client
    (two messages); down: the candidates (4·p2·k), then the changed coordinates (8k)
    and the mask. The reference also sends small tensors dense; not done here.

    Parameters
    ----------
    momentum : float (default: 0.0)
        ρ. The paper's 0.9 applies to gradients with a small learning rate; here δ_i is a
        local model change, which momentum 0.9 amplifies tenfold (unstable on ``fedswarm
        bench compression`` at server_lr 1).
    candidates : int (default: 4)
        p2: the server asks for p2·k exact values.
    layout, density, rows, cols, server_lr, ...
        See :class:`SketchStrategy`.

    Paper: Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, "Communication-efficient
    Distributed SGD with Sketching", NeurIPS 2019.
    """

    name = "sketched_sgd"

    def __init__(self, layout: ParamLayout | None = None, momentum: float = 0.0, candidates: int = 4,
                 **kwargs: Any):
        self._phase2_dim: int | None = None  # under --secagg, while the second exchange runs
        super().__init__(layout, **kwargs)
        self.momentum, self.candidates = float(momentum), int(candidates)

    def secure_exact_values(self, server_round: int, nodes: list[int],
                            cand: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
        """Phase 2 under secure aggregation (``SecAggGrid``): the exact values at the shared
        candidates are linear, so they are asked of the nodes in the first sum (``nodes``) as a
        second secure sum: each node masks ``n_i v_i[cand]`` with its weight ``n_i`` (its first
        reply's examples, :meth:`SketchClient.phase2`) and the server learns only
        ``Σ n_i v_i[cand] / Σ n_i`` and who is in it. None when that round fails."""
        # SUM_KEY: the round's second secure sum, whose distributed-DP noise is its own stream
        ask = RecordDict({KNOBS: ConfigRecord({"round": server_round, "phase": 2, "secagg": True,
                                               "server-round": server_round, SUM_KEY: 1}),
                          "candidates": ArrayRecord({"indices": Array(cand.to(torch.int32).numpy())})})
        self._phase2_dim = int(cand.numel())
        try:
            with self._grid.second_sum("values"):  # no train loss in it; its figures: the row's secagg_values
                replies = self.send_and_receive([Message(ask, message_type=self.message_type, dst_node_id=n)
                                                 for n in nodes])
        finally:
            self._phase2_dim = None
        if not replies or replies[0].has_error():
            return None
        msg = replies[0]
        try:
            p = read_payload(msg, self.layout.d)
            v = p.arrays.get("values")
            if set(p.arrays) != {"values"} or v.dtype != np.float32 or v.shape != (cand.numel(),):
                raise PayloadError(f"phase 2 secure reply must hold float32 'values' [{cand.numel()}]")
        except PayloadError as exc:
            self.reject(msg, str(exc))
            return None
        return torch.from_numpy(np.array(v)), list(self._grid.survivors)

    def knobs(self, server_round: int) -> dict[str, Any]:
        return {**super().knobs(server_round), "momentum": self.momentum, "phase": 1}

    @property
    def secagg_dim(self) -> int | None:
        """Under ``--secagg``: the r·c table, or in the round's second exchange the candidates' count."""
        return self._phase2_dim or super().secagg_dim

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step | None:
        est = self.sketch.estimate(self.summed(accepted))
        cand = topk_abs_indices(est[None], min(self.layout.d, self.candidates * self.k))[0]
        secure = getattr(self._grid, "survivors", None)  # SecAggGrid: one mean table from these nodes
        got = (self.exact_values(server_round, accepted, cand) if secure is None else
               self.secure_exact_values(server_round, list(secure), cand))
        if got is None:
            return None
        exact, nodes = got
        top = topk_abs_indices(exact[None], min(self.k, cand.numel()))[0]
        mask = torch.zeros(cand.numel(), dtype=torch.bool)
        mask[top] = True
        for nid in nodes:
            self.select(nid, server_round, mask=mask.numpy())
        return Step(self.sparse_update(cand[top], exact[top]), metrics={"phase2_replies": len(nodes)})


#: Sketched-SGD's clients keep u and v (:class:`SketchClient`).
SKETCHED_CLIENT = SketchClient(_SK, _SK + ".v", _SK + ".u")
sketched_client_update = SKETCHED_CLIENT.update


# -- FetchSGD ----------------------------------------------------------------------------------


class FetchSGD(SketchStrategy):
    """FetchSGD: stateless clients send sketches; momentum and error live in the sketch.

    Client c sends S(δ_c), the sketch of its local model change (one local step is the
    paper's setting: δ_c = −η_c g_c). The server
    (:func:`~fedswarm.algorithms.compression.sketched.fetchsgd_step`)::

        S_t = Σ_c n_c S(δ_c) / Σ n_c
        S_u ← ρ S_u + S_t;   S_e ← S_e + server_lr · S_u
        Δ = top-k(unsketch(S_e));  zero the cells of S_u and S_e touched by supp Δ
        x̂ ← x̂ + Δ

    Zeroing cells rather than subtracting S(Δ) follows the reference code (subtracting
    diverged there). No second round for exact values.

    State: S_u, S_e (2rc floats) on the server; clients keep only the model replica
    (needed to download just the changed weights). Wire: up 4rc bytes per client; down
    the weights changed since the client last took part (8 bytes each, or the model).

    Parameters
    ----------
    momentum : float (default: 0.9)
        ρ.
    layout, density, rows, cols, server_lr, ...
        See :class:`SketchStrategy`.

    Paper: Rothchild, Panda, Ullah, Ivkin, Stoica, Braverman, Gonzalez, Arora,
    "FetchSGD: Communication-Efficient Federated Learning with Sketching", ICML 2020.
    """

    name = "fetchsgd"

    state_attrs = SketchStrategy.state_attrs + ("s_u", "s_e")  # sketched momentum and error accumulation

    def __init__(self, layout: ParamLayout | None = None, momentum: float = 0.9, **kwargs: Any):
        super().__init__(layout, **kwargs)
        self.momentum = float(momentum)

    def on_layout(self) -> None:
        super().on_layout()
        self.s_u = torch.zeros(self.rows, self.cols)
        self.s_e = torch.zeros(self.rows, self.cols)

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step:
        idx, vals = fetchsgd_step(self.sketch, self.s_u, self.s_e, self.summed(accepted), rho=self.momentum,
                                  lr=self.server_lr, k=self.k)
        update = torch.zeros(self.layout.d, dtype=torch.float32)
        update[idx] = vals
        return Step(update, metrics={"sketch_error_l2": float(self.sketch.l2_estimate(self.s_e))})


#: FetchSGD's clients are stateless: they sketch their local model change.
FETCHSGD_CLIENT = SketchClient()
fetchsgd_client_update = FETCHSGD_CLIENT.update


# -- gs-SGD --------------------------------------------------------------------------------------

_GS = "gs_sgd"


class GlobalSketchSGD(SketchStrategy):
    """gs-SGD: top-k of a global Count Sketch of the workers' error-compensated updates.

    **A reconstruction.** Only the paper's abstract was retrievable (docs/algorithms.md §6d):
    it compresses with a Count Sketch of the *global* gradient instead of top-k, needs no
    parameter server, and costs O(log d · log P) per worker. Reconstructed here, from that
    and sketch linearity::

        client i:  e_i ← e_i + δ_i;  send S(e_i)           (local error, one table)
        server:    S = Σ_i n_i S(e_i) / Σ n_i             (the paper: a log2 P tree all-reduce)
                   𝒢 = top-k(unsketch(S))
                   Δ = Σ_i n_i e_i[𝒢] / Σ n_i             (exact_values: a second exchange)
                     or the sketch's estimates at 𝒢        (one exchange)
                   x̂ ← x̂ + server_lr · Δ
        client i:  e_i[𝒢] ← 0                            (told 𝒢 at its next round)

    Reconstructed, not from the paper: that error lives on the workers and momentum
    nowhere; the second exchange for exact values (on by default: with the sketch's
    estimates, clients zero e_i[𝒢] while the server applied a noisy, selection-inflated
    estimate of it, which diverged on our benchmark); the sketch sizes; weighting by
    examples; the server standing in for the tree all-reduce (each worker there sends a
    table per level, 4rc·log2 P bytes; here 4rc once). With exact values this is
    Sketched-SGD without momentum and with p2 = 1.

    State: e_i (d floats) per client. Wire up: 4rc bytes (+ 4k with exact values) per
    client; down the changed weights (8k), plus 𝒢 (4k, or the candidates and a k-bit
    mask with exact values).

    Parameters
    ----------
    exact_values : bool (default: True)
        Ask the clients for the exact values at 𝒢 (a second exchange in the round).
    layout, density, rows, cols, server_lr, ...
        See :class:`SketchStrategy`.

    Paper: arXiv 2108.06004, "A Distributed SGD Algorithm with Global Sketching for Deep
    Learning Training Acceleration" (2021).
    """

    name = "gs_sgd"

    def __init__(self, layout: ParamLayout | None = None, exact_values: bool = True, **kwargs: Any):
        super().__init__(layout, **kwargs)
        self.exact = bool(exact_values)

    def aggregate(self, server_round: int, accepted: list[Accepted]) -> Step | None:
        idx, vals = self.sketch.unsketch(self.summed(accepted), self.k)
        if not self.exact:
            for a in accepted:
                self.select(a.node_id, server_round, indices=idx.numpy())
            return Step(self.sparse_update(idx, vals))
        got = self.exact_values(server_round, accepted, idx)
        if got is None:
            return None
        exact, nodes = got
        for nid in nodes:
            self.select(nid, server_round, mask=np.ones(idx.numel(), dtype=bool))
        return Step(self.sparse_update(idx, exact))


#: gs-SGD's clients keep e (:class:`SketchClient` without momentum).
GS_CLIENT = SketchClient(_GS, _GS + ".e")
gs_client_update = GS_CLIENT.update

#: Each strategy's client half, for engines that run the clients' half themselves
#: (``--engine batched``, :mod:`fedswarm.sim.batched_sketched`).
SKETCH_CLIENTS: dict[str, SketchClient] = {"sketched_sgd": SKETCHED_CLIENT, "fetchsgd": FETCHSGD_CLIENT,
                                           "gs_sgd": GS_CLIENT}


# -- registry --------------------------------------------------------------------------------------

_SKETCH_PARAMS = (
    HyperParam("density", SIGNATURE, "fraction of coordinates updated per round, k = ceil(density·d)", gt=0.0, le=1.0),
    HyperParam("rows", SIGNATURE, "sketch rows r", ge=1, le=64),
    HyperParam("cols", SIGNATURE, "sketch columns c (0: 10·k)", ge=0, le=2**26),
    HyperParam("server_lr", SIGNATURE, "scale of the update applied to the model", gt=0.0, le=100.0),
)


def _builder(cls, extra: tuple[str, ...] = ()):
    def build(params: dict, ctx: BuildContext):
        cfg = ctx.config
        kw = {k: params[k] for k in ("density", "rows", "cols", "server_lr", *extra)}
        return cls(ctx.layout, fraction_train=cfg.fraction, min_available_nodes=cfg.clients, seed=cfg.seed, **kw)

    return build


register(StrategyEntry(
    name="sketched_sgd",
    description="Sketched-SGD: sketch of momentum+error up, exact values of candidates up, sparse update down.",
    build=_builder(SketchedSGD, ("momentum", "candidates")),
    hyperparams=defaults_from(SketchedSGD, (
        *_SKETCH_PARAMS,
        HyperParam("momentum", SIGNATURE, "client momentum ρ (0.9 with server_lr ≈ 0.1 is the paper's scale)",
                   ge=0.0, lt=1.0),
        HyperParam("candidates", SIGNATURE, "p2: the server asks for p2·k exact values", ge=1, le=1000))),
    client_update=sketched_client_update,
    paper="Ivkin et al., NeurIPS 2019",
    secagg=True,  # the sketches, then the exact values at the shared candidates: two secure sums a round
    batched=Batched("sketch"),  # one sketch of all the clients' vectors; no --byzantine there
))

register(StrategyEntry(
    name="fetchsgd",
    description="FetchSGD: stateless clients send sketches; the server keeps momentum and error in the sketch.",
    build=_builder(FetchSGD, ("momentum",)),
    hyperparams=defaults_from(FetchSGD, (
        *_SKETCH_PARAMS, HyperParam("momentum", SIGNATURE, "server momentum ρ (in sketch space)", ge=0.0, lt=1.0))),
    client_update=fetchsgd_client_update,
    paper="Rothchild et al., ICML 2020",
    secagg=True,  # stateless clients, a linear sketch: SecAggGrid sums the tables (strategies/secagg_payload.py)
    batched=Batched("sketch"),  # one sketch of all the clients' vectors; no --byzantine there
))

register(StrategyEntry(
    name="gs_sgd",
    description="gs-SGD (reconstructed): clients sketch their error-compensated update; top-k of the global sketch.",
    build=_builder(GlobalSketchSGD, ("exact_values",)),
    hyperparams=defaults_from(GlobalSketchSGD, (
        *_SKETCH_PARAMS,
        HyperParam("exact_values", SIGNATURE, "a second exchange for the exact values at the selected coordinates"))),
    client_update=gs_client_update,
    paper="arXiv 2108.06004 (2021); reconstructed from the abstract",
    batched=Batched("sketch"),  # one sketch of all the clients' vectors; no --byzantine there
))
