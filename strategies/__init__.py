"""fedswarm's algorithms as Flower strategies, codecs, topologies and gossip rules.

For a Flower user: ``from fedswarm.strategies import OneBitSGD`` inside any ServerApp. The
classes load on first use, so importing this package stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompressedFedAvg": "fedswarm.strategies.federated.compressed_fedavg",
    "OneBitSGD": "fedswarm.strategies.federated.compressed_fedavg",
    "GlobalTopK": "fedswarm.strategies.federated.gtopk",
    "SketchedSGD": "fedswarm.strategies.federated.sketched",
    "FetchSGD": "fedswarm.strategies.federated.sketched",
    "GlobalSketchSGD": "fedswarm.strategies.federated.sketched",
    "DecentralizedStrategy": "fedswarm.strategies.decentralized.router",
    "PartialVariableTraining": "fedswarm.strategies.edge.pvt",
    "ProgFed": "fedswarm.strategies.edge.progfed",
    "HomogeneousLearning": "fedswarm.strategies.edge.hl",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fedswarm.strategies' has no attribute {name!r}")
