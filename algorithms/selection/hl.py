"""The node-selection agent of Homogeneous Learning (``docs/algorithms.md`` §13).

The paper's agent is a DQN (MLP 100→500→200→10) on a PCA of all ten nodes' model
weights, trained over 120 episodes with ε-greedy exploration, replay and discount 0.9;
reward ``r = 32^(acc − target) − D[prev, a]/10 − 1``. What we simplify, and why:

- **State.** Not the weights of every node's model (that needs a global observer that
  reads all models, which HL's chain does not have). The server sees only what the chain
  tells it: which node holds the model (``prev``), when each node last trained in this
  episode, the training loss and example count each node last reported, the travelling
  model's test accuracy, and the distances ``D[prev, ·]``. :class:`NodeStates` holds these.
- **Q-function.** Linear: ``Q(s, a) = θ · φ(s, a)`` (:meth:`QAgent.features`), with a
  tabular ``(prev, a)`` term (which node should follow which: a node order), per-action
  features whose weights are shared across nodes (how long ``a`` has waited, its size,
  its last loss, the hop distance), and state features that carry the state's value. In
  our runs the tabular term does most of the work: shared features alone learned
  policies worse than random (they favour the largest nodes and ping-pong between them).
- **Learning.** Every-visit Monte Carlo control by default (each episode's discounted
  returns, regressed on minibatches from a small replay buffer of recent episodes;
  semi-gradient TD(0) as an option), ε-greedy with ε ← ε·exp(−decay) per episode as in
  the paper's schedule, down to a floor ``epsilon_min``.
- **Actions.** The model always moves: the node that holds it is not a candidate.

The same reward as the paper; an episode ends when the test accuracy reaches the target
(terminal) or after a step budget (truncated, bootstrapped from max Q).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["AgentFile", "NodeStates", "QAgent", "distance_matrix", "hl_reward"]


def distance_matrix(n: int, seed: int) -> np.ndarray:
    """The paper's communication distances: symmetric, uniform in [0, 1), zero diagonal."""
    rng = np.random.default_rng(seed + 7_777)
    upper = np.triu(rng.random((n, n)), 1)
    return upper + upper.T


def hl_reward(accuracy: float, target: float, hop: float) -> float:
    """``32^(acc − target) − hop − 1`` (hop = distance_weight · D[prev, a])."""
    return float(32.0 ** (accuracy - target) - hop - 1.0)


@dataclass
class NodeStates:
    """What the agent observes at one step of an episode.

    Attributes
    ----------
    prev : int
        The node that trained last (it holds the model).
    step : int
        Steps taken in this episode.
    last_visit : np.ndarray
        ``[n]`` the step of each node's last training in this episode, −1 if none.
    last_loss : np.ndarray
        ``[n]`` the training loss each node last reported (any episode), NaN if never.
    accuracy : float
        The travelling model's test accuracy now.
    examples : np.ndarray, optional
        ``[n]`` the training examples each node reported (any episode), NaN if never.
    """

    prev: int
    step: int
    last_visit: np.ndarray
    last_loss: np.ndarray
    accuracy: float = 0.0
    examples: np.ndarray | None = None

    @classmethod
    def initial(cls, n: int, last_loss: np.ndarray | None = None, examples: np.ndarray | None = None) -> NodeStates:
        """An episode's start: nothing visited; what nodes reported before is kept."""
        loss = np.full(n, np.nan) if last_loss is None else last_loss.copy()
        ex = np.full(n, np.nan) if examples is None else examples.copy()
        return cls(prev=-1, step=0, last_visit=np.full(n, -1), last_loss=loss, examples=ex)

    def after(self, node: int, loss: float | None, accuracy: float = 0.0, examples: int | None = None) -> NodeStates:
        """The state once ``node`` has trained (and reported ``loss`` and ``examples``;
        the model's test accuracy is then ``accuracy``)."""
        visit, losses = self.last_visit.copy(), self.last_loss.copy()
        ex = np.full(len(visit), np.nan) if self.examples is None else self.examples.copy()
        visit[node] = self.step + 1
        if loss is not None and math.isfinite(loss):
            losses[node] = loss
        if examples is not None:
            ex[node] = examples
        return NodeStates(prev=node, step=self.step + 1, last_visit=visit, last_loss=losses, accuracy=accuracy,
                          examples=ex)


