"""SQuARM-SGD, EASGD, LSGD and DaSGD: numpy re-derivations on tiny [n, d], invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.decentralized import ALGORITHMS, make_algorithm
from fedswarm.algorithms.decentralized.leader import contiguous_groups
from fedswarm.algorithms.decentralized.topology import make_topology

N, D = 4, 6


def _x0(same: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x[:1].repeat(N, 1) if same else x


def _grads(T: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, D, generator=g, dtype=torch.float64).float() for _ in range(T)]


def _W(name: str = "ring") -> torch.Tensor:
    return make_topology(name, N).mixing_matrix(0)


def _run(algo, x0, grads, lr, W, **kw):
    state = algo.init_state(x0)
    for g in grads:
        algo.local_step(state, g, lr, **kw) if kw else algo.local_step(state, g, lr)
        algo.mix(state, algo.message(state), W)
    return state


# ------------------------------------------------------------------------------ SQuARM


def test_squarm_identity_codec_reduces_to_nesterov_dsgdm():
    W = _W()
    x0, grads = _x0(same=True), _grads(5)
    sq = _run(make_algorithm("squarm", codec="none", threshold=0.0, gamma=1.0, period=1, momentum=0.9),
              x0, grads, 0.1, W)
    dm = _run(make_algorithm("dsgdm", momentum=0.9, nesterov=True), x0, grads, 0.1, W)
    torch.testing.assert_close(sq.x, dm.x, atol=1e-5, rtol=1e-5)
    # identity codec, always triggered, γ = 1: the replicas are the pre-gossip models, the
    # incremental sum s_i stays Σ_j w_ij x̂_j, and the mixed model is exactly that sum
    mix_of_replicas = W.to(sq.x.dtype) @ sq.buffers["x_hat"]
    torch.testing.assert_close(sq.buffers["s"], mix_of_replicas, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sq.x, mix_of_replicas, atol=1e-5, rtol=1e-5)


def test_squarm_matches_numpy_with_topk_period_and_trigger():
    W = _W()
    Wn = W.numpy().astype(np.float64)
    x0, grads = _x0(same=True), _grads(4)
    lr, beta, gamma, H, c, ratio = 0.1, 0.9, 0.5, 2, 1.0, 0.34
    algo = make_algorithm("squarm", codec="topk", ratio=ratio, threshold=c, gamma=gamma, period=H, momentum=beta)
    state = algo.init_state(x0)
    x = x0.numpy().astype(np.float64).copy()
    v = np.zeros_like(x)
    xh = x.copy()
    k = int(np.ceil(ratio * D))
    deg = (Wn != 0).sum(1) - 1
    sent_bytes = 0.0
    for t, g in enumerate(grads):
        algo.local_step(state, g, lr)
        algo.mix(state, algo.message(state), W)
        gn = g.numpy().astype(np.float64)
        v = beta * v + gn
        x = x - lr * (beta * v + gn)
        if (t + 1) % H == 0:
            q = np.zeros_like(x)
            for i in range(N):
                delta = x[i] - xh[i]
                if (delta ** 2).sum() > c * lr * lr:
                    idx = np.argsort(-np.abs(delta))[:k]
                    q[i, idx] = delta[idx]
                    sent_bytes += deg[i] * 8 * k
            xh = xh + q
            x = x + gamma * (Wn @ xh - xh)
        np.testing.assert_allclose(state.x.numpy(), x, atol=1e-5)
        np.testing.assert_allclose(state.buffers["x_hat"].numpy(), xh, atol=1e-5)
    assert state.meta["wire_bytes"] == pytest.approx(sent_bytes)


def test_squarm_replicas_track_x_and_skipping_saves_bytes():
    W = _W()
    x0 = _x0(same=True)
    grads = _grads(60)
    algo = make_algorithm("squarm", codec="none", threshold=0.0, gamma=0.5, period=1, momentum=0.0)
    state = algo.init_state(x0)
    for g in grads:
        algo.local_step(state, g, 0.01)
        pre_consensus = state.x.clone()
        algo.mix(state, algo.message(state), W)
        # identity codec: after each sync the public replica equals the pre-consensus model
        torch.testing.assert_close(state.buffers["x_hat"], pre_consensus, atol=1e-5, rtol=1e-5)
    # and s stays the W-weighted sum of the replicas
    torch.testing.assert_close(state.buffers["s"], (W.double() @ state.buffers["x_hat"].double()).float(),
                               atol=1e-5, rtol=1e-5)
    # with top-k, the replicas converge to x when gradients stop (error feedback)
    algo = make_algorithm("squarm", codec="topk", ratio=0.5, threshold=0.0, gamma=0.5, period=1)
    state = algo.init_state(x0)
    for g in grads[:5]:
        algo.local_step(state, g, 0.1)
        algo.mix(state, algo.message(state), W)
    zero = torch.zeros(N, D)
    for _ in range(200):
        algo.local_step(state, zero, 0.0)
        algo.mix(state, algo.message(state), W)
    assert float((state.x - state.buffers["x_hat"]).abs().max()) < 1e-4
    # bytes: a high threshold skips most sends; D-PSGD sends 4d to each neighbour every step
    T = 20
    algo = make_algorithm("squarm", codec="none", threshold=50.0, period=1, gamma=0.5)
    state = _run(algo, x0, grads[:T], 0.1, W)
    dpsgd_bytes = T * N * 2 * 4 * D
    assert 0 < state.meta["triggers"] < T * N
    assert state.meta["wire_bytes"] == pytest.approx(state.meta["triggers"] * 2 * 4 * D)
    assert state.meta["wire_bytes"] < dpsgd_bytes


def test_squarm_zero_lr_keeps_mean_and_node_mix_matches_mix():
    W = _W()
    x0 = _x0()  # different rows: replicas start at zero (CHOCO)
    algo = make_algorithm("squarm", codec="none", period=1, gamma=0.5)
    state = algo.init_state(x0)
    assert float(state.buffers["x_hat"].abs().max()) == 0.0
    mean0 = state.x.double().mean(0)
    for _ in range(30):
        algo.local_step(state, torch.zeros(N, D), 0.0)
        algo.mix(state, algo.message(state), W)
    torch.testing.assert_close(state.x.double().mean(0), mean0, atol=1e-5, rtol=0)
    # per-node path equals the stacked one
    topo = make_topology("ring", N)
    algo = make_algorithm("squarm", codec="topk", ratio=0.5, period=2)
    full = algo.init_state(_x0(same=True))
    nodes = [full.node(i) for i in range(N)]
    for g in _grads(4):
        algo.local_step(full, g, 0.1)
        for i in range(N):
            algo.local_step(nodes[i], g[i : i + 1], 0.1)
        msgs = [algo.message(s)[0].clone() for s in nodes]
        algo.mix(full, algo.message(full), W)
        for i in range(N):
            w = topo.weights(i, 0)
            algo.node_mix(nodes[i], i, {j: msgs[j] for j in w if j != i}, w)
    torch.testing.assert_close(torch.cat([s.x for s in nodes]), full.x, atol=1e-5, rtol=1e-5)


def test_squarm_refuses_time_varying_topology():
    with pytest.raises(ValueError, match="static topology"):
        make_algorithm("squarm").check_topology(make_topology("onepeer-exp", 8))


# ------------------------------------------------------------------------------ EASGD


def test_easgd_matches_numpy():
    W = _W("complete")
    x0, grads = _x0(same=True), _grads(6)
    lr, beta, tau = 0.1, 0.43, 2
    state = _run(make_algorithm("easgd", beta=beta, period=tau), x0, grads, lr, W)
    x = x0.numpy().astype(np.float64).copy()
    c = x.mean(0)
    a = beta / N
    for t, g in enumerate(grads):
        x = x - lr * g.numpy()
        if (t + 1) % tau == 0:
            diff = x - c
            x = x - a * diff
            c = c + a * diff.sum(0)
    np.testing.assert_allclose(state.x.numpy(), x, atol=1e-5)
    np.testing.assert_allclose(state.buffers["center"][0].numpy(), c, atol=1e-5)
    assert state.meta["wire_bytes"] == 3 * N * 4 * D


def test_easgd_zero_lr_keeps_center_plus_workers_and_needs_complete():
    W = _W("complete")
    algo = make_algorithm("easgd", beta=0.5, period=1)
    state = algo.init_state(_x0())
    c0 = state.buffers["center"][0].double()
    total0 = state.x.double().sum(0) + c0
    for _ in range(150):
        algo.local_step(state, torch.zeros(N, D), 0.0)
        algo.mix(state, algo.message(state), W)
    # Σ_i x_i + c is invariant (α Σ(x_i − c) leaves the workers, enters the center)
    torch.testing.assert_close(state.x.double().sum(0) + state.buffers["center"][0].double(), total0,
                               atol=1e-4, rtol=0)
    assert float((state.x - state.buffers["center"]).abs().max()) < 1e-3  # they agree
    with pytest.raises(ValueError, match="complete"):
        algo.check_topology(make_topology("ring", N))


# ------------------------------------------------------------------------------ LSGD


def test_lsgd_matches_numpy_and_pulls_to_leaders():
    x0, grads = _x0(), _grads(4)
    losses = [torch.tensor([3.0, 1.0, 2.0, 5.0]), torch.tensor([1.0, 4.0, 0.5, 2.0])] * 2
    lr, c1, c2 = 0.1, 0.2, 0.3
    algo = make_algorithm("lsgd", groups=2, c1=c1, c2=c2, tau_local=1, tau_global=2)
    state = algo.init_state(x0)
    x = x0.numpy().astype(np.float64).copy()
    for t, (g, f) in enumerate(zip(grads, losses)):
        algo.local_step(state, g, lr, losses=f)
        algo.mix(state)
        x = x - lr * g.numpy()
        fn = f.numpy()
        for grp in ([0, 1], [2, 3]):
            lead = grp[int(np.argmin(fn[grp]))]
            x[grp] = (1 - c1) * x[grp] + c1 * x[lead]
        if (t + 1) % 2 == 0:
            lead = int(np.argmin(fn))
            x = (1 - c2) * x + c2 * x[lead]
        np.testing.assert_allclose(state.x.numpy(), x, atol=1e-5)
    assert state.meta["leaders"] == [0, 2, 2]
    assert contiguous_groups(5, 2) == [[0, 1], [2, 3, 4]] or contiguous_groups(5, 2) == [[0, 1, 2], [3, 4]]


def test_lsgd_zero_lr_converges_to_the_leader_and_needs_losses():
    algo = make_algorithm("lsgd", groups=2, c1=0.5, c2=0.5, tau_local=1, tau_global=1)
    x0 = _x0()
    state = algo.init_state(x0)
    f = torch.tensor([2.0, 3.0, 1.0, 4.0])  # node 2 leads everything
    for _ in range(60):
        algo.local_step(state, torch.zeros(N, D), 0.0, losses=f)
        algo.mix(state)
    torch.testing.assert_close(state.x, x0[2:3].float().expand(N, D), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="loss"):
        algo.local_step(state, torch.zeros(N, D), 0.1)


def test_lsgd_single_leader_mode_matches_numpy():
    x0, grads = _x0(), _grads(4)
    losses = [torch.tensor([3.0, 1.0, 2.0, 5.0]), torch.tensor([1.0, 4.0, 0.5, 2.0])] * 2
    lr, c2 = 0.1, 0.3
    algo = make_algorithm("lsgd", mode="single", c1=0.9, c2=c2, tau_local=1, tau_global=2)  # c1, τ_l unused
    state = algo.init_state(x0)
    x = x0.numpy().astype(np.float64).copy()
    f_sum = np.zeros(N)
    for t, (g, f) in enumerate(zip(grads, losses)):
        algo.local_step(state, g, lr, losses=f)
        algo.mix(state)
        x = x - lr * g.numpy()
        f_sum += f.numpy()
        if (t + 1) % 2 == 0:  # the leader is the lowest mean loss since the last pull
            lead = int(np.argmin(f_sum / 2))
            x = (1 - c2) * x + c2 * x[lead]
            f_sum[:] = 0
        np.testing.assert_allclose(state.x.numpy(), x, atol=1e-5)
    assert algo.wire_bytes(100, 2) == 4 * 100 // 2


def test_lsgd_async_matches_numpy_leader_servers():
    """Async LSGD replayed under its fixed staggered schedule: worker i reports to its
    group's server when (k + i) % τ_l == 0 and to the global one when (k + i) % τ_g == 0,
    in node order; a better loss becomes the server's (possibly stale) leader."""
    T, lr, c1, c2, tl, tg = 6, 0.1, 0.2, 0.3, 2, 3
    x0, grads = _x0(), _grads(T)
    gen = torch.Generator().manual_seed(5)
    losses = [torch.rand(N, generator=gen, dtype=torch.float64) for _ in range(T)]
    algo = make_algorithm("lsgd", mode="async", groups=2, c1=c1, c2=c2, tau_local=tl, tau_global=tg)
    state = algo.init_state(x0)
    x = x0.numpy().astype(np.float64).copy()
    groups = [[0, 1], [2, 3]]
    loc = {0: [x[0].copy(), np.inf], 1: [x[2].copy(), np.inf]}  # group -> [leader copy, its loss]
    glob = [x[0].copy(), np.inf]
    f_sum, f_cnt = np.zeros(N), np.zeros(N)
    became = []
    for t in range(T):
        algo.local_step(state, grads[t], lr, losses=losses[t])
        algo.mix(state)
        x = x - lr * grads[t].numpy()
        f_sum += losses[t].numpy()
        f_cnt += 1
        for i in range(N):
            k = t + 1 + i
            due = [(loc[0 if i in groups[0] else 1], c1, k % tl == 0), (glob, c2, k % tg == 0)]
            if not any(d for _, _, d in due):
                continue
            f = f_sum[i] / f_cnt[i]
            for server, c, d in due:
                if not d:
                    continue
                if f < server[1]:
                    server[0], server[1] = x[i].copy(), f
                    became.append((t, i))
                x[i] = (1 - c) * x[i] + c * server[0]
            f_sum[i], f_cnt[i] = 0, 0
        np.testing.assert_allclose(state.x.numpy(), x, atol=1e-5)
    assert became  # some worker became a leader, and later pulls used stale copies
    with pytest.raises(ValueError, match="mode"):
        make_algorithm("lsgd", mode="ring")
    with pytest.raises(ValueError, match="server_exchange"):
        algo.node_pulls(state.node(0), 0, N, {0: 1.0})


