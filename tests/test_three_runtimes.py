"""One algorithm layer under three runtimes: the array engine (``[n, d]``), the Flower
router (fedswarm's ServerApp on the in-process engine, real ClientApp nodes) and the swarm
(real peers over loopback sockets, one thread each) give the same node models after 3
rounds from the same seed, for every decentralized algorithm each runtime runs.

What is not compared here, and why:

* ``lsgd`` has no router form (it needs every worker's loss each pull): array engine vs
  swarm only (multi-leader and asynchronous), and the router must refuse it with a clear
  error.
* ``adpsgd`` and ``prague`` are asynchronous: they are compared under their fixed schedule
  (``schedule="fixed"``, ``fedswarm.algorithms.decentralized.schedule``): the same seeded
  pairs/groups per iteration and gradients up to ``max_staleness`` iterations stale, which
  each runtime replays with its own machinery (array engine: the schedule's W; router:
  the schedule as the round's graph, staleness in the node's config; swarm: the
  ScheduledDriver). Timed by a clock (virtual or message timing) their runs differ by
  design and are not compared.
"""

from __future__ import annotations

import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.server.app import run_server
from fedswarm.sim.array_engine import ArraySimulation
from fedswarm.sim.inprocess import InProcessGrid
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.strategies.decentralized.node import load_state
from fedswarm.swarm.net.identity import create_or_load
from fedswarm.swarm.peer import Peer, PeerConfig
from fedswarm.train import trainer_for

from tests.swarm_helpers import run_all

pytestmark = pytest.mark.integration
torch.set_num_threads(1)

N, ROUNDS, SEED, LR, BATCH, TASK = 5, 3, 3, 0.1, 8, "digits-mlp"

CASES = {
    "dpsgd": ("ring", {}),
    "d2": ("ring", {}),
    "dsgdm": ("ring", {"nesterov": True}),
    "qgm": ("ring", {}),
    "squarm": ("ring", {"codec": "topk", "ratio": 0.1, "period": 2, "threshold": 0.0}),
    "easgd": ("complete", {"period": 2}),
    "dasgd": ("ring", {"period": 2, "delay": 1}),
    "lsgd": ("complete", {"mode": "multi", "groups": 2, "tau_local": 1, "tau_global": 2}),
    # ring of 5 is not bipartite: each edge's lower end initiates (exchange_roles)
    "adpsgd": ("ring", {"schedule": "fixed", "max_staleness": 2}),
    "prague": ("ring", {"schedule": "fixed", "group_size": 2, "max_staleness": 1}),
}


def _cfg(strategy: str) -> RunConfig:
    topology, params = CASES[strategy]
    return RunConfig(strategy=strategy, task=TASK, clients=N, rounds=ROUNDS, lr=LR, batch_size=BATCH, seed=SEED,
                     local_steps=1, topology=topology, params=params)


