"""``fedswarm bench engines``'s ``scale`` section: the batched engine against its compute floor.

Rows (each run cell in a fresh interpreter, its resident memory sampled for the peak):

- ``now``: the batched engine, digits-mlp, one local step (batch 16, lr 0.3), 100,000 clients
  (``--quick``: 20,000), ``--fraction 1.0``, federated evaluation off (``eval_every`` past the
  last round); client-rounds per second over the steady rounds (the median round after the first);
- ``now + fed eval``: the same with federated evaluation every round (the ratio to ``now`` is
  the cost of scoring the whole cohort; "in run": the same ratio within the evaluated run, each
  steady round's CPU seconds over those less its evaluation's, ``CohortEvaluator.round_figures``
  timed in the cell, the median over rounds and runs: no second run's different load in it);
- ``before``: the ``now`` run on another checkout's code, with ``FEDSWARM_BENCH_BEFORE=CHECKOUT``
  (e.g. an export of main before the change: ``git archive 8779d80 | tar -x -C /tmp/before``),
  run side by side with ``now``, in turn, so both see the same machine load;
- ``compute floor``: the same forward and backward pass over the same examples (the round's
  minibatches: one example per client here) as one plain torch batch, no engine: the median of
  several passes, measured between the engine's cells;
- ``1M population``: 1,000,000 clients at ``--fraction 0.01`` (10,000 a round), digits-mlp and
  synthetic-logreg: seconds per round and peak RSS; and ``compressed_fedavg`` (its default codec,
  top-k with error feedback) on digits-mlp, 3 rounds;
- ``sketched_sgd``: the Count-Sketch strategy with the most client state (error and momentum
  ``[d]`` each, the candidates it answered) and a second exchange a round, digits-mlp at
  ``--fraction 0.01`` on populations of 100,000 and 1,000,000, 3 rounds: seconds per round and
  peak RSS against the population, beside the client state the memory estimate states for it
  (``state_bound_mb``: the bound its arrays stay within); with ``FEDSWARM_BENCH_BEFORE`` each
  also on the other checkout (``before: ...``), in turn.

- ``availability first round``: FedAvg under ``--availability on=1800,off=1800,diurnal=0.5,dropout=0.1``
  (``--devices`` half gpu, half edge-wifi), digits-mlp at ``--fraction 0.01`` on populations of
  10,000 and 100,000, 2 rounds: the first round's seconds (``first_round_s``: every node's
  availability windows are drawn at its start), the whole run's (``run_s``, the process's
  setup included) and the availability part's CPU seconds (``availability_cpu_s``: building the
  fleet's ``Availability`` and the first round's ``Presence.at``, timed inside the run); with
  ``FEDSWARM_BENCH_BEFORE`` each also on the other checkout, in turn.

``FEDSWARM_BENCH_SCALE_ROWS=WORD`` runs only the rows whose label holds ``WORD`` (e.g. ``sketched``).

``repeats`` (2; quick 1) runs of every cell, interleaved; the table gives each cell's best
steady round (the least disturbed by other work on the machine) and the JSON every run. Each
round is timed twice: wall seconds (the recorder's ``wall_s``) and the process's CPU seconds
(``time.process_time`` between rounds; the floor's likewise). Every cell and the floor run on
one torch thread (``OMP_NUM_THREADS=1``): on a shared machine the CPU figures are then the
comparable ones (time spent waiting for a core is not in them, and no idle thread spins in
them); the engine's own default is two threads.
Written to ``DIR/engines-scale.json`` and ``DIR/engines-scale.png``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

__all__ = ["run_scale", "compute_floor", "BEFORE_ENV"]

BEFORE_ENV = "FEDSWARM_BENCH_BEFORE"
ROWS_ENV = "FEDSWARM_BENCH_SCALE_ROWS"
#: the availability rows' fleet: sessions of 30 min on and off on average, diurnal, 10 % dropouts
AVAILABILITY = "on=1800,off=1800,diurnal=0.5,dropout=0.1"
BASE = dict(task="digits-mlp", partition="iid", local_steps=1, batch_size=16, lr=0.3, fraction=1.0, seed=0,
            engine="batched")

# One cell, run by a fresh interpreter on whichever checkout PYTHONPATH puts first: it uses only
# what both the code before the change and after it have (RunConfig, bench.engines.run_in_store).
_CELL = r"""
import json, logging, sys, time
logging.getLogger("flwr").setLevel(logging.WARNING)
from fedswarm.config import RunConfig
from fedswarm.bench.arms import run_arm, scratch_store
spec = json.loads(sys.argv[1])
marks = []  # (round, process CPU seconds) as each round is recorded
evals = []  # process CPU seconds of each round's federated evaluation (code that has a CohortEvaluator)
try:
    from fedswarm.sim.batched_eval import CohortEvaluator
    def timed(figures):
        def round_figures(*args):
            c0 = time.process_time()
            try:
                return figures(*args)
            finally:
                evals.append(time.process_time() - c0)
        return round_figures
    CohortEvaluator.round_figures = timed(CohortEvaluator.round_figures)
