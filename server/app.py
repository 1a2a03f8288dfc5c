"""fedswarm's Flower ServerApp: runs any registered strategy and records every round.

``flwr run .`` on this project starts it; fedswarm's engines call :func:`run_server`
with their own Grid. The run config comes from Flower's ``run_config`` (the
``[tool.flwr.app.config]`` table of pyproject.toml plus ``--run-config`` overrides);
three extra keys are not part of the run config itself: ``db`` (the store's path or URL,
else ``FEDSWARM_DB``, else ./fedswarm.db), ``run-id`` (record into an existing run) and
``resume`` (true: continue ``run-id`` from its last checkpoint, see :mod:`.resume`;
``accept-client-state-loss`` = true lets a strategy with client state resume inexactly where
the nodes keep none). On engines whose nodes keep their own state (a deployment, Flower's
simulation engine) the train config also names the run (``fedswarm-run``): the nodes save
their state under it after every round, and a resumed run asks them for it
(:mod:`.client_state`).
Every ``checkpoint_every``-th round (default: every round) is checkpointed into the store
(:mod:`.checkpoint`). After every ``eval_every``-th round the round's cohort evaluates the model
on its own validation data (:mod:`.fed_eval`); ``central_eval = false`` runs with no server test
set at all (the task's data is never loaded here). ``round_timeout`` (seconds, default
:data:`ROUND_TIMEOUT_S`) is how long a round waits for replies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedswarm.algorithms.privacy.accountant import PrivacyBudgetExceeded
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout, get_flat
from fedswarm.policy import PolicyBook
from fedswarm.store import Store
from fedswarm.store.liveness import owner_fields
from fedswarm.strategies import registry
from fedswarm.tasks import get_task
from fedswarm.train import evaluate_flat, resolve_device, task_data
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord
from fedswarm.server.metered_grid import MeteredGrid, Traffic
from fedswarm.server.prompt_grid import PromptGrid
from fedswarm.server.checkpoint import ServerCheckpoint, ServerCheckpointer
from fedswarm.server.fed_eval import GridEvaluator
from fedswarm.server.fleet_grid import NodeTime, check_fleet, fleet_grid_for
from fedswarm.server.recorder import RoundListener, RoundRecorder, run_recorded
from fedswarm.server.client_state import restore_clients
from fedswarm.server.resume import ACCEPT_LOSS_KEY, RESUME_KEY, resume_into
from fedswarm.protocol import RUN_KEY
from fedswarm.strategies.resumable import shift_rounds
from fedswarm.strategies.federated.dp import attach_dp

__all__ = ["app", "run_server", "split_run_config", "build_strategy", "PreparedStrategy", "prepare_strategy",
           "strategy_for"]

# Seconds a round may wait for replies before it goes on without the missing ones (run config round_timeout).
ROUND_TIMEOUT_S = RunConfig.model_fields["round_timeout"].default


def split_run_config(run_config: dict) -> tuple[RunConfig, str | None, str | None]:
    """Flower's run_config -> (RunConfig, db, run_id)."""
    rc = dict(run_config)
    db = rc.pop("db", None) or None
    run_id = rc.pop("run-id", None) or None
    return RunConfig.from_flat(rc), db, run_id


