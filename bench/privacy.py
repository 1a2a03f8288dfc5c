"""``fedswarm bench privacy``: accuracy against epsilon for client-level DP-FedAvg.

Digits (``digits-mlp``), 100 clients, 20 sampled per round (q = 0.2: the accountant's
Poisson rate), the same seed, rounds and local work in every arm; the updates clipped to
norm 1 and Gaussian noise of z times the clip added to their sum (McMahan et al. 2018),
for several noise multipliers z, beside the same federation without DP. Epsilon is the
RDP accountant's (Google's dp-accounting) for delta = 1e-5 after the last round.

Quick mode (under two minutes on 2 cores): 6 rounds instead of 30, the same 4 noise
levels and the baseline.

    fedswarm bench privacy [--quick] --out out/

Writes ``OUT/privacy.json`` and ``OUT/privacy.png`` (final accuracy against epsilon, and
accuracy per round).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedswarm.bench.arms import quiet_flower, run_arm, scratch_store, start_bench
from fedswarm.config import RunConfig
from fedswarm.store import Store

__all__ = ["run", "NOISE"]

CLIENTS, FRACTION, SEED, TASK = 100, 0.2, 0, "digits-mlp"
ROUNDS, QUICK_ROUNDS = 30, 6
CLIP, DELTA = 1.0, 1e-5
NOISE = [0.5, 0.8, 1.2, 2.0]
LOCAL = dict(local_epochs=2, batch_size=16, lr=0.3)


def _arm(z: float | None, rounds: int, store: Store) -> dict:
    dp = None if z is None else f"noise_multiplier={z},clip={CLIP},delta={DELTA}"
    cfg = RunConfig(task=TASK, strategy="fedavg", clients=CLIENTS, fraction=FRACTION, rounds=rounds, seed=SEED,
                    dp=dp, **LOCAL)
    arm = run_arm(cfg, store, name=f"bench-privacy z={z}")
    rows = arm.rounds
    return {"noise_multiplier": z, "epsilon": arm.summary.get("epsilon"), "delta": DELTA if z else None,
            "final_test_accuracy": arm.summary["final_test_accuracy"],
            "best_test_accuracy": arm.summary["best_test_accuracy"],
            "accuracy": [r["test_accuracy"] for r in rows], "epsilon_per_round": [r.get("epsilon") for r in rows],
            "clipped_fraction": [r.get("dp_clipped_fraction") for r in rows[1:]],
            "wall_s": round(arm.wall_s, 1)}


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    quiet_flower()
    out_dir = start_bench(out_dir)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    console = Console(width=None if sys.stdout.isatty() else 160)
    rows = []
    with scratch_store() as store:
        for z in [None, *NOISE]:
            row = _arm(z, rounds, store)
            rows.append(row)
            eps = "no DP" if row["epsilon"] is None else f"eps {row['epsilon']:.2f}"
            console.print(f"  z = {z}: acc {row['final_test_accuracy']:.4f}, {eps} ({row['wall_s']:.0f} s)")
    t = Table(title=f"privacy: DP-FedAvg on digits, {CLIENTS} clients, q = {FRACTION}, clip {CLIP}, {rounds} rounds, "
                    f"delta = {DELTA:g} (RDP accountant)")
    for col in ("noise multiplier", "epsilon", "final acc", "best acc", "Δ vs no DP (points)", "clipped (last round)"):
        t.add_column(col, justify="right")
    base = rows[0]["final_test_accuracy"]
    for r in rows:
        t.add_row("no DP" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:g}",
                  "∞" if r["epsilon"] is None else f"{r['epsilon']:.2f}", f"{r['final_test_accuracy']:.4f}",
                  f"{r['best_test_accuracy']:.4f}", f"{100 * (r['final_test_accuracy'] - base):+.1f}",
                  "" if not r["clipped_fraction"] or r["clipped_fraction"][-1] is None
                  else f"{r['clipped_fraction'][-1]:.0%}")
    console.print(t)
    meta = {"task": TASK, "clients": CLIENTS, "fraction": FRACTION, "rounds": rounds, "clip": CLIP, "delta": DELTA,
            "local": LOCAL, "quick": quick, "seed": SEED}
    (out_dir / "privacy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, out_dir / "privacy.png", rounds)
    return rows


def _plot(rows: list[dict], path: Path, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    dp = [r for r in rows if r["epsilon"] is not None]
    a.plot([r["epsilon"] for r in dp], [r["final_test_accuracy"] for r in dp], marker="o", label="DP-FedAvg")
    for r in dp:
        a.annotate(f"z={r['noise_multiplier']:g}", (r["epsilon"], r["final_test_accuracy"]), fontsize=7)
    a.axhline(rows[0]["final_test_accuracy"], color="grey", linestyle="--", label="no DP")
    a.set_xscale("log")
    a.set_xlabel(f"epsilon after {rounds} rounds (delta = {DELTA:g})")
    a.set_ylabel("final test accuracy")
    a.grid(alpha=0.3, which="both")
    a.legend()
    for i, r in enumerate(rows):
        label = "no DP" if r["epsilon"] is None else f"z={r['noise_multiplier']:g}, eps={r['epsilon']:.1f}"
        b.plot(range(len(r["accuracy"])), r["accuracy"], color=f"C{i}", label=label)
    b.set_xlabel("round")
    b.set_ylabel("test accuracy")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.suptitle(f"DP-FedAvg on digits: {CLIENTS} clients, q = {FRACTION}, clip {CLIP}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
