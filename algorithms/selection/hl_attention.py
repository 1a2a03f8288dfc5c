"""HL's "self-attention" policy: the DQN node selector of Sun & Ochiai (``docs/algorithms.md`` §13).

The paper calls its selection mechanism *self-attention*: a reinforcement-learning agent
that observes the state of the nodes' models and picks the next node. In the paper's
reference code that agent is a DQN, not an attention layer, and this module follows it:

- **State** (:func:`chain_state`): the flattened weights of all ``n`` node models, stacked
  ``[n, d]``, reduced by PCA to ``k = min(10, n)`` components per node and flattened
  (``n·k``; 100 for the paper's 10 nodes). In the chain every node holds the shared model
  except the one that just trained, which holds its fresh update; before the first hop all
  nodes hold the same model and the state is zero. The server of our HL strategy sees both
  models (the one it sent and the one that came back), so it builds this state exactly,
  without reading any other node.
- **Q-network** (:class:`QNetwork`): MLP ``n·k → 500 → 200 → n``, ReLU.
- **Learning** (:class:`DQNAgent`): replay memory of transitions ``(s, a, r, s', done)``;
  once per episode (as the reference code) one pass over a random minibatch of 128 in
  steps of 16 with Adam (lr 1e-3) on the MSE between ``Q(s, a)`` and the Bellman target
  ``r + γ·max_a' Q(s', a')`` (``r`` alone at a terminal step), γ = 0.9; ε-greedy with
  ``ε ← ε·exp(−decay)`` per episode. What differs from the reference code: the targets
  are not L2-normalised per row (a quirk of that code that changes the regression target
  of every action), and ε stops at a floor ``epsilon_min``; the model never stays on the
  node that holds it (the strategy's rule).

Torch only; ``numpy`` only at the edges (state vectors in and out).
"""

from __future__ import annotations

import math
import random
import copy
from collections import deque
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedswarm.algorithms.selection.hl import AgentFile

__all__ = ["pca_scores", "chain_state", "visit_features", "QNetwork", "DQNAgent", "bellman_targets", "td_loss"]

HIDDEN = (500, 200)


def pca_scores(rows: torch.Tensor, k: int) -> torch.Tensor:
    """PCA scores ``[m, k]`` of the rows of ``rows`` (``[m, d]``): the rows centred, projected
    on the first ``k`` principal directions. Signs are fixed so that each component's
    largest-magnitude score is positive; components beyond the data's rank are zero."""
    x = rows.to(torch.float64)
    # directions below rounding of the data (identical rows leave ~1e-16 after centring) are zero
    rank_tol = 1e-9 * float(torch.linalg.norm(x))
    x = x - x.mean(dim=0, keepdim=True)
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    scores = u * s  # [m, r]
    r = min(k, scores.shape[1])
    scores = scores[:, :r]
    scores = torch.where((s[:r] > rank_tol)[None, :], scores, torch.zeros_like(scores))
    big = scores.abs().argmax(dim=0)
    sign = torch.sign(scores[big, torch.arange(r)])
    scores = scores * torch.where(sign == 0, torch.ones_like(sign), sign)[None, :]
    if r < k:
        scores = torch.cat([scores, scores.new_zeros(scores.shape[0], k - r)], dim=1)
    return scores


def chain_state(shared: np.ndarray | torch.Tensor, trained: np.ndarray | torch.Tensor | None, node: int, n: int,
                k: int = 10) -> np.ndarray:
    """The paper's observation after ``node`` trained in a chain of ``n`` nodes: the node
    models stacked (every node holds ``shared``, the model before the hop, except ``node``,
    which holds ``trained``), PCA to ``min(k, n)`` components per node, flattened row by row
    (``[n·min(k, n)]``, float32). ``trained=None``: all nodes hold ``shared`` (an episode's
    start; the state is zero)."""
    shared = torch.as_tensor(np.asarray(shared), dtype=torch.float64).reshape(1, -1)
    rows = shared.repeat(n, 1)
    if trained is not None:
        t = torch.as_tensor(np.asarray(trained), dtype=torch.float64).reshape(-1)
        if t.numel() != shared.shape[1]:
            raise ValueError(f"trained model has {t.numel()} values, the shared model {shared.shape[1]}")
        if not 0 <= node < n:
            raise ValueError(f"node {node} is not in 0..{n - 1}")
        rows[node] = t
    return pca_scores(rows, min(k, n)).reshape(-1).to(torch.float32).numpy()