def _array(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Node models after ``cfg.rounds`` iterations, and the initial model."""
    sim = ArraySimulation(cfg)
    for _ in range(cfg.rounds):
        sim.step()
    return sim.state.x, sim.x0


def _router(cfg: RunConfig, tmp_path) -> torch.Tensor:
    from fedswarm.client.app import app as client_app

    store = Store(tmp_path / "router.db")
    run_id = store.create_run(cfg.model_dump())
    grid = InProcessGrid(client_app, cfg.clients, run_config=cfg.to_flat())
    assert run_server(grid, cfg, store=store, run_id=run_id) == "finished"
    d = trainer_for(cfg, 0, cfg.clients).layout.d
    rows = {int(ctx.node_config["partition-id"]): load_state(ctx, cfg.strategy, d).x[0]
            for ctx in grid.contexts.values()}
    return torch.stack([rows[i] for i in range(cfg.clients)])


def _swarm(cfg: RunConfig, tmp_path) -> torch.Tensor:
    """Peers whose sorted ids follow their partition ids, so node i of the swarm's
    topology (sorted members) trains on partition i, as on the other runtimes."""
    idents = sorted((create_or_load(tmp_path / f"k{i}") for i in range(cfg.clients)), key=lambda k: k.peer_id)
    allow = tmp_path / "allow.txt"
    allow.write_text("\n".join(k.peer_id for k in idents) + "\n")
    peers, first = [], None
    for i, ident in enumerate(idents):
        pc = PeerConfig(join=[first] if first else [], algorithm=cfg.strategy, params=dict(cfg.params), task=cfg.task,
                        partition=cfg.partition, partition_id=i, num_partitions=cfg.clients, seed=cfg.seed,
                        rounds=cfg.rounds, local_steps=1, batch_size=cfg.batch_size, lr=cfg.lr,
                        topology=cfg.topology, allow=str(allow), state_dir=str(tmp_path / f"p{i}"),
                        min_peers=cfg.clients, heartbeat_s=0.1, round_timeout_s=30.0, linger_s=1.0,
                        suspect_after=100, remove_after=200)  # a loaded machine's late heartbeats: no churn
        p = Peer(pc, identity=ident)
        first = first or p.transport.address
        peers.append(p)
    out = run_all(peers, timeout=180)
    assert [o["rounds_done"] for o in out] == [cfg.rounds] * cfg.clients
    assert all(not o["dropped"] or set(o["dropped"]) <= {"closed"} for o in out), [o["dropped"] for o in out]
    return torch.stack([p.driver.model() for p in peers])


@pytest.mark.parametrize("strategy", [s for s in CASES if s != "lsgd"])
def test_array_router_and_swarm_agree(tmp_path, strategy):
    cfg = _cfg(strategy)
    X_array, x0 = _array(cfg)
    X_router = _router(cfg, tmp_path)
    X_swarm = _swarm(cfg, tmp_path)
    assert (X_array - x0).abs().max() > 1e-3  # they trained: equal models are not equal initial models
    assert (X_array - X_array.mean(0)).abs().max() > 1e-6  # and the nodes differ: each row is checked
    torch.testing.assert_close(X_router, X_array, atol=2e-5, rtol=0)
    torch.testing.assert_close(X_swarm, X_array, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", ["multi", "async"])
def test_lsgd_array_and_swarm_agree_and_the_router_refuses_it(tmp_path, mode):
    cfg = _cfg("lsgd")
    params = {**cfg.params, "mode": mode} if mode == "multi" else {"mode": "async", "groups": 2, "tau_local": 2,
                                                                   "tau_global": 3}
    cfg = cfg.model_copy(update={"params": params})
    X_array, _ = _array(cfg)
    X_swarm = _swarm(cfg, tmp_path)
    assert (X_array - X_array.mean(0)).abs().max() > 1e-6
    torch.testing.assert_close(X_swarm, X_array, atol=2e-5, rtol=0)
    with pytest.raises(ConfigError, match="array engine"):
        registry.get("lsgd").build(registry.resolve_params("lsgd", cfg.params), registry.BuildContext(cfg, None))


def test_the_fixed_schedules_are_nontrivial():
    """The asynchronous cases above exercise what they claim: several different pairings
    and groupings over the 3 rounds, some nodes sitting out, and stale gradients."""
    from fedswarm.algorithms.decentralized import make_algorithm, make_schedule
    from fedswarm.algorithms.decentralized.topology import make_topology

    for name in ("adpsgd", "prague"):
        topology, params = CASES[name]
        sched = make_schedule(make_algorithm(name, **params), make_topology(topology, N), SEED)
        ticks = [sched.groups(t) for t in range(1, ROUNDS + 1)]
        assert len({tuple(g) for g in ticks}) > 1, ticks
        assert all(ticks) and any(sum(map(len, g)) < N for g in ticks), ticks  # someone sits out
        assert any(sched.staleness(i, t) > 0 for t in range(2, ROUNDS + 1) for i in range(N))
        assert all(sched.staleness(i, 1) == 0 for i in range(N))
