"""The batched engine: every sampled client's local SGD as one batched computation.

A round of FedAvg over K clients is K independent local-SGD runs from the same start.
Here they run side by side on a leading client axis (:mod:`fedswarm.sim.batched_trainer`:
the parameters are a ``[K, d]`` tensor and one step of all K clients is
``vmap(grad(loss))``; different data sizes and per-class policies are padded and masked).
The client axis is cut into chunks that fit ``--memory-budget``
(:mod:`fedswarm.sim.batched_memory`).

This module is the engine loop: set up the task, the partition and the recorder, sample
the clients, run a round with the strategy's round runner, record it. Round runners:
FedAvg's here (each chunk's models are folded into the running weighted sum at once, so
memory does not grow with the number of clients); the compressed strategies' in
:mod:`fedswarm.sim.batched_compressed` (codec and error feedback on the client axis, the
strategy object's own sampling, replica sync and aggregation); the Count-Sketch ones
(``sketched_sgd``, ``fetchsgd``, ``gs_sgd``) in :mod:`fedswarm.sim.batched_sketched` (one
sketch of all the clients' vectors; a second exchange in the round is the strategy's own,
answered by each client's own update); PVT's in :mod:`fedswarm.sim.batched_pvt`;
ProgFed's in :mod:`fedswarm.sim.batched_progfed` (each trained stage's sub-model on its own
client axis, the strategy's stages and evaluation).

A client whose local SGD diverges (a non-finite model) is rejected as the in-process
server rejects its reply, with the same reason, and left out of the aggregate: FedAvg's
round masks it out of the weighted sum (:meth:`BatchedTrainer.average`), PVT's and
ProgFed's strategy objects refuse its real reply. In the compressed family the diverged
client runs its own codec step alone, as its own code would: where that raises, the node
fails for the round (an error reply, its row ``failed`` with the reason, the round's
``nodes_failed``), where it sends a non-finite payload the strategy refuses it.

Same numbers as ``--engine inprocess``: the same clients are sampled
(:func:`~fedswarm.algorithms.selection.cohort.sample_positions` after ``random.seed(seed)``, the
strategies' own draw), each client's minibatches and SGD steps are
:mod:`fedswarm.algorithms.local_sgd`'s from :func:`fedswarm.local.round_seed`, as
:meth:`fedswarm.train.LocalTrainer.fit` takes them, and the aggregate is the strategy's
(FedAvg's :class:`~fedswarm.algorithms.averaging.WeightedSum`, the Flower strategy's too).
Tests hold the two engines to 1e-5 (tests/test_batched*.py).

Bytes are measured, not computed: real train messages and real replies are built and
serialized (:mod:`fedswarm.sim.batched_round`), once per size class of the round.

At scale nothing runs per client in Python but what defines the numbers: FedAvg's round keeps
its bookkeeping as arrays over the cohort (the sampling draw, schedule, round seeds, byte sizes
read back by size key, per-node bytes as arrays (:class:`~fedswarm.sim.batched_round.CohortBytes`),
node rows in bulk; :func:`~fedswarm.sim.batched_round.cohort_schedule`), and federated evaluation
scores the whole cohort in one batch (:mod:`fedswarm.sim.batched_eval`). What stays per client:
the minibatch permutations of clients holding more than one example (torch's generator, seeded
per client, defines them), and in the compressed, sketch, PVT and ProgFed runners the strategy
object's own per-node work (its train messages, replica sync, replies). Per-client state is
kept only for the clients that have some (:class:`~fedswarm.sim.batched_round.ClientRows`),
and a run whose estimated peak does not fit the available memory is refused before it starts
(:func:`check_memory`).

Which strategies it serves, and with which options, each strategy's registry entry says
(:class:`fedswarm.strategies.registry.Batched`: its round runner, a name in
:data:`ROUND_RUNNERS`, and whether it takes ``--dp`` and ``--byzantine`` here; ``labelflip`` is the
one data attack served: the chosen clients train on flipped labels). What it does not do: the
strategies without a runner (they run on ``--engine inprocess``; :func:`check_supported` says so
in one line), ``--dp-sgd`` and models with buffers (batch-norm statistics).

Simulated time (``--devices``): every round runner's rounds carry the in-process engine's ``sim_time_s``,
the slowest sampled node's download + compute + upload (:mod:`fedswarm.sim.batched_simtime`, from the
round's metered bytes; none under ``--secagg``); under ``--quorum``, ``--over-select``, ``--eligible``
or ``--availability`` the fleet's (:mod:`fedswarm.sim.batched_fleet`); FedBuff's runner its virtual
clock's.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import numpy as np
import torch
from flwr.app import ConfigRecord
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.algorithms.averaging import WeightedSum
from fedswarm.algorithms.selection.cohort import sample_positions
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.params import get_flat
from fedswarm.policy import PolicyBook
from fedswarm.server.app import PreparedStrategy, strategy_for
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.recorder import RoundListener, RoundRecorder, run_recorded
from fedswarm.sim.batched_memory import available_ram, default_memory_budget, parse_memory_budget
from fedswarm.sim.batched_compressed import CompressedRounds
from fedswarm.sim.batched_eval import CohortEvaluator
from fedswarm.sim.batched_fedbuff import FedBuffRounds
from fedswarm.sim.batched_fleet import BatchedFleet
from fedswarm.sim.batched_gtopk import GTopKRounds
from fedswarm.sim.batched_progfed import ProgFedRounds
from fedswarm.sim.batched_pvt import PVTRounds
from fedswarm.sim.batched_round import (NODE_ROWS_MAX, ByteCounter, Meter, add_client, add_clients, cohort_nodes,
                                        cohort_rows, cohort_schedule, reject_diverged, round_schedule)
from fedswarm.sim.batched_secagg_round import SecureFedAvg
from fedswarm.sim.batched_simtime import round_clock_for
from fedswarm.sim.batched_sketched import SketchRounds
from fedswarm.sim.batched_trainer import BatchedTrainer, ClientSchedule
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.tasks import get_task
from fedswarm.tasks.partition import partition_offsets
import fedswarm.train as _train  # the nodes' scoring, as their ClientApp calls it (not the server's evaluate_flat)
from fedswarm.train import evaluate_flat, node_validation, pooled_client_data, resolve_device, task_data
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["BatchedTrainer", "ClientSchedule", "run_batched", "parse_memory_budget", "default_memory_budget",
           "available_ram", "round_schedule", "check_supported", "BatchedRun",
           "add_client", "ROUND_RUNNERS", "round_runner", "check_memory", "memory_estimate"]

#: The round runners a strategy's :class:`~fedswarm.strategies.registry.Batched` entry names:
#: name -> runner class (filled in below, once ``FedAvgRounds`` is defined). ``weighted_mean``:
#: FedAvg's round here (with ``--dp``: each client's change clipped as it leaves the chunk, noised
#: once per round by the strategy's own mechanism); ``codec``: the strategies whose client half is
#: :func:`fedswarm.strategies.federated.compressed_fedavg.client_update` (the compressed ones and the
#: Byzantine-robust rules; with ``--dp`` the clients clip, the strategy object noises) and
#: ``global_topk`` (:mod:`fedswarm.sim.batched_gtopk`); ``variable_subsets``: PVT's
#: (:mod:`fedswarm.sim.batched_pvt`); ``stages``: ProgFed's (:mod:`fedswarm.sim.batched_progfed`);
#: ``sketch``: the Count-Sketch strategies' (:mod:`fedswarm.sim.batched_sketched`); ``fedbuff``: FedBuff's
#: asynchronous aggregations, each a recorded round (:mod:`fedswarm.sim.batched_fedbuff`).
ROUND_RUNNERS: dict[str, type] = {}

#: The round runners that compute a secure round's sum directly under ``--secagg``: FedAvg's
#: (:mod:`fedswarm.sim.batched_secagg_round`) and the linear codecs'
#: (:mod:`fedswarm.sim.batched_secagg_codec`); which strategies may ask is their entry's ``secagg``.
SECAGG_RUNNERS = ("weighted_mean", "codec", "sketch")

ClientsListener = Callable[[int, int], None]  # (clients done this round, clients this round)


def __getattr__(name: str) -> Any:
    """``SUPPORTED_STRATEGIES``: the strategies this engine serves (:func:`registry.batched_names`)."""
    if name == "SUPPORTED_STRATEGIES":  # read from the registry each time: a strategy registered later is in it
        return tuple(registry.batched_names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- which runs it serves ----------------------------------------------------------------------

def check_supported(cfg: RunConfig) -> None:
    """Raise a one-line :class:`ConfigError` for a run the batched engine cannot serve,
    naming the engine that can."""
    entry = registry.get(cfg.strategy)
    if entry.batched is None:
        raise ConfigError(f"--engine batched serves {', '.join(registry.batched_names())}; strategy "
                          f"'{cfg.strategy}' runs on --engine inprocess (or flower)")
    if cfg.dp_sgd:
        raise ConfigError("--engine batched does not run --dp-sgd; use --engine inprocess")
    # the sum computed directly in these runners (a strategy whose entry says no secagg is refused by check_secagg)
    if cfg.secagg and entry.secagg and entry.batched.runner not in SECAGG_RUNNERS:
        able = [n for n in registry.batched_names() if registry.get(n).batched.runner in SECAGG_RUNNERS
                and registry.get(n).secagg]
        raise ConfigError(f"--engine batched runs --secagg with {', '.join(able)}; with '{cfg.strategy}' use "
                          f"--engine inprocess")
    if cfg.secagg:
        from fedswarm.strategies.secagg_compat import batched_refusal

        if why := batched_refusal(cfg.strategy):
            raise ConfigError(f"--engine batched --secagg does not run '{cfg.strategy}': {why}; use --engine inprocess")
    if cfg.dp and not entry.batched.dp and not cfg.secagg:  # under --secagg: the nodes' distributed DP, in the sum
        raise ConfigError(f"--engine batched runs --dp with {', '.join(registry.batched_names(dp=True))}; with "
                          f"'{cfg.strategy}' use --engine inprocess")
    if cfg.byzantine:
        attack = cfg.attack  # parsed by the config (signflip unless given)
        own = not entry.batched.byzantine  # its replies are its own round's: no attack rewrites them here
        if own or (attack.kind == "data" and attack.name != "labelflip"):
            what = cfg.strategy if own else f"the '{attack.name}' attack (it poisons training data)"
            raise ConfigError(f"--engine batched does not run --byzantine with {what}; use --engine inprocess")
    check_memory(cfg)


def memory_estimate(cfg: RunConfig, available: int | None = None):
    """The run's peak memory (:func:`fedswarm.sim.batched_memory.estimate_peak`) from its task's
    model and data sizes, against ``available`` (default: the available RAM)."""
    from fedswarm.sim.batched_memory import estimate_peak
    from fedswarm.sim.batched_trainer import _activations_per_example

    task = get_task(cfg.task)
    model = task.model(cfg.seed)
    entry = registry.get(cfg.strategy)
    if cfg.client_data:  # each client's own files: sized when they are read
        n_train = n_test = 0
        x1 = None
    else:
        data = task_data(cfg)
        n_train, n_test = int(data.train_x.shape[0]), int(data.test_x.shape[0])
        x1 = data.train_x[:1]
    x_numel = int(np.prod(x1.shape[1:])) if x1 is not None and x1.dim() > 1 else 1
    act = _activations_per_example(model, x1) if x1 is not None else 1
    runner = entry.batched.runner if entry.batched is not None and isinstance(entry.batched.runner, str) else ""
    return estimate_peak(cfg, d=sum(p.numel() for p in model.parameters()), x_numel=x_numel, act_per_example=act,
                         n_train=n_train, n_test=n_test, runner=runner,
                         available=available_ram() if available is None else available,
                         memory_budget=parse_memory_budget(cfg.memory_budget))


def check_memory(cfg: RunConfig, available: int | None = None) -> None:
    """Refuse, before it starts, a run whose estimated peak (:func:`memory_estimate`) passes the
    available memory, naming the flag that would fit it."""
    from fedswarm.sim.batched_memory import fitting_fraction, human

    est = memory_estimate(cfg, available)
    if est.fits():
        return
    fix = []
    if est.parts["client state"] + est.parts["cohort"] > est.parts["chunk"]:
        f = fitting_fraction(cfg, lambda c: memory_estimate(c, est.available))
        if f is not None:
            fix.append(f"--fraction {f:.3g}")
    if est.parts["chunk"] > est.parts["client state"] and cfg.memory_budget is not None:
        fix.append(f"a smaller --memory-budget (now {cfg.memory_budget})")
    raise ConfigError(f"--engine batched: this run needs an estimated {human(est.total)} at its peak "
                      f"({est.describe()}), more than the {human(est.available)} available; "
                      + (f"it fits with {' or '.join(fix)}" if fix else "use fewer --clients") + ".")


def round_runner(entry: registry.StrategyEntry) -> Callable[..., Any]:
    """The round runner class of ``entry``'s :class:`~fedswarm.strategies.registry.Batched`."""
    runner = entry.batched.runner if entry.batched is not None else None
    if callable(runner):
        return runner
    if runner not in ROUND_RUNNERS:
        raise ConfigError(f"strategy '{entry.name}': no batched round runner '{runner}' (the runners: "
                          f"{', '.join(ROUND_RUNNERS)})")
    return ROUND_RUNNERS[runner]


