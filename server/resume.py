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
   back; otherwise (a new Flower run on the SuperLink, a new Ray simulation) their
   residuals and replicas are gone, and the strategy resynchronises every one of them by
   protocol (``resync_clients``: the full model next round, nodes re-initialised), never by
   hoping their state survived;
4. rounds go on from the checkpoint's round + 1 to the run's total (``add_rounds`` included),
   with the clients told the run's round numbers, so a deterministic run ends with the
   model the uninterrupted run would have had.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fedswarm.config import RunConfig
from fedswarm.procs import pid_alive
from fedswarm.store import Store
from fedswarm.server.checkpoint import CheckpointError, ServerCheckpoint, load_latest
from fedswarm.strategies.resumable import load_strategy_state, resync_clients, set_rng_state

__all__ = ["RESUME_KEY", "prepare_resume", "resume_into"]

log = logging.getLogger("fedswarm.server")

#: The run-config key that tells fedswarm's ServerApp to resume ``run-id`` (deployment).
RESUME_KEY = "resume"


def prepare_resume(store: Store, run_id: str) -> tuple[RunConfig, ServerCheckpoint]:
    """The run's config and its newest checkpoint; :class:`CheckpointError` saying why a
    run cannot be resumed."""
    run = store.get_run(run_id)
    if run is None:
        raise CheckpointError(f"no run '{run_id}' in {store.url}")
    if run.status == "finished":
        raise CheckpointError(f"run '{run_id}' finished: there is nothing to resume")
    if run.status in ("running", "paused") and run.pid and run.pid != os.getpid() and pid_alive(run.pid):
        raise CheckpointError(f"run '{run_id}' is {run.status} in process {run.pid} on this machine: stop it "
                              f"first (`fedswarm` dashboard or kill {run.pid}), then resume it")
    try:
        cfg = RunConfig.model_validate(run.config)
    except ValueError as exc:
        raise CheckpointError(f"run '{run_id}' has a config this fedswarm cannot read: {exc}") from None
    ck = load_latest(store, run_id)
    if ck.strategy_name != cfg.strategy:
        raise CheckpointError(f"the checkpoint of run '{run_id}' is of strategy '{ck.strategy_name}', "
                              f"the run's config says '{cfg.strategy}'")
    return cfg, ck




def resume_into(ck: ServerCheckpoint, *, store: Store, run_id: str, strategy: Any, recorder: Any, policies: Any,
                train_config: Any, engine: Any = None, byzantine: Any = None) -> tuple[Any, int]:
    """Put a freshly built run back in the state of checkpoint ``ck``; return (the model
    the next round starts from, rounds left to run)."""
    load_strategy_state(strategy, ck.strategy)
    if engine is not None and ck.grid is not None:
        engine.load_state_dict(ck.grid)
        clients = "restored with the server"
    else:
        clients = "resynchronised by the strategy" if resync_clients(strategy) else "stateless"
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
    store.add_event(run_id, "resumed", message, data={"round": ck.round, "dropped_rounds": dropped})
    log.warning("run %s %s", run_id, message)
    set_rng_state(ck.rng)  # last: nothing may draw between here and the next round
    return ck.arrays, max(0, total - ck.round)
