"""Continuing a run from its last checkpoint, in the same run id and the same store.

``fedswarm resume RUN_ID [--db URL]`` (and the dashboard's Resume button, which calls
exactly that) reads the run's config and newest checkpoint from the store and starts the run
again on its engine: the in-process engine and Flower's simulation engine in this process;
a deployment (``engine = deployment``) through ``flwr run`` on the SuperLink named with
``--federation``, whose ServerApp gets ``resume=true`` in its run config.

What a resumed run does, wherever it runs (:func:`resume_into`):

1. the rounds recorded after the checkpoint's round (rounds between checkpoints with
   ``--checkpoint-every K``, a round that finished after the last checkpoint was written, or
   was half written) are deleted, with their per-node rows and rejections, so every round
   ends up recorded exactly once;
2. the strategy, the policies in force, the attack of a ``--byzantine`` run and the random
   states are put back as they were after that round;
3. the clients: an engine that checkpointed their state (the in-process engine) gets it
   back with the server's. Otherwise (a new Flower run on the SuperLink, a new Ray
   simulation) the nodes start empty, and the server first asks every node to restore its
   state of the checkpoint's round from its own disk, where fedswarm's ClientApp saved it
   after each round (``fedswarm client --state-dir``, :mod:`fedswarm.server.client_state`); a
   node that has no such state is resynchronised by the strategy's protocol (the full model
   and a zero residual; a decentralized node restarts from the checkpointed model) and named
   in a ``client_resync`` event, never trusted to still hold what it lost. Where the nodes
   cannot keep their state on disk (Flower's engine on a Ray cluster of other machines)
   every node is resynchronised: such a resume is NOT exact (:func:`client_state_lost` says
   what is lost), and :func:`prepare_resume` refuses it unless the caller accepts the loss
   (``fedswarm resume --accept-client-state-loss``); the ``resumed`` event says it;
4. rounds go on from the checkpoint's round + 1 to the run's total (``add_rounds`` included),
   with the clients told the run's round numbers, so a deterministic run ends with the
   model the uninterrupted run would have had.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from fedswarm.config import RunConfig
from fedswarm.store.liveness import owner_gone
from fedswarm.store import Store
from fedswarm.errors import CheckpointError
from fedswarm.server.checkpoint import ServerCheckpoint, load_latest
from fedswarm.strategies.resumable import load_strategy_state, resync_clients, set_rng_state

__all__ = ["ACCEPT_LOSS_KEY", "RESUME_KEY", "client_state_lost", "nodes_keep_state", "prepare_resume",
           "resume_into"]

log = logging.getLogger("fedswarm.server")

#: The run-config key that tells fedswarm's ServerApp to resume ``run-id`` (deployment).
RESUME_KEY = "resume"
#: The run-config key with which a deployment resume accepts losing the clients' own state.
ACCEPT_LOSS_KEY = "accept-client-state-loss"

#: What a node keeps in its ``Context.state`` between rounds, per strategy family (by the
#: class that defines ``resync_clients``), and what resynchronisation does instead.
_CLIENT_STATE = {
    "CompressedStrategy": ("each node's error-feedback residual (when the strategy keeps one) and its compressed "
                           "replica / sketch state", "nodes restart with zero residuals and receive the full model "
                           "once"),
    "DecentralizedStrategy": ("each node's own model and algorithm memory (momentum, trackers, buffers)",
                              "every node restarts from the resumed average model"),
}


def nodes_keep_state(engine: str | None, cfg: RunConfig | None) -> bool:
    """True for the engines whose nodes keep their own state on their own disk between
    runs (fedswarm's ClientApp saves it there): a deployment (``fedswarm client``; its
    ``--state-dir``), and Flower's simulation engine on this machine (its Ray actors write
    under ``$FEDSWARM_STATE_DIR``). Not Flower's engine on a Ray cluster (``ray_address``):
    the actors of a partition may run on another machine after the resume."""
    if engine == "deployment":
        return True
    return engine == "flower" and not (cfg is not None and cfg.ray_address)


def client_state_lost(ck: ServerCheckpoint, kept_on_nodes: bool = False) -> str | None:
    """What the clients' own state is that resuming from ``ck`` cannot give back, or None.

    None when the checkpoint carries the clients' state (the in-process engine saves every
    virtual node's ``Context.state``), when the nodes keep it on their own disk
    (``kept_on_nodes``, see :func:`nodes_keep_state`: the resumed server asks them for it,
    and resynchronises by protocol, naming them, the ones that lack it) or when the strategy
    keeps none (FedAvg and the other stateless ones: a resume is then exact anywhere).
    Otherwise a sentence naming the state lost."""
    if ck.grid is not None or kept_on_nodes:
        return None
    import importlib

    module, _, qualname = str(ck.strategy.get("class", "")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError, ValueError):
        return None  # load_strategy_state names the mismatch when the run is rebuilt
    if not callable(getattr(cls, "resync_clients", None)):
        return None
    owner = next((k for k in cls.__mro__ if "resync_clients" in vars(k)), cls).__name__
    what, instead = _CLIENT_STATE.get(owner, ("the nodes' own state in Context.state", "the strategy resynchronises "
                                                                                           "them"))
    return (f"'{ck.strategy_name}' keeps {what} on the clients, and this engine's nodes keep no state of their own "
            f"to restore it from: {instead}, so the model after the resume will differ from the uninterrupted run's")


def prepare_resume(store: Store, run_id: str, *,
                   accept_client_state_loss: bool = False) -> tuple[RunConfig, ServerCheckpoint]:
    """The run's config and its newest checkpoint; :class:`CheckpointError` saying why a
    run cannot be resumed, including a resume that would lose the clients' own state
    (:func:`client_state_lost`) unless ``accept_client_state_loss``."""
    run = store.get_run(run_id)
    if run is None:
        raise CheckpointError(f"no run '{run_id}' in {store.url}")
    if run.status == "finished":
        raise CheckpointError(f"run '{run_id}' finished: there is nothing to resume")
    if run.status in ("running", "paused") and run.pid and run.pid != os.getpid() and owner_gone(run) is None:
        raise CheckpointError(f"run '{run_id}' is {run.status} in process {run.pid} on {run.host or 'this machine'}: "
                              f"stop it first (`fedswarm` dashboard or kill {run.pid}), then resume it")
    try:
        cfg = RunConfig.model_validate(run.config)
    except ValueError as exc:
        raise CheckpointError(f"run '{run_id}' has a config this fedswarm cannot read: {exc}") from None
    ck = load_latest(store, run_id)
    if ck.strategy_name != cfg.strategy:
        raise CheckpointError(f"the checkpoint of run '{run_id}' is of strategy '{ck.strategy_name}', "
                              f"the run's config says '{cfg.strategy}'")
    lost = client_state_lost(ck, nodes_keep_state(run.engine or cfg.engine, cfg))
    if lost and not accept_client_state_loss:
        raise CheckpointError(f"run '{run_id}' cannot be resumed exactly: {lost}. Resume it anyway with "
                              f"--accept-client-state-loss, or run it in a deployment or on the in-process "
                              f"engine, where the clients' state is kept")
    return cfg, ck




def resume_into(ck: ServerCheckpoint, *, store: Store, run_id: str, strategy: Any, recorder: Any, policies: Any,
                train_config: Any, engine: Any = None, byzantine: Any = None,
                restore_clients: Callable[[], tuple[str, list[str]]] | None = None) -> tuple[Any, int]:
    """Put a freshly built run back in the state of checkpoint ``ck``; return (the model
    the next round starts from, rounds left to run). ``restore_clients`` (run_server's,
    :func:`fedswarm.server.client_state.restore_clients` over the grid) asks the nodes for
    their own state when the checkpoint has none of theirs; what is lost is then only the
    state of the nodes that had none (named)."""
    load_strategy_state(strategy, ck.strategy)
    resynced: list[str] = []
    lost = None
    if engine is not None and ck.grid is not None:
        engine.load_state_dict(ck.grid)
        clients = "restored with the server"
    else:
        lost = client_state_lost(ck)
        if restore_clients is not None and lost is not None:  # a strategy with client state: ask the nodes
            clients, resynced = restore_clients()
            lost = (f"{len(resynced)} node(s) had no state of their own and were resynchronised: "
                    + ", ".join(resynced)) if resynced else None
            if resynced:
                clients = f"LOST on {len(resynced)} node(s), {clients}"
        else:
            clients = "resynchronised by the strategy" if resync_clients(strategy) else "stateless"
            if lost:
                clients = f"LOST, {clients} ({lost})"
    if byzantine is not None:
        if ck.byzantine is None:
            raise CheckpointError("the run attacks (--byzantine) but its checkpoint has no attack state")
        byzantine.load_state_dict(ck.byzantine)
    for device_class, policy in ck.policies.items():
        policies.update(device_class, policy)
    policies.write(train_config)
    dropped = store.drop_rounds_after(run_id, ck.round)
    store.update_run(run_id, error=None, finished_at=None)  # what ended it is in the events, not the run now
    run = store.get_run(run_id)
    total = int(run.total_rounds) if run is not None and run.total_rounds else ck.round
    recorder.offset = recorder.last_round = ck.round
    message = (f"resumed after round {ck.round} of {total}: {max(0, total - ck.round)} rounds to go; clients' state "
               f"{clients}" + (f"; {dropped} round(s) recorded after the checkpoint will be redone" if dropped else ""))
    store.add_event(run_id, "resumed", message, data={"round": ck.round, "dropped_rounds": dropped,
                                                      "client_state_lost": lost, "resynchronised_nodes": resynced})
    log.warning("run %s %s", run_id, message)
    set_rng_state(ck.rng)  # last: nothing may draw between here and the next round
    return ck.arrays, max(0, total - ck.round)
