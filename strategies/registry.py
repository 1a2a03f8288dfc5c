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

An entry also says what the strategy can do, and everything that lists strategies reads it
there: its ``kind`` (which engines run it, :data:`fedswarm.sim.engines.ENGINES`), its
:class:`Batched` round runner on ``--engine batched`` (None: not served there) and the options
it takes there, whether it takes ``--dp`` and ``--byzantine``, a ``secagg``-style wrapper, and
the device-class policy keys its clients honour. The batched engine's served set, the CLI's
``--engine`` help, ``fedswarm strategies`` (and the dashboard's catalog) and the README's
strategy table are generated from these fields (docs/architecture.md, "How to add a strategy").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, get_args

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam

__all__ = [
    "Kind",
    "KINDS",
    "Batched",
    "LOCAL_POLICY_KEYS",
    "StrategyEntry",
    "unregister",
    "on_register",
    "register",
    "get",
    "names",
    "entries",
    "resolve_params",
    "with_run_defaults",
    "load_builtin",
    "message_type_of",
    "batched_names",
]


def message_type_of(name: str) -> str:
    """The Flower message type of strategy ``name``'s train messages, ``train.<name>``: the
    fedswarm ClientApp dispatches on it. (Strategies whose clients do plain local training,
    and any strategy talking to a user's own ClientApp, use Flower's ``train``.)"""
    return f"train.{name}"


#: What a strategy is, which decides the engines that run it:
#: ``federated`` (a global model, a Flower strategy: inprocess, flower, batched when it has a
#: :class:`Batched` runner); ``decentralized`` (no global model, synchronous gossip: the router on
#: inprocess/flower, and the array engine); ``array`` (needs every worker at once: the array engine
#: only, the virtual clock with ``--engine clock``); ``async`` (asynchronous: the virtual clock, or a
#: fixed replayed schedule with ``--set schedule=fixed``).
Kind = Literal["federated", "decentralized", "array", "async"]
KINDS: tuple[str, ...] = get_args(Kind)

#: The device-class policy keys (fedswarm/policy.py) of local work, which every federated client
#: honours (it trains through ``fedswarm.local``).
LOCAL_POLICY_KEYS = ("local_steps", "local_epochs", "batch_size", "lr")


@dataclass(frozen=True)
class Batched:
    """How ``--engine batched`` runs a strategy.

    ``runner``: the round runner, a name in :data:`fedswarm.sim.batched.ROUND_RUNNERS` (the
    built-in ones: ``weighted_mean`` FedAvg's own round, ``codec`` the strategies whose client half
    is compressed_fedavg's, ``global_topk``, ``sketch``, ``variable_subsets``, ``stages``), or a
    runner class of your own (``runner(run, global_vec, notes=recorder)``, with ``.model`` and
    ``.round(server_round) -> (row, node_rows)``). ``dp``: it takes ``--dp`` there; ``byzantine``:
    it takes ``--byzantine`` there (update attacks, ``random`` and ``labelflip``)."""

    runner: str | Callable[..., Any]
    dp: bool = False
    byzantine: bool = False


@dataclass(frozen=True)
class StrategyEntry:
    """A registered algorithm and what it can do.

    ``build(params, ctx)`` returns a Flower ``Strategy``; ``params`` are the resolved
    hyperparameters and ``ctx`` a :class:`BuildContext` with the run config and the model
    layout. ``client_update`` is None when clients use Flower's plain ``train`` message.

    Capabilities: ``kind`` (:data:`Kind`); ``batched``, how ``--engine batched`` runs it (None: it
    does not); ``dp``, it takes ``--dp`` (client-level DP-FedAvg: its aggregate is an average of
    per-client vectors); ``byzantine``, it takes ``--byzantine`` (None: every federated strategy
    does); ``secagg``, its aggregate may be wrapped by a secure-aggregation-style wrapper (no
    strategy sets it yet: future wrappers read it); ``policy_keys``, the device-class policy keys
    its clients honour (None: the local-work keys for a federated strategy, plus ``codec`` and
    ``codec_params`` where it has a ``codec`` hyperparameter; none for the others);
    ``run_defaults``, see :func:`with_run_defaults`.
    """

    name: str
    description: str
    build: Callable[..., Any]
    hyperparams: tuple[HyperParam, ...] = ()
    client_update: Callable[..., Any] | None = None
    kind: Kind = "federated"
    paper: str = ""
    #: Run options (RunConfig fields) the strategy needs to run, used where the user gave none:
    #: EASGD's all-reduce needs topology 'complete'. See :func:`with_run_defaults`.
    run_defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    batched: Batched | None = None
    #: The virtual clock's runner (``--engine clock``), a name in
    #: :data:`fedswarm.sim.async_engine.CLOCK_RUNNERS`; None: not run there.
    clock: str | None = None
    dp: bool = False
    byzantine: bool | None = None
    secagg: bool = False
    policy_keys: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"strategy {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        federated = self.kind == "federated"
        if self.clock is not None and self.kind not in ("async", "array"):
            raise ValueError(f"strategy {self.name!r}: a clock runner is for async and array strategies")
        if not federated and (self.batched is not None or self.dp or self.byzantine or self.secagg):
            raise ValueError(f"strategy {self.name!r}: batched, dp, byzantine and secagg are for federated "
                             f"strategies; it is {self.kind}")
        if self.batched is not None and (self.batched.dp and not self.dp):
            raise ValueError(f"strategy {self.name!r}: batched.dp needs dp=True")
        if self.byzantine is None:
            object.__setattr__(self, "byzantine", federated)
        if self.policy_keys is None:
            keys: tuple[str, ...] = ()
            if federated:
                keys = LOCAL_POLICY_KEYS
                if any(h.name == "codec" for h in self.hyperparams):
                    keys += ("codec", "codec_params")
            object.__setattr__(self, "policy_keys", keys)
        object.__setattr__(self, "policy_keys", tuple(self.policy_keys))

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
    "fedswarm.strategies.federated.fedbuff",
)