def run_server(grid: Grid, cfg: RunConfig, *, store: Store, run_id: str,
               listeners: list[RoundListener] | None = None,
               sim_time: Callable[[int, Traffic], float | None] | None = None,
               node_kind: str = "sim", resume: ServerCheckpoint | None = None,
               prepared: PreparedStrategy | None = None, node_time: NodeTime | None = None,
               partition_of: Callable[[int], int | None] | None = None) -> str:
    """Run ``cfg.strategy`` for ``cfg.rounds`` rounds over ``grid``; return the final status.

    ``sim_time(round, traffic)``, given by a simulation engine, returns the simulated time
    the round would take on the nodes' device classes (the time model). The run is
    checkpointed after every ``cfg.checkpoint_every``-th round (:mod:`fedswarm.server.checkpoint`); ``resume``, a
    checkpoint of this run, continues it after the checkpoint's round (:mod:`.resume`). ``prepared``: the
    strategy the engine's config check built for this run (:func:`strategy_for`), used instead of a second build.
    ``node_time`` and ``partition_of``, from a simulation engine: a node's simulated seconds of a round and its
    partition id, for quorum rounds on simulated time and ``--availability`` (:mod:`fedswarm.server.fleet_grid`)."""
    random.seed(cfg.seed)  # Flower's node sampling uses the random module
    torch.manual_seed(cfg.seed)
    task = get_task(cfg.task)
    device = resolve_device(cfg.device)
    model = task.model(cfg.seed).to(device)
    layout = ParamLayout.from_module(model)
    evaluate = None
    if cfg.central_eval:  # off: no server test set, the task's data is not loaded
        data = task_data(cfg)

        def evaluate(arrays: ArrayRecord) -> tuple[float, float]:
            flat = arrayrecord_to_vector(arrays, layout.d)
            return evaluate_flat(task, model, flat, data.test_x, data.test_y, device)

    strategy = strategy_for(cfg, layout, prepared)
    if callable(getattr(strategy, "use_virtual_clock", None)):  # asynchronous: simulated nodes run on its clock
        strategy.use_virtual_clock(node_kind == "sim")
    engine_state = grid if callable(getattr(grid, "state_dict", None)) else None  # clients' state, if it has it
    nodes_grid = grid  # the nodes themselves, for the resume query (no attack, no meter)
    if callable(getattr(strategy, "use_nodes_grid", None)):  # FedBuff: its eligibility probe goes through them
        strategy.use_nodes_grid(nodes_grid)
    byzantine = None
    if cfg.byzantine:
        from fedswarm.server.byzantine import ByzantineGrid

        # Attacks rewrite the chosen nodes' replies under the meter, so the bytes counted
        # are the ones the attackers send; the strategy is never told who they are.
        grid = ByzantineGrid(grid, cfg.attack, cfg.byzantine, seed=cfg.seed,
                             layout=layout, on_attack=lambda nodes, spec: recorder.note(
                                 byzantine_nodes=[str(n) for n in nodes], attack=spec))
        byzantine = grid
    policies = PolicyBook(cfg.policies)
    fleet = fleet_grid_for(cfg, grid, strategy, policies=policies, probe_grid=nodes_grid, node_time=node_time,
                           partition_of=partition_of)
    if fleet is not None:  # quorum, over-selection, eligibility, availability: under the meter
        grid = fleet
        sim_time = fleet.timed(sim_time)
    metered = MeteredGrid(grid)
    arrays = vector_to_arrayrecord(get_flat(model))
    # Policies travel as policy.<class> keys (current, per round), not as the initial table.
    train_config = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    if engine_state is None:  # nodes whose state lives with them: they save it under this run's id
        train_config[RUN_KEY] = run_id
    policies.write(train_config)
    observers = [example_level_privacy(cfg)] if cfg.dp_sgd else []
    recorder = RoundRecorder(store, run_id, metered, evaluate, listeners=listeners, sim_time=sim_time,
                             policies=policies, train_config=train_config, node_kind=node_kind,
                             observers=observers)
    if fleet is not None:
        fleet.on_rows = recorder.node_rows
        recorder.listeners.append(fleet.end_round)
    recorder.checkpoint = ServerCheckpointer(
        store, run_id, strategy, cfg.strategy, policies, byzantine=byzantine,
        grid_state=engine_state.state_dict if engine_state is not None else None).save
    recorder.checkpoint_at_round_end = bool(getattr(strategy, "checkpoint_at_round_end", False))
    recorder.checkpoint_every = cfg.checkpoint_every
    recorder.min_train_nodes = getattr(strategy, "min_train_nodes", None)
    timeout = float(cfg.round_timeout)
    strategy_grid = metered
    if cfg.secagg:  # every stage's messages cross the meter; the strategy sees one aggregated reply a round
        from fedswarm.server.secagg import SecAggGrid, secagg_params

        from fedswarm.server.secagg_dp import SecAggDP

        strategy_grid = SecAggGrid(metered, secagg_params(cfg), dropout=cfg.secagg_dropout, seed=cfg.seed,
                                   on_round=recorder.note, dp=SecAggDP(cfg.dp, cfg.seed) if cfg.dp else None,
                                   dim_of=lambda: getattr(strategy, "secagg_dim", None), loss=not cfg.dp)
    recorder.fed_eval = GridEvaluator(nodes_grid, train_config, timeout=timeout,
                                      own_model=registry.get(cfg.strategy).kind != "federated")
    recorder.eval_every = cfg.eval_every
    rounds = cfg.rounds
    if resume is not None:
        def restore() -> tuple[str, list[str]]:
            recorder.resume_asked, recorder.resume_round = set(), resume.round  # later nodes get named
            return restore_clients(nodes_grid, strategy, store=store, run_id=run_id, checkpoint_round=resume.round,
                                   num_nodes=cfg.clients, timeout=timeout, asked=recorder.resume_asked)

        arrays, rounds = resume_into(resume, store=store, run_id=run_id, strategy=strategy, recorder=recorder,
                                     policies=policies, train_config=train_config, engine=engine_state,
                                     byzantine=byzantine, restore_clients=restore)
        if fleet is not None:  # the fleet's round and simulated clock go on from the checkpoint's
            fleet.resume_at(resume.round, [r.sim_time_s for r in store.rounds(run_id) if 0 < r.round <= resume.round])

    def loop() -> None:
        nonlocal arrays, rounds
        while rounds > 0:
            shift_rounds(strategy, recorder.offset)  # clients are told the run's round, not start()'s
            recorder.reset_clock()
            recorder.final_round = recorder.offset + rounds
            result = strategy.start(strategy_grid, arrays, num_rounds=rounds, timeout=timeout,
                                    train_config=train_config, evaluate_fn=recorder)
            arrays = result.arrays if result.arrays is not None else arrays
            recorder.offset = recorder.last_round
            rounds, recorder.extra_rounds = recorder.extra_rounds, 0

    return run_recorded(store, run_id, loop)


