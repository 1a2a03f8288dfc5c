"""``fedswarm bench engines``: every simulation engine on the same FedAvg run, side by side.

The run: digits-mlp, iid, one local SGD step per client per round (batch 16, lr 0.3),
every client sampled every round, at 100, 1,000 and 10,000 clients (``--quick``: 100
and 1,000, two rounds). The engines:

- ``flower``: Flower's Simulation Engine (Ray actors running fedswarm's ClientApp);
- ``pfl``: Apple's pfl-research (``pip install prv-accountant && pip install pfl --no-deps``),
  its own ``FederatedAveraging`` with ``SimulatedBackend`` on the same data split and the
  same model (pfl weighs every user equally and walks each user's data in order: its
  accuracy differs slightly);
- ``inprocess``: fedswarm's ServerApp and ClientApp in one process;
- ``batched``: fedswarm's batched engine (all sampled clients at once).

Each cell runs in a fresh subprocess (Ray and pfl keep global state) whose process tree's
resident memory is sampled for the peak. A cell whose predicted time (from the same
engine's last cell, linear in clients) passes the cap (600 s; quick 60 s) runs fewer
rounds, or none, and the table says so. Columns: client-rounds per second, seconds per
round (the median round after the first, whose Ray actor start-up and warm caches are
shown apart with the start-up outside rounds), peak memory, final
accuracy, and each engine's ratio to Flower at the same size. JSON + a log-log PNG.

Then the ``scale`` section (:mod:`fedswarm.bench.engines_scale`, ``DIR/engines-scale.json`` and
``.png``): the batched engine at 100,000 clients against its compute floor, before and after
(``FEDSWARM_BENCH_BEFORE=CHECKOUT``), with federated evaluation, and a 1,000,000-client population;
``FEDSWARM_BENCH_ENGINES_SECTION=scale`` runs that section alone. Then the ``codec`` section
(:mod:`fedswarm.bench.engines_codec`, ``DIR/engines-codec.json``): the codec runner
(``compressed_fedavg``, top-k with error feedback) at 10,000 and 100,000 clients, before and after,
beside the compute floor; ``FEDSWARM_BENCH_ENGINES_SECTION=codec`` runs it alone.

``--device cuda`` (or cuda:N) adds the batched engine on that GPU (``batched@cuda``, with its
peak ``torch.cuda.max_memory_allocated``) beside every CPU row; ``scripts/gpu-check`` measures
more on one GPU (100,000 clients, digits-cnn4, the fraction of the GPU's peak).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedswarm.bench.cells import sampled_cell

__all__ = ["run", "run_cell", "run_in_store", "ENGINES"]

ENGINES = ("flower", "pfl", "inprocess", "batched")
SECTION_ENV = "FEDSWARM_BENCH_ENGINES_SECTION"  # "scale" / "codec": only that section
TASK = dict(task="digits-mlp", partition="iid", local_steps=1, batch_size=16, lr=0.3, fraction=1.0, seed=0)


def pfl_available() -> str | None:
    """None if pfl imports, else why not (shown in the table)."""
    try:
        import pfl  # noqa: F401
        from pfl.algorithm import FederatedAveraging  # noqa: F401
    except ImportError as exc:
        return f"pfl is not installed ({exc}); pip install prv-accountant && pip install pfl --no-deps (see README)"
    return None


# -- one cell, inside its own process ----------------------------------------------------------

def run_cell(engine: str, clients: int, rounds: int, device: str = "cpu") -> dict:
    """Run one (engine, clients, rounds) cell in this process on ``device``; return its
    figures (on a GPU also the peak of ``torch.cuda.max_memory_allocated``)."""
    import torch

    t0 = time.perf_counter()
    if engine == "pfl":
        return _pfl_cell(clients, rounds, t0)
    from fedswarm.config import RunConfig

    cfg = RunConfig(engine=engine, clients=clients, rounds=rounds, device=device, **TASK)
    gpu = torch.device(device).type == "cuda"
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    status, res, total = run_in_store(cfg, t0)
    walls = [r["wall_s"] for r in res["rounds"] if r["round"] > 0]
    extra = {"peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20} if gpu else {}
    return {"status": status, **_round_figures(walls, total),
            "final_test_accuracy": res["summary"]["final_test_accuracy"], **extra}


def run_in_store(cfg, t0: float) -> tuple[str, dict, float]:
    """Run ``cfg`` on its engine, recorded in a throwaway store: (status, the exported
    result, seconds from ``t0`` to the run's end)."""
    from fedswarm.bench.arms import run_arm, scratch_store

    with scratch_store() as store:
        arm = run_arm(cfg, store, ok=None)  # the cell reports the status
        return arm.status, arm.result, time.perf_counter() - t0


def _round_figures(walls: list[float], total: float) -> dict:
    """Rounds run, the first round, the steady round (median of the others: Ray starts its
    actors and caches warm up in the first) and the start-up time outside rounds."""
    steady = sorted(walls[1:])[len(walls[1:]) // 2] if len(walls) > 1 else (walls[0] if walls else None)
    return {"rounds_run": len(walls), "first_round_s": walls[0] if walls else None, "steady_round_s": steady,
            "setup_s": total - sum(walls)}


def _pfl_cell(clients: int, rounds: int, t0: float) -> dict:
    import torch
    import torch.nn.functional as F
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    from fedswarm.config import RunConfig
    from fedswarm.params import get_flat
    from fedswarm.tasks import get_task
    from fedswarm.tasks.partition import partition_offsets
    from fedswarm.train import evaluate_flat, task_data

    torch.set_num_threads(1)
    cfg = RunConfig(clients=clients, rounds=rounds, **TASK)
    task = get_task(cfg.task)
    data = task_data(cfg)
    flat, offsets = partition_offsets(data.train_y.numpy(), cfg.partition, clients, cfg.seed)

    class Net(torch.nn.Module):  # pfl's model contract: loss() and metrics() on the module
        def __init__(self):
            super().__init__()
            self.net = task.model(cfg.seed)

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=False):
            out = self(x)
            return {"loss": Weighted(F.cross_entropy(out, y, reduction="sum").item(), len(y))}

    def user_data(uid):
        idx = torch.from_numpy(flat[offsets[uid]:offsets[uid + 1]])
        return Dataset(raw_data=[data.train_x[idx], data.train_y[idx]], user_id=uid)

    times: list[float] = []

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            times.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            times.append(time.perf_counter())
            return False, Metrics()

    net = Net()
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    users = FederatedDataset(user_data, get_user_sampler("minimize_reuse", list(range(clients))))
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds,
                                           train_cohort_size=clients, val_cohort_size=0),
        backend=SimulatedBackend(training_data=users, val_data=None), model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=None, local_num_steps=cfg.local_steps,
                                              local_learning_rate=cfg.lr, local_batch_size=cfg.batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=4096), callbacks=[Clock()])
    total = time.perf_counter() - t0
    walls = [b - a for a, b in zip(times, times[1:])]
    _, acc = evaluate_flat(task, task.model(cfg.seed), get_flat(net.net), data.test_x, data.test_y,
                           torch.device("cpu"))
    return {"status": "finished", **_round_figures(walls, total), "final_test_accuracy": acc}


