"""Homogeneous Learning: the agent learns a node order where one order is clearly best,
the baselines select as named, and the chain runs end to end, one node per round."""

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.sim.inprocess import run_inprocess
from fedswarm.strategies.edge.hl import HomogeneousLearning
from fedswarm.algorithms.selection.hl import NodeStates, QAgent, distance_matrix, hl_reward
from fedswarm.algorithms.selection.hl_attention import (DQNAgent, QNetwork, bellman_targets, chain_state,
                                                        pca_scores, td_loss)
from fedswarm.strategies.registry import resolve_params

N, NEED = 6, 8


def _toy_episode(select, successor, agent=None, max_steps=80) -> int:
    """A chain where training node ``a`` after node ``prev`` makes progress only when
    ``a`` is prev's designated successor (one node order is clearly best). Accuracy is
    progress / NEED; the episode ends at accuracy 1. Returns the rounds it took."""
    s = NodeStates.initial(N).after(0, 1.0)  # the first node is fixed
    progress, rounds = 0, 1
    while rounds < max_steps:
        a = select(s)
        progress += int(a == successor[s.prev])
        acc = progress / NEED
        s2 = s.after(a, 1.0 - acc, acc)
        if agent is not None:
            agent.observe(s, a, hl_reward(acc, 1.0, 0.0), s2, terminal=acc >= 1)
        s, rounds = s2, rounds + 1
        if acc >= 1:
            break
    return rounds


def _toy_successor(seed: int) -> np.ndarray:
    """A hidden cyclic order of the nodes: the best next node after each node."""
    order = np.random.default_rng(seed).permutation(N)
    successor = np.empty(N, dtype=int)
    successor[order] = np.roll(order, -1)
    return successor


def test_agent_learns_the_best_order_on_a_toy_chain():
    successor = _toy_successor(1)
    rng = np.random.default_rng(0)
    others = lambda s: int(rng.choice([a for a in range(N) if a != s.prev]))  # noqa: E731
    random_rounds = np.mean([_toy_episode(others, successor) for _ in range(20)])
    agent = QAgent(N, distance_matrix(N, 0), epsilon_decay=0.15, seed=0)
    rounds = []
    for _ in range(35):
        rounds.append(_toy_episode(agent.act, successor, agent))
        agent.end_episode()
    learned = np.mean(rounds[-5:])  # still learning, at the exploration floor (as the paper reports)
    assert learned <= 2 * (NEED + 1)  # the optimum is NEED + 1 rounds
    assert learned < 0.35 * random_rounds
    assert np.mean(rounds[:5]) > 2 * learned  # it learned: early episodes were much longer


def test_baseline_selectors_and_agent_persistence(tmp_path):
    hl = HomogeneousLearning(4, d=10, selector="round_robin")
    s = NodeStates.initial(4).after(0, 1.0)
    order = []
    for _ in range(5):
        a = hl.select(s)
        order.append(a)
        s = s.after(a, 1.0)
    assert order == [1, 2, 3, 0, 1]
    rnd = HomogeneousLearning(4, d=10, selector="random", seed=3)
    assert {rnd.select(s) for _ in range(50)} == {0, 1, 2, 3} - {s.prev}  # the model always moves on
    with pytest.raises(ValueError, match="selector"):
        HomogeneousLearning(4, d=10, selector="greedy")
    with pytest.raises(ConfigError, match="selector"):
        resolve_params("hl", {"selector": "greedy"})
    D = distance_matrix(4, 0)
    assert np.allclose(D, D.T) and np.all(np.diag(D) == 0) and D.max() < 1
    # The agent survives a restart through its file.
    path = tmp_path / "agent.json"
    a = QAgent(4, D, seed=0)
    a.theta[:] = np.arange(a.theta.size)
    a.end_episode()
    a.save(path)
    b = QAgent(4, D, seed=0)
    assert b.load(path) and np.array_equal(b.theta, a.theta) and b.epsilon == a.epsilon