_LISTENERS: list[Callable[[StrategyEntry], None]] = []


def register(entry: StrategyEntry) -> StrategyEntry:
    if entry.name in _REGISTRY and _REGISTRY[entry.name] is not entry:
        raise ValueError(f"strategy {entry.name!r} is already registered")
    _REGISTRY[entry.name] = entry
    for listener in _LISTENERS:
        listener(entry)
    return entry


def on_register(listener: Callable[[StrategyEntry], None]) -> None:
    """Call ``listener(entry)`` for every strategy registered from now on (fedswarm's ClientApp
    serves a strategy registered after it was imported)."""
    _LISTENERS.append(listener)


def unregister(name: str) -> None:
    """Forget strategy ``name`` (a test's own strategy, once the test is done with it)."""
    _REGISTRY.pop(name, None)


def load_builtin() -> None:
    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)


def names() -> list[str]:
    load_builtin()
    return sorted(_REGISTRY)


def entries(*, registered: bool = False) -> list[StrategyEntry]:
    """Every strategy, by name (``registered``: in the order they were registered, the built-in
    ones first, FedAvg first of all: the order lists of what an engine serves are written in)."""
    load_builtin()
    if not registered:
        return [_REGISTRY[n] for n in sorted(_REGISTRY)]
    order = {name: i for i, name in enumerate(_REGISTRY)}

    def rank(e: StrategyEntry) -> tuple[int, int]:  # the built-in modules' order, whatever imported them first
        mod = getattr(e.build, "__module__", "")
        return (_BUILTIN_MODULES.index(mod) if mod in _BUILTIN_MODULES else len(_BUILTIN_MODULES), order[e.name])

    return sorted(_REGISTRY.values(), key=rank)


def batched_names(**need: bool) -> list[str]:
    """The strategies ``--engine batched`` serves, in registration order; ``dp=True`` or
    ``byzantine=True``: those it serves with that option."""
    return [e.name for e in entries(registered=True) if e.batched is not None
            and all(getattr(e.batched, k) for k, v in need.items() if v)]


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
