"""The simulation engines behind one interface: which engine runs a config, its config check,
its run, and whether it can resume a run.

Every engine's ``run(cfg, *, store, run_id, listeners=None, ...)`` records into an existing
run of the store through the one run lifecycle
(:func:`fedswarm.server.recorder.run_recorded`) and returns the final status; ``check(cfg)``
raises a one-line :class:`~fedswarm.config.ConfigError` for a config the engine cannot run.
:func:`run_engine` is the one dispatch: the engine :func:`engine_for` picks, checked, with its
intra-op threads set, refusing a resume the engine cannot do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.server.recorder import RoundListener
from fedswarm.store import Store

__all__ = ["Engine", "ENGINES", "engine_for", "check_config", "check_resume", "run_engine"]


@dataclass(frozen=True)
class Engine:
    """One simulation engine.

    ``threads``: torch's intra-op threads on a CPU run (at most what torch has; None leaves
    them: the flower engine's Ray actors set their own); ``reports_clients``: ``run`` takes
    ``on_clients(done, total)``, progress within a round."""

    name: str
    check: Callable[[RunConfig], None]
    run: Callable[..., str]
    can_resume: bool = False
    threads: int | None = 1  # tiny models: thread fan-out costs more than it gains
    reports_clients: bool = False


def _check_flower_strategy(cfg: RunConfig) -> None:
    """Build the run's Flower strategy once, so that a tolerance bound, a privacy budget or an
    unsupported combination fails as one line before the run starts, not mid-run."""
    from fedswarm.algorithms.privacy.accountant import PrivacyBudgetExceeded
    from fedswarm.params import ParamLayout
    from fedswarm.server.app import build_strategy
    from fedswarm.tasks import get_task

    try:
        build_strategy(cfg, ParamLayout.from_module(get_task(cfg.task).model(cfg.seed)))
    except PrivacyBudgetExceeded as exc:
        raise ConfigError(f"invalid value for 'dp': {exc}") from None


def _check_batched(cfg: RunConfig) -> None:
    from fedswarm.sim.batched import check_supported, parse_memory_budget

    check_supported(cfg)
    parse_memory_budget(cfg.memory_budget)
    _check_flower_strategy(cfg)  # the batched rounds drive the strategy objects


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``fedswarm.sim.<module>.<name>``, imported when first called: an engine's modules (Ray,
    vmap, the clocks) load only when it runs."""
    def call(*args: Any, **kw: Any) -> Any:
        return getattr(importlib.import_module(f"fedswarm.sim.{module}"), name)(*args, **kw)

    return call


#: Every engine ``--engine`` names (the names of :class:`RunConfig`'s ``engine`` field).
ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("inprocess", _check_flower_strategy, _lazy("inprocess", "run_inprocess"), can_resume=True),
    Engine("flower", _check_flower_strategy, _lazy("flower_engine", "run_flower"), can_resume=True, threads=None),
    Engine("array", _lazy("array_engine", "check_config"), _lazy("array_engine", "run_array")),
    Engine("batched", _check_batched, _lazy("batched", "run_batched"), threads=2,  # its math uses a second core
           reports_clients=True),
    Engine("clock", _lazy("async_engine", "check_config"), _lazy("async_engine", "run_async")),
)}


def engine_for(cfg: RunConfig) -> Engine:
    """The engine that runs ``cfg``: the one ``cfg.engine`` names, except where the strategy
    runs nowhere else. Asynchronous algorithms (registry kind ``async``) timed by the clock
    run on the virtual-clock engine (with ``--set schedule=fixed`` they replay a seeded
    schedule on the engine asked for): Flower's synchronous rounds cannot express them. Those
    of kind ``array`` (LSGD: it needs every worker's loss) run on the array engine, LSGD's
    asynchronous mode on the virtual clock when ``--engine clock`` asks for it."""
    from fedswarm.strategies import registry

    kind = registry.get(cfg.strategy).kind
    if cfg.engine == "clock":
        return ENGINES["clock"]
    if kind == "array":
        return ENGINES["array"]
    if kind == "async" and cfg.params.get("schedule", "clock") == "clock":
        return ENGINES["clock"]
    return ENGINES[cfg.engine]


def check_config(cfg: RunConfig) -> Engine:
    """Raise a one-line :class:`ConfigError` unless ``cfg``'s engine can run it; return the engine."""
    engine = engine_for(cfg)
    engine.check(cfg)
    return engine


def check_resume(cfg: RunConfig) -> Engine:
    """Raise a one-line :class:`ConfigError` unless ``cfg``'s engine can resume a run; return it."""
    engine = engine_for(cfg)
    if not engine.can_resume:
        able = ", ".join(e.name for e in ENGINES.values() if e.can_resume)
        raise ConfigError(f"the {engine.name} engine cannot resume a run ('{cfg.strategy}' runs there); "
                          f"the engines that can: {able}")
    return engine


def run_engine(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None,
               on_clients: Callable[[int, int], None] | None = None, resume: Any = None) -> str:
    """Run ``cfg`` on its engine (:func:`engine_for`), recording into ``run_id``; return the final
    status. ``on_clients(done, total)`` hears progress within a round where the engine reports
    it (batched); ``resume``: a checkpoint of this run to continue from (fedswarm.server.resume)."""
    engine = check_resume(cfg) if resume is not None else engine_for(cfg)
    engine.check(cfg)
    if cfg.device == "cpu" and engine.threads is not None:
        torch.set_num_threads(min(engine.threads, torch.get_num_threads()))
    kw: dict[str, Any] = {"store": store, "run_id": run_id, "listeners": listeners}
    if resume is not None:
        kw["resume"] = resume
    if engine.reports_clients:
        kw["on_clients"] = on_clients
    return engine.run(cfg, **kw)
