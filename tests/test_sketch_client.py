"""The Count-Sketch strategies' client half, written once for C clients
(:mod:`fedswarm.algorithms.compression.sketched`, :class:`~fedswarm.strategies.federated.sketched.SketchClient`):
C clients at once equal C runs with C = 1 (what the batched engine and a Flower client each
run), and one step equals a naive per-coordinate re-derivation (Ivkin et al. 2019, Alg. 1)."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedswarm.algorithms.compression.countsketch import CountSketch
from fedswarm.algorithms.compression.sketched import SketchClientState, sketch_client_step
from fedswarm.algorithms.compression.sparse import CountSketchCodec
from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout
from fedswarm.strategies.federated.compressed_base import KNOBS, ClientRound
from fedswarm.strategies.federated.compressed_client import SELECT
from fedswarm.sim.batched_sketched import SketchRows, _Exchange
from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS

LAYOUT = ParamLayout.from_shapes([("w", (12, 10)), ("b", (12,)), ("v", (7,))])  # d = 139
D = LAYOUT.d
ROWS, COLS, SEED = 3, 17, 41


def _state(kind: str, c: int, g: torch.Generator) -> SketchClientState:
    """Random memories of ``c`` clients: none (FetchSGD), e (gs-SGD) or v and u (Sketched-SGD)."""
    error = None if kind == "stateless" else torch.randn(c, D, generator=g)
    return SketchClientState(error, torch.randn(c, D, generator=g) if kind == "momentum" else None)


def _row(state: SketchClientState, i: int) -> SketchClientState:
    return SketchClientState(*(None if t is None else t[i:i + 1] for t in (state.error, state.momentum)))


@pytest.mark.parametrize("kind", ["stateless", "error", "momentum"])
def test_a_batch_of_clients_equals_one_client_at_a_time(kind):
    g = torch.Generator().manual_seed(3)
    c = 5
    state = _state(kind, c, g)
    delta = torch.randn(c, D, generator=g)
    taken = torch.rand(c, D, generator=g) < 0.2
    codec = CountSketchCodec(rows=ROWS, cols=COLS, k_ratio=0.05)
    payload, new = sketch_client_step(state, codec, delta, LAYOUT, seed=SEED, rho=0.7, taken=taken)
    assert payload.arrays["table"].shape == (c, ROWS, COLS)
    for i in range(c):
        one, new_i = sketch_client_step(_row(state, i), codec, delta[i:i + 1], LAYOUT, seed=SEED, rho=0.7,
                                        taken=taken[i:i + 1])
        torch.testing.assert_close(payload.arrays["table"][i:i + 1], one.arrays["table"], rtol=0, atol=1e-6)
        for name in ("error", "momentum"):
            got, want = getattr(new, name), getattr(new_i, name)
            assert (got is None) == (want is None)
            if got is not None:
                assert torch.equal(got[i:i + 1], want)


def test_one_step_matches_a_naive_rederivation():
    """u[T] = v[T] = 0;  u ← ρu + δ;  v ← v + u;  S[j, h_j(i)] += s_j(i)·v_i, coordinate by coordinate."""
    g = torch.Generator().manual_seed(5)
    c, rho = 3, 0.6
    state = _state("momentum", c, g)
    delta = torch.randn(c, D, generator=g)
    taken = torch.rand(c, D, generator=g) < 0.3
    codec = CountSketchCodec(rows=ROWS, cols=COLS, k_ratio=0.05)
    payload, new = sketch_client_step(state, codec, delta, LAYOUT, seed=SEED, rho=rho, taken=taken)
    h, s = CountSketch(D, ROWS, COLS, SEED).hashes(torch.arange(D))
    h, s = h.numpy(), s.numpy().astype(np.float64)
    u0, v0, dl, tk = (t.double().numpy() for t in (state.momentum, state.error, delta, taken))
    for k in range(c):
        u, v, table = np.zeros(D), np.zeros(D), np.zeros((ROWS, COLS))
        for i in range(D):
            ui, vi = (0.0, 0.0) if tk[k, i] else (u0[k, i], v0[k, i])
            u[i] = rho * ui + dl[k, i]
            v[i] = vi + u[i]
            for j in range(ROWS):
                table[j, h[j, i]] += s[j, i] * v[i]
        np.testing.assert_allclose(new.momentum[k].numpy(), u, rtol=0, atol=1e-5)
        np.testing.assert_allclose(new.error[k].numpy(), v, rtol=0, atol=1e-5)
        np.testing.assert_allclose(payload.arrays["table"][k].numpy(), table, rtol=0, atol=1e-4)
    unchanged = state.error.clone()
    sketch_client_step(state, codec, delta, LAYOUT, seed=SEED, rho=rho, taken=taken)
    assert torch.equal(state.error, unchanged)  # pure: the old state is left as it was


def test_bad_state_and_inputs_are_named():
    codec = CountSketchCodec(rows=ROWS, cols=COLS, k_ratio=0.05)
    with pytest.raises(ValueError, match="momentum needs an error accumulator"):
        SketchClientState(None, torch.zeros(1, D))
    with pytest.raises(ValueError, match="same shape"):
        SketchClientState(torch.zeros(2, D), torch.zeros(1, D))
    with pytest.raises(ValueError, match="memory is"):
        sketch_client_step(SketchClientState(torch.zeros(2, D)), codec, torch.zeros(3, D), LAYOUT, seed=0)
    with pytest.raises(ValueError, match="bool mask"):
        sketch_client_step(SketchClientState(torch.zeros(2, D)), codec, torch.zeros(2, D), LAYOUT, seed=0,
                           taken=torch.zeros(2, D))


# -- the Flower-side half: state in each client's Context, the server's select -------------


@dataclass
class _Model:
    """What a client round reads of its trainer here: the layout."""

    layout: ParamLayout


def _knobs(rnd: int, phase: int = 1) -> ConfigRecord:
    return ConfigRecord({"round": rnd, "rows": ROWS, "cols": COLS, "density": 0.05, "hash_seed": SEED,
                         "momentum": 0.5, "phase": phase})


def _round(name: str, ctx: Context, rnd: int, select: ConfigRecord | None) -> ClientRound:
    content = RecordDict({KNOBS: _knobs(rnd)})
    if select is not None:
        content[SELECT] = select
    msg = Message(content=content, message_type=f"train.{name}", dst_node_id=ctx.node_id)
    return ClientRound(msg, ctx, RunConfig(), _Model(LAYOUT), content[KNOBS], torch.zeros(D), 0, "")


def _commit(cr: ClientRound) -> None:
    for key, value in cr.state.items():  # what finish() writes
        cr.context.state[key] = value


def _ask(name: str, pid: int, rnd: int, cand: np.ndarray) -> Message:
    content = RecordDict({KNOBS: _knobs(rnd, phase=2), "candidates": ArrayRecord({"indices": Array(cand)})})
    return Message(content=content, message_type=f"train.{name}", dst_node_id=pid + 1)


@pytest.mark.parametrize("name", sorted(SKETCH_CLIENTS))
def test_the_cohort_on_arrays_equals_each_flower_client_on_its_context(name):
    """Three rounds (the second's selection by indices of the first's sketch; a phase-2 answer in
    the second, whose candidates the third's selection masks): the batched engine's call (the
    cohort's step on its memories in SketchRows) and each Flower client's (its step on its
    Context) give the same tables and phase-2 replies and leave the same memories."""
    client = SKETCH_CLIENTS[name]
    pids = [7, 2, 5, 0]  # out of order, with gaps: the store's slots
    c = len(pids)
    store = SketchRows(client, D, population=10)
    exchange = _Exchange(10, store, client)
    ctxs = [Context(run_id=0, node_id=p + 1, node_config={}, state=RecordDict(), run_config={}) for p in pids]
    g = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(0)
    taken, cand = None, np.sort(rng.choice(D, size=13, replace=False)).astype(np.int32)
    for rnd in (1, 2, 3):
        delta = torch.randn(c, D, generator=g)
        if rnd == 1:
            selects = [None] * c
        elif rnd == 2:
            taken = [np.sort(rng.choice(D, size=9, replace=False)) for _ in range(c)]
            selects = [ConfigRecord({"round": 1, "indices": t.astype("<i4").tobytes()}) for t in taken]
        else:
            bits = [rng.random(cand.size) < 0.5 for _ in range(c)]
            taken = [cand[b].astype(np.int64) for b in bits]
            selects = [ConfigRecord({"round": 2, "mask": np.packbits(b, bitorder="little").tobytes()}) for b in bits]
        payload, new = client.step(_knobs(rnd), LAYOUT, delta, store.state(pids), store.taken(pids, selects))
        store.keep(pids, new, rnd)
        for i in range(c):
            cr = _round(name, ctxs[i], rnd, selects[i])
            torch.testing.assert_close(payload.arrays["table"][i:i + 1],
                                       client.step_context(cr, delta[i:i + 1]).arrays["table"], rtol=0, atol=1e-6)
            _commit(cr)
        if client.prefix is not None and rnd == 2:  # the second exchange: from the arrays, from each Context
            replies = exchange.send_and_receive([_ask(name, p, rnd, cand) for p in pids])
            for reply, ctx in zip(replies, ctxs):
                assert not reply.has_error()
                want = client.phase2(_ask(name, ctx.node_id - 1, rnd, cand), ctx)
                np.testing.assert_array_equal(reply.content.array_records["values"]["values"].numpy(),
                                              want.array_records["values"]["values"].numpy())
    if client.error_key is None:  # FetchSGD's clients keep nothing
        assert len(store) == 0 and store.nbytes() == 0
        return
    assert len(store) == c and sorted(store.error) == sorted(pids)  # rows only for the clients that trained
    for pid, ctx in zip(pids, ctxs):
        for rows, key in ((store.error, client.error_key), (store.momentum, client.momentum_key)):
            if key is not None:
                np.testing.assert_array_equal(rows[pid].numpy(), ctx.state.array_records[key]["vector"].numpy())
        assert int(store.sent_round[pid]) == int(ctx.state.config_records[client.prefix + ".sent"]["round"]) == 3
        np.testing.assert_array_equal(store.sent_idx[pid].numpy(),
                                      ctx.state.array_records[client.prefix + ".sent_idx"]["indices"].numpy())
    for i, pid in enumerate(pids):  # the server's last selection was applied: there, u and v restarted from δ
        v = store.error[pid].numpy()
        np.testing.assert_array_equal(v[taken[i]], delta[i, taken[i]].numpy())
        assert not np.allclose(np.delete(v, taken[i]), np.delete(delta[i].numpy(), taken[i]))
