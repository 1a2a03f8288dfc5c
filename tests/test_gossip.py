"""Decentralized algorithms against independent numpy oracles and their invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.decentralized import (
    ADPSGD,
    ALGORITHMS,
    D2,
    DPSGD,
    DSGDm,
    QGDSGDm,
    bipartite_split,
    exchange_roles,
    consensus_distance,
    make_algorithm,
    pair_mixing_matrix,
    pairwise_average,
)
from fedswarm.algorithms.decentralized.topology import make_topology

SYNC_ALGOS = {
    "dpsgd-cta": lambda: DPSGD(order="cta"),
    "dpsgd-atc": lambda: DPSGD(order="atc"),
    "d2": lambda: D2(),
    "dsgdm": lambda: DSGDm(momentum=0.9),
    "dsgdm-nesterov": lambda: DSGDm(momentum=0.8, nesterov=True, weight_decay=1e-2),
    "qgm": lambda: QGDSGDm(momentum=0.9, mu=0.9),
    "qgm-nesterov": lambda: QGDSGDm(momentum=0.8, mu=0.7, nesterov=True, weight_decay=1e-2),
}


# --------------------------------------------------------------------------- problems


class LeastSquares:
    """Node i holds f_i(x) = ||A_i x − b_i||² / (2m); b_i = A_i (x_c + h δ_i), so the
    local optima spread with the heterogeneity h and coincide (at x_c) when h = 0."""

    def __init__(self, n, d, m, h, seed=0, shared_hessian=False):
        rng = np.random.default_rng(seed)
        A = rng.normal(size=(1 if shared_hessian else n, m, d))
        self.A = np.broadcast_to(A, (n, m, d)).copy()
        x_c = rng.normal(size=d)
        delta = rng.normal(size=(n, d))
        self.b = np.einsum("nmd,nd->nm", self.A, x_c + h * delta)
        self.n, self.d, self.m = n, d, m
        self.At = torch.tensor(self.A, dtype=torch.float32)
        self.bt = torch.tensor(self.b, dtype=torch.float32)

    def grads(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.einsum("nmd,nd->nm", self.At, x) - self.bt
        return torch.einsum("nmd,nm->nd", self.At, r) / self.m

    def grads_np(self, x: np.ndarray, rows=None) -> np.ndarray:
        """Per-node gradients at per-node points x [n, d], optionally on row subsets."""
        out = np.empty_like(x)
        for i in range(self.n):
            A, b = self.A[i], self.b[i]
            if rows is not None:
                A, b = A[rows[i]], b[rows[i]]
            out[i] = A.T @ (A @ x[i] - b) / len(b)
        return out

    def optimum(self) -> np.ndarray:
        H = sum(self.A[i].T @ self.A[i] for i in range(self.n))
        g = sum(self.A[i].T @ self.b[i] for i in range(self.n))
        return np.linalg.solve(H, g)


def run(algo, topo, problem, lr, steps, x0=None):
    x0 = torch.zeros(problem.n, problem.d) if x0 is None else x0
    state = algo.init_state(x0)
    for t in range(steps):
        algo.local_step(state, problem.grads(state.x), lr)
        algo.mix(state, algo.message(state), topo.mixing_matrix(t))
    return state


# --------------------------------------------------------------------------- oracles


def numpy_oracle(name, W_of, problem, lr, steps, beta=0.9, mu=0.9, nesterov=False, wd=0.0):
    """Each algorithm re-coded node by node from docs/algorithms.md, in float64 numpy."""
    n, d = problem.n, problem.d
    x = np.zeros((n, d))
    x_prev = x.copy()
    g_prev = np.zeros((n, d))
    m = np.zeros((n, d))
    for t in range(steps):
        W = W_of(t)
        g = problem.grads_np(x) + wd * x
        half = np.empty_like(x)
        new = np.empty_like(x)
        for i in range(n):
            if name == "d2":
                half[i] = x[i] - lr * g[i] if t == 0 else 2 * x[i] - x_prev[i] - lr * g[i] + lr * g_prev[i]
            elif name == "dsgdm":
                m[i] = beta * m[i] + g[i]
                half[i] = x[i] - lr * (g[i] + beta * m[i] if nesterov else m[i])
            elif name == "qgm":
                mom = g[i] + beta * (beta * m[i] + g[i]) if nesterov else g[i] + beta * m[i]
                half[i] = x[i] - lr * mom
            elif name == "dpsgd-atc":
                half[i] = x[i] - lr * g[i]
            else:  # dpsgd-cta mixes the models, not the half-steps
                half[i] = x[i]
        for i in range(n):
            new[i] = sum(W[i, j] * half[j] for j in range(n))
            if name == "dpsgd-cta":
                new[i] -= lr * g[i]
            if name == "qgm":
                m[i] = mu * m[i] + (1 - mu) * (x[i] - new[i]) / lr
        x_prev, g_prev, x = x, g, new
    return x


@pytest.mark.parametrize(
    "name, algo, kw",
    [
        ("dpsgd-cta", DPSGD(order="cta"), {}),
        ("dpsgd-atc", DPSGD(order="atc"), {}),
        ("d2", D2(), {}),
        ("dsgdm", DSGDm(momentum=0.9), {"beta": 0.9}),
        ("dsgdm", DSGDm(momentum=0.8, nesterov=True, weight_decay=0.01),
         {"beta": 0.8, "nesterov": True, "wd": 0.01}),
        ("qgm", QGDSGDm(momentum=0.9, mu=0.9), {"beta": 0.9, "mu": 0.9}),
        ("qgm", QGDSGDm(momentum=0.8, mu=0.7, nesterov=True, weight_decay=0.01),
         {"beta": 0.8, "mu": 0.7, "nesterov": True, "wd": 0.01}),
    ],
)
@pytest.mark.parametrize("spec", ["ring", "onepeer-exp"])
def test_matches_numpy_oracle(name, algo, kw, spec):
    problem = LeastSquares(n=7, d=6, m=12, h=1.0, seed=3)
    topo = make_topology(spec, 7)
    state = run(algo, topo, problem, lr=0.05, steps=25)
    ref = numpy_oracle(name, lambda t: topo.mixing_matrix(t).numpy(), problem, 0.05, 25, **kw)
    np.testing.assert_allclose(state.x.numpy(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- gossip


TOPO_CASES = [("ring", 8), ("torus:3x4", 12), ("exp", 16), ("random:3", 12), ("complete", 6),
              ("onepeer-exp", 8), ("ring+lazy", 9)]


@pytest.mark.parametrize("spec, n", TOPO_CASES)
@pytest.mark.parametrize("key", ["dpsgd-cta", "dpsgd-atc", "dsgdm", "qgm"])
def test_zero_lr_gossip_meets_spectral_gap_bound(spec, n, key):
    topo = make_topology(spec, n, seed=5)
    algo = SYNC_ALGOS[key]()
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(n, 10, generator=gen, dtype=torch.float32)
    mean0 = x0.mean(0, keepdim=True)
    state = algo.init_state(x0)
    dev0 = (x0 - mean0).norm().item()
    bound = 1.0
    for t in range(30):
        algo.local_step(state, torch.randn(n, 10, generator=gen), 0.0)  # lr 0: gradients ignored
        algo.mix(state, algo.message(state), topo.mixing_matrix(t))
        bound *= 1.0 - topo.spectral_gap(t)
        dev = (state.x - state.x.mean(0, keepdim=True)).norm().item()
        assert dev <= bound * dev0 * (1 + 1e-5) + 1e-5, f"round {t}: {dev} > {bound * dev0}"
        torch.testing.assert_close(state.x.mean(0, keepdim=True), mean0, atol=1e-5, rtol=0)
    if not topo.time_varying:
        assert bound < 0.5  # the bound has teeth: the nodes did move toward the average


@pytest.mark.parametrize("spec, n", TOPO_CASES)
@pytest.mark.parametrize("key", list(SYNC_ALGOS))
def test_mix_keeps_the_mean(spec, n, key):
    topo = make_topology(spec, n, seed=5)
    algo = SYNC_ALGOS[key]()
    state = algo.init_state(torch.randn(n, 7, generator=torch.Generator().manual_seed(1)))
    msg = algo.message(state).clone()
    W = topo.mixing_matrix(0)
    if key == "d2" and torch.linalg.eigvalsh(W).min() <= -1 / 3 + 1e-9:
        with pytest.raises(ValueError, match="D² needs"):  # even ring, 3x4 torus
            algo.mix(state, msg, W)
        W = make_topology(spec + "+lazy" if "lazy" not in spec else spec, n, seed=5).mixing_matrix(0)
    algo.mix(state, msg, W)
    torch.testing.assert_close(state.x.mean(0), msg.mean(0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("key", ["dpsgd-cta", "dpsgd-atc", "d2"])
def test_node_average_moves_by_mean_gradient_step(key):
    """D-PSGD and D² keep x̄_{t+1} = x̄_t − η mean_i g_i(x_i^t) (W doubly stochastic)."""
    problem = LeastSquares(n=5, d=4, m=8, h=2.0, seed=1)
    topo = make_topology("ring", 5)
    algo = SYNC_ALGOS[key]()
    state = algo.init_state(torch.randn(5, 4, generator=torch.Generator().manual_seed(2)))
    for t in range(10):
        g = problem.grads(state.x)
        expected = state.x.mean(0) - 0.05 * g.mean(0)
        algo.local_step(state, g, 0.05)
        algo.mix(state, algo.message(state), topo.mixing_matrix(t))
        torch.testing.assert_close(state.x.mean(0), expected, atol=1e-5, rtol=1e-5)


def test_atc_dpsgd_on_complete_graph_is_centralized_minibatch_sgd():
    n, d, m, B, lr, steps = 6, 5, 20, 4, 0.1, 30
    problem = LeastSquares(n, d, m, h=1.5, seed=4)
    rng = np.random.default_rng(9)
    batches = [[rng.choice(m, size=B, replace=False) for _ in range(n)] for _ in range(steps)]

    # centralized oracle, plain numpy: one model, gradient = mean of the n minibatch gradients
    x = np.zeros(d)
    central = []
    for t in range(steps):
        g = problem.grads_np(np.tile(x, (n, 1)), rows=batches[t]).mean(0)
        x = x - lr * g
        central.append(x.copy())

    algo = DPSGD(order="atc")
    W = make_topology("complete", n).mixing_matrix()
    state = algo.init_state(torch.zeros(n, d))
    for t in range(steps):
        g = torch.tensor(problem.grads_np(state.x.double().numpy(), rows=batches[t]), dtype=torch.float32)
        algo.local_step(state, g, lr)
        algo.mix(state, algo.message(state), W)
        for i in range(n):
            np.testing.assert_allclose(state.x[i].numpy(), central[t], atol=1e-5, rtol=1e-5)


def test_cta_dpsgd_on_complete_graph_average_is_centralized_sgd():
    """Lian's form: with a shared Hessian the node average follows centralized SGD exactly,
    while the individual nodes differ by their own last gradient step."""
    n, d, lr, steps = 5, 4, 0.1, 20
    problem = LeastSquares(n, d, m=10, h=1.0, seed=6, shared_hessian=True)
    x = np.zeros(d)
    algo = DPSGD(order="cta")
    W = make_topology("complete", n).mixing_matrix()
    state = algo.init_state(torch.zeros(n, d))
    for _ in range(steps):
        x = x - lr * problem.grads_np(np.tile(x, (n, 1))).mean(0)
        algo.local_step(state, problem.grads(state.x), lr)
        algo.mix(state, algo.message(state), W)
    np.testing.assert_allclose(state.x.mean(0).numpy(), x, atol=1e-5)
    assert consensus_distance(state.x) > 1e-4


# --------------------------------------------------------------------------- D² vs D-PSGD


def _error(state, x_star):
    return float(np.abs(state.x.double().numpy() - x_star).max())


def test_d2_reaches_global_optimum_where_dpsgd_stays_biased():
    topo = make_topology("ring", 5)  # odd ring: λ_min(W) ≈ −0.21 > −1/3
    lr, steps = 0.1, 1000
    errs = {}
    for h in [0.0, 0.5, 1.0, 2.0]:
        problem = LeastSquares(n=5, d=5, m=10, h=h, seed=0)
        x_star = problem.optimum()
        errs[h] = (_error(run(D2(), topo, problem, lr, steps), x_star),
                   _error(run(DPSGD(), topo, problem, lr, steps), x_star))
    for h, (e_d2, _) in errs.items():
        assert e_d2 < 1e-4, (h, e_d2)
    assert errs[0.0][1] < 1e-4  # homogeneous: no bias for anyone
    assert errs[1.0][1] > 1e-2 and errs[1.0][1] > 100 * errs[1.0][0]
    # the bias grows with heterogeneity (linearly: the fixed point is linear in h)
    assert errs[0.5][1] < errs[1.0][1] < errs[2.0][1]
    assert errs[2.0][1] / errs[1.0][1] == pytest.approx(2.0, rel=0.05)


def test_d2_does_not_drift_in_float32():
    """With float32 weights (1/3 rounded) each mix scales the average by ~1+1e-7 and D²
    integrates it: 2.5e-3 off the optimum after 3000 steps. Mixing in float64 holds it."""
    problem = LeastSquares(n=5, d=5, m=10, h=1.0, seed=0)
    state = run(D2(), make_topology("ring", 5), problem, 0.05, 3000)
    assert _error(state, problem.optimum()) < 1e-4


def test_d2_first_step_is_dpsgd():
    problem = LeastSquares(n=5, d=4, m=8, h=1.0)
    topo = make_topology("ring", 5)
    a = run(D2(), topo, problem, 0.1, 1)
    b = run(DPSGD(order="atc"), topo, problem, 0.1, 1)
    torch.testing.assert_close(a.x, b.x)


def test_d2_refuses_small_eigenvalues():
    d2 = D2()
    with pytest.raises(ValueError, match=r"smallest eigenvalue > -1/3, but it is -0\.333"):
        d2.check_topology(make_topology("ring", 8))
    # constructed: W = 0.25 I + 0.75 (swap) has eigenvalues 1 and -0.5
    W = torch.tensor([[0.25, 0.75], [0.75, 0.25]], dtype=torch.float64)
    state = d2.init_state(torch.randn(2, 3))
    d2.local_step(state, torch.zeros(2, 3), 0.1)
    with pytest.raises(ValueError, match=r"but it is -0\.5"):
        d2.mix(state, d2.message(state), W)
    # fine: odd ring, lazy even ring, and the same swap made lazier (eigenvalue -0.2)
    d2.check_topology(make_topology("ring", 7))
    d2.check_topology(make_topology("ring+lazy", 8))
    d2.check_mixing_matrix(torch.tensor([[0.4, 0.6], [0.6, 0.4]], dtype=torch.float64))
    DPSGD().check_topology(make_topology("ring", 8))  # D-PSGD has no such condition


# --------------------------------------------------------------------------- one node's view


@pytest.mark.parametrize("key", list(SYNC_ALGOS))
@pytest.mark.parametrize("spec", ["ring+lazy", "random:3", "onepeer-exp", "exp"])
def test_node_mix_equals_vectorized_mix(key, spec):
    n = 8
    if key == "d2" and not spec.endswith("+lazy"):
        spec += "+lazy"  # these graphs have λ_min(W) <= -1/3
    topo = make_topology(spec, n, seed=2)
    problem = LeastSquares(n=n, d=5, m=8, h=1.0, seed=7)
    algo = SYNC_ALGOS[key]()
    state = run(algo, topo, problem, 0.05, 3, x0=torch.randn(n, 5, generator=torch.Generator().manual_seed(3)))
    t = 3
    grads = problem.grads(state.x)
    peers = [state.node(i) for i in range(n)]
    algo.local_step(state, grads, 0.05)
    msgs = algo.message(state).clone()
    algo.mix(state, msgs, topo.mixing_matrix(t))
    for i, peer in enumerate(peers):
        algo.local_step(peer, grads[i : i + 1], 0.05)
        torch.testing.assert_close(algo.message(peer)[0], msgs[i])
        received = {j: msgs[j] for j in topo.neighbors(i, t)}
        algo.node_mix(peer, i, received, topo.weights(i, t))
        torch.testing.assert_close(peer.x[0], state.x[i], atol=1e-6, rtol=1e-5)
        for k, buf in state.buffers.items():
            torch.testing.assert_close(peer.buffers[k][0], buf[i], atol=1e-5, rtol=1e-5)
        assert peer.step == state.step


def test_node_mix_refuses_bad_inputs():
    algo = DPSGD()
    peer = algo.init_state(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="cover node 0"):
        algo.node_mix(peer, 0, {1: torch.zeros(3)}, {0: 0.5, 2: 0.5})
    with pytest.raises(ValueError, match="sum to 1"):
        algo.node_mix(peer, 0, {1: torch.zeros(3)}, {0: 0.5, 1: 0.6})
    with pytest.raises(ValueError, match="expected 3"):
        algo.node_mix(peer, 0, {1: torch.zeros(4)}, {0: 0.5, 1: 0.5})


# --------------------------------------------------------------------------- AD-PSGD


def test_pairwise_average_keeps_the_sum():
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = pairwise_average(x, [(0, 1), (5, 2), (3, 7)])
    torch.testing.assert_close(y.sum(0), x.sum(0))
    torch.testing.assert_close(y[0], (x[0] + x[1]) / 2)
    torch.testing.assert_close(y[5], y[2])
    torch.testing.assert_close(y[4], x[4])  # untouched
    torch.testing.assert_close(pair_mixing_matrix(8, 0, 1) @ x, pairwise_average(x, [(0, 1)]))
    with pytest.raises(ValueError, match="disjoint"):
        pairwise_average(x, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="itself"):
        pairwise_average(x, [(3, 3)])


def test_adpsgd_events_keep_the_sum_and_peer_view_agrees():
    algo = ADPSGD()
    topo = make_topology("ring", 8)
    active = bipartite_split(topo)
    gen = torch.Generator().manual_seed(4)
    state = algo.init_state(torch.randn(8, 5, generator=gen))
    total = state.x.sum(0).clone()
    for _ in range(50):
        i = int(torch.nonzero(active).flatten()[torch.randint(4, (1,), generator=gen)])
        j = algo.choose_peer(i, topo, active, gen)
        assert not active[j] and j in topo.neighbors(i)
        a, b = state.node(i), state.node(j)
        xi, xj = a.x[0].clone(), b.x[0].clone()
        algo.average_pairs(state, [(i, j)])
        algo.node_average(a, xj)
        algo.node_average(b, xi)
        torch.testing.assert_close(a.x[0], state.x[i])
        torch.testing.assert_close(b.x[0], state.x[j])
        torch.testing.assert_close(state.x.sum(0), total, atol=1e-5, rtol=0)
    # the pair matrix through the generic mix is the same averaging
    before = state.x.clone()
    algo.mix(state, algo.message(state), pair_mixing_matrix(8, 2, 3))
    torch.testing.assert_close(state.x, pairwise_average(before, [(2, 3)]))
    mixed = state.x.clone()
    algo.local_step(state, torch.ones(8, 5), 0.5)  # pending (x ← W x − η g): applied by the next mix
    assert torch.equal(state.x, mixed) and state.step == 1
    algo.mix(state, algo.message(state), torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(state.x.sum(0), before.sum(0) - 4.0)
    assert state.step == 1


@pytest.mark.parametrize("name,n", [("ring", 8), ("ring", 7), ("complete", 5), ("torus:3x3", 9), ("exp", 8)])
def test_exchange_roles_give_each_edge_one_initiator_and_no_cycle(name, n):
    topo = make_topology(name, n)
    roles = exchange_roles(topo)
    initiated = [(i, j) for i, (active, partners) in enumerate(roles) for j in partners]
    edges = {frozenset((i, j)) for i in range(n) for j in topo.neighbors(i) if i != j}
    assert {frozenset(e) for e in initiated} == edges and len(initiated) == len(edges)
    assert all(active == bool(partners) or not partners for active, partners in roles)
    # no cycle in "i initiates with j": a topological order exists (Kahn's algorithm)
    indegree = [0] * n
    for _, j in initiated:
        indegree[j] += 1
    ready, seen = [i for i in range(n) if indegree[i] == 0], 0
    while ready:
        i = ready.pop()
        seen += 1
        for j in roles[i][1]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    assert seen == n


def test_bipartite_split():
    active = bipartite_split(make_topology("ring", 8))
    assert active.tolist() == [True, False] * 4
    assert bipartite_split(make_topology("torus:4x4", 16)).sum() == 8
    with pytest.raises(ValueError, match="odd cycle"):
        bipartite_split(make_topology("ring", 7))
    with pytest.raises(ValueError, match="odd cycle"):
        ADPSGD().check_topology(make_topology("complete", 4))
    with pytest.raises(ValueError, match="passive"):
        ADPSGD().choose_peer(1, make_topology("ring", 8), active)


# --------------------------------------------------------------------------- registry


def test_registry_builds_every_algorithm_with_defaults():
    assert set(ALGORITHMS) >= {"dpsgd", "d2", "dsgdm", "qgm", "adpsgd"}
    for name, entry in ALGORITHMS.items():
        algo = make_algorithm(name)
        assert isinstance(algo, entry.cls) and algo.name == name
        for h in entry.hyperparams:
            assert h.help and h.check(h.default, name) == h.default
        doc = entry.cls.__doc__
        assert "Wire" in doc and "State" in doc, name
    assert make_algorithm("qgm", momentum="0.5").momentum == 0.5


def test_registry_refuses_bad_parameters():
    with pytest.raises(ValueError, match="unknown decentralized algorithm 'sgd'"):
        make_algorithm("sgd")
    with pytest.raises(ValueError, match="unknown parameter 'beta' for 'qgm'"):
        make_algorithm("qgm", beta=0.9)
    with pytest.raises(ValueError, match=r"qgm.momentum.*< 1"):
        make_algorithm("qgm", momentum=1.0)
    with pytest.raises(ValueError, match="dpsgd.order"):
        make_algorithm("dpsgd", order="both")


def test_wire_bytes_formula():
    assert make_algorithm("dpsgd").wire_bytes(1000, 2) == 8000
    assert make_algorithm("d2").wire_bytes(10, 4) == 160
    assert make_algorithm("adpsgd").wire_bytes(10, 4) == 40
