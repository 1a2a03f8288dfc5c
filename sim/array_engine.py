"""The ``array`` engine: every node of a decentralized algorithm as one row of ``[n, d]``.

No Flower messages, no per-node contexts: each iteration computes every node's gradient
(the same :func:`~fedswarm.algorithms.decentralized.steps.local_gradient` and seeds as the
router's nodes and the swarm's peers), then calls the algorithm object once for all nodes
(``local_step``, ``mix``: a gossip step is one matrix product). It runs every synchronous
algorithm of :data:`fedswarm.algorithms.decentralized.ALGORITHMS` (dpsgd, d2, dsgdm, qgm,
squarm, easgd, dasgd), LSGD in its three modes, which the router cannot (it needs
every worker's loss), and AD-PSGD and Prague under a fixed schedule
(``--set schedule=fixed``, :mod:`fedswarm.algorithms.decentralized.schedule`: seeded
pairs/groups per iteration, gradients up to ``max_staleness`` iterations stale; the
schedule takes the topology's place). Timed by a clock, they run on the virtual-clock
engine.

Recording is the other engines': one round per iteration, the node-average model's test
accuracy, ``consensus_distance``, per-node rows. Federated evaluation (every ``eval_every``-th
iteration) gives the router's numbers: every node scores its own model, its row of
``[n, d]``, on its validation split (:func:`~fedswarm.sim.async_clock.own_models_eval`);
with ``central_eval`` off the task's test set is not loaded. With ``client_data`` node ``i``
trains on the train split of the ``i``-th client's own dataset
(:func:`~fedswarm.train.trainer_for`). Bytes: each node's message is its
algorithm's :class:`~fedswarm.payload.Payload`, measured serialized as Flower records
(as the router would carry it), times its degree in that round's topology;
``bytes_up = bytes_down = p2p_bytes``. LSGD has no per-neighbour message: its bytes are
the object's own wire accounting (``meta["wire_bytes"]``, noted as such).

    fedswarm sim --engine array --strategy dpsgd --clients 64
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.algorithms.decentralized import (ALGORITHMS, DecentralizedAlgorithm, consensus_distance, make_algorithm,
                                              make_schedule, uses_fixed_schedule)
from fedswarm.algorithms.decentralized.topology import make_topology
from fedswarm.params import get_flat
from fedswarm.payload import Payload
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.recorder import RoundListener, RoundRecorder, run_recorded
from fedswarm.sim.async_clock import _P2PGrid, own_models_eval
from fedswarm.store import Store
from fedswarm.config import round_seed
from fedswarm.algorithms.decentralized.steps import local_gradient
from fedswarm.tasks import get_task
from fedswarm.train import evaluate_flat, resolve_device, task_data, trainer_for
from fedswarm.wire import arrayrecord_to_vector, payload_to_records, recorddict_nbytes, vector_to_arrayrecord

__all__ = ["ARRAY_KINDS", "array_algorithms", "ArraySimulation", "check_config", "payload_nbytes", "run_array"]

#: The strategy kinds the array engine runs (those of kind ``async``, AD-PSGD and Prague, with
#: ``schedule="fixed"`` only: timed by a clock they need the virtual-clock engine).
ARRAY_KINDS = ("decentralized", "array", "async")


def array_algorithms() -> list[str]:
    """What the array engine runs: every registered strategy of the :data:`ARRAY_KINDS`."""
    from fedswarm.strategies import registry

    return [e.name for e in registry.entries(registered=True) if e.kind in ARRAY_KINDS]

_SIZES: dict[tuple, int] = {}


def payload_nbytes(payload: Payload) -> int:
    """Serialized size of ``payload`` as Flower records (measured once per distinct shape
    and metadata, then cached: the size depends on nothing else)."""
    key = (tuple((k, str(getattr(a, "dtype", "")), tuple(a.shape)) for k, a in payload.arrays.items()),
           tuple(sorted((k, repr(v)) for k, v in payload.meta.items())))
    if key not in _SIZES:
        _SIZES[key] = recorddict_nbytes(payload_to_records(payload))
    return _SIZES[key]


def _algorithm_params(cfg: RunConfig) -> dict[str, Any]:
    from fedswarm.strategies import registry

    own = {h.name for h in ALGORITHMS[cfg.strategy].hyperparams}  # not the router's report_every
    return {k: v for k, v in registry.resolve_params(cfg.strategy, cfg.params).items() if k in own}


def check_config(cfg: RunConfig) -> None:
    """Raise :class:`~fedswarm.errors.ConfigError` (one line) unless the array engine can
    run ``cfg``: a supported algorithm, valid hyperparameters, a topology it accepts."""
    if cfg.strategy not in (served := array_algorithms()):
        raise ConfigError(f"invalid value for 'engine': the array engine runs {', '.join(served)}, "
                          f"not '{cfg.strategy}'")
    try:
        algo = make_algorithm(cfg.strategy, **_algorithm_params(cfg))
        _check_scheduled(algo)
        if _kind(cfg.strategy) != "array":  # needs every worker's loss, no gossip graph
            algo.check_topology(_graph(algo, cfg))
    except ValueError as exc:
        raise ConfigError(f"invalid value for 'topology' or 'params': {exc}") from None


def _check_scheduled(algo: DecentralizedAlgorithm) -> None:
    if _kind(algo.name) == "async" and not uses_fixed_schedule(algo):
        raise ValueError(f"{algo.name} timed by a clock runs on the virtual-clock engine (fedswarm sim --strategy "
                         f"{algo.name}); the array engine replays a fixed schedule: --set schedule=fixed")


def _kind(name: str) -> str:
    from fedswarm.strategies import registry

    return registry.get(name).kind


def _graph(algo: DecentralizedAlgorithm, cfg: RunConfig):
    """The run's topology, or the fixed schedule drawn over it (AD-PSGD, Prague)."""
    topo = make_topology(cfg.topology, cfg.clients, cfg.seed)
    return make_schedule(algo, topo, cfg.seed) if uses_fixed_schedule(algo) else topo


