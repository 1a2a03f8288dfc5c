"""The catalog of decentralized (gossip) algorithms: name -> class, hyperparameters, paper.

Every algorithm has three steps shared by all runtimes: a local step, what a node sends,
and how a node mixes what it received (see :mod:`fedswarm.algorithms.decentralized.base`)::

    algo = make_algorithm("d2")
    topo = make_topology("ring", 5)
    algo.check_topology(topo)
    state = algo.init_state(x0)                 # x0: [n, d]
    for t in range(T):
        grads = ...                             # [n, d], at state.x
        algo.local_step(state, grads, lr)
        algo.mix(state, algo.message(state), topo.mixing_matrix(t))

:data:`ALGORITHMS` maps a name to its class, hyperparameters (with defaults and ranges,
checked by :func:`make_algorithm`) and description, for the CLI and the dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedswarm.algorithms.decentralized.adpsgd import (ADPSGD, bipartite_split, exchange_roles, pair_mixing_matrix,
                                                     pairwise_average)
from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState, consensus_distance
from fedswarm.algorithms.decentralized.dasgd import DaSGD
from fedswarm.algorithms.decentralized.leader import (EASGD, LSGD, LSGD_MODES, elect_leader, leader_pull,
                                                     leader_server_update)
from fedswarm.algorithms.decentralized.prague import Prague, partial_allreduce
from fedswarm.algorithms.decentralized.schedule import FixedSchedule, make_schedule, uses_fixed_schedule
from fedswarm.algorithms.decentralized.squarm import SQuARM
from fedswarm.algorithms.decentralized.swarm_merge import merge_leader, weighted_merge
from fedswarm.algorithms.decentralized.sync import D2, DPSGD, DSGDm, QGDSGDm
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from

__all__ = [
    "GossipState",
    "DecentralizedAlgorithm",
    "DPSGD",
    "D2",
    "DSGDm",
    "QGDSGDm",
    "ADPSGD",
    "SQuARM",
    "EASGD",
    "LSGD",
    "elect_leader",
    "leader_pull",
    "leader_server_update",
    "merge_leader",
    "weighted_merge",
    "DaSGD",
    "Prague",
    "partial_allreduce",
    "pairwise_average",
    "pair_mixing_matrix",
    "bipartite_split",
    "exchange_roles",
    "FixedSchedule",
    "make_schedule",
    "uses_fixed_schedule",
    "consensus_distance",
    "AlgorithmEntry",
    "ALGORITHMS",
    "make_algorithm",
]


@dataclass(frozen=True)
class AlgorithmEntry:
    """A registered decentralized algorithm."""

    name: str
    cls: type[DecentralizedAlgorithm]
    hyperparams: tuple[HyperParam, ...]
    description: str
    paper: str
    synchronous: bool = True
    #: The topology it runs on when none is given (its ``check_topology`` refuses some graphs).
    topology: str = "ring"

    def __post_init__(self) -> None:
        # the defaults are the constructor's own (declared SIGNATURE here), written once
        object.__setattr__(self, "hyperparams", defaults_from(self.cls.__init__, self.hyperparams))

    def defaults(self) -> dict[str, Any]:
        return {h.name: h.default for h in self.hyperparams}


_WD = HyperParam("weight_decay", SIGNATURE, "L2 weight decay added to the gradient (wd·x)", ge=0.0)
_BETA = HyperParam("momentum", SIGNATURE, "momentum factor β", ge=0.0, lt=1.0)
_SCHEDULE = HyperParam("schedule", SIGNATURE, "asynchronous events timed by the runtime ('clock': the simulator's "
                      "virtual clock, the swarm's messages) or replayed from a seeded fixed schedule, the same on "
                      "the array engine, the router and the swarm ('fixed')", choices=("clock", "fixed"))
_STALENESS = HyperParam("max_staleness", SIGNATURE, "schedule='fixed': a gradient may be taken at the node's model "
                        "up to this many iterations old (drawn per iteration and node from the seed)", ge=0)
_NESTEROV = HyperParam("nesterov", SIGNATURE, "Nesterov momentum (epfml's scripts use it) instead of heavy ball")

ALGORITHMS: dict[str, AlgorithmEntry] = {
    e.name: e
    for e in (
        AlgorithmEntry(
            "dpsgd", DPSGD,
            (HyperParam("order", SIGNATURE, "'cta': x ← Wx − ηg (the paper); 'atc': x ← W(x − ηg)",
                        choices=("cta", "atc")), _WD),
            "D-PSGD: gossip the models with neighbours, then a local SGD step",
            "Lian et al., NeurIPS 2017, arXiv:1705.09056",
        ),
        AlgorithmEntry(
            "d2", D2, (_WD,),
            "D²: D-PSGD with a correction that removes the bias of heterogeneous data "
            "(needs λ_min(W) > -1/3)",
            "Tang et al., ICML 2018, arXiv:1803.07068",
            topology="ring+lazy",  # λ_min((I + W)/2) >= 0 for every W; a plain even ring has -1/3
        ),
        AlgorithmEntry(
            "dsgdm", DSGDm, (_BETA, _NESTEROV, _WD),
            "DSGDm: D-PSGD with local momentum",
            "baseline of Lin et al., ICML 2021, arXiv:2102.04761",
        ),
        AlgorithmEntry(
            "qgm", QGDSGDm,
            (_BETA, HyperParam("mu", SIGNATURE, "averaging factor μ of the quasi-global momentum buffer",
                               ge=0.0, lt=1.0), _NESTEROV, _WD),
            "QG-DSGDm: momentum from the model's displacement after gossip, robust to non-IID data",
            "Lin, Karimireddy, Stich, Jaggi, ICML 2021, arXiv:2102.04761",
        ),
        AlgorithmEntry(
            "adpsgd", ADPSGD, (_SCHEDULE, _STALENESS, _WD),
            "AD-PSGD: asynchronous pairwise averaging between active and passive nodes",
            "Lian, Zhang, Zhang, Liu, ICML 2018, arXiv:1710.06952",
            synchronous=False,
        ),
        AlgorithmEntry(
            "squarm", SQuARM,
            (HyperParam("momentum", SIGNATURE, "Nesterov momentum factor β", ge=0.0, lt=1.0),
             HyperParam("gamma", SIGNATURE, "consensus step size γ", gt=0.0, le=1.0),
             HyperParam("period", SIGNATURE, "H: local steps between synchronization steps", ge=1),
             HyperParam("threshold", SIGNATURE, "event trigger c: send only if ‖x − x̂‖² > c·η²", ge=0.0),
             HyperParam("codec", SIGNATURE, "compressor of x − x̂ (algorithms.compression.codecs)",
                        choices=("topk", "sign", "randk", "qsgd", "fp16", "onebit", "none")),
             HyperParam("ratio", SIGNATURE, "fraction of coordinates kept by topk/randk", gt=0.0, le=1.0),
             HyperParam("seed", SIGNATURE, "seed of the codec's randomness", ge=0),
             _WD),
            "SQuARM-SGD: local Nesterov steps, event-triggered compressed gossip of x − x̂ every H steps "
            "with consensus step γ (static topologies)",
            "Singh, Data, George, Diggavi, IEEE JSAIT 2021, arXiv:2005.07041",
        ),
        AlgorithmEntry(
            "easgd", EASGD,
            (HyperParam("beta", SIGNATURE, "moving rate β = n·α of the elastic pull", gt=0.0, le=1.0),
             HyperParam("period", SIGNATURE, "τ: steps between elastic pulls", ge=1), _WD),
            "EASGD: every τ steps workers and a center variable pull elastically towards each other "
            "(needs topology 'complete')",
            "Zhang, Choromanska, LeCun, NeurIPS 2015, arXiv:1412.6651",
            topology="complete",  # the all-reduce of every worker
        ),
        AlgorithmEntry(
            "lsgd", LSGD,
            (HyperParam("mode", SIGNATURE, "'multi': local leaders per group plus a global leader; 'single': "
                        "the global leader only; 'async': leader servers under a fixed staggered schedule",
                        choices=LSGD_MODES),
             HyperParam("groups", SIGNATURE, "number of contiguous worker groups (local leaders)", ge=1),
             HyperParam("c1", SIGNATURE, "pull towards the group's leader", ge=0.0, le=1.0),
             HyperParam("c2", SIGNATURE, "pull towards the global leader", ge=0.0, le=1.0),
             HyperParam("tau_local", SIGNATURE, "τ_l: steps between local pulls", ge=1),
             HyperParam("tau_global", SIGNATURE, "τ_g: steps between global pulls", ge=1),
             HyperParam("momentum", SIGNATURE, "local heavy-ball momentum", ge=0.0, lt=1.0), _WD),
            "LSGD: every τ steps workers pull towards the lowest-loss worker of their group and of all "
            "(array engine and swarm: needs every worker's loss)",
            "Teng et al., NeurIPS 2019, arXiv:1905.10395",
        ),
        AlgorithmEntry(
            "dasgd", DaSGD,
            (HyperParam("period", SIGNATURE, "τ: steps between averagings", ge=1),
             HyperParam("delay", SIGNATURE, "δ: steps after which the average is applied (0 <= δ < τ)", ge=0),
             _WD),
            "DaSGD: local SGD whose periodic average is applied δ steps late, overlapping communication",
            "Zhou et al., arXiv:2006.00441 (update reconstructed, docs/algorithms.md §10)",
        ),
        AlgorithmEntry(
            "prague", Prague,
            (HyperParam("group_size", SIGNATURE, "workers per Partial All-Reduce (n = synchronous all-reduce)", ge=2),
             _SCHEDULE, _STALENESS, _WD),
            "Prague: local SGD steps, each followed by a Partial All-Reduce among a group of ready workers",
            "Luo, He, Zhuo, Qian, ASPLOS 2020, doi:10.1145/3373376.3378499",
            synchronous=False,
        ),
    )
}


def make_algorithm(name: str, **params: Any) -> DecentralizedAlgorithm:
    """Build algorithm ``name`` with ``params`` over its defaults, each value checked
    against its range (ValueError naming the parameter otherwise)."""
    try:
        entry = ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown decentralized algorithm '{name}' (available: {', '.join(ALGORITHMS)})"
        ) from None
    known = {h.name: h for h in entry.hyperparams}
    values = entry.defaults()
    for key, value in params.items():
        if key not in known:
            raise ValueError(
                f"unknown parameter '{key}' for '{name}' (allowed: {', '.join(known) or 'none'})"
            )
        values[key] = known[key].check(value, name)
    return entry.cls(**values)
