"""``fedswarm bench minibatch``: the minibatch draw of a batched round, before and after it
became array operations over the cohort (:func:`fedswarm.algorithms.local_sgd.minibatch_plans`).

The round: the batched trainer's FedAvg sum (:meth:`BatchedTrainer.average`: the cohort's
minibatch plan, its local SGD and the weighted sum) of 10,000 clients with 8 examples each,
batch 4, 2 local steps (``--quick``: a fifth of the clients), digits-mlp's model on synthetic rows
(random 64-feature examples: digits has too few for 80,000). The engine's per-round
bookkeeping around it (sampling, bytes, node rows) is not in it: this is the part the draw
belongs to. Columns: client-rounds per second (steady CPU seconds, one torch thread), the
round's CPU seconds and the plan's (``BatchedTrainer.minibatches``, timed inside the round) and
its share of the round.

``before`` is the same cell on another checkout's code (``FEDSWARM_BENCH_BEFORE=CHECKOUT``,
e.g. ``git worktree add /tmp/before main``), run in turn with ``now`` (``repeats`` each,
interleaved) so both see the same load; every cell is a fresh interpreter on one torch thread.
JSON (minibatch.json) + PNG (minibatch.png).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

__all__ = ["run", "SHAPE"]

BEFORE_ENV = "FEDSWARM_BENCH_BEFORE"
SHAPE = dict(clients=10_000, examples=8, batch_size=4, steps=2, rounds=3)

# One cell: uses only what the code before the change has too (BatchedTrainer, ClientSchedule, round_seeds)
_CELL = r"""
import json, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from fedswarm.params import get_flat
from fedswarm.sim.batched_round import round_seeds
from fedswarm.sim.batched_trainer import BatchedTrainer, ClientSchedule
from fedswarm.tasks import get_task
spec = json.loads(sys.argv[1])
k, n = spec["clients"], spec["examples"]
g = torch.Generator().manual_seed(0)
x, y = torch.randn(k * n, 64, generator=g), torch.randint(0, 10, (k * n,), generator=g)
task = get_task("digits-mlp")
trainer = BatchedTrainer(task, x, y, np.arange(k * n), np.arange(k + 1) * n)
plan_cpu = []
draw = BatchedTrainer.minibatches
def timed(self, schedule):
    c0 = time.process_time()
    try:
        return draw(self, schedule)
    finally:
        plan_cpu.append(time.process_time() - c0)
BatchedTrainer.minibatches = timed
start = get_flat(task.model(0)).detach()
rounds = []
for r in range(1, spec["rounds"] + 1):
    sched = ClientSchedule(torch.arange(k), torch.full((k,), spec["steps"]), torch.full((k,), spec["batch_size"]),
                           torch.full((k,), 0.1), torch.from_numpy(round_seeds(0, r, np.arange(k))))
    c0 = time.process_time()
    total = sum(part[1] for part in trainer.average(start, sched, torch.ones(k, dtype=torch.float64),
                                                    per_client_loss=False))
    rounds.append(time.process_time() - c0)
    start = (total / k).float()
with open(sys.argv[2], "w") as fh:
    json.dump({"status": "finished", "round_cpu": rounds, "plan_cpu": plan_cpu,
               "model_norm": float(start.norm())}, fh)