# -- the table ------------------------------------------------------------------------------------

def _subprocess_cell(engine: str, clients: int, rounds: int, timeout_s: float, device: str = "cpu") -> dict:
    """Run a cell in a fresh interpreter, sampling its process tree's RSS for the peak."""
    return sampled_cell(["-m", "fedswarm.bench.engines", engine, str(clients), str(rounds), "{out}", device],
                        timeout_s, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))


def run(out_dir: Path, quick: bool = False, *, sizes: list[int] | None = None, rounds: int | None = None,
        cap_s: float | None = None, engines: tuple[str, ...] = ENGINES, device: str = "cpu") -> list[dict]:
    """Every engine on the CPU; with ``device`` a GPU (cuda, cuda:N; checked to exist) the
    batched engine also runs there, its row (``batched@cuda``, with its peak GPU memory)
    beside the CPU's."""
    from fedswarm.train import check_node_device

    gpu = check_node_device(device).type != "cpu"
    if os.environ.get(SECTION_ENV) == "scale":  # the scale section alone
        return _scale(out_dir, quick)
    if os.environ.get(SECTION_ENV) == "codec":  # the codec section alone
        return _codec(out_dir, quick)
    sizes = sizes or ([100, 1000] if quick else [100, 1000, 10_000])
    rounds = rounds or (2 if quick else 5)
    cap_s = cap_s or (60.0 if quick else 600.0)
    pfl_missing = pfl_available()
    rows: list[dict] = []
    last_per_client: dict[str, float] = {}  # seconds per client-round at the engine's last size
    console = Console(width=200)
    cells = [(e, "cpu") for e in engines] + ([("batched", device)] if gpu else [])
    for clients in sizes:
        for engine, dev in cells:
            label = engine if dev == "cpu" else f"{engine}@{dev}"
            row = {"engine": label, "device": dev, "clients": clients, "rounds": rounds, "cap": ""}
            if engine == "pfl" and pfl_missing:
                row.update(status=f"not run: {pfl_missing}")
                rows.append(row)
                continue
            run_rounds = rounds
            if label in last_per_client:
                per_round = last_per_client[label] * clients
                if per_round * rounds > cap_s:  # fewer rounds; one if one round fits the cap
                    run_rounds = min(rounds, max(int(cap_s // per_round), 1 if per_round <= cap_s else 0))
                    row["cap"] = (f"{run_rounds} of {rounds} rounds: a round predicted {per_round:.0f} s, cap "
                                  f"{cap_s:.0f} s") if run_rounds else (
                        f"not run: a round predicted {per_round:.0f} s > cap {cap_s:.0f} s")
            if run_rounds == 0:
                row.update(status="capped")
                rows.append(row)
                continue
            console.print(f"[dim]engines: {label} at {clients} clients, {run_rounds} rounds ...[/]")
            cell = _subprocess_cell(engine, clients, run_rounds, timeout_s=cap_s * 2 + 300, device=dev)
            row.update(cell)
            if cell.get("steady_round_s"):
                row["s_per_round"] = cell["steady_round_s"]
                row["client_rounds_per_s"] = clients / row["s_per_round"]
                last_per_client[label] = row["s_per_round"] / clients
            rows.append(row)
            # after every cell, so a long run interrupted still leaves what it measured
            (out_dir / "engines.partial.json").write_text(json.dumps(rows, indent=2))
    _ratios(rows)
    _print(rows, console)
    meta = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "task": TASK}
    (out_dir / "engines.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _plot(rows, out_dir / "engines.png")
    if "batched" in engines:  # its Ray section: a table, engines-ray.json and .png of its own
        from fedswarm.bench.engines_ray import run as run_ray
        run_ray(out_dir, quick)
    return rows + _scale(out_dir, quick) + _codec(out_dir, quick)


def _scale(out_dir: Path, quick: bool) -> list[dict]:
    """The ``scale`` section (:mod:`fedswarm.bench.engines_scale`): its own JSON and PNG."""
    from fedswarm.bench.engines_scale import run_scale

    return [dict(r, engine="batched", section="scale") for r in run_scale(out_dir, quick)]


def _codec(out_dir: Path, quick: bool) -> list[dict]:
    """The ``codec`` section (:mod:`fedswarm.bench.engines_codec`): its own JSON."""
    from fedswarm.bench.engines_codec import run_codec

    return [dict(r, engine="batched", section="codec") for r in run_codec(out_dir, quick)]


def _ratios(rows: list[dict]) -> None:
    by = {(r["engine"], r["clients"]): r for r in rows}
    for r in rows:
        flower = by.get(("flower", r["clients"]), {})
        inproc = by.get(("inprocess", r["clients"]), {})
        if r.get("client_rounds_per_s") and flower.get("client_rounds_per_s"):
            r["speed_vs_flower"] = r["client_rounds_per_s"] / flower["client_rounds_per_s"]
        if r.get("peak_rss_mb") and flower.get("peak_rss_mb"):
            r["memory_vs_flower"] = r["peak_rss_mb"] / flower["peak_rss_mb"]
        if r.get("final_test_accuracy") is not None and inproc.get("final_test_accuracy") is not None:
            r["accuracy_minus_inprocess"] = r["final_test_accuracy"] - inproc["final_test_accuracy"]
        if r.get("final_test_accuracy") is not None and flower.get("final_test_accuracy") is not None:
            r["accuracy_minus_flower"] = r["final_test_accuracy"] - flower["final_test_accuracy"]


def _print(rows: list[dict], console: Console) -> None:
    load = os.getloadavg()
    table = Table(title=f"engines: FedAvg, digits-mlp, one local step, all clients every round "
                        f"(load {load[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("engine", "clients", "rounds run", "client-rounds/s", "x Flower", "s/round", "first round s", "setup s",
                "peak MB", "GPU peak MB", "mem x Flower", "final acc", "acc - inprocess", "note"):
        table.add_column(col)

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        note = r.get("cap") or ("" if r.get("status") == "finished" else str(r.get("status", "")))
        table.add_row(r["engine"], str(r["clients"]), str(r.get("rounds_run", 0)),
                      f(r.get("client_rounds_per_s"), ",.0f"),
                      f(r.get("speed_vs_flower"), ".1f"), f(r.get("s_per_round"), ".3f"),
                      f(r.get("first_round_s"), ".2f"), f(r.get("setup_s"), ".1f"),
                      f(r.get("peak_rss_mb"), ".0f"), f(r.get("peak_gpu_mb"), ".0f"),
                      f(r.get("memory_vs_flower"), ".2f"),
                      f(r.get("final_test_accuracy"), ".4f"), f(r.get("accuracy_minus_inprocess"), "+.4f"), note[:70])
    console.print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, engine in enumerate(dict.fromkeys(r["engine"] for r in rows)):
        pts = [(r["clients"], r["client_rounds_per_s"]) for r in rows
               if r["engine"] == engine and r.get("client_rounds_per_s")]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=engine)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round")
    ax.set_ylabel("client-rounds per second")
    ax.set_title("FedAvg, digits-mlp, one local step (same run on every engine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":  # a cell: python -m fedswarm.bench.engines ENGINE CLIENTS ROUNDS OUT.json [DEVICE]
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    engine_name, n_clients, n_rounds, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    cell_device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    out_path.write_text(json.dumps(run_cell(engine_name, n_clients, n_rounds, cell_device)))
