"""Homogeneous Learning (Sun & Ochiai, IEEE Access 2022; ``docs/algorithms.md`` §13).

One model travels along a chain of nodes: each round one node trains it on its own data
(plain local training, Flower's ``train`` message, so any node's policy applies) and
hands it on; the next node is chosen by a learned policy, or by a baseline::

    episode: x ← x_0 ; prev ← node 0 (the first node is fixed); node 0 trains x
    each round: a ← selector(state) ; node a trains x ; acc ← test accuracy of x
                r = 32^(acc − target) − w·D[prev, a] − 1        (the paper's reward)
                the agent learns from (state, a, r, next state) ; prev ← a
    the episode ends at acc ≥ target (or after max_episode_rounds); with reset_model the
    next one starts again from x_0, as the paper trains its agent

``selector``: ``attention`` (the paper's "self-attention" agent: a DQN on a PCA of the node
models, :mod:`fedswarm.algorithms.selection.hl_attention`), ``learned`` (a linear Q-learner on
what the chain reports, :mod:`fedswarm.algorithms.selection.hl`, kept as a baseline),
``random`` or ``round_robin``. The
model always moves on: no selector picks the node that holds it.

State: the server keeps the agent (global, as in the paper's reference code) and the
node states it observes; nodes keep nothing. Wire: one model hop per round. On Flower the
hop goes through the server (the node downloads 4d and uploads 4d bytes, measured as
usual); the round notes ``p2p_bytes``, the size of the one model message that would go
straight from ``prev`` to ``a``, and ``hop_cost`` = D[prev, a] (the paper's
communication cost). Each round also notes ``node`` (index in sorted node ids),
``episode``, ``episode_round`` and ``epsilon``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedswarm.algorithms.selection.hl import NodeStates, QAgent, distance_matrix, hl_reward
from fedswarm.algorithms.selection.hl_attention import DQNAgent, chain_state, visit_features
from fedswarm.hyperparams import SIGNATURE, HyperParam, defaults_from
from fedswarm.strategies.registry import BuildContext, StrategyEntry, register
from fedswarm.strategies.resumable import capture, restore
from fedswarm.payload import PayloadError
from fedswarm.strategies.strategy_utils import NODE_WAIT_S, ReportsRounds, wait_for_nodes
from fedswarm.wire import arrayrecord_to_vector, recorddict_nbytes

__all__ = ["HomogeneousLearning", "SELECTORS", "HYPERPARAMS"]

SELECTORS = ("attention", "learned", "random", "round_robin")


class HomogeneousLearning(ReportsRounds, Strategy):
    """Sequential training along a chain of nodes chosen by a selector (HL, §13).

    Parameters
    ----------
    num_nodes : int
        Nodes in the federation; node ``i`` is the ``i``-th smallest node id.
    d : int
        Parameters of the model (to validate what nodes send back).
    selector : str
        ``attention`` (DQN on the node models' PCA, the paper's agent), ``learned`` (linear
        Q), ``random`` or ``round_robin``.
    target_accuracy : float
        An episode ends when the model's test accuracy reaches it.
    max_episode_rounds : int
        An episode also ends after this many rounds (the paper: 35).
    reset_model : bool
        Start every episode from the initial model (the paper's agent training); else
        the model carries on and episodes only structure the agent's learning.
    distance_weight : float
        Weight of the hop distance ``D[prev, a]`` in the reward (the paper: 1/10).
    gamma, agent_lr, epsilon_decay : float
        The agent's discount, step size and per-episode exploration decay (``attention``:
        Adam's step size is ``dqn_lr``).
    agent_target : str
        ``learned`` only: ``mc`` (Monte Carlo returns, the default) or ``td`` (TD(0)).
    dqn_lr : float
        ``attention`` only: the DQN's Adam step size (the paper: 1e-3).
    dqn_passes : int
        ``attention`` only: training passes after each episode (the paper: 1).
    attention_state : str
        ``attention`` only: ``pca`` (the paper's observation, the node models' PCA) or
        ``pca+visits`` (plus each node's visit recency in the episode, ours).
    seed : int
        Seed of the distances, the random selector and the agent.
    agent_path : str
        Load the agent from this JSON file if it exists and save it there at the end.
    accuracy_fn : callable, optional
        ``arrays -> accuracy`` for the reward when ``evaluate_fn`` returns no
        ``test_accuracy``.
    node_wait_s : float
        How long :meth:`start` waits for all nodes to connect.
    """

    def __init__(self, num_nodes: int, d: int, selector: str = "learned", target_accuracy: float = 0.8,
                 max_episode_rounds: int = 35, reset_model: bool = True, distance_weight: float = 0.1,
                 gamma: float = 0.9, agent_lr: float = 0.1, epsilon_decay: float = 0.1, agent_target: str = "mc",
                 dqn_lr: float = 1e-3, dqn_passes: int = 1, attention_state: str = "pca", seed: int = 0,
                 agent_path: str = "", accuracy_fn: Callable[[ArrayRecord], float] | None = None,
                 node_wait_s: float = NODE_WAIT_S):
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, got '{selector}'")
        self.num_nodes, self.d = int(num_nodes), int(d)
        self.selector = selector
        self.target_accuracy = float(target_accuracy)
        self.max_episode_rounds = int(max_episode_rounds)
        self.reset_model = bool(reset_model)
        self.distance_weight = float(distance_weight)
        self.distance = distance_matrix(self.num_nodes, seed)
        self.state_k = min(10, self.num_nodes)  # PCA components per node (the paper: 10)
        if attention_state not in ("pca", "pca+visits"):
            raise ValueError(f"attention_state must be 'pca' or 'pca+visits', got '{attention_state}'")
        self.attention_state = attention_state
        if selector == "attention":
            dim = self.num_nodes * self.state_k + (2 * self.num_nodes if attention_state == "pca+visits" else 0)
            self.agent: QAgent | DQNAgent = DQNAgent(self.num_nodes, dim, gamma=gamma, lr=dqn_lr,
                                                     epsilon_decay=epsilon_decay, passes=dqn_passes, seed=seed)
        else:
            self.agent = QAgent(self.num_nodes, self.distance, gamma=gamma, lr=agent_lr,
                                epsilon_decay=epsilon_decay, target=agent_target, seed=seed)
        self._obs: np.ndarray | None = None  # attention: the observation after the last hop
        self.agent_path = agent_path
        if agent_path:
            self.agent.load(agent_path)
        self.accuracy_fn = accuracy_fn
        self.node_wait_s = float(node_wait_s)
        self._rng = random.Random(seed)
        self._rounds = 0  # rounds done by earlier calls of start()
        self.episode = 0
        self._state: NodeStates | None = None  # None: the next round starts an episode
        self._loss = np.full(self.num_nodes, np.nan)  # what each node last reported
        self._examples = np.full(self.num_nodes, np.nan)
        self._initial: ArrayRecord | None = None  # the model every episode restarts from
        self._arrays: ArrayRecord | None = None
        self._p2p: int | None = None
        self._hopped = 0  # the absolute round of the last hop (what a checkpoint has done)

    # -- Flower's round-loop hooks: unused, start() drives the chain itself ----------
    def configure_train(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_train(self, server_round, replies):
        return None, None

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    def summary(self) -> None:
        log(INFO, "\t├── Homogeneous Learning over %d nodes, selector '%s'", self.num_nodes, self.selector)
        log(INFO, "\t└── episodes end at accuracy %.3g or after %d rounds; model reset: %s",
            self.target_accuracy, self.max_episode_rounds, self.reset_model)

    # -- checkpoint (fedswarm.strategies.resumable) ------------------------------------
    #: start() numbers the hops across calls itself (``_rounds``)
    counts_own_rounds = True
    checkpoint_at_round_end = True  # evaluate_fn comes before the hop's learning: see round_done
    _STATE = ("agent", "_rng", "episode", "_state", "_loss", "_examples", "_initial", "_arrays", "_p2p", "_obs")

    def state_dict(self) -> dict:
        """The learned policy (Q-agent weights, replay, exploration), the episode in flight,
        what each node last reported, the travelling and initial models, the hops done."""
        state = capture(self, self._STATE)
        state["rounds"] = self._hopped
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        rounds = int(state.pop("rounds"))
        restore(self, state, self._STATE)
        self._rounds = self._hopped = rounds

    def _observe(self, pca: np.ndarray, state: NodeStates) -> np.ndarray:
        """The attention agent's state vector: the PCA part, and with ``pca+visits`` the
        nodes' visit recency in the episode."""
        if self.attention_state == "pca":
            return pca
        return np.concatenate([pca, visit_features(state.last_visit, state.step)])

    # -- selection ------------------------------------------------------------------
    def select(self, state: NodeStates) -> int:
        if self.selector == "round_robin":
            return (state.prev + 1) % self.num_nodes
        if self.selector == "random":  # any node but the one holding the model
            return self._rng.choice([a for a in range(self.num_nodes) if a != state.prev or self.num_nodes == 1])
        if self.selector == "attention":
            return self.agent.act(self._obs, state.prev)
        return self.agent.act(state)

    # -- the run --------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run ``num_rounds`` hops; ``evaluate_fn(round, arrays)`` gets the travelling model
        after each (and its ``note`` the round's selection metrics)."""
        log(INFO, "Starting %s (%d rounds):", type(self).__name__, num_rounds)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        result = Result()
        if self._arrays is None:
            self._initial = initial_arrays
            self._arrays = initial_arrays
        if evaluate_fn is not None:
            res = evaluate_fn(0, self._arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        node_ids = self._wait_for_nodes(grid)
        notes = self.bind_notes(evaluate_fn)
        for t in range(1, num_rounds + 1):
            state = self._state
            if state is None:  # a new episode: the first node is fixed
                if self.reset_model:
                    self._arrays = self._initial
                state, node = NodeStates.initial(self.num_nodes, self._loss, self._examples), 0
                self.episode += 1
                self._obs = self._observe(np.zeros(self.num_nodes * self.state_k, dtype=np.float32), state)
                learned_step = False
            else:
                node = self.select(state)
                learned_step = True
            hop = float(self.distance[state.prev, node]) if state.prev >= 0 else 0.0
            sent = self._arrays
            arrays, loss, examples = self._hop(grid, node_ids[node], self._rounds + t, train_config, timeout)
            if arrays is not None:
                self._arrays = arrays
            pca = None
            if self.selector == "attention":  # the paper's observation: node models, PCA
                pca = chain_state(arrayrecord_to_vector(sent, self.d),
                                  None if arrays is None else arrayrecord_to_vector(arrays, self.d),
                                  node, self.num_nodes, self.state_k)
            if loss is not None:
                self._loss[node] = loss
            if examples is not None:
                self._examples[node] = examples
            if notes is evaluate_fn:
                if self._p2p is None:  # one model message; its size does not change
                    self._p2p = recorddict_nbytes(RecordDict({"arrays": self._arrays}))
                # the exploration rate: "epsilon" in a round row is the privacy budget spent (DP)
                extra = {"explore_epsilon": self.agent.epsilon} if self.selector in ("learned", "attention") else {}
                self.note(node=node, episode=self.episode, episode_round=state.step + 1, hop_cost=hop,
                     p2p_bytes=self._p2p, **extra)
            res = evaluate_fn(t, self._arrays) if evaluate_fn is not None else None
            if res is not None:
                result.evaluate_metrics_serverapp[t] = res
            acc = self._accuracy(res, self._arrays)
            reached = acc >= self.target_accuracy
            nxt = state.after(node, loss, acc, examples)
            obs = self._observe(pca, nxt) if pca is not None else self._obs
            reward = hl_reward(acc, self.target_accuracy, self.distance_weight * hop)
            if learned_step and self.selector == "learned":
                self.agent.observe(state, node, reward, nxt, terminal=reached)
            elif learned_step and self.selector == "attention":
                self.agent.remember(self._obs, node, reward, obs, done=reached)
            self._obs = obs
            if reached or nxt.step >= self.max_episode_rounds:
                self._state = None
                if self.selector in ("learned", "attention"):
                    self.agent.end_episode()
            else:
                self._state = nxt
            round_done = getattr(evaluate_fn, "round_done", None)
            if callable(round_done):  # the hop's learning is done: a checkpoint may be taken
                round_done(t)
        self._rounds += num_rounds
        result.arrays = self._arrays
        if self.agent_path and self.selector in ("learned", "attention"):
            self.agent.save(self.agent_path)
        return result

    def _accuracy(self, res: MetricRecord | None, arrays: ArrayRecord) -> float:
        if res is not None and "test_accuracy" in res:
            return float(res["test_accuracy"])
        if self.accuracy_fn is None:
            raise RuntimeError("HL needs the model's accuracy each round: pass an evaluate_fn that returns "
                               "'test_accuracy' or give the strategy an accuracy_fn")
        return float(self.accuracy_fn(arrays))

    def _hop(self, grid: Grid, node_id: int, server_round: int, train_config: ConfigRecord,
             timeout: float) -> tuple[ArrayRecord | None, float | None, int | None]:
        """Send the model to one node; (its model, train loss, examples), all None when the
        node failed or replied with something malformed (the model stays as it was)."""
        self._hopped = server_round
        conf = ConfigRecord(dict(train_config))
        conf["server-round"] = server_round
        msg = Message(RecordDict({"arrays": self._arrays, "config": conf}), message_type="train",
                      dst_node_id=node_id)
        replies = list(grid.send_and_receive([msg], timeout=timeout))
        if not replies:
            log(WARNING, "node %s did not reply in time", node_id)
            return None, None, None
        reply = replies[0]
        if reply.has_error():
            log(WARNING, "node %s failed this round: %s", node_id, (reply.error.reason.splitlines() or [""])[0][:300])
            return None, None, None
        try:
            rec = reply.content.array_records["arrays"]
            arrayrecord_to_vector(rec, self.d)  # validates size, dtype and finiteness
            metrics = reply.content.metric_records.get("metrics") or {}
            loss = float(metrics["train_loss"]) if "train_loss" in metrics else None
            examples = int(metrics["num-examples"]) if "num-examples" in metrics else None
        except (KeyError, TypeError, ValueError, PayloadError) as exc:
            self.reject(reply, exc)
            return None, None, None
        return rec, loss, examples

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        return wait_for_nodes(grid, self.num_nodes, self.node_wait_s)[: self.num_nodes]


# --------------------------------------------------------------------------- registry

HYPERPARAMS = defaults_from(HomogeneousLearning.__init__, (  # defaults: the constructor's
    HyperParam("selector", SIGNATURE, "how the next node is chosen", choices=SELECTORS),
    HyperParam("target_accuracy", SIGNATURE, "an episode ends when the test accuracy reaches it", gt=0.0, le=1.0),
    HyperParam("max_episode_rounds", SIGNATURE, "an episode also ends after this many rounds", ge=1, le=1_000_000),
    HyperParam("reset_model", SIGNATURE, "start each episode from the initial model (the paper's agent training)"),
    HyperParam("distance_weight", SIGNATURE, "weight of the hop distance in the reward", ge=0.0, le=100.0),
    HyperParam("gamma", SIGNATURE, "the agent's discount", ge=0.0, lt=1.0),
    HyperParam("agent_lr", SIGNATURE, "the agent's step size", gt=0.0, le=10.0),
    HyperParam("epsilon_decay", SIGNATURE, "exploration decay per episode: eps <- eps * exp(-decay)", ge=0.0, le=10.0),
    HyperParam("agent_target", SIGNATURE, "the agent learns from Monte Carlo returns or TD(0) targets",
               choices=("mc", "td")),
    HyperParam("dqn_lr", SIGNATURE, "selector 'attention': the DQN's Adam step size", gt=0.0, le=1.0),
    HyperParam("dqn_passes", SIGNATURE, "selector 'attention': DQN training passes after each episode (the paper: 1)",
               ge=1, le=1000),
    HyperParam("attention_state", SIGNATURE, "selector 'attention': the paper's state (pca: the node models' PCA) "
               "or pca+visits (plus each node's visit recency)", choices=("pca", "pca+visits")),
    HyperParam("agent_path", SIGNATURE, "load the agent from this JSON file if it exists; save it there at the end"),
))


def build(params: dict, ctx: BuildContext) -> HomogeneousLearning:
    from fedswarm.tasks import get_task
    from fedswarm.train import evaluate_flat, resolve_device, task_data

    cfg = ctx.config
    task = get_task(cfg.task)
    model, device = task.model(cfg.seed), resolve_device(cfg.device)

    def accuracy(arrays: ArrayRecord) -> float:
        data = task_data(cfg)
        flat = arrayrecord_to_vector(arrays, ctx.layout.d)
        return evaluate_flat(task, model.to(device), flat, data.test_x, data.test_y, device)[1]

    return HomogeneousLearning(cfg.clients, ctx.layout.d, seed=cfg.seed, accuracy_fn=accuracy, **params)


ENTRY = register(StrategyEntry(
    name="hl",
    description="Homogeneous Learning: one node trains per round and passes the model on; the next node is "
                "chosen by a learned policy (attention: the paper's DQN on the node models; learned: linear Q) or "
                "random / round_robin.",
    build=build,
    hyperparams=HYPERPARAMS,
    paper="Sun, Ochiai, IEEE Access 10 (2022) 7695-7703 (arXiv 2110.05290)",
))