def visit_features(last_visit: np.ndarray, step: int) -> np.ndarray:
    """Per node: whether it has not trained in this episode yet, and how long ago it last
    did (``min((step − last_visit)/n, 1)``, 1 if never), ``[2n]`` float32. Not in the paper's
    state: the ``pca+visits`` variant adds them (the chain's history, which the PCA of the
    node models, equal but for the last node, does not carry)."""
    last_visit = np.asarray(last_visit)
    n = last_visit.size
    never = last_visit < 0
    waited = np.where(never, 1.0, np.minimum((step - last_visit) / n, 1.0))
    return np.concatenate([never.astype(np.float32), waited.astype(np.float32)])


class QNetwork(nn.Module):
    """``Q(s, ·)``: MLP ``state_dim → 500 → 200 → n_actions`` with ReLU (the paper's DQN)."""

    def __init__(self, state_dim: int, n_actions: int, hidden: tuple[int, ...] = HIDDEN):
        super().__init__()
        dims = (state_dim, *hidden, n_actions)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims, dims[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.net(s)


def bellman_targets(rewards: torch.Tensor, next_q: torch.Tensor, done: torch.Tensor, gamma: float) -> torch.Tensor:
    """``r + γ·max_a' Q(s', a')`` where not ``done``, else ``r``."""
    return rewards + gamma * next_q.max(dim=1).values * (~done).to(rewards.dtype)


def td_loss(q: nn.Module, s: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error between ``Q(s, a)`` and the targets ``y`` (the paper's MSE loss;
    the other actions' outputs get no gradient)."""
    return ((q(s).gather(1, a[:, None])[:, 0] - y) ** 2).mean()


class DQNAgent(AgentFile):
    """ε-greedy DQN over state vectors (see the module docstring).

    Parameters
    ----------
    n : int
        Number of nodes (actions).
    state_dim : int
        Length of a state vector (``n·min(10, n)`` for :func:`chain_state`).
    gamma, lr : float
        Discount and Adam step size (the paper: 0.9, 1e-3).
    epsilon, epsilon_decay, epsilon_min : float
        Exploration and its per-episode decay ``ε ← max(ε_min, ε·exp(−decay))`` (the
        paper: from 1, decay 0.02 over 120 episodes, no floor).
    batch, fit_batch, replay : int
        Transitions sampled per training pass (128), Adam minibatch within it (16), replay
        memory size (50,000).
    passes : int
        Training passes at the end of each episode (the paper: 1; more learn faster from
        fewer episodes).
    seed : int
        Seeds the network's initialisation, exploration and replay sampling.
    """

    def __init__(self, n: int, state_dim: int, gamma: float = 0.9, lr: float = 1e-3, epsilon: float = 1.0,
                 epsilon_decay: float = 0.02, epsilon_min: float = 0.05, batch: int = 128, fit_batch: int = 16,
                 replay: int = 50_000, passes: int = 1, seed: int = 0, hidden: tuple[int, ...] = HIDDEN):
        if n < 2:
            raise ValueError(f"the DQN selector needs at least 2 nodes, got {n}")
        self.n, self.state_dim = int(n), int(state_dim)
        self.gamma, self.lr = float(gamma), float(lr)
        self.epsilon, self.epsilon_decay, self.epsilon_min = float(epsilon), float(epsilon_decay), float(epsilon_min)
        self.batch, self.fit_batch, self.passes = int(batch), int(fit_batch), int(passes)
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            self.q = QNetwork(self.state_dim, self.n, hidden).to(torch.float32)
        self.opt = torch.optim.Adam(self.q.parameters(), lr=self.lr)
        self.memory: deque = deque(maxlen=int(replay))
        self._rng = random.Random(seed)
        self.episodes = 0
        self.last_loss: float | None = None

    # -- acting ----------------------------------------------------------------------
    def q_values(self, state: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.q(self._vec(state)[None])[0].numpy().astype(float)

    def act(self, state: np.ndarray, prev: int, explore: bool = True) -> int:
        """Next node: random (not ``prev``) with probability ε when exploring, else the
        argmax of ``Q(state, ·)`` over nodes other than ``prev``."""
        allowed = [a for a in range(self.n) if a != prev]
        if explore and self._rng.random() < self.epsilon:
            return self._rng.choice(allowed)
        q = self.q_values(state)
        return max(allowed, key=lambda a: q[a])

    # -- learning --------------------------------------------------------------------
    def remember(self, s: np.ndarray, a: int, r: float, s2: np.ndarray, done: bool) -> None:
        if not 0 <= a < self.n:
            raise ValueError(f"action {a} is not in 0..{self.n - 1}")
        self.memory.append((self._vec(s), int(a), float(r), self._vec(s2), bool(done)))

    def train_pass(self) -> float | None:
        """One pass over a random minibatch of ``batch`` transitions (all there are, if
        fewer) in Adam steps of ``fit_batch``; targets from the network before the pass.
        Returns the mean loss, None when memory is empty."""
        if not self.memory:
            return None
        picks = self._rng.sample(range(len(self.memory)), min(self.batch, len(self.memory)))
        s, a, r, s2, done = (list(x) for x in zip(*(self.memory[i] for i in picks)))
        s, s2 = torch.stack(s), torch.stack(s2)
        a = torch.tensor(a)
        with torch.no_grad():
            y = bellman_targets(torch.tensor(r, dtype=torch.float32), self.q(s2), torch.tensor(done), self.gamma)
        losses = []
        for i in range(0, len(picks), self.fit_batch):
            sl = slice(i, i + self.fit_batch)
            loss = td_loss(self.q, s[sl], a[sl], y[sl])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
        self.last_loss = sum(losses) / len(losses)
        return self.last_loss

    def end_episode(self) -> None:
        """Train (``passes`` passes; the reference code: one after each episode) and decay ε."""
        for _ in range(self.passes):
            self.train_pass()
        self.episodes += 1
        self.epsilon = max(self.epsilon_min, self.epsilon * math.exp(-self.epsilon_decay))

    # -- checkpoint (fedswarm.strategies.resumable captures the agent through these) ---------
    def state_dict(self) -> dict:
        """Everything that moves: the network and Adam's state, exploration, episodes, the
        RNG, and the replay memory packed into five tensors, oldest first. Packed, a
        checkpoint costs one copy of the memory; deep-copied transition by transition (one
        tuple and two tensors each) it cost more with every hop, half of each hop's time
        after 200 hops."""
        mem = list(self.memory)
        s, a, r, s2, done = (list(x) for x in zip(*mem)) if mem else ([], [], [], [], [])
        empty = torch.zeros((0, self.state_dim))
        return {"q": copy.deepcopy(self.q.state_dict()), "opt": copy.deepcopy(self.opt.state_dict()),
                "epsilon": self.epsilon, "episodes": self.episodes, "last_loss": self.last_loss,
                "rng": self._rng.getstate(),
                "memory": {"s": torch.stack(s) if mem else empty, "a": torch.tensor(a, dtype=torch.int64),
                           "r": torch.tensor(r, dtype=torch.float64), "s2": torch.stack(s2) if mem else empty,
                           "done": torch.tensor(done, dtype=torch.bool)}}

    def load_state_dict(self, state: dict) -> None:
        m = state["memory"]
        rows = m["a"].numel()
        if any(m[k].shape != (rows, self.state_dim) for k in ("s", "s2")) or m["r"].numel() != rows \
                or m["done"].numel() != rows:
            raise ValueError(f"replay memory of the checkpoint does not fit a DQN agent with state size "
                             f"{self.state_dim}")
        self.q.load_state_dict(state["q"])
        self.opt.load_state_dict(state["opt"])
        self.epsilon, self.episodes = float(state["epsilon"]), int(state["episodes"])
        self.last_loss = state["last_loss"]
        self._rng.setstate(state["rng"])
        self.memory = deque(zip(m["s"].clone().unbind(0), m["a"].tolist(), m["r"].tolist(), m["s2"].clone().unbind(0),
                                m["done"].tolist()), maxlen=self.memory.maxlen)

    # -- persistence -----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"kind": "dqn", "n": self.n, "state_dim": self.state_dim, "epsilon": self.epsilon,
                "episodes": self.episodes, "weights": {k: v.tolist() for k, v in self.q.state_dict().items()}}

    def restore(self, data: dict, path: Path) -> None:
        if data.get("kind") != "dqn" or int(data["n"]) != self.n or int(data["state_dim"]) != self.state_dim:
            raise ValueError(f"agent file {path} is not a DQN agent for {self.n} nodes and state size {self.state_dim}")
        self.q.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in data["weights"].items()})
        self.epsilon, self.episodes = float(data["epsilon"]), int(data["episodes"])

    def _vec(self, state: np.ndarray | torch.Tensor) -> torch.Tensor:
        v = torch.as_tensor(np.asarray(state, dtype=np.float32)).reshape(-1)
        if v.numel() != self.state_dim:
            raise ValueError(f"state has {v.numel()} values, the agent expects {self.state_dim}")
        if not torch.isfinite(v).all():
            raise ValueError("state has non-finite values")
        return v
