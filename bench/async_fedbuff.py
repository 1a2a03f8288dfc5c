"""Fleets that never wait for their slowest device: FedBuff against synchronous FedAvg.

``digits-mlp``, 100 nodes, ``--devices edge-wifi:80,straggler:20`` (a straggler computes 10x
slower, same link), 10 local steps of batch 32, seeds 0-2, on the in-process engine (its rounds
carry the time model's simulated seconds; FedBuff runs on its virtual clock). Every arm folds the
same number of client updates: synchronous FedAvg samples 10 nodes for each of R rounds; FedBuff
keeps 20 nodes training and folds K = 10 updates into each of R aggregations. Figures, all on
*simulated* time: the time to 0.90 test accuracy (the first recorded round at or above it) and the
final accuracy, per seed and their mean, and each arm's time to target as a multiple of synchronous
FedAvg's.

Arms that need the quorum rounds and simulated availability of issue 45's fleet work (RunConfig
``quorum``/``over_select``, ``availability``) run only where this checkout has those options; the
JSON says which were left out and why.

    fedswarm bench async [--quick] --out DIR

Writes ``DIR/async.json`` (per-seed rows and the per-arm means) and ``DIR/async.png`` (accuracy
against simulated time); prints the table.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedswarm.bench.arms import run_arm, scratch_store, start_bench
from fedswarm.config import RunConfig

__all__ = ["run", "TARGET", "arms"]

TARGET = 0.90
BASE = dict(task="digits-mlp", clients=100, devices="edge-wifi:80,straggler:20", local_steps=10, batch_size=32,
            eval_every=1_000_000)
PER_ROUND = 10  # client updates per round (FedAvg) and per aggregation (FedBuff's K)
ROUNDS = 40
QUICK = dict(clients=20, devices="edge-wifi:16,straggler:4")


def arms(quick: bool) -> tuple[dict[str, dict], list[str]]:
    """The arms' run options (name -> RunConfig fields beyond BASE and the seed) and the notes on
    the arms left out."""
    clients = QUICK["clients"] if quick else BASE["clients"]
    fraction = PER_ROUND / clients
    out = {
        "fedavg (sync)": dict(strategy="fedavg", fraction=fraction),
        "fedbuff": dict(strategy="fedbuff", params={"buffer_size": PER_ROUND, "concurrency": 2 * PER_ROUND}),
    }
    missing = []
    if "quorum" in RunConfig.model_fields:
        out["fedavg --over-select 1.3 --quorum"] = dict(strategy="fedavg", fraction=fraction, over_select=1.3,
                                                         quorum=PER_ROUND)
    else:
        missing.append("fedavg --over-select 1.3 --quorum: this checkout has no quorum rounds (issue 45 item 2)")
    if "availability" not in RunConfig.model_fields:
        missing.append("the diurnal-availability section with 10% mid-round dropouts: this checkout has no "
                       "simulated availability (issue 45 item 4)")
    return out, missing


def _curve(rows: list[dict]) -> tuple[list[float], list[float]]:
    t, times, accs = 0.0, [], []
    for r in rows:
        t += float(r.get("sim_time_s") or 0.0)
        times.append(t)
        accs.append(float(r["test_accuracy"]))
    return times, accs


def _time_to(times: list[float], accs: list[float], target: float) -> float | None:
    return next((t for t, a in zip(times, accs) if a >= target), None)


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """Run every arm for every seed; write ``async.json`` and ``async.png``; print the table."""
    out_dir = start_bench(out_dir)
    options, missing = arms(quick)
    seeds = [0] if quick else [0, 1, 2]
    rounds = 2 if quick else ROUNDS
    base = {**BASE, **(QUICK if quick else {})}
    rows: list[dict] = []
    with scratch_store("async.db") as store:
        for name, opts in options.items():
            for seed in seeds:
                cfg = RunConfig.model_validate({**base, **opts, "seed": seed, "rounds": rounds})
                arm = run_arm(cfg, store, name=f"bench-async {name} seed {seed}")
                trained = arm.trained_rounds
                times, accs = _curve(trained)
                updates = sum(int(r.get("updates", r.get("num_clients") or 0)) for r in trained)
                rows.append({"section": "always available", "arm": name, "seed": seed, "rounds": len(trained),
                             "client_updates": updates, "time_to_target_s": _time_to(times, accs, TARGET),
                             "final_acc": accs[-1], "sim_time_s": times[-1], "wall_s": arm.wall_s,
                             "curve_t": times, "curve_acc": accs})
    summary = _summarize(rows)
    (out_dir / "async.json").write_text(json.dumps({"target": TARGET, "config": base, "rounds": rounds,
                                                    "seeds": seeds, "left_out": missing, "summary": summary,
                                                    "rows": rows}, indent=1))
    _plot(rows, out_dir / "async.png")
    _print(summary, missing)
    return rows


def _summarize(rows: list[dict]) -> list[dict]:
    out = []
    ref = [r for r in rows if r["arm"] == "fedavg (sync)"]
    ref_t = _mean([r["time_to_target_s"] for r in ref])
    ref_acc = _mean([r["final_acc"] for r in ref])
    for name in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == name]
        t = _mean([r["time_to_target_s"] for r in mine])
        acc = _mean([r["final_acc"] for r in mine])
        out.append({"section": mine[0]["section"], "arm": name, "seeds": len(mine),
                    "reached": sum(r["time_to_target_s"] is not None for r in mine),
                    "client_updates": _mean([r["client_updates"] for r in mine]),
                    "time_to_target_s": t, "x_sync": None if t is None or not ref_t else t / ref_t,
                    "final_acc": acc, "acc_points_vs_sync": None if acc is None or ref_acc is None
                    else 100 * (acc - ref_acc), "sim_time_s": _mean([r["sim_time_s"] for r in mine])})
    return out


def _mean(values: list) -> float | None:
    """The mean, None when any value is None (an arm that missed the target in a seed has no time)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def _print(summary: list[dict], missing: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"async: time to {TARGET:.2f} test accuracy, simulated seconds (means over seeds)")
    for c in ("section", "arm", "reached", "client updates", "to target (s)", "x sync", "final acc",
              "vs sync (points)", "simulated s"):
        table.add_column(c, justify="left" if c in ("section", "arm") else "right")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in summary:
        table.add_row(r["section"], r["arm"], f"{r['reached']}/{r['seeds']}", f(r["client_updates"], ".0f"),
                      f(r["time_to_target_s"], ".1f"), f(r["x_sync"], ".2f"), f(r["final_acc"], ".4f"),
                      f(r["acc_points_vs_sync"], "+.2f"), f(r["sim_time_s"], ".1f"))
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)
    for m in missing:
        console.print(f"left out: {m}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {}
    for r in rows:
        c = colors.setdefault(r["arm"], f"C{len(colors)}")
        ax.plot(r["curve_t"], r["curve_acc"], color=c, alpha=0.8, label=r["arm"] if r["seed"] == rows[0]["seed"]
                else None)
    ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="simulated seconds (time model)", ylabel="test accuracy",
           title="digits-mlp, 100 nodes, edge-wifi:80 + straggler:20")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