def test_hl_runs_end_to_end_one_node_per_round(store):
    cfg = RunConfig(task="digits-mlp", strategy="hl", clients=4, rounds=12, local_epochs=1, batch_size=32,
                    partition="dirichlet:0.5", params={"target_accuracy": 0.6, "max_episode_rounds": 5})
    rid = store.create_run(cfg.model_dump())
    assert run_inprocess(cfg, store=store, run_id=rid) == "finished"
    rows = store.export_result(rid)["rounds"][1:]
    assert len(rows) == 12 and all(r["num_clients"] == 1 for r in rows)
    assert rows[0]["node"] == 0 and rows[0]["episode"] == 1 and rows[0]["episode_round"] == 1
    for prev, r in zip(rows, rows[1:]):
        ended = prev["test_accuracy"] >= 0.6 or prev["episode_round"] == 5
        assert r["episode"] == prev["episode"] + int(ended)
        assert r["episode_round"] == (1 if ended else prev["episode_round"] + 1)
        if r["episode_round"] == 1:
            assert r["node"] == 0 and r["hop_cost"] == 0  # each episode starts at the fixed node
    # One model hop per round, through the server: the model down and back up.
    assert all(r["bytes_down"] > r["p2p_bytes"] and r["bytes_up"] > r["p2p_bytes"] for r in rows)
    nodes = store.node_rounds(rid)
    assert len(nodes) == 12


# --------------------------------------------------------------------------- the attention (DQN) policy


def _np_mlp(q, s: np.ndarray) -> np.ndarray:
    """Independent forward pass of the Q-network in numpy."""
    lin = [m for m in q.net if isinstance(m, torch.nn.Linear)]
    x = s.astype(np.float64)
    for i, layer in enumerate(lin):
        x = x @ layer.weight.detach().double().numpy().T + layer.bias.detach().double().numpy()
        if i < len(lin) - 1:
            x = np.maximum(x, 0.0)
    return x