class ArraySimulation:
    """``n`` nodes of ``cfg.strategy`` on ``[n, d]``; :meth:`step` runs one iteration.

    Node ``i`` trains on partition ``i`` and is node ``i`` of ``cfg.topology``; every node
    starts from the task's seeded model. Hyperparameters are ``cfg.params`` (resolved
    against the catalog)."""

    def __init__(self, cfg: RunConfig, algorithm: DecentralizedAlgorithm | None = None):
        if cfg.strategy not in (served := array_algorithms()):
            raise ValueError(f"the array engine runs {', '.join(served)}, not '{cfg.strategy}'"
                             + (" (asynchronous: it runs on the virtual-clock engine)"
                                if cfg.strategy in ALGORITHMS else ""))
        self.cfg, n = cfg, cfg.clients
        self.n = n
        self.algo = algorithm or make_algorithm(cfg.strategy, **_algorithm_params(cfg))
        _check_scheduled(self.algo)
        self.topology = _graph(self.algo, cfg)
        self.uses_losses = _kind(cfg.strategy) == "array"
        if not self.uses_losses:
            self.algo.check_topology(self.topology)
        self.task = get_task(cfg.task)
        self.device = resolve_device(cfg.device)
        self.model = self.task.model(cfg.seed).to(self.device)
        self.x0 = get_flat(self.model).detach().cpu()
        self.trainers = [trainer_for(cfg, i, n) for i in range(n)]
        self.state = self.algo.init_state(self.x0.repeat(n, 1))
        self.steps = cfg.local_steps or 1
        self.t = 0  # iterations done

    def gradients(self, t: int) -> tuple[torch.Tensor, list[float]]:
        """Every node's gradient ``[n, d]`` for iteration ``t`` (1-based), at its current
        model (a fixed schedule's stale one: ``algo.gradient_point``)."""
        c, st, topo = self.cfg, self.state, self.topology
        points = [st.x[i] if self.uses_losses else self.algo.gradient_point(st, i, topo.staleness(i, t))
                  for i in range(self.n)]
        pairs = [local_gradient(self.trainers[i], points[i], steps=self.steps, batch_size=c.batch_size,
                                lr=c.lr, seed=round_seed(c.seed, t, i)) for i in range(self.n)]
        return torch.stack([g for g, _ in pairs]), [loss for _, loss in pairs]

    def step(self) -> dict[str, Any]:
        """One iteration on every node; returns its losses and per-node bytes sent."""
        self.t += 1
        t, st, algo = self.t, self.state, self.algo
        grads, losses = self.gradients(t)
        if self.uses_losses:
            before = float(st.meta.get("wire_bytes", 0.0))
            algo.local_step(st, grads, self.cfg.lr, losses=losses)
            algo.mix(st)
            total = float(st.meta.get("wire_bytes", 0.0)) - before
            sent = [total / self.n] * self.n  # the object's accounting, spread evenly
        else:
            algo.local_step(st, grads, self.cfg.lr)
            W = self.topology.mixing_matrix(t)
            deg = self.topology.degrees(t)
            sent = [payload_nbytes(algo.payload(st, i)) * int(deg[i]) for i in range(self.n)]
            algo.mix(st, algo.message(st), W)
        return {"losses": losses, "sent": sent}

    def average(self) -> torch.Tensor:
        return self.state.x.mean(dim=0)