class AgentFile:
    """An agent kept in one JSON file between runs: subclasses give ``to_dict`` (what is saved)
    and ``restore(data, path)`` (check that ``data`` fits this run, then take it)."""

    def to_dict(self) -> dict:
        raise NotImplementedError

    def restore(self, data: dict, path: Path) -> None:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    def load(self, path: str | Path) -> bool:
        """Load what :meth:`save` wrote; False when there is no such file."""
        p = Path(path)
        if not p.is_file():
            return False
        self.restore(json.loads(p.read_text()), p)
        return True


@dataclass
class QAgent(AgentFile):
    """ε-greedy linear Q-learner choosing the next node (see the module docstring).

    Parameters
    ----------
    n : int
        Number of nodes (actions).
    distance : np.ndarray
        ``[n, n]`` communication distances (a feature; the reward's hop cost).
    gamma, lr : float
        Discount and step size.
    epsilon, epsilon_decay, epsilon_min : float
        Exploration rate, its per-episode decay ``ε ← max(ε_min, ε·exp(−decay))`` and its
        floor (a little exploration stays on, as in DQN's evaluation: a greedy policy on an
        approximate Q can loop on a node forever).
    shaping : float
        Weight of potential-based shaping on the model's accuracy (0: the paper's reward).
    target : str
        ``mc``: learn from each episode's discounted returns at its end (the default:
        steadier here than TD(0), whose bootstrapped targets on this aliased state let
        the policy drift); ``td``: a TD(0) step after every transition.
    tabular_boost : float
        Step-size multiplier of the tabular ``(prev, a)`` weights.
    batch, replay : int
        Minibatch and replay-buffer sizes. The buffer is small (about ten episodes) so
        that Monte Carlo returns come from recent policies.
    seed : int
        Seed of exploration and replay sampling.
    """

    n: int
    distance: np.ndarray
    gamma: float = 0.9
    lr: float = 0.1
    epsilon: float = 1.0
    epsilon_decay: float = 0.1
    epsilon_min: float = 0.05
    shaping: float = 0.0
    target: str = "mc"
    tabular_boost: float = 4.0
    batch: int = 32
    replay: int = 500
    seed: int = 0
    episodes: int = 0
    theta: np.ndarray = field(default=None)  # type: ignore[assignment]

    ACTION_FEATURES = ("staleness", "never_visited", "repeat", "loss", "examples", "distance")
    STATE_FEATURES = ("bias", "accuracy", "visited", "steps")

    def __post_init__(self) -> None:
        if self.theta is None:
            self.theta = np.zeros(self.n * self.n + len(self.ACTION_FEATURES) + len(self.STATE_FEATURES))
        self._rng = np.random.default_rng(self.seed)
        if self.target not in ("mc", "td"):
            raise ValueError(f"target must be 'mc' or 'td', got {self.target!r}")
        self._buffer: list[tuple[np.ndarray, float, np.ndarray | None]] = []
        self._pos = 0
        self._episode: list[tuple[np.ndarray, float, NodeStates | None]] = []

    # -- features and values ---------------------------------------------------------
    def features(self, s: NodeStates) -> np.ndarray:
        """``φ(s, a)`` for every action, ``[n, n·n + 6 + 4]``: per-action features (the
        tabular ``(prev, a)`` indicator, then how long ``a`` has waited, whether it has not
        trained this episode, whether it is ``prev``, its last loss and its example count
        relative to the largest, ``D[prev, a]``), centred over the actions so that they carry only an
        action's *advantage*; then state features shared by all actions (bias, test
        accuracy, share of nodes visited, episode steps / n), which carry the state's
        value. Without the centring the per-action weights soak up how far the episode
        is from its end (a node "not yet visited" means "early in the episode")."""
        n = self.n
        a = np.arange(n)
        per_action = np.zeros((n, n * n + len(self.ACTION_FEATURES)))
        if s.prev >= 0:
            per_action[a, s.prev * n + a] = 1.0  # tabular (prev, a)
        never = s.last_visit < 0
        waited = np.where(never, n, s.step - s.last_visit)
        loss = np.nan_to_num(s.last_loss, nan=0.0)
        top = loss.max() if loss.size and loss.max() > 0 else 1.0
        ex = np.zeros(n) if s.examples is None else np.nan_to_num(s.examples, nan=0.0)
        per_action[:, n * n:] = np.stack([
            np.minimum(waited / n, 1.0),
            never.astype(float),
            (a == s.prev).astype(float),
            loss / top,
            ex / ex.max() if ex.max() > 0 else ex,
            self.distance[s.prev] if s.prev >= 0 else np.zeros(n),
        ], axis=1)
        per_action -= per_action.mean(axis=0, keepdims=True)
        state = np.array([1.0, s.accuracy, 1.0 - never.mean(), min(s.step / n, 4.0)])
        return np.concatenate([per_action, np.broadcast_to(state, (n, state.size))], axis=1)

    def q_values(self, s: NodeStates) -> np.ndarray:
        return self.features(s) @ self.theta

    def act(self, s: NodeStates, explore: bool = True, allow_stay: bool = False) -> int:
        """The next node: random with probability ε (when exploring), else argmax Q (ties
        broken at random); never ``s.prev`` unless ``allow_stay``."""
        allowed = np.ones(self.n, dtype=bool)
        if not allow_stay and 0 <= s.prev < self.n and self.n > 1:
            allowed[s.prev] = False
        if explore and self._rng.random() < self.epsilon:
            return int(self._rng.choice(np.flatnonzero(allowed)))
        q = np.where(allowed, self.q_values(s), -np.inf)
        best = np.flatnonzero(q >= q.max() - 1e-12)
        return int(self._rng.choice(best))

    # -- learning --------------------------------------------------------------------
    def observe(self, s: NodeStates, a: int, r: float, s2: NodeStates, terminal: bool) -> None:
        """Record one transition. ``mc``: kept until :meth:`end_episode`, which learns from
        the episode's discounted returns; ``td``: stored and learned from at once (one
        TD(0) step on a replay minibatch). With ``shaping`` w > 0 the reward gets
        ``γ·w·acc(s2) − w·acc(s)`` (potential-based shaping on the model's accuracy, kept
        at the terminal step)."""
        r = float(r) + self.shaping * (self.gamma * s2.accuracy - s.accuracy)
        phi = self.features(s)[a]
        if self.target == "mc":
            self._episode.append((phi, r, None if terminal else s2))
            return
        self._store((phi, r, None if terminal else self.features(s2)))
        self._learn()

    def _store(self, item: tuple) -> None:
        if len(self._buffer) < self.replay:
            self._buffer.append(item)
        else:
            self._buffer[self._pos] = item
            self._pos = (self._pos + 1) % self.replay

    def _learn(self) -> None:
        """One step on a replay minibatch: toward ``r + γ·max Q(s')`` for TD items
        ``(φ, r, φ(s') or None)``, toward the return ``G`` for MC items ``(φ, G, None)``."""
        picks = self._rng.integers(len(self._buffer), size=min(self.batch, len(self._buffer)))
        phi = np.stack([self._buffer[i][0] for i in picks])
        target = np.array([self._buffer[i][1] + (0.0 if self._buffer[i][2] is None
                                                 else self.gamma * float((self._buffer[i][2] @ self.theta).max()))
                           for i in picks])
        td = np.clip(target - phi @ self.theta, -5.0, 5.0)
        step = (td[:, None] * phi).mean(axis=0)
        # A tabular weight is in few samples of a minibatch: a larger step for those.
        step[: self.n * self.n] *= self.tabular_boost
        self.theta += self.lr * step

    def end_episode(self) -> None:
        """Close an episode: decay ε; ``mc`` learns from the episode's returns (a
        truncated episode bootstraps from ``max Q`` of its last state)."""
        if self._episode:
            last = self._episode[-1][2]
            G = 0.0 if last is None else float(self.q_values(last).max())
            for phi, r, _ in reversed(self._episode):
                G = r + self.gamma * G
                self._store((phi, G, None))
            for _ in range(len(self._episode)):
                self._learn()
            self._episode = []
        self.episodes += 1
        self.epsilon = max(self.epsilon_min, self.epsilon * math.exp(-self.epsilon_decay))

    # -- persistence -----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"n": self.n, "theta": self.theta.tolist(), "epsilon": self.epsilon, "episodes": self.episodes}

    def restore(self, data: dict, path: Path) -> None:
        if int(data["n"]) != self.n or len(data["theta"]) != self.theta.size:
            raise ValueError(f"agent file {path} is for {data['n']} nodes, this run has {self.n}")
        self.theta = np.asarray(data["theta"], dtype=float)
        self.epsilon, self.episodes = float(data["epsilon"]), int(data["episodes"])
