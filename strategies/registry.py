"""The strategy registry: name -> (strategy builder, client update, hyperparameters, description).

The CLI (`fedswarm strategies`, `fedswarm sim --strategy NAME --set key=value`), the
dashboard's new-run form and the docs are generated from it. A strategy module registers
itself at import with :func:`register`; :func:`load_builtin` imports every built-in one.

A *client update* is a plain function the ClientApp dispatches to by message type
(``train.<name>``), so one ClientApp serves every algorithm::

    def client_update(msg: Message, context: Context) -> RecordDict

It returns the reply's content. ``fedswarm.local.local_fit(msg, context)`` does the
common part (config, partition, local SGD); ``context.state`` is the node's memory
across rounds (error-feedback residuals, momentum, ...). Strategies whose clients do plain local training (FedAvg) use
Flower's own ``train`` message type and need no client update of their own.

An entry's ``run_defaults`` are the run options the strategy needs where the user gives none
(EASGD's all-reduce: topology ``complete``); every front end (the CLI, the dashboard) completes a
raw config with :func:`with_run_defaults` before building the ``RunConfig``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam

__all__ = [
    "StrategyEntry",
    "register",
    "get",
    "names",
    "entries",
    "resolve_params",
    "with_run_defaults",
    "load_builtin",
    "message_type_of",
]


def message_type_of(name: str) -> str:
    """The Flower message type of strategy ``name``'s train messages, ``train.<name>``: the
    fedswarm ClientApp dispatches on it. (Strategies whose clients do plain local training,
    and any strategy talking to a user's own ClientApp, use Flower's ``train``.)"""
    return f"train.{name}"


@dataclass(frozen=True)
class StrategyEntry:
    """A registered algorithm.

    ``build(params, ctx)`` returns a Flower ``Strategy``; ``params`` are the resolved
    hyperparameters and ``ctx`` a :class:`BuildContext` with the run config and the model
    layout. ``client_update`` is None when clients use Flower's plain ``train`` message.
    """

    name: str
    description: str
    build: Callable[..., Any]
    hyperparams: tuple[HyperParam, ...] = ()
    client_update: Callable[..., Any] | None = None
    kind: str = "federated"  # "federated" | "decentralized"
    paper: str = ""
    #: Run options (RunConfig fields) the strategy needs to run, used where the user gave none:
    #: EASGD's all-reduce needs topology 'complete'. See :func:`with_run_defaults`.
    run_defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def message_type(self) -> str:
        """The Flower message type the strategy's train messages carry."""
        return "train" if self.client_update is None else message_type_of(self.name)

    def defaults(self) -> dict[str, Any]:
        return {h.name: h.default for h in self.hyperparams}


@dataclass
class BuildContext:
    """What a strategy builder may need besides its hyperparameters."""

    config: Any  # fedswarm.config.RunConfig
    layout: Any  # fedswarm.params.ParamLayout
    extra: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, StrategyEntry] = {}

# Modules that register built-in strategies when imported.
_BUILTIN_MODULES = (
    "fedswarm.strategies.federated.fedavg",
    "fedswarm.strategies.decentralized.router",
    "fedswarm.strategies.edge.pvt",
    "fedswarm.strategies.edge.progfed",
    "fedswarm.strategies.edge.hl",
    "fedswarm.strategies.federated.compressed_fedavg",
    "fedswarm.strategies.federated.gtopk",
    "fedswarm.strategies.federated.sketched",
    "fedswarm.strategies.federated.robust",
    "fedswarm.strategies.federated.coded",
)


def register(entry: StrategyEntry) -> StrategyEntry:
    if entry.name in _REGISTRY and _REGISTRY[entry.name] is not entry:
        raise ValueError(f"strategy {entry.name!r} is already registered")
    _REGISTRY[entry.name] = entry
    return entry


def load_builtin() -> None:
    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)


def names() -> list[str]:
    load_builtin()
    return sorted(_REGISTRY)


def entries() -> list[StrategyEntry]:
    load_builtin()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def get(name: str) -> StrategyEntry:
    load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy '{name}' (available: {', '.join(sorted(_REGISTRY))})"
        ) from None


def resolve_params(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Defaults of strategy ``name`` updated with ``overrides``, every value checked."""
    entry = get(name)
    known = {h.name: h for h in entry.hyperparams}
    out = entry.defaults()
    for key, value in overrides.items():
        if key not in known:
            allowed = ", ".join(known) or "none"
            raise ConfigError(
                f"unknown parameter '{key}' for strategy '{name}' (allowed: {allowed})"
            )
        out[key] = known[key].check(value, name)
    return out


def with_run_defaults(values: Mapping[str, Any]) -> dict[str, Any]:
    """A raw run config (before ``RunConfig.build``) completed with its strategy's
    ``run_defaults`` for the options it leaves unset, so ``--strategy S`` alone runs. What the
    user gave wins; a combination the strategy cannot run is then refused by its own check."""
    entry = get(str(values.get("strategy") or RunConfig.model_fields["strategy"].default))
    return {**entry.run_defaults, **values}