def build_strategy(cfg: RunConfig, layout: ParamLayout):
    """The run's strategy with its hyperparameters, ``--dp`` attached, and the checks a
    bad combination fails (tolerance bounds, privacy budget, unsupported pairs) raised as
    one-line errors."""
    entry = registry.get(cfg.strategy)
    if cfg.byzantine and not entry.byzantine:
        raise ConfigError(f"--byzantine applies to federated strategies; '{cfg.strategy}' is {entry.kind}")
    if cfg.dp and entry.kind != "federated":
        raise ConfigError(f"--dp applies to federated strategies; '{cfg.strategy}' is {entry.kind}")
    # Under --secagg, --dp is distributed DP on the nodes: each clips the vector it masks (for a sketch
    # strategy, its table) and adds its noise share, so any strategy secure aggregation serves takes it.
    if cfg.dp and not entry.dp and not (cfg.secagg and entry.secagg):
        able = ", ".join(e.name for e in registry.entries(registered=True) if e.dp)
        raise ConfigError(f"strategy '{cfg.strategy}' does not support --dp: its aggregate is not an average of "
                          f"per-client vectors, so one client's influence is not bounded by the clip norm "
                          f"(use {able})")
    if cfg.dp:
        require_accounting("--dp")
    if cfg.secagg:
        from fedswarm.server.secagg import check_secagg

        check_secagg(cfg, entry)
    params = registry.resolve_params(cfg.strategy, cfg.params)
    if cfg.secagg:
        from fedswarm.strategies.secagg_compat import check_linear_codecs

        check_linear_codecs(cfg, params)
    strategy = entry.build(params, registry.BuildContext(cfg, layout))
    strategy = strategy if cfg.secagg else attach_dp(strategy, cfg)  # under --secagg the nodes add the noise
    check_fleet(cfg, entry.kind, strategy)
    return strategy


def _rng_state() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_rng(a: tuple, b: tuple) -> bool:
    return (torch.equal(a[0], b[0]) and a[1] == b[1] and a[2][0] == b[2][0] and np.array_equal(a[2][1], b[2][1])
            and a[2][2:] == b[2][2:])


def _set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


@dataclass
class PreparedStrategy:
    """A run's strategy built once, by the engine's config check (:func:`prepare_strategy`), for
    the run to use (:func:`strategy_for`): one model init for its layout, one DP calibration, one
    build per run instead of one in the check and one in the run. The global random states before
    and after the build let the run take it only where that changes no number: the build drew
    nothing from them, or the run is where the build would be, in the same state."""

    cfg: RunConfig
    layout: ParamLayout
    strategy: Any
    rng_before: tuple = field(repr=False)
    rng_after: tuple = field(repr=False)
    used: bool = False