except (ImportError, AttributeError):  # code without it (a checkout from before)
    pass
fleet_cpu = {"setup": [], "presence": []}  # availability: CPU seconds of the windows' setup and of each Presence.at
try:
    import fedswarm.sim.batched_fleet as bf
    def timed_as(key, fn):
        def call(*args, **kwargs):
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                fleet_cpu[key].append(time.process_time() - c0)
        return call
    bf.availability_for = timed_as("setup", bf.availability_for)
    bf.Presence.at = timed_as("presence", bf.Presence.at)
except (ImportError, AttributeError):
    pass
t0 = time.perf_counter()
with scratch_store() as store:
    arm = run_arm(RunConfig(**spec), store, listeners=[lambda rnd, row: marks.append((rnd, time.process_time()))],
                  ok=None)
cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:]) if b[0] == a[0] + 1 and a[0] >= 0]
walls = [r["wall_s"] for r in arm.result["rounds"] if r["round"] > 0]
with open(sys.argv[2], "w") as fh:
    json.dump({"status": arm.status, "walls": walls, "cpu": cpu, "eval_cpu": evals, "total_s": time.perf_counter() - t0,
               "availability_setup_cpu": fleet_cpu["setup"], "presence_cpu": fleet_cpu["presence"],
               "final_test_accuracy": arm.result["summary"]["final_test_accuracy"]}, fh)
