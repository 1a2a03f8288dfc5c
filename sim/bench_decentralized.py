"""Decentralized training against centralized SGD, stragglers and non-IID data.

Sixteen nodes on ``digits-mlp``, batch 16 per node, the same seeds in every arm (so the
same initial model, partitions and minibatch order). Synchronous arms run fedswarm's
ServerApp on the in-process engine (the router strategy for gossip); AD-PSGD runs on the
virtual-clock engine. All times are **simulated** seconds from the time model
(``fedswarm/timemodel.py``), never wall time.

1. D-PSGD on a ring against centralized SGD (C-PSGD: every node takes a minibatch
   gradient step from the global model, the server averages: FedAvg with one local
   step). Accuracy per epoch, and simulated seconds per epoch with all nodes on
   ``datacenter`` and on ``edge-lte`` profiles. C-PSGD's server has the nodes' link, as
   in the paper (its busiest node moves P models each way); D-PSGD's time is the gossip
   iteration without the router's server hops.
2. AD-PSGD against D-PSGD with one 10x straggler (``straggler:1,edge-wifi:15``):
   simulated seconds to a target test accuracy.
3. QG-DSGDm against DSGDm (Nesterov momentum 0.9, ring, the paper's "-N" variants) on
   ``dirichlet:0.1``; each at its best learning rate of a small grid (quick: one rate).

One epoch is ``ceil(train examples / (16 · 16))`` iterations: 16 nodes × 16 samples each.

    python -m fedswarm.sim.bench_decentralized --quick --out out/   # or: fedswarm bench decentralized

Writes ``OUT/decentralized.json`` (the rows) and ``OUT/decentralized.png``, prints a table.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch

from fedswarm.config import RunConfig
from fedswarm.sim.async_engine import run_async
from fedswarm.sim.inprocess import run_inprocess
from fedswarm.timemodel import BUILTIN_PROFILES, gossip_round_time_s, sync_round_time_s
from fedswarm.store import Store
from fedswarm.train import task_data

__all__ = ["run", "main"]

NODES, BATCH, SEED, TASK = 16, 16, 0, "digits-mlp"
LR = 0.3
LR_MOMENTUM = (0.1,)  # quick
LR_MOMENTUM_GRID = (0.02, 0.05, 0.1)
STRAGGLER_DEVICES = "straggler:1,edge-wifi:15"
LINKS = ("datacenter", "edge-lte")


def _iters_per_epoch() -> int:
    n_train = task_data(RunConfig(task=TASK, seed=SEED)).train_x.shape[0]
    return math.ceil(n_train / (NODES * BATCH))


def _config(strategy: str, rounds: int, **kw) -> RunConfig:
    base = dict(task=TASK, strategy=strategy, clients=NODES, rounds=rounds, batch_size=BATCH, seed=SEED, lr=LR,
                local_steps=1, topology="ring", partition="iid")
    base.update(kw)
    return RunConfig(**base)


def _rounds(cfg: RunConfig, store: Store) -> list[dict]:
    run_id = store.create_run(cfg.model_dump(), name=f"bench-decentralized-{cfg.strategy}")
    status = (run_async if cfg.strategy == "adpsgd" else _inprocess)(cfg, store, run_id)
    if status != "finished":
        raise RuntimeError(f"{cfg.strategy} run ended {status}")
    return store.export_result(run_id)["rounds"]


def _inprocess(cfg: RunConfig, store: Store, run_id: str) -> str:
    return run_inprocess(cfg, store=store, run_id=run_id)


def _per_epoch(rows: list[dict], ipe: int) -> list[float]:
    by_round = {r["round"]: r["test_accuracy"] for r in rows}
    return [by_round[e * ipe] for e in range(1, max(by_round) // ipe + 1)]


def _curve(rows: list[dict]) -> tuple[list[float], list[float]]:
    """(cumulative simulated seconds, accuracy) per recorded round."""
    t, ts, accs = 0.0, [], []
    for r in rows:
        t += r["sim_time_s"] or 0.0
        ts.append(t)
        accs.append(r["test_accuracy"])
    return ts, accs


def _time_to(rows: list[dict], target: float) -> float | None:
    for t, acc in zip(*_curve(rows)):
        if acc >= target:
            return t
    return None


def _epoch_times(dpsgd: list[dict], cpsgd: list[dict], ipe: int) -> dict[str, dict[str, float]]:
    """Simulated seconds per epoch of each arm with every node on each profile, from the
    message sizes the runs measured."""
    r_d = next(r for r in dpsgd if r["round"] == 2)
    r_c = next(r for r in cpsgd if r["round"] == 2)
    msg = r_d["p2p_bytes"] / (2 * NODES)  # ring: each node's message goes to 2 neighbours
    down, up = r_c["bytes_down"] / NODES, r_c["bytes_up"] / NODES
    out: dict[str, dict[str, float]] = {"dpsgd": {}, "cpsgd": {}}
    for name in LINKS:
        nodes = [BUILTIN_PROFILES[name]] * NODES
        out["dpsgd"][name] = ipe * gossip_round_time_s(nodes, [2] * NODES, msg, BATCH, overlap=True)
        out["cpsgd"][name] = ipe * sync_round_time_s(nodes, BATCH, down, up, server_link=nodes[0].link)
    out["dpsgd"]["busiest_mb"] = ipe * 2 * 2 * msg / 1e6  # 2 neighbours, sent and received
    out["cpsgd"]["busiest_mb"] = ipe * NODES * (down + up) / 1e6  # the server
    return out


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """Run the three comparisons, write ``decentralized.json`` and ``decentralized.png``
    to ``out_dir``, print the table and return its rows."""
    torch.set_num_threads(1)  # a 5k-parameter model: threads only add overhead
    ipe = _iters_per_epoch()
    epochs, epochs_noniid = (10, 20) if quick else (30, 60)
    target = 0.85 if quick else 0.92
    rounds, rounds_noniid = epochs * ipe, epochs_noniid * ipe
    lrs = LR_MOMENTUM if quick else LR_MOMENTUM_GRID
    best_lr = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.db")
        runs = {
            "dpsgd": _rounds(_config("dpsgd", rounds, devices=STRAGGLER_DEVICES), store),
            "cpsgd": _rounds(_config("fedavg", rounds), store),
            "adpsgd": _rounds(_config("adpsgd", rounds, devices=STRAGGLER_DEVICES), store),
        }
        for key in ("dsgdm", "qgm"):
            tried = {lr: _rounds(_config(key, rounds_noniid, lr=lr, partition="dirichlet:0.1",
                                         params={"nesterov": True}), store) for lr in lrs}
            best_lr[key] = max(tried, key=lambda lr: max(r["test_accuracy"] for r in tried[lr]))
            runs[key] = tried[best_lr[key]]
        store.close()
    times = _epoch_times(runs["dpsgd"], runs["cpsgd"], ipe)
    rows = []

    def row(comparison: str, arm: str, key: str, partition: str, **extra) -> None:
        accs = [r["test_accuracy"] for r in runs[key] if r["round"] > 0]
        rows.append({"comparison": comparison, "arm": arm, "strategy": key, "partition": partition,
                     "epochs": len(_per_epoch(runs[key], ipe)), "final_accuracy": accs[-1],
                     "best_accuracy": max(accs), "accuracy_per_epoch": _per_epoch(runs[key], ipe), **extra})

    gap = max(abs(a - b) for a, b in zip(_per_epoch(runs["dpsgd"], ipe), _per_epoch(runs["cpsgd"], ipe)))
    speed = {name: times["cpsgd"][name] / times["dpsgd"][name] for name in LINKS}
    notes = {"dpsgd": f"per-epoch gap to C-PSGD <= {100 * gap:.1f} pts; faster/epoch: "
                      + ", ".join(f"{speed[n]:.1f}x {n}" for n in LINKS), "cpsgd": ""}
    for key, arm in (("dpsgd", "D-PSGD, ring"), ("cpsgd", "C-PSGD (server averages)")):
        row("D-PSGD vs centralized", arm, key, "iid",
            **{f"sim_s_per_epoch_{name}": times[key][name] for name in LINKS},
            busiest_node_mb_per_epoch=times[key]["busiest_mb"], note=notes[key])
    for key, arm in (("dpsgd", "D-PSGD, ring"), ("adpsgd", "AD-PSGD, ring")):
        ts, _ = _curve(runs[key])
        row("1 straggler (10x)", arm, key, "iid", devices=STRAGGLER_DEVICES, target_accuracy=target,
            sim_s_to_target=_time_to(runs[key], target), sim_s_per_epoch=ts[-1] / (len(ts) - 1) * ipe,
            sim_curve=[[t, r["test_accuracy"]] for t, r in zip(ts, runs[key])], note="")
    t_d, t_a = rows[-2]["sim_s_to_target"], rows[-1]["sim_s_to_target"]
    if t_d is not None and t_a is not None:
        rows[-1]["note"] = f"{t_d / t_a:.1f}x faster to target than D-PSGD"
    for key, arm in (("dsgdm", "DSGDm-N, ring"), ("qgm", "QG-DSGDm-N, ring")):
        row("non-IID momentum", arm, key, "dirichlet:0.1", lr=best_lr[key], lr_grid=list(lrs),
            final_consensus_distance=runs[key][-1].get("consensus_distance"), note=f"lr {best_lr[key]}")
    diff = rows[-1]["best_accuracy"] - rows[-2]["best_accuracy"]
    rows[-1]["note"] += f"; best acc {100 * diff:+.1f} pts vs DSGDm-N"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decentralized.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out_dir / "decentralized.png")
    _print(rows)
    return rows


def _fmt(v, f: str) -> str:
    return "-" if v is None else format(v, f)


def _print(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decentralized, {NODES} nodes on {TASK} (times are SIMULATED seconds, time model)")
    cols = ("comparison", "arm", "partition", "epochs", "final acc", "best acc", "sim s/epoch datacenter",
            "sim s/epoch edge-lte", "busiest node MB/epoch", "sim s to target (1 straggler)", "note")
    for c in cols:
        table.add_column(c, justify="left" if c in ("comparison", "arm", "partition", "note") else "right",
                         min_width=44 if c == "note" else None)
    for r in rows:
        to_target = r.get("sim_s_to_target")
        target = "" if "target_accuracy" not in r else (
            f"{_fmt(to_target, '.1f')} (acc {r['target_accuracy']:.2f})" if to_target is not None
            else f"not reached (acc {r['target_accuracy']:.2f})")
        table.add_row(r["comparison"], r["arm"], r["partition"], str(r["epochs"]), f"{r['final_accuracy']:.3f}",
                      f"{r['best_accuracy']:.3f}", _fmt(r.get("sim_s_per_epoch_datacenter"), ".4f"),
                      _fmt(r.get("sim_s_per_epoch_edge-lte"), ".3f"),
                      _fmt(r.get("busiest_node_mb_per_epoch"), ".2f"), target or "-", r.get("note", ""))
    console = Console()
    (console if console.is_terminal else Console(width=240)).print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    groups = {}
    for r in rows:
        groups.setdefault(r["comparison"], []).append(r)
    for ax, name in ((axes[0], "D-PSGD vs centralized"), (axes[3], "non-IID momentum")):
        for r in groups[name]:
            ax.plot(range(1, r["epochs"] + 1), r["accuracy_per_epoch"], marker=".", label=r["arm"])
        ax.set(title=name, xlabel="epoch", ylabel="test accuracy (node average)")
        ax.legend()
    width = 0.38
    for k, r in enumerate(groups["D-PSGD vs centralized"]):
        vals = [r[f"sim_s_per_epoch_{name}"] for name in LINKS]
        axes[1].bar([x + k * width for x in range(len(LINKS))], vals, width, label=r["arm"])
    axes[1].set_xticks([x + width / 2 for x in range(len(LINKS))], LINKS)
    axes[1].set(yscale="log", title="time per epoch", ylabel="SIMULATED s per epoch")
    axes[1].legend()
    for r in groups["1 straggler (10x)"]:
        ts, accs = zip(*r["sim_curve"][1:])
        axes[2].plot(ts, accs, label=r["arm"])
    target = groups["1 straggler (10x)"][0]["target_accuracy"]
    axes[2].axhline(target, color="grey", ls="--", lw=0.8)
    axes[2].set(xscale="log", title="one 10x straggler", xlabel="SIMULATED seconds", ylabel="test accuracy")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
