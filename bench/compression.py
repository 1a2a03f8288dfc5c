"""``fedswarm bench compression``: accuracy against measured uplink bytes, every codec
and compressed strategy beside FedAvg in float32.

Digits (scikit-learn's 8x8 handwritten digits), 50 clients, Dirichlet(0.5) label skew,
the same seed, rounds, local work and initial model in every arm. The model is a
64-512-512-10 MLP (d = 301,066, ``digits_mlp_wide`` below) rather than the 4,810-parameter
``digits-mlp``: at d = 4,810 a compressed reply is a few hundred bytes and Flower's framing
(a 128-byte numpy header per array, record keys, metadata, about 450-650 bytes a reply)
would dominate what is measured, and 1-bit SGD's 8 bytes of scales per column cap its
ratio at 11.7x whatever the framing (the output layer's columns have only 10 rows).

Arms: FedAvg; ``compressed_fedavg`` with fp16, 1-bit, sign, top-1%, rand-1%, QSGD and
Count Sketch, each biased codec with and without error feedback; the ``onebit`` strategy
(two-stage aggregation, 1-bit down) with and without error feedback; ``gtopk`` (1%, the
paper's tree merge and the exact one); ``sketched_sgd``, ``fetchsgd`` and ``gs_sgd`` with
sketches of about 1/20 of the model, and FetchSGD once more with a sketch of 1/5 (at
1/20, a 5 x 2,800 sketch of a real averaged update finds only ~14% of its top 602
coordinates; at 5 x 20,000, 76%). Bytes are what crossed the grid, measured on the
serialized Flower messages, both phases of the two-phase strategies included.

Quick mode (under two minutes on 2 cores): 8 rounds instead of 30 and five arms
(FedAvg, 1-bit with and without error feedback, top-1% with error feedback, FetchSGD).

    fedswarm bench compression [--quick] --out out/

Writes ``OUT/compression.json`` (the rows, with each arm's accuracy curve) and
``OUT/compression.png`` (test accuracy against cumulative uplink bytes, log x).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from torch import nn

from fedswarm.bench.arms import bytes_up_curve, run_arm, scratch_store, start_bench
from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.tasks import Task, get_task

__all__ = ["run", "digits_mlp_wide", "ARMS", "QUICK_ARMS"]

TASK = "fedswarm.bench.compression:digits_mlp_wide"
CLIENTS, PARTITION, SEED = 50, "dirichlet:0.5", 0
ROUNDS, QUICK_ROUNDS = 30, 8
SKETCH = {"rows": 5, "cols": 2800}  # 4·r·c = 56 KB: 1/21.5 of the 1.2 MB model
CS = "rows=5,cols=2800,k_ratio=0.0003"  # the countsketch codec at the same size

# (label, strategy, params); params use the registry's hyperparameter names, and the
# registry's defaults where none are given.
ARMS: list[tuple[str, str, dict]] = [
    ("FedAvg fp32", "fedavg", {}),
    ("fp16", "compressed_fedavg", {"codec": "fp16", "error_feedback": False}),
    ("1-bit + EF", "compressed_fedavg", {"codec": "onebit"}),
    ("1-bit, no EF", "compressed_fedavg", {"codec": "onebit", "error_feedback": False}),
    ("sign + EF", "compressed_fedavg", {"codec": "sign"}),
    ("sign, no EF", "compressed_fedavg", {"codec": "sign", "error_feedback": False}),
    ("top-1% + EF", "compressed_fedavg", {"codec": "topk", "codec_params": "ratio=0.01"}),
    ("top-1%, no EF", "compressed_fedavg", {"codec": "topk", "codec_params": "ratio=0.01", "error_feedback": False}),
    ("rand-1% + EF", "compressed_fedavg", {"codec": "randk", "codec_params": "ratio=0.01"}),
    ("rand-1%, no EF", "compressed_fedavg", {"codec": "randk", "codec_params": "ratio=0.01", "error_feedback": False}),
    ("QSGD s=16", "compressed_fedavg", {"codec": "qsgd", "error_feedback": False}),
    ("count sketch + EF", "compressed_fedavg", {"codec": "countsketch", "codec_params": CS}),
    ("count sketch, no EF", "compressed_fedavg", {"codec": "countsketch", "codec_params": CS, "error_feedback": False}),
    ("onebit (2-stage) + EF", "onebit", {}),
    ("onebit (2-stage), no EF", "onebit", {"error_feedback": False}),
    ("gTop-k 1% (tree)", "gtopk", {"density": 0.01}),
    ("gTop-k 1% (exact merge)", "gtopk", {"density": 0.01, "merge": "exact"}),
    ("Sketched-SGD", "sketched_sgd", {"density": 0.004, "rows": 5, "cols": 2500, "candidates": 2}),
    ("FetchSGD", "fetchsgd", {"density": 0.002, **SKETCH}),
    ("FetchSGD, 5x sketch", "fetchsgd", {"density": 0.004, "rows": 5, "cols": 12000}),
    ("gs-SGD", "gs_sgd", {"density": 0.002, **SKETCH}),
]
QUICK_ARMS = ("FedAvg fp32", "1-bit + EF", "1-bit, no EF", "top-1% + EF", "FetchSGD")


def _wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def digits_mlp_wide() -> Task:
    """scikit-learn digits with a 64-512-512-10 MLP (d = 301,066): big enough that the
    compressed payloads, not the message framing, are what the bytes measure."""
    base = get_task("digits-mlp")
    return Task("digits-mlp-wide", "scikit-learn digits, 64-512-512-10 MLP", _wide_mlp, base.load_data)


def _config(strategy: str, params: dict, rounds: int) -> RunConfig:
    return RunConfig(task=TASK, strategy=strategy, params=params, clients=CLIENTS, rounds=rounds,
                     partition=PARTITION, seed=SEED)


def _arm(label: str, strategy: str, params: dict, rounds: int, store: Store) -> dict:
    arm = run_arm(_config(strategy, params, rounds), store, name=f"bench-compression {label}")
    s = arm.summary
    return {
        "arm": label, "strategy": strategy, "params": params, "rounds": rounds,
        "final_test_accuracy": s["final_test_accuracy"], "best_test_accuracy": s["best_test_accuracy"],
        "total_bytes_up": s["total_bytes_up"], "total_bytes_down": s["total_bytes_down"],
        "rejected": sum(int(r.get("rejected") or 0) for r in arm.rounds),
        "wall_s": round(arm.wall_s, 2), "curve": bytes_up_curve(arm.rounds),
    }


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """Run every arm (quick: five arms, 8 rounds), print the table, write
    ``compression.json`` and ``compression.png`` to ``out_dir``; return the rows."""
    out_dir = start_bench(out_dir)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    arms = [a for a in ARMS if not quick or a[0] in QUICK_ARMS]
    console = Console(width=None if sys.stdout.isatty() else 160)
    rows = []
    with scratch_store() as store:
        for label, strategy, params in arms:
            row = _arm(label, strategy, params, rounds, store)
            rows.append(row)
            console.print(f"  {label:<26} acc {row['final_test_accuracy']:.4f}"
                          f"  up {row['total_bytes_up'] / 1e6:9.2f} MB"
                          f"  ({row['wall_s']:.0f} s)")
    base = rows[0]
    for r in rows:
        r["delta_vs_fedavg_points"] = round(100 * (r["final_test_accuracy"] - base["final_test_accuracy"]), 2)
        r["uplink_ratio_vs_fedavg"] = round(base["total_bytes_up"] / max(1, r["total_bytes_up"]), 2)
        r["downlink_ratio_vs_fedavg"] = round(base["total_bytes_down"] / max(1, r["total_bytes_down"]), 2)
    console.print(_table(rows, rounds))
    for r in rows:
        r.update(task=TASK, clients=CLIENTS, partition=PARTITION, seed=SEED, quick=quick)
    (out_dir / "compression.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out_dir / "compression.png", rounds)
    return rows


def _table(rows: list[dict], rounds: int) -> Table:
    t = Table(title=f"compression: digits 64-512-512-10 MLP, {CLIENTS} clients, {PARTITION}, {rounds} rounds "
                    "(bytes measured on serialized messages)")
    for col in ("arm", "final acc", "Δ vs FedAvg (points)", "uplink total", "uplink ratio", "downlink ratio"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for r in rows:
        t.add_row(r["arm"], f"{r['final_test_accuracy']:.4f}", f"{r['delta_vs_fedavg_points']:+.2f}",
                  f"{r['total_bytes_up'] / 1e6:.2f} MB", f"{r['uplink_ratio_vs_fedavg']:.1f}x",
                  f"{r['downlink_ratio_vs_fedavg']:.1f}x")
    return t


def _plot(rows: list[dict], path: Path, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(rows):
        xs = [max(1, up) for up, _ in r["curve"][1:]]
        ys = [acc for _, acc in r["curve"][1:]]
        ax.plot(xs, ys, styles[i // 10 % 4], marker="o" if i == 0 else None, markersize=3, linewidth=1.4,
                color=f"C{i % 10}", label=r["arm"])
    ax.set_xscale("log")
    ax.set_xlabel("cumulative uplink bytes (all clients, measured)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(f"digits, {CLIENTS} clients, {PARTITION}, {rounds} rounds: accuracy against uplink bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