"""


def _cell(spec: dict, pythonpath: Path | None, timeout_s: float) -> dict:
    """Run one cell in a fresh interpreter (``pythonpath`` first on its path: another checkout's
    code); its figures and the peak RSS of its process tree."""
    from fedswarm.bench.cells import sampled_cell

    env = dict(os.environ, OMP_NUM_THREADS="1")  # one torch thread: CPU seconds measure work, not spinning threads
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return _steady(sampled_cell(["-c", _CELL, json.dumps(spec), "{out}"], timeout_s, env=env, every_s=0.1))


def _steady(cell: dict) -> dict:
    """``cell`` with its steady figures (the median round after the first): ``steady_round_s``,
    ``steady_cpu_s`` and, for a run with federated evaluation every round, ``steady_x_without_fed_eval``
    (each round's CPU seconds over those less its evaluation's)."""
    for key, out in (("walls", "steady_round_s"), ("cpu", "steady_cpu_s")):
        xs = cell.get(key)
        if xs:
            cell[out] = statistics.median(xs[1:]) if len(xs) > 1 else xs[0]
    cpu, evals = cell.get("cpu") or [], cell.get("eval_cpu") or []
    if evals and len(evals) == len(cpu):
        steady = list(zip(cpu, evals))[1:] or list(zip(cpu, evals))
        cell["steady_x_without_fed_eval"] = statistics.median(c / (c - e) for c, e in steady)
    return cell


def compute_floor(clients: int, repeats: int = 7) -> tuple[float, float]:
    """Seconds of one plain-torch forward and backward pass of digits-mlp over the examples a
    ``clients``-client round of :data:`BASE` trains on (each client's first-step minibatch, as the
    batched trainer draws them; one batch, the mean loss) on one torch thread, as the cells run:
    the median wall and process CPU seconds of ``repeats`` passes after a warm-up."""
    import torch
    from fedswarm.config import RunConfig
    from fedswarm.sim.batched_round import round_schedule
    from fedswarm.sim.batched_trainer import BatchedTrainer
    from fedswarm.tasks import get_task
    from fedswarm.tasks.partition import partition_offsets
    from fedswarm.train import task_data

    cfg = RunConfig(**BASE, clients=clients)
    task = get_task(cfg.task)
    data = task_data(cfg)
    flat, offsets = partition_offsets(data.train_y.numpy(), cfg.partition, clients, cfg.seed)
    trainer = BatchedTrainer(task, data.train_x, data.train_y, flat, offsets)
    sched, _, _ = round_schedule(cfg, list(range(1, clients + 1)), _train_config(cfg), offsets[1:] - offsets[:-1], 1)
    idx, valid = trainer.minibatches(sched)
    rows = idx[:, 0][valid[:, 0]]
    x, y = data.train_x[rows], data.train_y[rows]
    model = task.model(cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the engine's cells (OMP_NUM_THREADS=1)
    walls, cpus = [], []
    try:
        for i in range(repeats + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            model.zero_grad(set_to_none=True)
            task.objective(model, x, y).backward()
            if i:  # the first pass warms up
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(walls), statistics.median(cpus)


def _train_config(cfg):
    from flwr.app import ConfigRecord

    return ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})


def run_scale(out_dir: Path, quick: bool = False, console: Console | None = None) -> list[dict]:
    """The section's rows (see the module's docstring); writes engines-scale.json and .png."""
    from fedswarm.bench.dashboard_runs import source_tree

    console = console or Console(width=200)
    clients = 20_000 if quick else 100_000
    rounds = 3 if quick else 5
    repeats = 1 if quick else 2
    before = os.environ.get(BEFORE_ENV) or None
    cells: list[tuple[str, dict, bool]] = [
        ("now", dict(BASE, clients=clients, rounds=rounds, eval_every=rounds + 1), False),
        ("now + fed eval", dict(BASE, clients=clients, rounds=rounds, eval_every=1), False),
    ]
    if before:
        cells.insert(0, ("before", dict(BASE, clients=clients, rounds=rounds, eval_every=rounds + 1), True))
    for task in ("digits-mlp", "synthetic-logreg"):
        cells.append((f"1M population {task}", dict(BASE, task=task, clients=1_000_000, fraction=0.01, rounds=rounds,
                                                    eval_every=rounds + 1), False))
    # the compressed family's runner at the same population (top-k with error feedback, its defaults): 3 rounds,
    # its rounds are seconds each
    cells.append(("1M population compressed_fedavg digits-mlp",
                  dict(BASE, strategy="compressed_fedavg", clients=1_000_000, fraction=0.01, rounds=3, eval_every=4),
                  False))
    # the sketch strategy with the most client state, against the population (each before the change too)
    for population in (100_000, 1_000_000):
        label = f"{population // 1000:,}k population sketched_sgd digits-mlp".replace("1,000k", "1M")
        spec = dict(BASE, strategy="sketched_sgd", clients=population, fraction=0.01, rounds=3, eval_every=4)
        if before:
            cells.append(("before: " + label, spec, True))
        cells.append((label, spec, False))
    # the fleet's first round under --availability (each node's windows drawn at the round's start), against the
    # population (each before the change too): 2 rounds at --fraction 0.01
    for population in (10_000, 100_000):
        label = f"{population // 1000:,}k population availability first round"
        spec = dict(BASE, clients=population, fraction=0.01, rounds=2, eval_every=3, availability=AVAILABILITY,
                    devices=f"gpu:{population // 2},edge-wifi:{population - population // 2}")
        if before:
            cells.append(("before: " + label, spec, True))
        cells.append((label, spec, False))
    only = os.environ.get(ROWS_ENV)
    if only:
        cells = [c for c in cells if only in c[0]]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in cells}
    floors: list[tuple[float, float]] = []  # (wall, CPU) seconds
    with tempfile.TemporaryDirectory() as tmp:
        tree = source_tree(Path(before), Path(tmp) / "before") if before else None
        for rep in range(repeats):
            for label, spec, old in cells:
                console.print(f"[dim]engines scale: {label} ({spec['clients']:,} clients), run {rep + 1} ...[/]")
                runs[label].append(_cell(spec, tree if old else None, timeout_s=900))
                if label in ("before", "now"):
                    floors.append(compute_floor(clients))
    rows = []
    for label, spec, old in cells:
        ok = [c for c in runs[label] if c.get("status") == "finished"]
        best = min(ok, key=lambda c: c["steady_round_s"]) if ok else (runs[label][0] if runs[label] else {})
        per_round = spec["clients"] * spec["fraction"]
        row = {"row": label, "code": before if old else "this checkout", "task": spec["task"],
               "strategy": spec.get("strategy", "fedavg"),
               "clients": spec["clients"], "fraction": spec["fraction"],
               "fed_eval_every_round": spec["eval_every"] == 1,
               "status": best.get("status"), "s_per_round": best.get("steady_round_s"),
               "cpu_s_per_round": min((c["steady_cpu_s"] for c in ok if c.get("steady_cpu_s")), default=None),
               "peak_rss_mb": max((c.get("peak_rss_mb") or 0) for c in runs[label]) if runs[label] else None,
               "final_test_accuracy": best.get("final_test_accuracy"), "runs": runs[label]}
        if row["s_per_round"]:
            row["client_rounds_per_s"] = per_round / row["s_per_round"]
        if spec.get("availability"):  # its first round (the median below is the second's), and the whole run
            row["first_round_s"] = min((c["walls"][0] for c in ok if c.get("walls")), default=None)
            row["run_s"] = min((c["total_s"] for c in ok if c.get("total_s")), default=None)
            # the availability part of it, CPU seconds: the windows' setup, the first round's Presence.at
            row["availability_cpu_s"] = min((sum(c["availability_setup_cpu"]) + c["presence_cpu"][0] for c in ok
                                             if c.get("presence_cpu")), default=None)
        if spec.get("strategy") == "sketched_sgd" and not old:
            row["state_bound_mb"] = _state_bound(spec) / 1e6
        rows.append(row)
    floor = min(w for w, _ in floors) if floors else None
    if not floors:  # the floor is measured beside "now"
        _ratios(rows)
        _print(rows, console)
        _write(out_dir, rows, before, repeats)
        return rows
    rows.append({"row": "compute floor", "code": "plain torch", "task": "digits-mlp", "clients": clients,
                 "fraction": 1.0, "s_per_round": floor, "client_rounds_per_s": clients / floor if floor else None,
                 "cpu_s_per_round": min(c for _, c in floors) if floors else None,
                 "floors": floors, "status": "measured"})
    _ratios(rows)
    _print(rows, console)
    _write(out_dir, rows, before, repeats)
    return rows


def _write(out_dir: Path, rows: list[dict], before: str | None, repeats: int) -> None:
    meta = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "base": BASE, "repeats": repeats,
            "before": before}
    (out_dir / "engines-scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _plot(rows, out_dir / "engines-scale.png")


def _state_bound(spec: dict) -> int:
    """The client state the batched engine's memory estimate states for run ``spec`` (its bound)."""
    from fedswarm.config import RunConfig
    from fedswarm.sim.batched import memory_estimate

    return memory_estimate(RunConfig(**spec), available=10**15).parts["client state"]