"""


def _cell(spec: dict, pythonpath: Path | None) -> dict:
    from fedswarm.bench.cells import sampled_cell

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cell = sampled_cell(["-c", _CELL, json.dumps(spec), "{out}"], 900, env=env)
    if cell.get("round_cpu"):  # steady: the rounds after the first
        steady = list(zip(cell["round_cpu"], cell["plan_cpu"]))[1:] or list(zip(cell["round_cpu"], cell["plan_cpu"]))
        cell["steady_round_cpu_s"] = statistics.median(r for r, _ in steady)
        cell["steady_plan_cpu_s"] = statistics.median(p for _, p in steady)
    return cell


def run(out_dir: Path, quick: bool = False, console: Console | None = None) -> list[dict]:
    from fedswarm.bench.dashboard_runs import source_tree

    console = console or Console(width=200)
    spec = dict(SHAPE, clients=SHAPE["clients"] // 5 if quick else SHAPE["clients"])
    repeats = 1 if quick else 2
    before = os.environ.get(BEFORE_ENV) or None
    labels = (["before"] if before else []) + ["now"]
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        tree = source_tree(Path(before), Path(tmp) / "before") if before else None
        for rep in range(repeats):
            for label in labels:
                console.print(f"[dim]minibatch: {label} ({spec['clients']:,} clients), run {rep + 1} ...[/]")
                runs[label].append(_cell(spec, tree if label == "before" else None))
    rows = []
    for label in labels:
        ok = [c for c in runs[label] if c.get("steady_round_cpu_s")]
        best = min(ok, key=lambda c: c["steady_round_cpu_s"]) if ok else {}
        row = {"row": label, "code": before if label == "before" else "this checkout", **spec,
               "status": best.get("status") or (runs[label][0].get("status") if runs[label] else None),
               "cpu_s_per_round": best.get("steady_round_cpu_s"), "plan_cpu_s": best.get("steady_plan_cpu_s"),
               "runs": runs[label]}
        if row["cpu_s_per_round"]:
            row["client_rounds_per_s"] = spec["clients"] / row["cpu_s_per_round"]
            row["plan_share"] = row["plan_cpu_s"] / row["cpu_s_per_round"]
        rows.append(row)
    by = {r["row"]: r for r in rows}
    if by.get("before", {}).get("cpu_s_per_round") and by["now"].get("cpu_s_per_round"):
        by["now"]["x_before"] = by["before"]["cpu_s_per_round"] / by["now"]["cpu_s_per_round"]
        by["now"]["plan_x_before"] = by["before"]["plan_cpu_s"] / by["now"]["plan_cpu_s"]
    _print(rows, console)
    meta = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "shape": spec, "repeats": repeats,
            "before": before}
    (out_dir / "minibatch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _plot(rows, out_dir / "minibatch.png")
    return rows


def _print(rows: list[dict], console: Console) -> None:
    load = os.getloadavg()
    table = Table(title=f"minibatch draw in a batched round (load {load[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("row", "clients", "examples", "batch", "steps", "client-rounds/s", "CPU s/round", "plan CPU s",
                "plan share", "x before", "plan x before", "note"):
        table.add_column(col)

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(r["row"], f"{r['clients']:,}", str(r["examples"]), str(r["batch_size"]), str(r["steps"]),
                      f(r.get("client_rounds_per_s"), ",.0f"), f(r.get("cpu_s_per_round"), ".4f"),
                      f(r.get("plan_cpu_s"), ".4f"), f(r.get("plan_share"), ".1%"), f(r.get("x_before"), ".2f"),
                      f(r.get("plan_x_before"), ".1f"),
                      "" if r.get("status") == "finished" else str(r.get("status"))[:60])
    console.print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("cpu_s_per_round")]
    fig, ax = plt.subplots(figsize=(7, 3))
    names = [r["row"] for r in shown]
    plan = [r["plan_cpu_s"] for r in shown]
    rest = [r["cpu_s_per_round"] - r["plan_cpu_s"] for r in shown]
    ax.barh(names, plan, color="C3", label="minibatch plan")
    ax.barh(names, rest, left=plan, color="C0", label="local SGD + FedAvg sum")
    for i, r in enumerate(shown):
        ax.text(r["cpu_s_per_round"], i, f" {r['cpu_s_per_round']:.3f} s (plan {r['plan_share']:.0%})", va="center",
                fontsize=8)
    ax.set_xlabel("CPU seconds per batched round (one torch thread)")
    if shown:
        r = shown[0]
        ax.set_title(f"{r['clients']:,} clients x {r['examples']} examples, batch {r['batch_size']}, "
                     f"{r['steps']} steps")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
