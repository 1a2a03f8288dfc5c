"""SecAgg+ under what a real SuperNode's runtime does to a ClientApp's ``Context`` (flwr 1.42,
read in its source): the ClientApp process pushes its reply before its context, so the next
stage's process can start from the context before the last stage's write, and that older write
can land last; a task whose process starts slowly (more than 30 s in STARTING) is handed to a
second process, so one message can run twice on the same context; a task whose heartbeat lapses
is finished as failed and its context write dropped.

Each of these, at each stage, on the in-process engine with fedswarm's ServerApp and ClientApp:
the run finishes and every round either completes with the exact aggregate of the nodes it
counted (the oracle: the same seed's plain round, whose replies give each node's update, summed
over the survivors the round names) or, when too few nodes are left, fails cleanly. Never a
wrong model.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from flwr.app import Message
from flwr.common import Error
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.algorithms.secagg import SecAggParams, SecAggServer
from fedswarm.config import RunConfig
from fedswarm.server.app import run_server
from fedswarm.server.checkpoint import load_latest
from fedswarm.sim.engines import check_run
from fedswarm.sim.inprocess import InProcessGrid
from fedswarm.strategies.secagg_records import RECORD
from fedswarm.wire import arrayrecord_to_vector

BASE = dict(task="synthetic-logreg", clients=4, rounds=2, seed=7, local_epochs=1, central_eval=False, eval_every=100)


class RuntimeQuirks(InProcessGrid):
    """An in-process grid whose node ``node`` meets ``quirk`` on its ``at``-th secagg stage message
    (0-based, over the run): ``stale`` (it runs on the context from before its previous message,
    and that previous write lands after its own), ``twice`` (it runs twice on copies of the same
    context: the first run's reply goes to the server, the second run's context stays) or ``lost``
    (its context write is dropped) or ``unreachable`` (the SuperLink answers, from its own node id
    1, that the node is unavailable)."""

    def __init__(self, *args, node: int, at: int, quirk: str, **kw):
        super().__init__(*args, **kw)
        self.node, self.at, self.quirk = node, at, quirk
        self.seen = 0
        self.before = None  # the node's context before its last message
        self.starts: dict[int, np.ndarray] = {}  # round -> the model its masked-input stage carried
        self.counted: dict[int, set[int]] = {}  # round -> the nodes whose masked input reached the server

    def _execute(self, msg: Message) -> Message:
        masked = msg.has_content() and "arrays" in msg.content.array_records and RECORD in msg.content.config_records
        if masked:  # read now: the node's mod takes the secagg record out, the server reuses its config record
            rnd = _round_of(msg)
            self.starts[rnd] = arrayrecord_to_vector(msg.content.array_records["arrays"]).double().numpy()
        reply = self._quirky(msg)
        if masked and not reply.has_error():
            self.counted.setdefault(rnd, set()).add(int(msg.metadata.dst_node_id))
        return reply

    def _quirky(self, msg: Message) -> Message:
        nid = msg.metadata.dst_node_id
        if nid != self.node or not (msg.has_content() and RECORD in msg.content.config_records):
            return super()._execute(msg)
        at, self.seen = self.seen, self.seen + 1
        ctx = self.contexts[nid]
        before, self.before = self.before, copy.deepcopy(ctx)
        if at != self.at:
            return super()._execute(msg)
        if self.quirk == "stale" and before is not None:
            after_previous = ctx  # the previous message's write, which lands last
            self.contexts[nid] = before
            reply = super()._execute(msg)
            self.contexts[nid] = after_previous
            return reply
        if self.quirk == "twice":
            first = copy.deepcopy(ctx)
            self.contexts[nid] = first
            reply = super()._execute(copy.deepcopy(msg))
            self.contexts[nid] = ctx
            super()._execute(msg)  # the second process: its reply is lost, its context kept
            return reply
        if self.quirk == "unreachable":  # the SuperLink answers for a node it lost, from its own id (1)
            reply = Message(Error(code=5, reason="Node Unavailable"), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = 1
            return reply
        if self.quirk == "lost":
            self.contexts[nid] = copy.deepcopy(ctx)
            reply = super()._execute(msg)
            self.contexts[nid] = ctx
            return reply
        return super()._execute(msg)


def _run(store, monkeypatch, **quirk):
    cfg = RunConfig(**BASE, secagg=True)
    check_run(cfg)
    from fedswarm.client import secagg_mod
    from fedswarm.client.app import app as client_app

    plain: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # each node's own update, as it computed it
    update_of = secagg_mod.update_of

    def spy(sent, reply):
        u, w = update_of(sent, reply)
        # a task run twice: the first reply is the one the server gets
        plain.setdefault((int(reply.metadata.src_node_id), _round_of(sent)), (u.copy(), w))
        return u, w

    monkeypatch.setattr(secagg_mod, "update_of", spy)
    inner = RuntimeQuirks(client_app, cfg.clients, run_config=cfg.to_flat(), **quirk)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = inner.run.run_id, 1, 0
    rid = store.create_run(cfg.model_dump())
    assert run_server(inner, cfg, store=store, run_id=rid) == "finished"
    return cfg, rid, inner, plain


def _round_of(msg: Message) -> int:
    return int(msg.content.config_records["config"]["server-round"])


@pytest.mark.parametrize("quirk", ["stale", "twice", "lost"])
@pytest.mark.parametrize("at", [1, 2, 3, 4])  # round 1's share/masked/unmask, round 2's advertise
def test_runtime_quirks_never_give_a_wrong_model(store, monkeypatch, quirk, at):
    cfg, rid, grid, plain = _run(store, monkeypatch, node=2, at=at, quirk=quirk)
    res = {r["round"]: r for r in store.export_result(rid)["rounds"]}
    final = arrayrecord_to_vector(load_latest(store, rid).arrays).double().numpy()
    starts, counted = grid.starts, grid.counted
    q = SecAggServer(list(range(1, cfg.clients + 1)), final.size, SecAggParams(bits=cfg.secagg_bits)).quantizer
    for rnd in range(1, cfg.rounds + 1):
        end = starts.get(rnd + 1, final)
        if "secagg_failed" in res[rnd]:  # a clean failure: the model did not move
            assert rnd not in starts or np.array_equal(end, starts[rnd]), (quirk, at, res[rnd]["secagg_failed"])
            continue
        row = res[rnd]["secagg"]
        ups = [plain[(n, rnd)] for n in sorted(counted[rnd])]
        assert row["nodes"]["masked_input"] == len(ups), (quirk, at, row)
        total = sum(w for _, w in ups)
        want = starts[rnd] + sum(np.clip(u, -cfg.secagg_clip, cfg.secagg_clip) * w for u, w in ups) / total
        bound = len(ups) / (total * q.scale) + 1e-5  # one rounding unit per node, plus float32
        assert np.max(np.abs(end - want)) <= bound, (quirk, at, rnd, row)
    assert all("secagg_failed" not in res[r] for r in range(1, cfg.rounds + 1)), [(quirk, at, r) for r in res.values()]


def test_a_superlink_error_reply_is_the_unreachable_nodes(store, monkeypatch):
    """The SuperLink's error for an unreachable node comes from node id 1: the round names the node the
    message went to, and recovers it."""
    _, rid, grid, _ = _run(store, monkeypatch, node=2, at=2, quirk="unreachable")
    row = {r["round"]: r for r in store.export_result(rid)["rounds"]}[1]["secagg"]
    assert list(row["refused"]) == ["2"] and "Node Unavailable" in row["refused"]["2"], row
    assert row["recovered"] == 1 and grid.counted[1] == {1, 3, 4}
