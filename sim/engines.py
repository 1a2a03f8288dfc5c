"""The simulation engines behind one interface: which engine runs a config, its config check,
its run, and whether it can resume a run.

Every engine's ``run(cfg, *, store, run_id, listeners=None, ...)`` records into an existing
run of the store through the one run lifecycle
(:func:`fedswarm.server.recorder.run_recorded`) and returns the final status; ``check(cfg)``
raises a one-line :class:`~fedswarm.config.ConfigError` for a config the engine cannot run.
:func:`run_engine` is the one dispatch: the engine :func:`engine_for` picks, checked, with its
intra-op threads set, refusing a resume the engine cannot do.

Which strategies an engine serves comes from their registry entries (their ``kind``, and the
batched engine's :class:`~fedswarm.strategies.registry.Batched` runner); the ``--engine`` help,
``fedswarm strategies`` and the README's strategy table are generated from :data:`ENGINES` and
the entries. Importing this module is cheap (the CLI builds its help from it): an engine's own
modules, torch among them, load when it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from fedswarm.config import EngineName, RunConfig
from fedswarm.errors import ConfigError

if TYPE_CHECKING:
    from fedswarm.server.recorder import RoundListener
    from fedswarm.store import Store
    from fedswarm.strategies.registry import StrategyEntry

__all__ = ["Engine", "ENGINES", "Checked", "engine_for", "engines_for", "engine_help", "check_config", "check_run",
           "check_resume", "run_engine"]


@dataclass(frozen=True)
class Engine:
    """One simulation engine.

    ``check(cfg)`` raises a one-line :class:`ConfigError` for a config the engine cannot run and
    returns what it built checking it for the run to take (a
    :class:`~fedswarm.server.app.PreparedStrategy`, or None): ``run`` then takes it as ``prepared``
    where ``takes_prepared``. ``help``: what it is for, in the ``--engine`` help; ``serves(entry)``: whether it runs a
    registered strategy (its kind, its capabilities), which the help and the catalog list;
    ``owns(cfg, entry)``: the run goes to this engine whatever ``--engine`` says (a strategy that
    runs nowhere else). ``threads``: torch's intra-op threads on a CPU run (at most what torch has;
    None leaves them: the flower engine's Ray actors set their own); ``reports_clients``: ``run``
    takes ``on_clients(done, total)``, progress within a round."""

    name: str
    check: Callable[[RunConfig], Any]
    run: Callable[..., str]
    help: str = ""
    serves: Callable[[StrategyEntry], bool] = lambda entry: True
    owns: Callable[[RunConfig, StrategyEntry], bool] | None = None
    lists_strategies: bool = False  # the --engine help names the strategies it serves (not all of a kind)
    can_resume: bool = False
    threads: int | None = 1  # tiny models: thread fan-out costs more than it gains
    reports_clients: bool = False
    takes_prepared: bool = False


@dataclass
class Checked:
    """A config its engine checked (:func:`check_run`): the engine, and what the check built for
    the run (the strategy, built once per run)."""

    cfg: RunConfig
    engine: Engine
    prepared: Any = None


def _check_flower_strategy(cfg: RunConfig) -> Any:
    """Build the run's Flower strategy, so that a tolerance bound, a privacy budget or an
    unsupported combination fails as one line before the run starts, not mid-run; the run takes
    what was built (a :class:`~fedswarm.server.app.PreparedStrategy`)."""
    from fedswarm.algorithms.privacy.accountant import PrivacyBudgetExceeded
    from fedswarm.server.app import prepare_strategy

    try:
        return prepare_strategy(cfg)
    except PrivacyBudgetExceeded as exc:
        raise ConfigError(f"invalid value for 'dp': {exc}") from None


def _check_batched(cfg: RunConfig) -> Any:
    from fedswarm.sim.batched import check_supported, parse_memory_budget

    check_supported(cfg)
    parse_memory_budget(cfg.memory_budget)
    if cfg.ray_address or cfg.workers is not None:  # the cohort sharded across Ray actors (no Ray imported here)
        from fedswarm.sim.batched_ray import check_sharded

        check_sharded(cfg)
    return _check_flower_strategy(cfg)  # the batched rounds drive the strategy objects


def _run_batched(cfg: RunConfig, **kw: Any) -> str:
    """The batched engine's run: in this process, or with ``--ray-address`` its cohort sharded
    across Ray actors (:mod:`fedswarm.sim.batched_ray`)."""
    module, name = ("batched_ray", "run_batched_ray") if cfg.ray_address else ("batched", "run_batched")
    return _lazy(module, name)(cfg, **kw)


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``fedswarm.sim.<module>.<name>``, imported when first called: an engine's modules (Ray,
    vmap, the clocks) load only when it runs."""
    def call(*args: Any, **kw: Any) -> Any:
        return getattr(importlib.import_module(f"fedswarm.sim.{module}"), name)(*args, **kw)

    return call