def test_q_network_shapes_and_forward_match_numpy():
    agent = DQNAgent(10, 100, seed=3)
    dims = [(m.in_features, m.out_features) for m in agent.q.net if isinstance(m, torch.nn.Linear)]
    assert dims == [(100, 500), (500, 200), (200, 10)]  # the paper's 100 -> 500 -> 200 -> 10
    s = np.random.default_rng(0).normal(size=(7, 100))
    with torch.no_grad():
        got = agent.q(torch.tensor(s, dtype=torch.float32)).numpy()
    assert got.shape == (7, 10)
    np.testing.assert_allclose(got, _np_mlp(agent.q, s), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(agent.q_values(s[0]), _np_mlp(agent.q, s[:1])[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="state has 99 values"):
        agent.q_values(np.zeros(99))


def test_pca_state_matches_numpy_svd_and_the_chain_case():
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(6, 40))
    got = pca_scores(torch.tensor(rows), 4).numpy()
    xc = rows - rows.mean(axis=0)
    u, s, _ = np.linalg.svd(xc, full_matrices=False)
    want = (u * s)[:, :4]
    want *= np.sign(want[np.abs(want).argmax(axis=0), range(4)])
    np.testing.assert_allclose(got, want, atol=1e-9)
    # more components than the data's rank (5 for 6 centred rows): zeros
    assert np.allclose(pca_scores(torch.tensor(rows), 8).numpy()[:, 5:], 0.0)
    # The chain: every node holds the shared model but the one that trained, so the centred
    # stack is rank one: (e_node - 1/n)·||delta|| on the first component, zero elsewhere.
    n, shared = 5, rng.normal(size=30)
    trained = shared + rng.normal(size=30)
    state = chain_state(shared, trained, 2, n).reshape(n, n)
    e = np.zeros(n)
    e[2] = 1.0
    np.testing.assert_allclose(state[:, 0], (e - 1 / n) * np.linalg.norm(trained - shared), rtol=1e-5)
    assert np.allclose(state[:, 1:], 0.0, atol=1e-5)
    assert np.all(chain_state(shared, None, 0, n) == 0)  # an episode's start: all nodes alike
    assert chain_state(np.zeros(3), np.ones(3), 0, 12).shape == (12 * 10,)  # k = min(10, n)
    with pytest.raises(ValueError, match="trained model has 4 values"):
        chain_state(np.zeros(3), np.ones(4), 0, n)


def test_td_loss_gradient_and_bellman_targets_against_numpy():
    torch.manual_seed(0)
    q = QNetwork(6, 3, hidden=(5,)).double()
    s = torch.randn(4, 6, dtype=torch.float64)
    a = torch.tensor([0, 2, 1, 2])
    y = torch.randn(4, dtype=torch.float64)
    loss = td_loss(q, s, a, y)
    loss.backward()

    def np_loss() -> float:
        out = _np_mlp(q, s.numpy())
        return float(np.mean((out[np.arange(4), a.numpy()] - y.numpy()) ** 2))

    assert abs(loss.item() - np_loss()) < 1e-12
    w = q.net[0].weight
    for i, j in [(0, 0), (2, 3), (4, 5)]:  # central finite differences of the numpy loss
        with torch.no_grad():
            w[i, j] += 1e-6
            up = np_loss()
            w[i, j] -= 2e-6
            down = np_loss()
            w[i, j] += 1e-6
        assert abs((up - down) / 2e-6 - w.grad[i, j].item()) < 1e-6
    r, nq = torch.tensor([1.0, -2.0]), torch.tensor([[0.5, 3.0], [4.0, -1.0]])
    assert bellman_targets(r, nq, torch.tensor([False, True]), 0.9).tolist() == pytest.approx([1 + 0.9 * 3, -2.0])


def _onehot_state(prev: int) -> np.ndarray:
    """The chain state's shape on the toy: the first component marks the last node."""
    v = np.zeros(N * N, dtype=np.float32)
    if prev >= 0:
        v[prev * N: prev * N + N] = -1.0 / N
        v[prev * N] = (N - 1) / N
    return v


def test_attention_agent_learns_the_best_order_on_a_toy_chain():
    successor = _toy_successor(1)
    rng = np.random.default_rng(0)
    others = lambda s: int(rng.choice([a for a in range(N) if a != s.prev]))  # noqa: E731
    random_rounds = np.mean([_toy_episode(others, successor) for _ in range(20)])
    agent = DQNAgent(N, N * N, epsilon_decay=0.1, seed=0)
    rounds = []
    for _ in range(40):
        prev, progress, n = 0, 0, 1
        s = _onehot_state(0)
        while n < 80:
            a = agent.act(s, prev)
            assert a != prev  # the model always moves on
            progress += int(a == successor[prev])
            s2 = _onehot_state(a)
            agent.remember(s, a, hl_reward(progress / NEED, 1.0, 0.0), s2, progress >= NEED)
            s, prev, n = s2, a, n + 1
            if progress >= NEED:
                break
        rounds.append(n)
        agent.end_episode()
    learned = np.mean(rounds[-10:])
    assert learned < 0.5 * random_rounds, (rounds, random_rounds)
    assert np.mean(rounds[:5]) > 2 * learned


def test_hl_attention_selector_runs_and_learns_from_its_observations(store):
    cfg = RunConfig(task="digits-mlp", strategy="hl", clients=4, rounds=10, local_epochs=1, batch_size=32,
                    partition="dirichlet:0.5", params={"selector": "attention", "target_accuracy": 0.99,
                                                        "max_episode_rounds": 4})
    rid = store.create_run(cfg.model_dump())
    assert run_inprocess(cfg, store=store, run_id=rid) == "finished"
    rows = store.export_result(rid)["rounds"][1:]
    assert len(rows) == 10 and [r["episode"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 2
    assert all(r["node"] == 0 for r in rows if r["episode_round"] == 1)
    assert all(a["node"] != b["node"] for a, b in zip(rows, rows[1:]) if b["episode_round"] > 1)
    assert rows[-1]["explore_epsilon"] < rows[0]["explore_epsilon"]  # two episodes ended: exploration decayed
    assert all("epsilon" not in r for r in rows)  # that is the privacy budget (DP): not spent here
    from fedswarm.sim.report import summary_table

    result = store.export_result(rid)
    assert result["summary"].get("epsilon") is None
    summary_table(result)  # `fedswarm sim`'s table (it raised on the exploration rate read as a privacy budget)
    hl = HomogeneousLearning(4, d=10, selector="attention")
    assert isinstance(hl.agent, DQNAgent) and hl.agent.state_dim == 16
    hl = HomogeneousLearning(4, d=10, selector="attention", attention_state="pca+visits")
    assert hl.agent.state_dim == 16 + 8
    s = NodeStates.initial(4).after(0, 1.0).after(2, 1.0).after(0, 1.0)  # steps 1..3: nodes 0, 2, 0
    assert hl._observe(np.zeros(16, dtype=np.float32), s)[16:].tolist() == pytest.approx(
        [0, 1, 0, 1] + [0.0, 1.0, 0.25, 1.0])  # never trained; waited/n (node 2: 3 - 2 = 1 step)
    with pytest.raises(ValueError, match="attention_state"):
        HomogeneousLearning(4, d=10, selector="attention", attention_state="graph")


def test_the_dqn_agent_survives_a_restart_through_its_file_and_refuses_another_shape(tmp_path):
    path = tmp_path / "dqn.json"
    assert not DQNAgent(4, 16, seed=0).load(path)  # no file yet: a fresh agent
    a = DQNAgent(4, 16, seed=0)
    a.end_episode()
    a.save(path)
    b = DQNAgent(4, 16, seed=1)  # other initial weights
    assert b.load(path) and b.epsilon == a.epsilon and b.episodes == a.episodes == 1
    for (k, va), vb in zip(a.q.state_dict().items(), b.q.state_dict().values()):
        assert torch.equal(va, vb), k
    with pytest.raises(ValueError, match="not a DQN agent for 5 nodes"):
        DQNAgent(5, 25, seed=0).load(path)


def test_dqn_agent_checkpoint_continues_exactly_where_it_stopped():
    """The DQN selector's state_dict (packed replay memory, network, Adam, RNG, ε) loaded into
    a fresh agent: the two then learn and act identically; the state is a snapshot."""
    import copy
    import io

    from fedswarm.server.checkpoint import safe_globals

    rng = np.random.default_rng(0)
    transitions = [(rng.normal(size=6), i % 4, float(rng.normal()), rng.normal(size=6), i % 5 == 0) for i in range(40)]
    a = DQNAgent(4, 6, seed=1, batch=8, fit_batch=4, replay=20, epsilon_decay=1.0)
    for i, t in enumerate(transitions[:30]):  # more than the memory holds: the oldest are dropped
        a.remember(*t)
        if i % 7 == 6:
            a.end_episode()
    state = a.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)  # as the checkpoint writes it
    frozen = copy.deepcopy(state)
    b = DQNAgent(4, 6, seed=99, batch=8, fit_batch=4, replay=20)
    with torch.serialization.safe_globals(safe_globals()):  # as the checkpoint reads it
        b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert len(b.memory) == 20 and b.epsilon == a.epsilon and b.episodes == a.episodes
    for t in transitions[30:]:
        for agent in (a, b):
            agent.remember(*t)
        assert a.train_pass() == b.train_pass()
        s = t[3]
        assert [a.act(s, 0) for _ in range(5)] == [b.act(s, 0) for _ in range(5)]
    np.testing.assert_array_equal(a.q_values(transitions[0][0]), b.q_values(transitions[0][0]))
    torch.testing.assert_close(state["memory"]["s"], frozen["memory"]["s"])  # a snapshot: later learning left it
    torch.testing.assert_close(state["q"], frozen["q"])
    with pytest.raises(ValueError, match="state size 7"):
        DQNAgent(4, 7).load_state_dict(frozen)
