"""Decentralized training on Flower: a strategy that keeps no global model and only routes.

:class:`DecentralizedStrategy` is a Flower ``Strategy`` whose server is a router (the
usual trick for gossip on a server-centric framework, ``docs/algorithms.md`` §F). Node
``i``'s model and algorithm memory live on node ``i`` (``Context.state``, see
:mod:`fedswarm.strategies.decentralized.node`); each round the server hands every node
the messages its neighbours sent, per the topology's mixing matrix of that round, and the
node mixes them itself. The server never mixes.

One round ``t`` is one gossip iteration: one local step (``--local-steps H`` makes it H
plain SGD steps fed to the algorithm as one pseudo-gradient; ``local_epochs`` does not
apply) and one mix, on every node. Messages of iteration ``t`` are computed at the end of
exchange ``t − 1`` and mixed at the start of exchange ``t``, so a run of R rounds is
R + 1 exchanges: exchange 0 sends every node the initial model (the seeded arrays given to
:meth:`start`) and collects its first message, and its server-hop bytes count in round
1; exchange R only mixes. A node that fails costs its neighbours its message for that
iteration (they keep its weight on themselves) and the round its model; it resumes from
the state it had before.

Accounting. Bytes through the grid are server hops, measured by the MeteredGrid as
usual; ``bytes_up`` is the algorithm's messages, and the nodes' model reports (monitoring,
``report.model``, for the accuracy only) are recorded apart as ``bytes_report``. What
would travel peer to peer is noted per round as ``p2p_bytes``: the serialized size of
each node's message times its degree. Accuracy is that of the node-average model (nodes
report their models; the average is only evaluated, never sent back) and
``consensus_distance`` is ``(1/n) Σ_i ‖x_i − x̄‖²``.

Registered: ``dpsgd``, ``d2``, ``dsgdm``, ``qgm``, ``squarm``, ``easgd``, ``dasgd`` (kind
``decentralized``, topology from ``RunConfig.topology``); ``adpsgd``, ``prague`` (kind ``async``:
timed by a clock they run on the virtual-clock simulator, ``fedswarm.sim.async_engine``; with
``--set schedule=fixed`` the router replays their seeded fixed schedule,
``fedswarm.algorithms.decentralized.schedule``: each round is one tick, the tick's pairs or
groups are the round's graph and each node's gradient staleness travels in its config);
``lsgd`` (kind ``array``: the array engine, ``fedswarm.sim.array_engine``).
Every node's message is its algorithm's ``Payload`` (compressed for SQuARM), carried as
records; ``--set report_every=N`` sets how often nodes also report their models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam
from fedswarm.strategies.decentralized.node import (NO_STATE, REPORT_MODEL, make_client_update, message_nbytes_of,
                                                   neighbour_keys)
from fedswarm.algorithms.decentralized import ALGORITHMS, consensus_distance, make_algorithm, make_schedule
from fedswarm.strategies.registry import BuildContext, StrategyEntry, message_type_of, register
from fedswarm.strategies.resumable import capture, restore
from fedswarm.algorithms.decentralized.topology import make_topology
from fedswarm.payload import PayloadError
from fedswarm.strategies.strategy_utils import NODE_WAIT_S, ReportsRounds, wait_for_nodes
from fedswarm.wire import (PAYLOAD_ARRAYS, PAYLOAD_META, arrayrecord_to_vector, payload_from_records,
                           vector_to_arrayrecord)

__all__ = ["DecentralizedStrategy", "SYNC_ALGORITHMS", "SCHEDULED_ALGORITHMS"]

#: Synchronous gossip algorithms served by the router.
#: Every node's message is its algorithm's Payload (``squarm``: the codec's payload, or a
#: few bytes when it does not fire), so ``p2p_bytes`` and ``bytes_up`` are the real bytes;
#: ``easgd`` needs ``--topology complete``; ``dasgd`` averages along the topology
#: (``complete`` = the paper's all-reduce). ``lsgd`` is not here: it needs every node's
#: loss, so it runs on the array engine and the swarm.
SYNC_ALGORITHMS = ("dpsgd", "d2", "dsgdm", "qgm", "squarm", "easgd", "dasgd")
#: Asynchronous algorithms the router runs only under a fixed schedule (``schedule="fixed"``).
SCHEDULED_ALGORITHMS = ("adpsgd", "prague")


class DecentralizedStrategy(ReportsRounds, Strategy):
    """Route gossip messages along a topology; keep no global model.

    Parameters
    ----------
    algorithm : str
        A synchronous algorithm of :data:`fedswarm.algorithms.decentralized.ALGORITHMS`
        (:data:`SYNC_ALGORITHMS`), or ``adpsgd`` / ``prague`` with
        ``algorithm_params["schedule"] == "fixed"`` (the topology is then the base graph
        of the seeded schedule); nodes run its per-node steps.
    num_nodes : int
        Number of nodes; node ``i`` of the topology is the node whose ``partition-id``
        is ``i``.
    topology : str
        Topology spec (``ring``, ``torus``, ``exp``, ``onepeer-exp``, ``complete``,
        ``random:D``, ``edges:PATH``, optionally ``+lazy``).
    seed : int
        Seed of random topologies.
    algorithm_params : dict, optional
        Hyperparameters of the algorithm; the nodes read the same ones from the run
        config, the router uses them only to check the topology.
    node_wait_s : float
        How long :meth:`start` waits for all nodes to connect.
    report_every : int
        Nodes whose message is not their model send their model (for the node-average
        accuracy) every ``report_every`` rounds and in the last one; ``0``: the last only.
        Rounds without reports record no accuracy (null), and their ``bytes_up`` are the
        messages alone.
    """

    def __init__(self, algorithm: str, num_nodes: int, topology: str = "ring", seed: int = 0,
                 algorithm_params: dict | None = None, node_wait_s: float = NODE_WAIT_S, report_every: int = 1):
        params = dict(algorithm_params or {})
        fixed = algorithm in SCHEDULED_ALGORITHMS and params.get("schedule") == "fixed"
        if algorithm not in SYNC_ALGORITHMS and not fixed:
            raise ValueError(f"the router runs {', '.join(SYNC_ALGORITHMS)}, and {', '.join(SCHEDULED_ALGORITHMS)} "
                             f"with schedule='fixed', not '{algorithm}'"
                             + (" timed by a clock" if algorithm in SCHEDULED_ALGORITHMS else ""))
        self.algorithm = algorithm
        self.algorithm_params = params
        self.num_nodes = int(num_nodes)
        self.algo = make_algorithm(algorithm, **self.algorithm_params)  # checks the topology and replies
        self.topology = make_topology(topology, self.num_nodes, seed)
        if fixed:  # the seeded schedule over the graph: round t is tick t
            self.topology = make_schedule(self.algo, self.topology, seed)
        self.algo.check_topology(self.topology)
        if int(report_every) < 0:
            raise ValueError(f"report_every must be >= 0 (got {report_every})")
        self.report_every = int(report_every)
        self.node_wait_s = float(node_wait_s)
        self.message_type = message_type_of(algorithm)
        self._pid_of: dict[int, int] = {}  # node id -> topology index (partition id)
        self._node_of: dict[int, int] = {}  # and back
        self._needs_init: set[int] = set()  # node ids that lost their state
        self._messages: dict[int, tuple[ArrayRecord, ConfigRecord]] = {}  # topology index -> latest payload
        self._iterations = 0  # iterations completed by earlier calls of start()
        self._average: torch.Tensor | None = None

    # -- checkpoint (fedswarm.strategies.resumable) ------------------------------------
    #: start() numbers the iterations across calls itself (``_iterations``)
    counts_own_rounds = True
    _STATE = ("_pid_of", "_node_of", "_needs_init", "_messages", "_iterations", "_average")

    def state_dict(self) -> dict:
        """Which node holds which topology index, the messages in flight to be mixed next,
        the iterations done and the node-average model (the nodes keep their own models)."""
        return capture(self, self._STATE)

    def load_state_dict(self, state: dict) -> None:
        restore(self, state, self._STATE)

    def resync_clients(self) -> None:
        """The nodes' models may be gone: every known node starts again from the model the
        run resumes with (the node average), as a node that reported lost state does."""
        self._needs_init |= set(self._pid_of)

    #: What resynchronising one node does (named in the ``client_resync`` event).
    resync_what = "it restarts from the checkpointed node-average model"

    def rejoin_clients(self, reports: list) -> None:
        """A resumed run's nodes answered the resume query (:mod:`fedswarm.server.client_state`):
        each answering node holds its partition's topology index under its current id; one
        that restored its state goes on from it, one without restarts from the checkpointed
        node-average model (the ``init`` the resumed run sends). Without such a model the
        nodes without state are refused by name."""
        lost = [r for r in reports if r.partition >= 0 and not r.restored]
        if lost and self._average is None:
            from fedswarm.errors import CheckpointError

            raise CheckpointError("the checkpoint holds no model to restart " + ", ".join(r.name() for r in lost)
                                  + " from, and they have no state of their own")
        for r in reports:
            if r.partition < 0:
                continue
            for nid in {self._node_of.get(r.partition), r.node_id} - {None}:
                if nid in self._pid_of:
                    self._node_of.pop(self._pid_of.pop(nid), None)
                self._needs_init.discard(nid)
            self._pid_of[r.node_id], self._node_of[r.partition] = r.partition, r.node_id
            if not r.restored:
                self._needs_init.add(r.node_id)

    # -- Flower's round-loop hooks: unused, start() drives the exchanges itself ---------
    def configure_train(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_train(self, server_round, replies):
        return None, None

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    def summary(self) -> None:
        log(INFO, "\t├── Decentralized router (no global model): %s", self.algorithm)
        log(INFO, "\t├── Algorithm params: %s", self.algorithm_params or "defaults")
        log(INFO, "\t└── Topology: %s", self.topology.summary())

    # -- the run ------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run ``num_rounds`` gossip iterations; ``evaluate_fn(round, arrays)`` gets the
        node-average model after each (and its ``note`` the round's metrics)."""
        log(INFO, "Starting %s (decentralized, %d rounds):", type(self).__name__, num_rounds)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        result = Result()
        initial = arrayrecord_to_vector(initial_arrays)
        if self._average is None:
            self._average = initial
        self.bind_notes(evaluate_fn)
        if evaluate_fn is not None:
            if self._iterations == 0:
                # Round 0 of a new run evaluates the initial model: no node has trained or
                # gossiped yet, so there is no consensus distance to measure: null, never 0.
                self.note(consensus_distance=None)
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        node_ids = self._wait_for_nodes(grid)
        done = self._iterations
        for t in range(num_rounds + 1):
            it = done + t  # messages of iteration `it` are mixed in this exchange
            first = t == 0
            final = t == num_rounds
            report = final or (self.report_every > 0 and (it + 1) % self.report_every == 0)
            messages = [self._train_message(nid, it, first, final, report, initial_arrays, train_config)
                        for nid in node_ids]
            p2p = 0 if first else self._p2p_bytes(it)
            replies = list(grid.send_and_receive(messages, timeout=timeout))
            models = self._collect(replies, initial.numel())
            if first:
                continue
            self._iterations = it
            unreported: dict = {}
            if models:
                X = torch.stack([models[i] for i in sorted(models)])
                self._average = X.mean(dim=0)
                cd = consensus_distance(X)
            else:
                cd = None
                unreported = {"test_accuracy": None, "test_loss": None}  # no model this round: no accuracy
            arrays = vector_to_arrayrecord(self._average)
            result.arrays = arrays
            if evaluate_fn is not None:
                self.note(consensus_distance=cd, p2p_bytes=p2p, nodes_reporting=len(models),
                          nodes_failed=len(node_ids) - self._answered, **unreported)
                res = evaluate_fn(t, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[t] = res
        return result

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        return wait_for_nodes(grid, self.num_nodes, self.node_wait_s)

    def _train_message(self, nid: int, it: int, first: bool, final: bool, report: bool, initial: ArrayRecord,
                       train_config: ConfigRecord) -> Message:
        conf = ConfigRecord(dict(train_config))
        conf["server-round"] = it
        conf["iteration"] = it + 1  # the local step this exchange computes
        conf["final"] = final
        conf["report-model"] = report and not first
        if nid in self._pid_of:  # a fixed schedule's gradient staleness (0 on a graph); iteration 1 has none
            conf["staleness"] = self.topology.staleness(self._pid_of[nid], it + 1)
        content = RecordDict({"config": conf})
        if nid not in self._pid_of or nid in self._needs_init:
            content["init"] = initial
        elif not first:
            i = self._pid_of[nid]
            w = self.topology.weights(i, it)
            got = {j: self._messages[j] for j in w if j != i and j in self._messages}
            # A neighbour that failed sent nothing: its weight stays with the node itself,
            # so the row still sums to 1 (the column does not, for this one iteration).
            weights = {str(j): w[j] for j in got}
            weights[str(i)] = w[i] + sum(v for j, v in w.items() if j != i and j not in got)
            for j, (arrays, meta) in got.items():
                arrays_key, meta_key = neighbour_keys(j)
                content[arrays_key], content[meta_key] = arrays, meta
            content["weights"] = ConfigRecord(weights)
        return Message(content=content, message_type=self.message_type, dst_node_id=nid)

    def _p2p_bytes(self, it: int) -> int:
        """Bytes the messages of iteration ``it`` would move peer to peer."""
        deg = self.topology.degrees(it)
        return sum(message_nbytes_of(*rec) * int(deg[i]) for i, rec in self._messages.items())

    def _collect(self, replies: list[Message], d: int) -> dict[int, torch.Tensor]:
        """Keep each node's new message; return the models the nodes reported, by topology
        index (a node that failed, timed out or sent a malformed reply is missing)."""
        messages: dict[int, tuple[ArrayRecord, ConfigRecord]] = {}
        models: dict[int, torch.Tensor] = {}
        answered = 0
        for reply in replies:
            nid = reply.metadata.src_node_id
            if reply.has_error():
                if NO_STATE in reply.error.reason:
                    self._needs_init.add(nid)
                log(WARNING, "node %s failed this round: %s", nid, (reply.error.reason.splitlines() or [""])[0][:300])
                continue
            try:
                pid = int(reply.content.metric_records["metrics"]["partition-id"])
                if not 0 <= pid < self.num_nodes or self._pid_of.get(nid, pid) != pid:
                    raise PayloadError(f"bad partition-id {pid}")
                if self._node_of.get(pid, nid) != nid:
                    raise PayloadError(f"partition-id {pid} is already node {self._node_of[pid]}'s")
                msg, vec = None, None
                if PAYLOAD_ARRAYS in reply.content.array_records:  # the algorithm's message, checked here
                    payload = payload_from_records(reply.content, max_bytes=8 * d + 4096)
                    vec = self.algo.read_payload(payload, d)
                    msg = (reply.content.array_records[PAYLOAD_ARRAYS], reply.content.config_records[PAYLOAD_META])
                model = reply.content.array_records.get(REPORT_MODEL)
                if model is not None:
                    models_vec = arrayrecord_to_vector(model, d)
                else:  # a dense message is the model (D-PSGD); a compressed one is not
                    models_vec = vec if msg is not None and msg[1].get("kind") == "dense" else None
            except (KeyError, TypeError, ValueError, PayloadError) as exc:
                self.reject(reply, exc)
                continue
            self._pid_of[nid], self._node_of[pid] = pid, nid
            self._needs_init.discard(nid)
            answered += 1
            if msg is not None:
                messages[pid] = msg
            if models_vec is not None:
                models[pid] = models_vec
        self._messages = messages
        self._answered = answered
        return models


# --------------------------------------------------------------------------- registry


def _builder(algorithm: str):
    def build(params: dict, ctx: BuildContext) -> DecentralizedStrategy:
        cfg = ctx.config
        if cfg.fraction != 1.0:
            raise ConfigError(f"invalid value for 'fraction': decentralized strategies train every node "
                              f"every round, so it must be 1 (got {cfg.fraction})")
        params = dict(params)
        report_every = params.pop("report_every", 1)
        try:
            return DecentralizedStrategy(algorithm, cfg.clients, cfg.topology, cfg.seed, params,
                                         report_every=report_every)
        except ValueError as exc:
            raise ConfigError(f"invalid value for 'topology': {exc}") from None

    return build


def _build_async(params: dict, ctx: BuildContext):
    name = ctx.config.strategy
    if params.get("schedule") == "fixed":
        return _builder(name)(params, ctx)
    raise ConfigError(f"{name} is asynchronous: it runs on the virtual-clock simulator "
                      f"(fedswarm sim --strategy {name}), not in Flower's synchronous rounds; "
                      f"--set schedule=fixed replays a seeded fixed schedule on the router")


#: The router's own parameter, next to each algorithm's.
REPORT_EVERY = HyperParam("report_every", 1, "router: nodes whose message is not their model report it every N "
                          "rounds for the accuracy (0: the last round only; other rounds record no accuracy)", ge=0)

for _name in SYNC_ALGORITHMS:
    _alg = ALGORITHMS[_name]
    register(StrategyEntry(
        name=_name,
        description=f"{_alg.description} (decentralized: no global model; --topology sets the graph)",
        build=_builder(_name),
        hyperparams=_alg.hyperparams + (REPORT_EVERY,),
        client_update=make_client_update(_name),
        kind="decentralized",
        paper=_alg.paper,
        run_defaults={"topology": _alg.topology},
    ))

def _build_array(params: dict, ctx: BuildContext):
    name = ctx.config.strategy
    raise ConfigError(f"{name} needs every worker's loss each pull: it runs on the array engine "
                      f"(fedswarm sim --engine array --strategy {name}) or the swarm, not on the router")


register(StrategyEntry(
    name="lsgd",
    description=f"{ALGORITHMS['lsgd'].description} (runs on the array engine and the swarm)",
    build=_build_array,
    hyperparams=ALGORITHMS["lsgd"].hyperparams,
    kind="array",
    clock="leaders",  # its asynchronous mode (--set mode=async)
    paper=ALGORITHMS["lsgd"].paper,
))

register(StrategyEntry(
    name="adpsgd",
    description=f"{ALGORITHMS['adpsgd'].description} (asynchronous: virtual-clock simulator; "
                "--devices sets each node's speed and link)",
    build=_build_async,
    hyperparams=ALGORITHMS["adpsgd"].hyperparams + (REPORT_EVERY,),
    client_update=make_client_update("adpsgd"),
    kind="async",
    clock="gossip",
    paper=ALGORITHMS["adpsgd"].paper,
))

register(StrategyEntry(
    name="prague",
    description=f"{ALGORITHMS['prague'].description} (asynchronous: virtual-clock simulator; "
                "--devices sets each node's speed and link)",
    build=_build_async,
    hyperparams=ALGORITHMS["prague"].hyperparams + (REPORT_EVERY,),
    client_update=make_client_update("prague"),
    kind="async",
    clock="groups",
    paper=ALGORITHMS["prague"].paper,
))