def _clocked(cfg: RunConfig, entry: StrategyEntry) -> bool:
    """An asynchronous algorithm timed by the clock (not replaying ``--set schedule=fixed``)."""
    return entry.kind == "async" and cfg.params.get("schedule", "clock") == "clock"


_FLOWER_KINDS = ("federated", "decentralized", "async")  # the router runs async ones with --set schedule=fixed

#: Every engine ``--engine`` names, in the order of :data:`fedswarm.config.EngineName` (the
#: ``engine`` field's values: the config layer cannot import this one, so this table is checked
#: against it when it is built).
ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("inprocess", _check_flower_strategy, _lazy("inprocess", "run_inprocess"), can_resume=True,
           takes_prepared=True,
           help="default: fedswarm's ServerApp and ClientApp in one process, no Ray",
           serves=lambda e: e.kind in _FLOWER_KINDS),
    Engine("flower", _check_flower_strategy, _lazy("flower_engine", "run_flower"), can_resume=True, threads=None,
           takes_prepared=True,
           help="Flower's Simulation Engine on Ray", serves=lambda e: e.kind in _FLOWER_KINDS),
    Engine("array", _lazy("array_engine", "check_config"), _lazy("array_engine", "run_array"),
           help="decentralized algorithms, every node one row of an n-by-d tensor: fast, no Flower messages; "
                "asynchronous ones with --set schedule=fixed",
           serves=lambda e: e.kind in ("decentralized", "array", "async"), owns=lambda cfg, e: e.kind == "array"),
    Engine("batched", _check_batched, _run_batched, threads=2,  # its math uses a second core
           help="every sampled client trained at once with torch.func.vmap: 10,000+ clients per round",
           serves=lambda e: e.batched is not None, lists_strategies=True, reports_clients=True, takes_prepared=True),
    Engine("clock", _lazy("async_engine", "check_config"), _lazy("async_engine", "run_async"),
           help="asynchronous algorithms on the virtual clock, --devices sets each node's speed: they run there "
                "unless --set schedule=fixed; lsgd with --set mode=async",
           serves=lambda e: e.clock is not None, owns=_clocked),
)}
if tuple(ENGINES) != get_args(EngineName):  # pragma: no cover - a new engine named in one place only
    raise RuntimeError(f"ENGINES {tuple(ENGINES)} and fedswarm.config.EngineName {get_args(EngineName)} differ: "
                       "an engine is added to both (docs/architecture.md, 'How to add an engine')")


#: The engines that run secure aggregation's real protocol (SecAggGrid over Flower messages).
SECAGG_ENGINES = ("inprocess", "flower", "batched")  # batched: the sum computed directly (sim/batched_secagg*.py)


def engines_for(entry: StrategyEntry) -> list[str]:
    """The engines that run strategy ``entry``."""
    return [e.name for e in ENGINES.values() if e.serves(entry)]


def engine_help(strategies: bool = True) -> str:
    """The ``--engine`` help: every engine of :data:`ENGINES` with what it is for and, with
    ``strategies``, the strategies that run there where not every one of their kind does (the
    batched engine's come from the registry: a strategy registered later is listed)."""
    parts = []
    for e in ENGINES.values():
        text = f"{e.name} ({e.help}"
        if strategies and e.lists_strategies:
            from fedswarm.strategies import registry

            text += ": " + ", ".join(s.name for s in registry.entries(registered=True) if e.serves(s))
        parts.append(text + ")")
    return "; ".join(parts) + ". See README 'Which engine when'."


def engine_for(cfg: RunConfig) -> Engine:
    """The engine that runs ``cfg``: the one ``cfg.engine`` names, except where the strategy
    runs nowhere else (an engine that ``owns`` it). Asynchronous algorithms (registry kind
    ``async``) timed by the clock run on the virtual-clock engine (with ``--set schedule=fixed``
    they replay a seeded schedule on the engine asked for): Flower's synchronous rounds cannot
    express them. Those of kind ``array`` (LSGD: it needs every worker's loss) run on the array
    engine, LSGD's asynchronous mode on the virtual clock when ``--engine clock`` asks for it."""
    from fedswarm.strategies import registry

    entry = registry.get(cfg.strategy)
    if cfg.engine == "clock":
        return ENGINES["clock"]
    for engine in ENGINES.values():
        if engine.owns is not None and engine.owns(cfg, entry):
            return engine
    return ENGINES[cfg.engine]