def _ratios(rows: list[dict]) -> None:
    """The targets' ratios, on wall seconds and on process CPU seconds (``cpu_`` prefix: what a
    loaded machine disturbs least, since waiting for a core is not counted)."""
    by = {r["row"]: r for r in rows}
    now, floor, before = by.get("now", {}), by.get("compute floor", {}), by.get("before", {})
    fed = by.get("now + fed eval", {})
    for key, prefix in (("s_per_round", ""), ("cpu_s_per_round", "cpu_")):
        if now.get(key) and floor.get(key):
            now[prefix + "x_floor"] = now[key] / floor[key]
        if now.get(key) and before.get(key):
            now[prefix + "x_before"] = before[key] / now[key]  # client-rounds/s now over before
        if fed.get(key) and now.get(key):
            fed[prefix + "x_without_fed_eval"] = fed[key] / now[key]
        for label, row in by.items():  # each "before: X" row against its X
            after = by.get(label.removeprefix("before: ")) if label.startswith("before: ") else None
            if after is not None and after.get(key) and row.get(key):
                after[prefix + "x_before"] = row[key] / after[key]
            for part in ("first_round_s", "availability_cpu_s"):
                if key == "s_per_round" and after is not None and after.get(part) and row.get(part):
                    after[part.removesuffix("_s") + "_x_before"] = row[part] / after[part]
    # the same ratio within each evaluated run (its rounds' CPU seconds over those less the evaluation's):
    # no second cell, so no load that differs between two runs
    within = [c["steady_x_without_fed_eval"] for c in fed.get("runs", []) if c.get("steady_x_without_fed_eval")]
    if within:
        fed["cpu_x_without_fed_eval_in_run"] = statistics.median(within)