# -- the engine --------------------------------------------------------------------------------

class BatchedRun:
    """What every round runner shares: the run's config, the trainer over the partition,
    the train config (policies included), the byte meter and the chunking knobs, and the
    strategy the config check built (``prepared``: :func:`strategy` takes it)."""

    def __init__(self, cfg: RunConfig, trainer: BatchedTrainer, train_config: ConfigRecord, n_examples: np.ndarray,
                 meter: Meter, *, memory_budget: int | None, chunk_size: int | None,
                 on_clients: ClientsListener | None, prepared: PreparedStrategy | None = None):
        self.cfg = cfg
        self.trainer = trainer
        self.train_config = train_config
        self.n_examples = n_examples
        self.meter = meter
        self.memory_budget = memory_budget
        self.chunk_size = chunk_size
        self.on_clients = on_clients
        self.prepared = prepared

    def strategy(self):
        """The run's strategy object: the one the config check built where it can be taken
        (:func:`fedswarm.server.app.strategy_for`), else built now."""
        return strategy_for(self.cfg, self.trainer.layout, self.prepared)

    def progress(self, total: int) -> Callable[[int], None]:
        """An ``on_chunk`` callback that reports clients done out of ``total``."""
        done = [0]

        def on_chunk(n: int) -> None:
            done[0] += n
            if self.on_clients is not None:
                self.on_clients(done[0], total)

        return on_chunk


