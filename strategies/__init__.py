"""fedswarm's algorithms as Flower strategies, codecs, topologies and gossip rules.

For a Flower user: ``from fedswarm.strategies import OneBitSGD`` inside any ServerApp. The
classes load on first use, so importing this package stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompressedFedAvg": "fedswarm.strategies.compressed_fedavg",
    "OneBitSGD": "fedswarm.strategies.compressed_fedavg",
    "GlobalTopK": "fedswarm.strategies.gtopk",
    "SketchedSGD": "fedswarm.strategies.sketched",
    "FetchSGD": "fedswarm.strategies.sketched",
    "GlobalSketchSGD": "fedswarm.strategies.sketched",
    "DecentralizedStrategy": "fedswarm.strategies.decentralized",
    "PartialVariableTraining": "fedswarm.strategies.pvt",
    "ProgFed": "fedswarm.strategies.progfed",
    "HomogeneousLearning": "fedswarm.strategies.hl",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fedswarm.strategies' has no attribute {name!r}")