# ------------------------------------------------------------------------------ DaSGD


def test_dasgd_matches_numpy_delayed_average():
    W = _W("complete")
    x0, grads = _x0(), _grads(9)
    lr, tau, delay = 0.1, 3, 2
    state = _run(make_algorithm("dasgd", period=tau, delay=delay), x0, grads, lr, W)
    x = x0.numpy().astype(np.float64).copy()
    pending, due = None, None
    for t, g in enumerate(grads):
        x = x - lr * g.numpy()
        if (t + 1) % tau == 0:
            s = x.copy()
            pending, due = s.mean(0, keepdims=True) - s, t + delay
        if due == t:
            x = x + pending
            due = None
    np.testing.assert_allclose(state.x.numpy(), x, atol=1e-5)
    assert state.meta["wire_bytes"] == 3 * N * (N - 1) * 4 * D


def test_dasgd_special_cases_and_zero_lr_mean():
    W = _W()
    x0, grads = _x0(same=True), _grads(5)
    a = _run(make_algorithm("dasgd", period=1, delay=0), x0, grads, 0.1, W)
    b = _run(make_algorithm("dpsgd", order="atc"), x0, grads, 0.1, W)
    torch.testing.assert_close(a.x, b.x, atol=1e-6, rtol=1e-6)
    algo = make_algorithm("dasgd", period=2, delay=1)
    state = algo.init_state(_x0())
    mean0 = state.x.double().mean(0)
    for _ in range(7):
        algo.local_step(state, torch.zeros(N, D), 0.0)
        algo.mix(state, algo.message(state), W)
    torch.testing.assert_close(state.x.double().mean(0), mean0, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="delay"):
        make_algorithm("dasgd", period=2, delay=2)