class FedAvgRounds:
    """FedAvg's round: the clients' models folded into the weighted sum chunk by chunk."""

    def __init__(self, run: BatchedRun, model: torch.Tensor, notes=None):
        self.run = run
        self.model = model
        self.notes = notes  # the recorder: a diverged client's reply is rejected there
        self.counter = ByteCounter(run.train_config)
        # --dp: the mechanism fedavg's DPFedAvg strategy object holds, calibrated once for the run
        self.dp = run.strategy().dp if run.cfg.dp and not run.cfg.secagg else None
        # --secagg: the round's secure sum computed directly (sim/batched_secagg_round.py)
        self.secure = SecureFedAvg(run.cfg) if run.cfg.secagg else None
        # --quorum, --over-select, --eligible, --availability: who trains, as the fleet grid decides (batched_fleet.py)
        self.fleet = (BatchedFleet(run.cfg, run.train_config, run.n_examples, self.counter, run.meter)
                      if run.cfg.fleet_options() else None)

    def round(self, server_round: int) -> tuple[dict, list[dict]]:
        cfg = self.run.cfg
        if self.fleet is not None:
            self.model, row, node_rows = self.fleet.round(self.model, server_round, lambda kept: _one_round(
                self.run, self.counter, self.model, kept, server_round, self.notes, dp=self.dp))
            return row, node_rows
        # node ids 1..N, drawn as the in-process strategy draws them (sample_train_nodes' sample_positions)
        sample = sample_positions(cfg.clients, max(int(cfg.clients * cfg.fraction), 1)) + 1  # node ids, an array
        if self.secure is not None:
            self.model, row, node_rows = self.secure.round(self.run, self.counter, self.model, sample.tolist(),
                                                           server_round)
            return row, node_rows
        self.model, row, node_rows = _one_round(self.run, self.counter, self.model, sample, server_round, self.notes,
                                                dp=self.dp)
        return row, node_rows


