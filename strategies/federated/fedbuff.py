"""FedBuff (Nguyen et al., AISTATS 2022): buffered asynchronous aggregation, registered as ``fedbuff``.

The server keeps up to ``concurrency`` nodes training, never waits for a round: each update
that arrives is weighted by its staleness and buffered, and every ``buffer_size`` (K) buffered
updates fold into the model (:mod:`fedswarm.algorithms.fedbuff`, the math). A recorded round is
one aggregation: its number is the model version it made; its row notes ``model_version``,
``updates``, ``staleness_min/mean/max``, ``staleness_by_node`` (node id: the staleness of each of
its updates, refused ones included), ``in_flight`` (nodes still training when it was made),
``lost`` (dispatches given up after ``round_timeout`` with no reply) and, on a simulated fleet,
``sim_time_s`` (simulated seconds since the last aggregation). An update older than
``max_staleness`` versions is rejected (the node's row: status ``rejected``, reason
``stale: ...``). Clients run the plain ``train`` step; ``--dp`` clips each weighted update and
noises the sum once per aggregation (epsilon accounted per aggregation, sample rate K / clients).

With an uplink codec (``--set codec=topk --set codec_params=ratio=0.05``, any of
:data:`~fedswarm.algorithms.compression.codecs.CODECS` but ``none``) the train message is
``train.fedbuff`` and carries the codec in its ``compress`` record; the client half
(:func:`client_update`) is the plain local training followed by ``compressed_fedavg``'s client step
(:func:`~fedswarm.strategies.federated.compressed_fedavg.client_step`, C = 1): it sends
``C(delta + e)`` and keeps its error-feedback residual ``e`` in its state (``error_feedback``). The
server decodes each arrived payload with the codec its meta names, as ``compressed_fedavg`` does,
and buffers the decoded ``delta`` with its staleness weight (``--dp`` then clips the decoded updates).

Two arrival sources:

- **a simulated fleet** (the in-process engine; ``simulated`` set by the ServerApp): the virtual
  clock of :class:`~fedswarm.algorithms.fedbuff.AsyncSchedule`. A dispatch takes download +
  compute + upload of the node's device class (``--devices``; compute on ``local_steps x
  batch_size`` samples, else ``local_epochs`` passes over its partition; the model both ways,
  4 bytes a parameter); the grid runs the ClientApp when its message is pulled, so messages are
  pulled one at a time in order of simulated finish. Without ``--devices`` every node takes the
  same time: arrivals come first dispatched, first arrived.
- **a real deployment**: messages are pushed and pulled through the Grid with no round barrier;
  whatever reply comes back is folded in, a late node's update arrives stale, a dead node's never
  arrives and is counted as ``lost`` after ``round_timeout`` seconds.

``--eligible`` (or a device class's ``eligible`` policy): the dispatch draws only eligible idle nodes,
and the nodes passed over get an ``ineligible`` row
(:mod:`fedswarm.strategies.federated.fedbuff_eligibility`): on a simulated fleet addressed by
partition (inprocess, batched) from this machine's telemetry per device class; in a deployment and on
the flower engine from each node's own telemetry, probed as the fleet grid does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp.strategy import FedAvg, Result

from fedswarm.algorithms.fedbuff import AsyncSchedule, FedBuffer, Stale, staleness_weight
from fedswarm.algorithms.compression.codecs import CODECS
from fedswarm.strategies.federated.compressed_client import KNOBS
from fedswarm.strategies.federated.fedbuff_eligibility import ProbedRules, dispatch_rules_for
from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam
from fedswarm.payload import PayloadError
from fedswarm.strategies.registry import Batched, BuildContext, StrategyEntry, register
from fedswarm.strategies.strategy_utils import ReportsRounds, check_model_reply, wait_for_nodes
from fedswarm.wire import array_keys, arrayrecord_to_vector, vector_to_arrays_like

__all__ = ["FedBuff", "build", "ENTRY", "VERSION_KEY", "fleet_durations", "client_update", "MESSAGE_TYPE"]

#: The train config key telling a node which model version it trains on.
VERSION_KEY = "fedbuff-version"
#: The train message type of a run with an uplink codec (answered by :func:`client_update`).
MESSAGE_TYPE = f"{MessageType.TRAIN}.fedbuff"


@dataclass
class _Sent:
    node: int
    version: int
    pushed: float  # time.monotonic() at push (deployment: the timeout)
    seq: int = -1  # the schedule's dispatch number (simulated)


def fleet_durations(cfg: Any, d: int, up_nbytes: float | None = None) -> Any:
    """``duration(node_id)`` in simulated seconds for ``cfg``'s devices (node id = partition id + 1),
    or None without ``--devices`` (every node equally fast): the model down (``4·d`` bytes), the
    local steps, and the update up (``up_nbytes``, the codec's payload; the model's ``4·d`` without
    one)."""
    if cfg.devices is None:
        return None
    from fedswarm.timemodel import BUILTIN_PROFILES, compute_time_s, load_profiles, parse_devices, transfer_time_s

    profiles = load_profiles(cfg.profiles) if cfg.profiles else BUILTIN_PROFILES
    names = parse_devices(cfg.devices, cfg.clients, profiles)
    nbytes = 4.0 * d
    up = nbytes if up_nbytes is None else float(up_nbytes)
    samples: dict[int, float] = {}

    def node_samples(pid: int) -> float:
        if cfg.local_steps:
            return float(cfg.local_steps) * cfg.batch_size
        if pid not in samples:
            from fedswarm.train import partition_data

            samples[pid] = float(partition_data(cfg, pid, cfg.clients)[0].shape[0]) * cfg.local_epochs
        return samples[pid]

    def duration(node: int) -> float:
        pid = node - 1
        p = profiles[names[pid]]
        return transfer_time_s(p, nbytes) + compute_time_s(p, samples=node_samples(pid)) + transfer_time_s(p, up)

    return duration


class FedBuff(ReportsRounds, FedAvg):
    """The FedBuff server (see the module). ``simulated``: arrivals come from the virtual clock
    (a grid that runs the ClientApp when pulled); else from the grid as they come."""

    builds_own_dp = True  # --dp: its own mechanism, once per aggregation (fedswarm.strategies.federated.dp.attach_dp)
    schedules_own_fleet = True  # --availability: its schedule's (fedswarm.server.fleet_grid.fleet_grid_for)

    def __init__(self, *, buffer_size: int = 10, concurrency: int = 0, staleness_weight_spec: str = "poly:0.5",
                 max_staleness: int | None = None, server_lr: float = 1.0, min_nodes: int = 1, seed: int = 0,
                 duration: Any = None, dp: Any = None, poll_s: float = 0.5, availability: Any = None,
                 codec: str = "none", codec_params: str | dict = "", error_feedback: bool = True,
                 layout: Any = None, eligibility: Any = None, partition_nodes: bool = True):
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=1, min_evaluate_nodes=0,
                         min_available_nodes=min_nodes)
        self.buffer = FedBuffer(buffer_size, staleness_weight(staleness_weight_spec), max_staleness, server_lr)
        self.concurrency = concurrency  # 0: every node the grid has (resolved when the run starts)
        self.seed = seed
        self.duration = duration
        self.availability = availability  # the simulated fleet's (--availability), None: always on
        self.dp = dp
        self.simulated = False
        self.poll_s = poll_s
        self.version = 0
        self.codec = None  # the uplink codec (None: the plain model travels)
        if codec != "none":
            from fedswarm.algorithms.compression.codecs import make_codec
            from fedswarm.strategies.federated.compressed_fedavg import parse_codec_params

            self.codec = make_codec(codec, **parse_codec_params(codec_params))
        self.error_feedback = bool(error_feedback)
        self.layout = layout
        self.eligibility = eligibility  # a DispatchRules (fedbuff_eligibility.py), None: every node may train
        self.partition_nodes = partition_nodes  # node id = partition id + 1 (not on the flower engine)
        self.nodes_grid = None  # the nodes themselves, unmetered: the eligibility probe's grid (use_nodes_grid)

    def upload_nbytes(self) -> float | None:
        """A node's upload in bytes for the simulated clock: the codec's payload arrays
        (``wire_bytes``, what its reply mostly carries), None without a codec (the model) or when
        the codec does not say."""
        if self.codec is None or self.layout is None:
            return None
        try:
            return float(self.codec.wire_bytes(self.layout))
        except NotImplementedError:
            return None

    def knobs(self, version: int) -> ConfigRecord:
        """The ``compress`` record of a train message with an uplink codec, sent with model ``version``
        (``version + 1`` is the encode's round: randk's coordinates, QSGD's noise)."""
        import json

        return ConfigRecord({"codec": self.codec.name, "codec_params": json.dumps(self.codec.params),
                             "error_feedback": self.error_feedback, "round": version + 1})

    def parse_update(self, reply: Message, sent_model: torch.Tensor) -> torch.Tensor:
        """The client's step from its reply: the decoded payload with a codec, else its model minus
        ``sent_model``; PayloadError when the reply is malformed or not finite."""
        if self.codec is None:
            return check_model_reply(reply, sent_model.numel()) - sent_model
        from fedswarm.strategies.federated.compressed_fedavg import decode_reply

        return decode_reply(reply, self.layout)

    # the ServerApp tells the strategy its nodes are simulated (fedswarm.server.app.run_server)
    def use_virtual_clock(self, simulated: bool) -> None:
        self.simulated = simulated

    # ... and the grid of the nodes themselves (no meter), which its eligibility probe goes through
    def use_nodes_grid(self, grid: Any) -> None:
        self.nodes_grid = grid

    def start(self, grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config=None, evaluate_fn=None) -> Result:
        self.bind_notes(evaluate_fn)
        train_config = ConfigRecord() if train_config is None else train_config
        result = Result()
        if evaluate_fn is not None:
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        keys = array_keys(initial_arrays)
        x = arrayrecord_to_vector(initial_arrays)
        if self.codec is not None and self.layout is None:
            from fedswarm.strategies.strategy_utils import layout_of_arrays

            self.layout = layout_of_arrays(initial_arrays)
        start_version = self.version
        rules = self.eligibility
        if rules is not None and not (self.simulated and self.partition_nodes):  # real nodes: probed
            # (kept even with no rule yet: a class's eligible policy may come with a policy control mid-run)
            rules = ProbedRules(rules.rules, self.nodes_grid if self.nodes_grid is not None else grid, wait_s=timeout)
        add_rows = getattr(evaluate_fn, "node_rows", None)  # the recorder's: rows of nodes that sent nothing
        sent_models: dict[int, torch.Tensor] = {self.version: x}
        flying: dict[str, _Sent] = {}
        nodes = wait_for_nodes(grid, self.min_available_nodes, timeout)
        if self.concurrency <= 0:
            self.concurrency = len(nodes)
        sched = AsyncSchedule(nodes, self.concurrency, self.duration, seed=self.seed,
                              availability=self.availability if self.simulated else None, timeout=timeout)
        t_last_agg = 0.0
        counts = {"lost": 0}
        backlog: list[tuple[Message, _Sent]] = []  # replies pulled, not yet folded (deployment)
        by_node: dict[str, list[int]] = {}  # node id -> the staleness of its updates in this aggregation

        def push(pairs: list[tuple[int, int]]) -> None:
            msgs = []
            for node, _seq in pairs:
                config = ConfigRecord(dict(train_config))
                config["server-round"] = self.version + 1
                config[VERSION_KEY] = self.version
                record = RecordDict({self.arrayrecord_key: vector_to_arrays_like(x, keys),
                                     self.configrecord_key: config})
                kind = MessageType.TRAIN
                if self.codec is not None:
                    record[KNOBS] = self.knobs(self.version)
                    kind = MESSAGE_TYPE
                msgs.append(Message(content=record, dst_node_id=node, message_type=kind))
            now = time.monotonic()
            for (node, seq), mid in zip(pairs, grid.push_messages(msgs)):
                if mid:
                    flying[mid] = _Sent(node, self.version, now, seq)
            sent_models[self.version] = x

        def take(reply: Message, sent: _Sent) -> None:
            if rules is not None:
                rules.learn(reply)
            if reply.has_error():
                return  # the recorder writes the node's row as failed
            try:
                delta = self.parse_update(reply, sent_models[sent.version])
            except PayloadError as exc:
                self.reject(reply, exc)
                return
            staleness = self.version - sent.version
            by_node.setdefault(str(sent.node), []).append(staleness)
            try:
                self.buffer.add(delta, staleness)
            except Stale as exc:
                self.reject(reply, exc)

        while self.version < start_version + num_rounds:
            if self.simulated:
                jobs = (sched.dispatch(self.version) if rules is None
                        else rules.dispatch(sched, self.version, train_config))
                push([(j.node, j.seq) for j in jobs])
                job = sched.arrive()
                mid = next(m for m, s in flying.items() if s.seq == job.seq)
                sent = flying.pop(mid)
                if job.lost:  # dropped mid-training: no update, given up after the timeout
                    counts["lost"] += 1
                    continue
                for reply in self._pull_one(grid, mid, timeout):
                    take(reply, sent)
            else:
                busy = {s.node for s in flying.values()}
                connected = sorted(int(n) for n in grid.get_node_ids())
                idle = [n for n in connected if n not in busy]
                free = self.concurrency - len(flying)
                if free > 0 and idle and rules is not None:
                    idle = rules.eligible_idle(idle, train_config, busy=bool(flying or backlog))
                if free > 0 and idle:
                    picks = [idle.pop(sched.rng.randrange(len(idle))) for _ in range(min(free, len(idle)))]
                    push([(n, -1) for n in picks])
                if rules is not None:  # once an aggregation: the nodes left without a model, probed if due
                    busy = {s.node for s in flying.values()}
                    rules.probe_left([n for n in connected if n not in busy], train_config)
                if not backlog:
                    got = list(grid.pull_messages(list(flying))) if flying else []
                    for reply in got:
                        sent = flying.pop(reply.metadata.reply_to_message_id, None)
                        if sent is not None:
                            backlog.append((reply, sent))
                    now = time.monotonic()
                    for mid in [m for m, s in flying.items() if now - s.pushed > timeout]:
                        flying.pop(mid)  # a dead node: its update never arrives
                        counts["lost"] += 1
                    if not got:
                        time.sleep(self.poll_s)  # polling the grid for replies, as Flower's grid does
                # one at a time: exactly K per aggregation, the rest folded after it (one version staler)
                while backlog and not self.buffer.ready:
                    take(*backlog.pop(0))
            if not self.buffer.ready:
                continue
            privatize = None
            if self.dp is not None:
                self.dp.before_round()
                privatize = self.dp.privatize
            x, metrics = self.buffer.fold(x, privatize)
            self.version += 1
            in_use = {s.version for s in flying.values()} | {s.version for _, s in backlog}
            for v in [v for v in sent_models if v not in in_use]:
                del sent_models[v]
            metrics.update(model_version=self.version, in_flight=len(flying), lost=counts["lost"],
                           staleness_by_node=dict(by_node),
                           # federated evaluation asks the nodes that arrived (idle until the next dispatch),
                           # never one still training: an aggregation waits for no node
                           eval_cohort=sorted(int(n) for n in by_node))
            counts["lost"] = 0
            if rules is not None and callable(add_rows):
                # (a node whose reply is pulled but not yet folded has its train row in this aggregation too)
                add_rows(rules.rows(lambda n, pulled={s.node for _, s in backlog}: str(n) in by_node or n in pulled))
            by_node.clear()
            if self.simulated and self.duration is not None:
                metrics["sim_time_s"] = sched.now - t_last_agg
                metrics["sim_clock_s"] = sched.now
                t_last_agg = sched.now
            self.note(**metrics)
            log(INFO, "FedBuff: model version %d from %d updates (staleness %s..%s), %d in flight", self.version,
                metrics["updates"], metrics.get("staleness_min"), metrics.get("staleness_max"), len(flying))
            carry = getattr(grid, "carry_over", None)  # a metering grid: in-flight messages are not unanswered
            if callable(carry):
                carry(list(flying))
            arrays = vector_to_arrays_like(x, keys)
            result.arrays = arrays
            if evaluate_fn is not None:
                res = evaluate_fn(self.version - start_version, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[self.version] = res
        return result  # replies still in flight are not waited for

    def _pull_one(self, grid: Any, mid: str, timeout: float) -> list[Message]:
        """The reply to ``mid``: at once on the in-process grid; polled for on a grid whose nodes
        run on their own (Flower's simulation engine), up to ``timeout`` seconds (then none: lost)."""
        deadline = time.monotonic() + timeout
        pause = 0.01
        while not (got := list(grid.pull_messages([mid]))) and time.monotonic() < deadline:
            time.sleep(pause)  # polling the grid for the reply, as Flower's grid does
            pause = min(pause * 1.5, self.poll_s)
        return got

    # -- checkpoint (fedswarm.strategies.resumable): the model version
    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state.get("version", 0))


def client_update(msg: Message, context: Any) -> RecordDict:
    """FedBuff's client half with an uplink codec (``train.fedbuff``): the plain local training of the
    message's model, then ``compressed_fedavg``'s client step with C = 1: send ``C(delta + e)`` and
    keep the new residual ``e`` (error feedback) in the node's state."""
    from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState
    from fedswarm.local import local_fit
    from fedswarm.strategies.federated.compressed_fedavg import client_step, uplink_of
    from fedswarm.strategies.strategy_utils import load_error_feedback, save_error_feedback
    from fedswarm.wire import payload_to_records

    fit = local_fit(msg, context)
    pid = int(context.node_config.get("partition-id", 0))
    uplink = uplink_of(msg.content.config_records[KNOBS], fit.policy, fit.cfg.seed, pid)
    layout = fit.trainer.layout
    key = f"{MESSAGE_TYPE}.residual"
    ef = load_error_feedback(context.state, key, layout.d) if uplink.error_feedback else ErrorFeedbackState()
    payload, ef = client_step(uplink, ef, (fit.result.flat - fit.start)[None], layout)
    if uplink.error_feedback:
        save_error_feedback(context.state, key, ef)
    content = fit.reply(payload_to_records(payload, RecordDict()))
    content["node"]["partition-id"] = pid
    return content


def build(params: dict, ctx: BuildContext) -> FedBuff:
    cfg = ctx.config
    used = cfg.fleet_options() if callable(getattr(cfg, "fleet_options", None)) else []
    # its schedule honours the simulated fleet's availability, its dispatch the eligibility rules
    fleet = [f for f in used if f not in ("--availability", "--eligible")]
    if fleet:
        raise ConfigError(f"fedbuff does not take {', '.join(fleet)}: it has no rounds to close early or sample")
    if cfg.devices is not None and cfg.engine == "flower":
        raise ConfigError("fedbuff --devices: its virtual clock runs on --engine inprocess or batched (on the flower "
                          "engine a node's id does not tell its partition, so not its device class)")
    if getattr(cfg, "availability", None) is not None and cfg.devices is None:
        raise ConfigError("fedbuff --availability runs on simulated time: give --devices")
    from fedswarm.availability import run_availability

    availability = run_availability(cfg)
    k = int(params["buffer_size"])
    concurrency = int(params["concurrency"]) or cfg.clients
    if concurrency > cfg.clients:
        raise ConfigError(f"fedbuff: concurrency {concurrency} is more than the {cfg.clients} clients")
    dp = None
    if cfg.dp:
        from fedswarm.algorithms.privacy.dp_fedavg import ClientLevelDP

        dp = ClientLevelDP(cfg.dp, rounds=cfg.rounds, sample_rate=min(1.0, k / cfg.clients), seed=cfg.seed)
    max_stale = int(params["max_staleness"])
    strategy = FedBuff(buffer_size=k, concurrency=concurrency, staleness_weight_spec=str(params["staleness_weight"]),
                       max_staleness=None if max_stale < 0 else max_stale, server_lr=float(params["server_lr"]),
                       min_nodes=cfg.clients, seed=cfg.seed, dp=dp, availability=availability,
                       codec=str(params["codec"]), codec_params=str(params["codec_params"]),
                       error_feedback=bool(params["error_feedback"]), layout=ctx.layout,
                       eligibility=dispatch_rules_for(cfg), partition_nodes=cfg.engine != "flower")
    # the simulated clock's upload: the codec's payload when there is one
    strategy.duration = fleet_durations(cfg, ctx.layout.d, strategy.upload_nbytes())
    return strategy


ENTRY = register(StrategyEntry(
    name="fedbuff",
    description="FedBuff: asynchronous, buffered aggregation of K staleness-weighted updates; no round barrier.",
    build=build,
    hyperparams=(
        HyperParam("buffer_size", 10, "K: updates folded into the model per aggregation", ge=1),
        HyperParam("concurrency", 0, "nodes training at once (0: every client)", ge=0),
        HyperParam("staleness_weight", "poly:0.5",
                   "weight of an update tau versions old: poly:P = (1+tau)^-P, const, hinge:A,B"),
        HyperParam("max_staleness", -1, "refuse updates more than this many versions old (-1: no limit)", ge=-1),
        HyperParam("server_lr", 1.0, "server learning rate on the buffered mean update", gt=0.0),
        HyperParam("codec", "none", "uplink codec of the clients' updates (none: the model travels)",
                   choices=tuple(CODECS)),
        HyperParam("codec_params", "", "codec hyperparameters: 'ratio=0.05,levels=4' or JSON"),
        HyperParam("error_feedback", True, "with a codec: clients keep the untransmitted part (residual)"),
    ),
    client_update=client_update,
    paper="Nguyen et al., AISTATS 2022",
    byzantine=False,  # its replies come one at a time, not through a round the Byzantine grid rewrites
    batched=Batched("fedbuff", dp=True),  # the same events, clients trained in waves (sim/batched_fedbuff.py)
    dp=True,
))
