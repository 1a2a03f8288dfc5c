"""fedswarm's client side: the ClientApp (``fedswarm.client.app``), ``fedswarm client``
(``supernode``), and :data:`compression_mod`, the Flower Mod with which a user's own
ClientApp joins fedswarm's compressed strategies (``fedswarm.client.mod``), and
:data:`secagg_mod`, the one that runs fedswarm's secure aggregation (``fedswarm.client.secagg_mod``). Loaded on first
use, so importing this package stays light."""

from __future__ import annotations

from typing import Any

__all__ = ["compression_mod", "secagg_mod"]


def __getattr__(name: str) -> Any:
    if name == "compression_mod":
        from fedswarm.client.mod import compression_mod

        return compression_mod
    if name == "secagg_mod":
        from fedswarm.client.secagg_mod import secagg_mod

        return secagg_mod
    raise AttributeError(f"module 'fedswarm.client' has no attribute {name!r}")