ROUND_RUNNERS.update({
    "weighted_mean": FedAvgRounds,
    "codec": CompressedRounds,
    "global_topk": GTopKRounds,
    "variable_subsets": PVTRounds,
    "stages": ProgFedRounds,
    "sketch": SketchRounds,
    "fedbuff": FedBuffRounds,
})


def run_batched(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None,
                on_clients: ClientsListener | None = None, memory_budget: int | None = None,
                chunk_size: int | None = None, prepared: PreparedStrategy | None = None,
                runner: Callable[..., Any] | None = None) -> str:
    """Run ``cfg`` on the batched engine, recording into ``run_id``; return the final status.
    ``cfg`` passed :func:`check_supported` (:func:`fedswarm.sim.engines.run_engine` checks it).

    ``on_clients(done, total)`` is called after every chunk (the CLI's clients/s bar); ``prepared``:
    the strategy the config check built; ``runner``: the round runner class instead of the strategy's
    (:mod:`fedswarm.sim.batched_ray`'s sharded ones)."""
    from fedswarm.sim.inprocess import _run_ids

    TaskIdentity.run_id = next(_run_ids)  # what Flower's Message stamps on the messages it builds
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = 0
    if memory_budget is None:
        memory_budget = parse_memory_budget(cfg.memory_budget)
    random.seed(cfg.seed)  # as run_server: Flower's node sampling uses the random module
    torch.manual_seed(cfg.seed)
    task = get_task(cfg.task)
    device = resolve_device(cfg.device)
    model = task.model(cfg.seed).to(device)
    data = task_data(cfg)
    if cfg.client_data:  # each client's own train split, one after another
        train_x, train_y, flat_idx, offsets = pooled_client_data(cfg)
    else:
        train_x, train_y = data.train_x, data.train_y
        flat_idx, offsets = partition_offsets(data.train_y.numpy(), cfg.partition, cfg.clients, cfg.seed)
    trainer = BatchedTrainer(task, train_x, train_y, flat_idx, offsets, device, model_seed=cfg.seed,
                             num_classes=data.num_classes)
    n_examples = offsets[1:] - offsets[:-1]
    global_vec = get_flat(model).cpu()

    def evaluate(vec: torch.Tensor) -> tuple[float, float]:
        return evaluate_flat(task, model, vec, data.test_x, data.test_y, device)

    def on_partition(pid: int, vec: torch.Tensor) -> tuple[float, float, int]:
        """What node ``pid + 1``'s ClientApp answers an evaluate message with (fedswarm.client.evaluate)."""
        x, y = node_validation(cfg, pid, cfg.clients)
        return (*_train.evaluate_flat(task, model, vec, x, y, device), int(x.shape[0]))

    # the cohort's federated evaluation, one batched computation (sim/batched_eval.py)
    evaluator = CohortEvaluator(cfg, task, model, device, data.test_x, data.test_y, on_partition)

    train_config = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    policies = PolicyBook(cfg.policies)
    policies.write(train_config)
    meter = Meter()
    central = evaluate if cfg.central_eval else None  # off: no server test set
    recorder = RoundRecorder(store, run_id, meter, central,  # type: ignore[arg-type]  (a Meter: only take())
                             listeners=listeners, policies=policies,
                             train_config=train_config, node_kind="sim")
    run = BatchedRun(cfg, trainer, train_config, n_examples, meter, memory_budget=memory_budget,
                     chunk_size=chunk_size, on_clients=on_clients, prepared=prepared)
    rounds_of = (runner or round_runner(registry.get(cfg.strategy)))(run, global_vec, notes=recorder)
    evaluator.scorer = getattr(rounds_of, "score_cohort", None)  # a sharded runner's: on its workers
    recorder.min_train_nodes = getattr(getattr(rounds_of, "strategy", None), "min_train_nodes", None)
    recorder.eval_every = cfg.eval_every
    clock = round_clock_for(run)  # --devices alone: the rounds' simulated time (sim/batched_simtime.py)

    def loop() -> None:
        recorder(0, rounds_of.model)
        rounds, done = cfg.rounds, 0
        while rounds > 0:
            for _ in range(rounds):
                done += 1
                row, node_rows = rounds_of.round(done)
                if clock is not None and "sim_time_s" not in row:
                    row["sim_time_s"] = clock.round_time(done, meter.traffic, node_rows)
                if recorder.eval_due(done):  # the round's cohort: the clients it sampled
                    row.update(evaluator.round_figures(done, rounds_of.model, cohort_nodes(meter.traffic.node_down),
                                                       node_rows))
                recorder.node_rows(node_rows)
                recorder.note(**row, **recorder.failed_nodes(done, node_rows))
                recorder(done, rounds_of.model)
            rounds, recorder.extra_rounds = recorder.extra_rounds, 0

    return run_recorded(store, run_id, loop)


