"""The Flower engine: fedswarm's ServerApp and ClientApp on Flower's Simulation Engine (Ray).

For many cores, GPUs and clusters. Each virtual SuperNode runs fedswarm's ClientApp in a
Ray actor; the ServerApp runs in a thread of this process and records into the store,
exactly as on the in-process engine. Same seed and config give the same model on both.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.server.app import PreparedStrategy, run_server
from fedswarm.server.checkpoint import ServerCheckpoint
from fedswarm.server.recorder import RoundListener
from fedswarm.sim.simtime import make_node_timer, make_round_timer

__all__ = ["run_flower", "check_ray_address", "start_ray"]


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the address, when nothing listens at a ``HOST:PORT`` Ray address
    (Ray itself would retry for minutes). ``auto`` and ``ray://`` addresses go to Ray as is."""
    import socket

    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--ray-address '{address}': expected HOST:PORT (the head's GCS port, 6379 by default), "
                         "'auto' or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address} ({exc}); start one with "
                              f"'ray start --head --port {port}'") from None


#: Ray's own wait for a starting node to register is fixed at 30 s (ray/_private/node.py);
#: on an overloaded machine the raylet can take longer, and Ray then gives up with this message.
RAY_STARTUP_TIMEOUT = "timed out during startup"


def start_ray(init_args: dict, attempts: int = 3, log: Callable[[str], None] | None = None) -> None:
    """Start (or attach to) Ray before Flower's backend does, so that a node start that ran
    past Ray's fixed 30 s registration wait is retried instead of ending the run.

    Flower's Ray backend calls ``ray.init`` only when Ray is not initialised yet; this does
    it the same way (``init_args``, and the driver's ``sys.path`` as the workers'
    ``PYTHONPATH``, as Flower does) and retries up to ``attempts`` times on that one error.
    Any other error is raised at once."""
    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    say = log or (lambda m: logging.getLogger(__name__).warning(m))
    for attempt in range(1, attempts + 1):
        try:
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            _stop_ray()
            if RAY_STARTUP_TIMEOUT not in str(exc) or attempt == attempts:
                raise
            say(f"Ray's node did not register within Ray's 30 s (a loaded machine?); starting it again "
                f"({attempt + 1} of {attempts})")


def _stop_ray() -> None:
    try:
        import ray
    except ImportError:  # pragma: no cover
        return
    if ray.is_initialized():
        ray.shutdown()


def run_flower(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None,
               num_cpus_per_client: float = 1.0, num_gpus_per_client: float = 0.0,
               resume: ServerCheckpoint | None = None, prepared: PreparedStrategy | None = None) -> str:
    """Run one simulation on Flower's Simulation Engine; returns the final run status.
    ``prepared``: the strategy the config check built (the ServerApp runs in this process).

    With ``cfg.ray_address`` the engine attaches to that running Ray cluster (``ray start
    --head`` on one machine, ``ray start --address HEAD`` on the others) instead of starting
    a private one, so the virtual SuperNodes' actors spread over every machine that joined.
    ``resume``: continue the run from this checkpoint (the Ray nodes start empty and restore
    their state from this machine's disk, ``$FEDSWARM_STATE_DIR`` or the per-user data folder;
    on a Ray cluster the strategy resynchronises them)."""
    try:
        from flwr.simulation import run_simulation
    except ImportError as exc:  # pragma: no cover
        raise RuntimeError("--engine flower needs Flower's simulation extra: pip install 'fedswarm[sim]'") from exc
    from fedswarm.client.app import app as client_app
    from fedswarm.client.state_store import STATE_DIR_ENV, default_state_dir

    sim_time = make_round_timer(cfg)  # simulated seconds per round, None without --devices
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        run_server(grid, cfg, store=store, run_id=run_id, listeners=listeners, sim_time=sim_time, resume=resume,
                   prepared=prepared, node_time=make_node_timer(cfg))

    init_args: dict = {"log_to_driver": False, "include_dashboard": False}
    if cfg.ray_address:  # attach to a running cluster: its resources are what the cluster has
        check_ray_address(cfg.ray_address)
        init_args["address"] = cfg.ray_address
    else:
        init_args["num_cpus"] = os.cpu_count() or 1
    backend_config = {
        "client_resources": {"num_cpus": num_cpus_per_client, "num_gpus": num_gpus_per_client},
        "init_args": init_args,
    }
    # One intra-op thread per actor (Ray workers inherit this environment): the actors
    # already use every core between them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # The virtual nodes keep their own state (residuals, replicas, gossip models) on this
    # machine's disk, keyed by the run, so a resumed run finds it (fedswarm.client.persist);
    # the Ray workers read the folder from their environment, inherited from this process.
    own_state_dir = not cfg.ray_address and STATE_DIR_ENV not in os.environ
    if own_state_dir:
        os.environ[STATE_DIR_ENV] = str(default_state_dir())
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)
    try:
        start_ray(init_args)
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.clients,
                       backend_config=backend_config)
    except Exception as exc:
        run = store.get_run(run_id)
        where = f" (Ray cluster at {cfg.ray_address})" if cfg.ray_address else ""
        if run is not None and run.status in ("pending", "running", "paused"):
            store.set_status(run_id, "failed", error=f"Flower's Simulation Engine failed{where}: {exc}")
        raise
    finally:
        flwr_logger.setLevel(level)
        _stop_ray()
        if own_state_dir:
            os.environ.pop(STATE_DIR_ENV, None)
    run = store.get_run(run_id)
    status = run.status if run is not None else "failed"
    if status == "running":  # the ServerApp thread died without recording why
        store.set_status(run_id, "failed", error="the ServerApp stopped without finishing (see the log above)")
        status = "failed"
    return status