def _print(rows: list[dict], console: Console) -> None:
    load = os.getloadavg()
    table = Table(title=f"engines scale: batched engine, one local step (load {load[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("row", "task", "clients", "fraction", "client-rounds/s", "s/round", "x floor", "x before",
                "x no fed eval", "CPU s/round", "CPU x floor", "CPU x before", "CPU x no fed eval",
                "CPU x no fed eval (in run)", "peak MB", "state bound MB", "first round s", "first round x before",
                "availability CPU s", "availability x before", "note"):
        table.add_column(col)

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(r["row"], r["task"], f"{r['clients']:,}", f"{r['fraction']:g}",
                      f(r.get("client_rounds_per_s"), ",.0f"), f(r.get("s_per_round"), ".3f"),
                      f(r.get("x_floor"), ".2f"), f(r.get("x_before"), ".1f"), f(r.get("x_without_fed_eval"), ".2f"),
                      f(r.get("cpu_s_per_round"), ".3f"), f(r.get("cpu_x_floor"), ".2f"),
                      f(r.get("cpu_x_before"), ".1f"), f(r.get("cpu_x_without_fed_eval"), ".2f"),
                      f(r.get("cpu_x_without_fed_eval_in_run"), ".3f"),
                      f(r.get("peak_rss_mb"), ".0f"), f(r.get("state_bound_mb"), ".0f"),
                      f(r.get("first_round_s"), ".3f"), f(r.get("first_round_x_before"), ".1f"),
                      f(r.get("availability_cpu_s"), ".3f"), f(r.get("availability_cpu_x_before"), ".0f"),
                      "" if r.get("status") in ("finished", "measured") else str(r.get("status"))[:60])
    console.print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("first_round_s") or r.get("s_per_round")]
    secs = [r.get("first_round_s") or r["s_per_round"] for r in shown]  # the availability rows: their first round
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.barh([f"{r['row']} ({r['clients'] * r['fraction']:,.0f}/round)" for r in shown], secs,
            color=[f"C{i}" for i in range(len(shown))])
    for i, s in enumerate(secs):
        ax.text(s, i, f" {s:.3f} s", va="center", fontsize=8)
    ax.set_xlabel("seconds per round (steady; availability rows: the first; floor: one plain torch forward+backward)")
    ax.set_title("batched engine at scale: digits-mlp, one local step")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