def _one_round(run: BatchedRun, counter: ByteCounter, global_vec: torch.Tensor, sample: Sequence[int] | np.ndarray,
               server_round: int, notes=None, dp=None) -> tuple[torch.Tensor, dict, list[dict]]:
    """Train the sampled clients, average their models weighted by examples (Flower's
    FedAvg, leaving out the clients that diverged: their replies are rejected), count the
    bytes of every client's message and reply. With ``dp`` (a
    :class:`~fedswarm.algorithms.privacy.dp_fedavg.ClientLevelDP`), DP-FedAvg instead: the
    mean of the clipped changes plus its Gaussian noise, the round's DP figures in its row.

    The bookkeeping is arrays over the cohort (:func:`cohort_schedule`,
    :meth:`ByteCounter.cohort_sizes`, :func:`add_clients`): no Python work per client but the
    per-node rows, kept only up to ``NODE_ROWS_MAX`` clients."""
    cfg, trainer = run.cfg, run.trainer
    ids = np.asarray(sample, dtype=np.int64)  # once: the cohort's arrays all read it
    cohort = cohort_schedule(cfg, ids, run.train_config, run.n_examples, server_round)
    sched = cohort.sched
    total = len(sample)
    acc = WeightedSum(trainer.layout.d)  # FedAvg's aggregate, as the Flower strategy's; with dp, the clipped sum
    loss_sum = 0.0
    record_nodes = total <= NODE_ROWS_MAX
    weights = trainer.num_examples(sched.partitions).to(torch.float32)  # FedAvg weighs by num-examples
    within = [0]
    if dp is not None:
        dp.before_round()
    kept = total
    losses: list[torch.Tensor] = []
    rejected: dict[int, torch.Tensor] = {}
    for rows, part_sum, loss, _n, loss_wsum, diverged in trainer.average(
            global_vec, sched, weights, momentum=cfg.momentum, chunk_size=run.chunk_size,
            memory_budget=run.memory_budget, on_chunk=run.progress(total), per_client_loss=record_nodes,
            clip=None if dp is None else dp.clip, within=within):
        acc.add_sum(part_sum, float(weights[rows].sum()) - sum(float(weights[i]) for i in diverged))
        kept -= len(diverged)
        loss_sum += loss_wsum
        if loss is not None:
            losses.append(loss)
        rejected.update(diverged)
    # the bytes: one measured message and reply per size key (the reply's size depends on the model's length,
    # not its values, and any float loss is 8 bytes)
    n_all = run.n_examples[sched.partitions.numpy()]
    down, up = counter.cohort_sizes(vector_to_arrayrecord(global_vec), global_vec, ids, n_all,
                                    sched.steps.numpy(), cohort, server_round)
    traffic = Traffic()
    add_clients(traffic, ids, up, down)
    node_rows: list[dict] = []
    if record_nodes:
        loss_list = torch.cat(losses).tolist() if losses else [0.0] * total
        node_rows = cohort_rows(ids.tolist(), up, down, n_all.tolist(), loss_list, cohort.classes(), cohort.policies())
    for i in sorted(rejected):
        reject_diverged(notes, node_rows if record_nodes else None, int(ids[i]), rejected[i], int(n_all[i]), row=i)
    run.meter.traffic = traffic
    if acc.weight == 0:  # every client diverged: the model stays
        return global_vec, {"train_loss": None, "num_clients": total}, node_rows
    row = {"train_loss": loss_sum / acc.weight, "num_clients": total}
    if dp is None:
        return acc.mean(), row, node_rows
    mean, metrics = dp.noised_mean(acc.total, within[0], kept)
    row.update(metrics)
    return global_vec + mean, row, node_rows