def check_run(cfg: RunConfig, *, resume: bool = False) -> Checked:
    """Raise a one-line :class:`ConfigError` unless ``cfg``'s engine can run it (``resume``: and
    resume it); return the engine and what its check built for the run, which
    :func:`run_engine` hands it."""
    engine = check_resume(cfg) if resume else engine_for(cfg)
    check_fleet_engine(cfg, engine.name)
    if cfg.workers is not None and engine.name != "batched":
        raise ConfigError(f"--workers splits the batched engine's cohort across Ray actors (--engine batched "
                          f"--ray-address); the {engine.name} engine takes none")
    if cfg.secagg and engine.name not in SECAGG_ENGINES:
        raise ConfigError(f"--secagg runs on the {' and '.join(SECAGG_ENGINES)} engines and a deployment (flwr run), "
                          f"not on '{engine.name}' ('{cfg.strategy}' runs there)")
    return Checked(cfg, engine, engine.check(cfg))


#: The engines that run quorum rounds, over-selection, eligibility and availability: through
#: fedswarm.server.fleet_grid (inprocess, flower), or the batched rounds'
#: fedswarm.sim.batched_fleet (the same nodes, rows and model on the same seed).
FLEET_ENGINES = ("inprocess", "flower", "batched")


def check_fleet_engine(cfg: RunConfig, engine: str) -> None:
    """Refuse, in one line, quorum/over-selection/eligibility/availability on an engine that does not run them
    (the array and clock engines have no federated rounds to sample or close; the batched engine runs them
    with every synchronous strategy it serves, in this process, and FedBuff's --eligible and --availability
    (batched_fleet's check_batched_fleet); the clock engine runs --availability with every algorithm it runs)."""
    used = cfg.fleet_options()
    if not used:
        return
    if engine == "clock" and used == ["--availability"]:
        return  # every clock runner: a node off neither computes nor exchanges (sim/async_*.py)
    if engine not in FLEET_ENGINES:
        also = " (--availability also on the clock engine, without the others)" if "--availability" in used else ""
        raise ConfigError(f"{', '.join(used)}: run on --engine {', '.join(FLEET_ENGINES)} (or in a deployment), not "
                          f"on the {engine} engine: it has no federated rounds to sample or close{also}")
    if engine == "batched":
        from fedswarm.sim.batched_fleet import check_batched_fleet
        from fedswarm.strategies import registry

        entry = registry.get(cfg.strategy)
        if entry.batched is not None:  # (a strategy the engine does not serve: its own check says so)
            check_batched_fleet(cfg, entry.batched.runner)
        if cfg.ray_address or cfg.workers is not None:
            raise ConfigError(f"{', '.join(used)} on the batched engine: in this process, not sharded across Ray "
                              "actors (--ray-address/--workers)")


def check_config(cfg: RunConfig) -> Engine:
    """Raise a one-line :class:`ConfigError` unless ``cfg``'s engine can run it; return the engine."""
    return check_run(cfg).engine


def check_resume(cfg: RunConfig) -> Engine:
    """Raise a one-line :class:`ConfigError` unless ``cfg``'s engine can resume a run; return it."""
    engine = engine_for(cfg)
    if not engine.can_resume:
        able = ", ".join(e.name for e in ENGINES.values() if e.can_resume)
        raise ConfigError(f"the {engine.name} engine cannot resume a run ('{cfg.strategy}' runs there); "
                          f"the engines that can: {able}")
    return engine


def run_engine(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None,
               on_clients: Callable[[int, int], None] | None = None, resume: Any = None,
               checked: Checked | None = None) -> str:
    """Run ``cfg`` on its engine (:func:`engine_for`), recording into ``run_id``; return the final
    status. ``on_clients(done, total)`` hears progress within a round where the engine reports
    it (batched); ``resume``: a checkpoint of this run to continue from (fedswarm.server.resume);
    ``checked``: :func:`check_run` of this ``cfg`` done already (the CLI's), not done again."""
    if checked is None or checked.cfg != cfg or (resume is not None and not checked.engine.can_resume):
        checked = check_run(cfg, resume=resume is not None)
    engine = checked.engine
    if cfg.device == "cpu" and engine.threads is not None:
        import torch

        torch.set_num_threads(min(engine.threads, torch.get_num_threads()))
    kw: dict[str, Any] = {"store": store, "run_id": run_id, "listeners": listeners}
    if resume is not None:
        kw["resume"] = resume
    if engine.reports_clients:
        kw["on_clients"] = on_clients
    if engine.takes_prepared:
        kw["prepared"] = checked.prepared
    return engine.run(cfg, **kw)