def prepare_strategy(cfg: RunConfig) -> PreparedStrategy:
    """Build ``cfg``'s strategy as :func:`run_server` would (the seeds, the model's layout), with
    every check a bad combination fails (:func:`build_strategy`), for the run to take."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    layout = ParamLayout.from_module(get_task(cfg.task).model(cfg.seed))
    before = _rng_state()
    strategy = build_strategy(cfg, layout)
    return PreparedStrategy(cfg, layout, strategy, before, _rng_state())


def strategy_for(cfg: RunConfig, layout: ParamLayout, prepared: PreparedStrategy | None = None):
    """The run's strategy: ``prepared`` where it was built for this config and layout and taking
    it changes nothing (its build drew no random numbers, or the random states now are those it
    was built from: they then move on as the build moved them), once; else a new build."""
    if (prepared is not None and not prepared.used and prepared.cfg == cfg and prepared.layout.specs == layout.specs):
        drew_nothing = _same_rng(prepared.rng_before, prepared.rng_after)
        if drew_nothing or _same_rng(_rng_state(), prepared.rng_before):
            if not drew_nothing:
                _set_rng(prepared.rng_after)  # as if built here
            prepared.used = True  # a strategy holds the run's state: one run takes it
            return prepared.strategy
    return build_strategy(cfg, layout)


def require_accounting(option: str) -> None:
    """Privacy accounting is server-side (the ``server`` extra): say so in one line."""
    from fedswarm.extras import MissingExtra, require

    try:
        require("server", f"{option} (privacy accounting)")
    except MissingExtra as exc:
        raise ConfigError(str(exc)) from None


def example_level_privacy(cfg: RunConfig):
    """An observer of each round's replies that accounts every client's DP-SGD steps and
    returns the round's ``epsilon_example`` (the worst client's ε at the spec's delta)."""
    from fedswarm.algorithms.privacy.accountant import PrivacyAccountant

    require_accounting("--dp-sgd")
    spec = cfg.dp_sgd
    accountants: dict[int, PrivacyAccountant] = {}

    def observe(traffic) -> dict:
        for msg in traffic.replies:
            if msg.has_error() or not msg.has_content():
                continue
            metrics = next(iter(msg.content.metric_records.values()), None)
            if metrics is None or "dp_sample_rate" not in metrics:
                continue
            acc = accountants.setdefault(msg.metadata.src_node_id, PrivacyAccountant(spec.delta))
            acc.step(float(metrics["dp_sample_rate"]), spec.noise_multiplier, int(metrics.get("steps", 0)))
        if not accountants:
            return {}
        eps = max(a.epsilon() for a in accountants.values())
        if spec.target_epsilon is not None and eps > spec.target_epsilon:
            raise PrivacyBudgetExceeded(f"example-level epsilon {eps:.3f} passed target_epsilon="
                                        f"{spec.target_epsilon:g} (delta={spec.delta:g})")
        return {"epsilon_example": eps, "delta_example": spec.delta}

    return observe


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    resuming = str(run_config.pop(RESUME_KEY, "")).lower() in ("1", "true", "yes")
    accept_loss = str(run_config.pop(ACCEPT_LOSS_KEY, "")).lower() in ("1", "true", "yes")
    cfg, db, run_id = split_run_config(run_config)
    store = Store(db)
    checkpoint = None
    if resuming:  # `fedswarm resume RUN_ID --federation NAME`: the run's own config, from its checkpoint on
        from fedswarm.server.resume import prepare_resume

        if run_id is None:
            raise ConfigError(f"'{RESUME_KEY}' needs the 'run-id' of the run to resume")
        cfg, checkpoint = prepare_resume(store, run_id, accept_client_state_loss=accept_loss)
    elif run_id is None or store.get_run(run_id) is None:
        run_id = store.create_run(cfg.model_dump(), run_id=run_id)
    # Started by a SuperLink (`flwr run`), not by a fedswarm simulation engine; its process is
    # this ServerApp's (what the dashboard watches, and stops), recorded again when the rounds start.
    store.update_run(run_id, engine="deployment", **owner_fields())
    run_server(PromptGrid(grid), cfg, store=store, run_id=run_id, node_kind="supernode", resume=checkpoint)
