"""The Count-Sketch strategies' client half, written once for C clients
(:mod:`fedswarm.algorithms.compression.sketched`, :class:`~fedswarm.strategies.federated.sketched.SketchClient`):
C clients at once equal C runs with C = 1 (what the batched engine and a Flower client each
run), and one step equals a naive per-coordinate re-derivation (Ivkin et al. 2019, Alg. 1)."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedswarm.algorithms.compression.countsketch import CountSketch
from fedswarm.algorithms.compression.sketched import SketchClientState, sketch_client_step
from fedswarm.algorithms.compression.sparse import CountSketchCodec
from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout
from fedswarm.strategies.federated.compressed_base import KNOBS, ClientRound
from fedswarm.strategies.federated.compressed_client import SELECT
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


def _rounds(name: str, contexts: list[Context], rnd: int, taken: list[np.ndarray] | None) -> list[ClientRound]:
    knobs = ConfigRecord({"round": rnd, "rows": ROWS, "cols": COLS, "density": 0.05, "hash_seed": SEED,
                          "momentum": 0.5, "phase": 1})
    out = []
    for i, ctx in enumerate(contexts):
        content = RecordDict({KNOBS: knobs})
        if taken is not None:
            content[SELECT] = ConfigRecord({"round": rnd - 1, "indices": taken[i].astype("<i4").tobytes()})
        msg = Message(content=content, message_type=f"train.{name}", dst_node_id=ctx.node_id)
        out.append(ClientRound(msg, ctx, RunConfig(), _Model(LAYOUT), knobs, torch.zeros(D), 0, ""))
    return out


def _commit(rounds: list[ClientRound]) -> None:
    for cr in rounds:  # what finish() writes
        for key, value in cr.state.items():
            cr.context.state[key] = value


@pytest.mark.parametrize("name", sorted(SKETCH_CLIENTS))
def test_the_strategy_client_on_a_cohort_equals_each_client_alone(name):
    """Two rounds (the second with the server's selection of the first): the cohort's step
    (the batched engine's call) and C steps with C = 1 (each Flower client's) give the same
    tables and leave the same state in every client's Context."""
    client = SKETCH_CLIENTS[name]
    c = 4
    g = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(0)

    def contexts():
        return [Context(run_id=0, node_id=i + 1, node_config={}, state=RecordDict(), run_config={}) for i in range(c)]

    together, alone = contexts(), contexts()
    for rnd in (1, 2):
        delta = torch.randn(c, D, generator=g)
        taken = None if rnd == 1 else [np.sort(rng.choice(D, size=9, replace=False)) for _ in range(c)]
        rounds = _rounds(name, together, rnd, taken)
        table = client.step(rounds, delta).arrays["table"]
        _commit(rounds)
        for i in range(c):
            one = _rounds(name, alone[i:i + 1], rnd, None if taken is None else taken[i:i + 1])
            torch.testing.assert_close(table[i:i + 1], client.step(one, delta[i:i + 1]).arrays["table"],
                                       rtol=0, atol=1e-6)
            _commit(one)
    for a, b in zip(together, alone):
        assert sorted(a.state.keys()) == sorted(b.state.keys())
        for key in a.state.array_records:
            assert np.array_equal(a.state.array_records[key]["vector"].numpy(),
                                  b.state.array_records[key]["vector"].numpy()), key
    if client.error_key is not None:  # the server's selection was applied: there, u and v restarted from δ
        for i, ctx in enumerate(together):
            v = ctx.state.array_records[client.error_key]["vector"].numpy()
            np.testing.assert_array_equal(v[taken[i]], delta[i, taken[i]].numpy())
            assert not np.allclose(np.delete(v, taken[i]), np.delete(delta[i].numpy(), taken[i]))
