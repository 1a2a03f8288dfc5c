"""The node half of exact resume: save ``Context.state`` after each train reply, restore it
when a resumed server asks (the server half is :mod:`fedswarm.server.client_state`).

After every train reply the ClientApp calls :func:`save_after_train`: when the message's
``config`` names the fedswarm run (``fedswarm-run``, which fedswarm's ServerApp puts there on
engines whose nodes keep their own state) and the node has a state folder (node config
``state-dir``, set by ``fedswarm client --state-dir``, or ``$FEDSWARM_STATE_DIR``), the node's
``Context.state`` is written as the snapshot of that message's ``server-round``
(:class:`~fedswarm.client.state_store.ClientStateStore`), keeping ``checkpoint_every + 2``
rounds: every round since the server's last checkpoint and the one in flight when it died.

A resumed server first sends every node a ``query.fedswarm_resume`` message naming the run and
the round its checkpoint followed; :func:`answer_resume` replaces the node's (empty)
``Context.state`` with the newest snapshot of a round at most that one and replies whether it
did, with the node id the node had then (a restarted node has a new one) and its partition.
"""

from __future__ import annotations

import logging

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.client.state_store import KEEP_RUNS_KEY, RUNS_KEPT, ClientStateStore, state_dir_of
from fedswarm.protocol import RESUME_RECORD, RUN_KEY

__all__ = ["save_after_train", "answer_resume", "store_for"]

log = logging.getLogger("fedswarm.client")


def store_for(context: Context, run_id: str, keep: int = 3) -> ClientStateStore | None:
    """This node's state store for ``run_id``, or None when it keeps no state on disk."""
    root = state_dir_of(context.node_config)
    if root is None or "partition-id" not in context.node_config:
        return None
    keep_runs = int(context.node_config.get(KEEP_RUNS_KEY, RUNS_KEPT))
    return ClientStateStore(root, run_id, int(context.node_config["partition-id"]), keep=keep, keep_runs=keep_runs)


def save_after_train(msg: Message, context: Context) -> None:
    """Snapshot ``context.state`` as the state after this train message's round (see the
    module docstring); nothing when the run or the node keeps no state on disk. A snapshot
    that cannot be written removes the node's older ones, so that a resume finds no state
    (and is resynchronised) rather than an older round's."""
    conf = msg.content.config_records.get("config") if msg.has_content() else None
    if conf is None or not conf.get(RUN_KEY) or len(context.state) == 0:
        return
    store = store_for(context, str(conf[RUN_KEY]), keep=int(conf.get("checkpoint_every", 1)) + 2)
    if store is None:
        return
    try:
        store.save(int(conf.get("server-round", 0)), context.state, int(context.node_id))
    except OSError as exc:
        log.error("fedswarm: cannot save this node's state to %s (%s); dropping its older snapshots",
                  store.folder, exc)
        for rnd in store.rounds():
            (store.folder / f"round-{rnd:08d}.state").unlink(missing_ok=True)


def answer_resume(msg: Message, context: Context) -> Message:
    """Restore the snapshot the resumed server asks for; reply ``restored`` (1/0), the
    snapshot's ``round``, ``partition-id``, the node id it was saved under (``old-node-id``)
    and, when nothing was restored, ``why``."""
    req = msg.content.config_records.get(RESUME_RECORD)
    if req is None or "run" not in req or "round" not in req:
        raise ValueError(f"a resume query needs a '{RESUME_RECORD}' record with 'run' and 'round'")
    run_id, rnd = str(req["run"]), int(req["round"])
    pid = int(context.node_config.get("partition-id", -1))
    for key in list(context.state.keys()):  # whatever this run put there so far is not the run's state
        del context.state[key]
    store = store_for(context, run_id)
    snap = store.load(rnd) if store is not None else None
    info = {"partition-id": pid, "restored": 0, "round": -1}
    if store is None:
        why = "this node keeps no state on disk (no state-dir in its node config, no $FEDSWARM_STATE_DIR)"
    elif snap is None:
        why = f"no usable snapshot of a round <= {rnd} in {store.folder}"
    else:
        why = ""
        for key, record in snap.state.items():
            context.state[key] = record
        info.update(restored=1, round=snap.round)
        log.info("fedswarm: run %s resumed after round %d: restored this node's state of round %d from %s",
                 run_id, rnd, snap.round, store.folder)
    old = str(snap.node_id) if snap is not None else ""
    content = RecordDict({"metrics": MetricRecord(info), "resume": ConfigRecord({"why": why, "old-node-id": old})})
    return Message(content, reply_to=msg)