def test_new_algorithms_are_registered_and_routed():
    from fedswarm.strategies import registry
    import fedswarm.strategies.decentralized.router as dec

    for name in ("squarm", "easgd", "lsgd", "dasgd"):
        assert name in ALGORITHMS and ALGORITHMS[name].synchronous
    for name in ("squarm", "easgd", "dasgd"):
        assert name in dec.SYNC_ALGORITHMS and registry.get(name).kind == "decentralized"
    dec.DecentralizedStrategy("squarm", 4, "ring")
    dec.DecentralizedStrategy("easgd", 4, "complete")
    with pytest.raises(ValueError, match="complete"):
        dec.DecentralizedStrategy("easgd", 4, "ring")


# ------------------------------------------------------------------------------ Prague


def _prague_sim(profiles, group_size, x0, grads_of=None, lr=0.1):
    from fedswarm.sim.async_groups import PragueSimulation

    def gradient(i, x, k):
        g = torch.zeros(x.numel()) if grads_of is None else grads_of(i, k)
        return g, 0.0

    return PragueSimulation(x0, profiles, gradient, lr=lr, samples_per_step=16, message_bytes=4 * x0.shape[1],
                            group_size=group_size)


def test_partial_allreduce_keeps_mean_and_prague_matches_numpy():
    from fedswarm.algorithms.decentralized import partial_allreduce
    from fedswarm.timemodel import BUILTIN_PROFILES

    x = _x0().float()
    y = partial_allreduce(x, [0, 2])
    torch.testing.assert_close(y.double().mean(0), x.double().mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(y[0], (x[0] + x[2]) / 2)
    torch.testing.assert_close(y[[1, 3]], x[[1, 3]])
    # equal speeds, groups of 2: workers finish together and pair up in index order
    gen = torch.Generator().manual_seed(3)
    table = {(i, k): torch.randn(D, generator=gen) for i in range(N) for k in range(1, 4)}
    sim = _prague_sim([BUILTIN_PROFILES["edge-wifi"]] * N, 2, x, lambda i, k: table[(i, k)])
    sim.advance(2 * N)
    xn = x.numpy().astype(np.float64).copy()
    for k in (1, 2):
        xn = xn - 0.1 * np.stack([table[(i, k)].numpy() for i in range(N)])
        for a, b in ((0, 1), (2, 3)):
            xn[[a, b]] = xn[[a, b]].mean(0)
    sim.advance_to(sim.now + 0.05)  # the second P-Reduces (20 ms), not the third steps (160 ms)
    np.testing.assert_allclose(sim.x.numpy(), xn, atol=1e-5)
    assert sim.groups[:4] == [(0, 1), (2, 3), (0, 1), (2, 3)]


def test_prague_tolerates_a_straggler_where_allreduce_waits():
    from fedswarm.timemodel import BUILTIN_PROFILES

    profiles = [BUILTIN_PROFILES["straggler"]] + [BUILTIN_PROFILES["edge-wifi"]] * 7
    x0 = torch.zeros(8, D)
    horizon = 20.0
    pr = _prague_sim(profiles, 4, x0)
    pr.advance_to(horizon)
    ar = _prague_sim(profiles, 8, x0)  # group of everyone: synchronous all-reduce
    ar.advance_to(horizon)
    fast_pr, fast_ar = min(pr.steps()[1:]), min(ar.steps()[1:])
    assert fast_ar <= ar.steps()[0] + 1 and max(ar.steps()) - min(ar.steps()) <= 1  # lock step with the straggler
    assert fast_pr >= 3 * fast_ar
    assert pr.steps()[0] >= 1  # the straggler still takes part