def run_array(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` on the array engine, recording ``cfg.rounds`` iterations into ``run_id``;
    return the final status."""
    torch.manual_seed(cfg.seed)
    sim = ArraySimulation(cfg)
    evaluate = None
    if cfg.central_eval:  # off: no server test set, the task's data is not loaded
        data = task_data(cfg)

        def evaluate(arrays: ArrayRecord) -> tuple[float, float]:
            return evaluate_flat(sim.task, sim.model, arrayrecord_to_vector(arrays), data.test_x, data.test_y,
                                 sim.device)

    grid = _P2PGrid()  # what the recorder reads: the bytes the messages would move
    recorder = RoundRecorder(store, run_id, grid, evaluate, listeners=listeners)  # type: ignore[arg-type]
    recorder.eval_every = cfg.eval_every
    fed_eval = own_models_eval(cfg, lambda: sim.state.x)
    nodes = list(range(1, sim.n + 1))  # node i + 1 is row i, as on the in-process engine
    samples = sim.steps * cfg.batch_size

    def loop() -> None:
        recorder.note(consensus_distance=None)
        recorder(0, vector_to_arrayrecord(sim.x0))
        rnd, total = 0, cfg.rounds
        while rnd < total:
            rnd += 1
            recorder.reset_clock()
            out = sim.step()
            sent = out["sent"]
            grid.pending = Traffic(bytes_up=int(sum(sent)), bytes_down=int(sum(sent)))
            rows = [{"node_id": str(i + 1), "bytes_up": int(sent[i]), "num_examples": samples,
                     "train_loss": out["losses"][i]} for i in range(sim.n)]
            fed = recorder.federated(rnd, None, nodes, rows, fed_eval) if recorder.eval_due(rnd) else {}
            recorder.node_rows(rows)
            recorder.note(train_loss=sum(out["losses"]) / sim.n, consensus_distance=consensus_distance(sim.state.x),
                          p2p_bytes=int(sum(sent)), num_clients=sim.n, nodes_reporting=sim.n,
                          bytes_source="wire_accounting" if sim.uses_losses else "serialized_payloads", **fed)
            recorder(rnd, vector_to_arrayrecord(sim.average()))
            total, recorder.extra_rounds = total + recorder.extra_rounds, 0

    return run_recorded(store, run_id, loop)


