"""``fedswarm bench robust``: Byzantine-robust training side by side, and Solon's claims.

P = 15 clients on digits (``digits-mlp``, IID), the same seed, rounds and local work in
every arm: FedAvg, coordinate-wise median, trimmed mean, Multi-Krum, Bulyan, Signum
(majority vote), Draco and Solon (m = 3), each built for s Byzantine clients, under no
attack and under each attack with s = 1 and s = 3 attackers (the same nodes for every
arm). Each partition's update is 2 local SGD steps (batch 32) from the public model with
that partition's seed, so the coded schemes' r partitions per client are real training.

Reported per arm: final accuracy; bytes per round, measured on the serialized messages;
and simulated time to reach 90% of the unattacked FedAvg's final accuracy. Simulated time
applies the time model (``fedswarm/timemodel.py``: per round, the slowest client's
download + compute + upload, the parameter server's link shared by the 15 uploads and
downloads) to each round's measured per-node bytes and to each client's real compute
(r partitions x steps x batch), under two device profiles computed from the same runs:

- ``comm-bound``: the paper's regime (large models over a shared parameter-server link).
  The 19 KB model travels over a 20 Mbit/s server link shared by 15 workers, against fast
  compute (5,000 samples/s): moving a model costs ~10x one partition's compute (two steps
  of 32 samples), roughly a ResNet-18 over a 10 Gbit/s link shared by 15 GPU workers.
- ``compute-bound``: the opposite (edge devices, 100 samples/s, the same link): every
  extra partition a client trains costs more than the bytes it saves.

Solon's claims, in miniature: its time to accuracy against Bulyan's (paper: > 10x
faster) and Draco's (paper: 1.8x), and which attacks break Signum and Bulyan but not
Solon. Quick mode (under two minutes on 2 cores): 6 rounds, s = 3 only, no attack,
ALIE and signvote.

    fedswarm bench robust [--quick] --out out/

Writes ``OUT/robust.json`` (rows with accuracy and time curves, and the Solon factors)
and ``OUT/robust.png`` (accuracy against simulated time, one panel per scenario).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedswarm.bench.arms import quiet_flower, run_arm, scratch_store, start_bench
from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.timemodel import DeviceClass, Link, Profile, sync_round_time_s

__all__ = ["run", "ARMS", "ATTACKS", "PROFILES", "time_to_target"]

CLIENTS, TASK, SEED = 15, "digits-mlp", 0
ROUNDS, QUICK_ROUNDS = 20, 6
LOCAL = dict(local_steps=2, batch_size=32, lr=0.5)
SOLON_M = 3

# label -> (strategy, params given s, partitions per client given s)
ARMS: dict[str, tuple[str, callable, callable]] = {
    "FedAvg": ("fedavg", lambda s: {}, lambda s: 1),
    "median": ("median", lambda s: {"f": s}, lambda s: 1),
    "trimmed mean": ("trimmed_mean", lambda s: {"f": s}, lambda s: 1),
    "Multi-Krum": ("multikrum", lambda s: {"f": s}, lambda s: 1),
    "Bulyan": ("bulyan", lambda s: {"f": s}, lambda s: 1),
    "Signum": ("signum", lambda s: {"f": s, "server_lr": 0.01}, lambda s: 1),
    "Draco": ("draco", lambda s: {"s": s}, lambda s: 2 * s + 1),
    "Solon": ("solon", lambda s: {"s": s, "m": SOLON_M}, lambda s: 2 * s + SOLON_M),
}
ATTACKS = ["signflip:scale=10", "gaussian:std=1", "alie", "ipm:eps=0.5", "labelflip", "random", "signvote"]
QUICK_ATTACKS = ["alie", "signvote"]

_SERVER = Link(20.0, 1.0)  # the parameter server's link, shared by the round's transfers
PROFILES: dict[str, Profile] = {
    "comm-bound": Profile("comm-bound", DeviceClass("gpu-worker", 5000.0, 16.0), Link(1000.0, 1.0)),
    "compute-bound": Profile("compute-bound", DeviceClass("edge", 100.0, 4.0), Link(1000.0, 1.0)),
}


def _arm(label: str, s: int, attack: str | None, rounds: int, store: Store) -> dict:
    strategy, params, r_of = ARMS[label]
    cfg = RunConfig(task=TASK, strategy=strategy, params=params(s), clients=CLIENTS, rounds=rounds, seed=SEED,
                    byzantine=s if attack else 0, attack=attack, **LOCAL)
    arm = run_arm(cfg, store, name=f"bench-robust {label} s={s} {attack}")
    run_id, res, wall = arm.run_id, arm.result, arm.wall_s
    r = r_of(s)
    by_round: dict[int, list] = {}
    for nr in store.node_rounds(run_id):
        by_round.setdefault(nr.round, []).append(nr)
    samples = r * LOCAL["local_steps"] * LOCAL["batch_size"]
    times = {}
    for name, prof in PROFILES.items():
        t, curve = 0.0, [0.0]
        for row in res["rounds"][1:]:
            nodes = by_round.get(row["round"], [])
            if nodes:
                t += sync_round_time_s([prof] * len(nodes), samples, [n.bytes_down for n in nodes],
                                       [n.bytes_up for n in nodes], server_link=_SERVER)
            curve.append(t)
        times[name] = curve
    rows = res["rounds"]
    return {
        "arm": label, "strategy": strategy, "s": s, "attack": attack or "none", "r": r,
        "final_test_accuracy": res["summary"]["final_test_accuracy"],
        "accuracy": [x["test_accuracy"] for x in rows],
        "sim_time_s": times,
        "bytes_up_per_round": res["summary"]["total_bytes_up"] / rounds,
        "bytes_down_per_round": res["summary"]["total_bytes_down"] / rounds,
        "decode_failed_rounds": sum(1 for x in rows if x.get("decode_failed")),
        "liars_located": sorted({str(n) for x in rows for n in (x.get("liars_located") or [])}),
        "byzantine_nodes": res["summary"].get("byzantine_nodes", []),
        "wall_s": round(wall, 1),
    }


def time_to_target(row: dict, target: float, profile: str) -> float | None:
    """Simulated seconds until the accuracy first reaches ``target`` (None: never)."""
    for acc, t in zip(row["accuracy"], row["sim_time_s"][profile]):
        if acc is not None and acc >= target:
            return t
    return None


def _factor(slow: float | None, fast: float | None) -> float | None:
    if fast is None:
        return None
    if slow is None:
        return math.inf
    return slow / fast if fast > 0 else None


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    quiet_flower()
    out_dir = start_bench(out_dir)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    scenarios = [(3, None)] + [(3, a) for a in QUICK_ATTACKS] if quick else (
        [(1, None), (3, None)] + [(s, a) for s in (1, 3) for a in ATTACKS])
    console = Console(width=None if sys.stdout.isatty() else 180)
    rows: list[dict] = []
    t0 = time.perf_counter()
    with scratch_store() as store:
        for s, attack in scenarios:
            console.print(f"[bold]s = {s}, attack: {attack or 'none'}[/]")
            for label in ARMS:
                row = _arm(label, s, attack, rounds, store)
                rows.append(row)
                console.print(f"  {label:<13} acc {row['final_test_accuracy']:.4f}  up/round "
                              f"{row['bytes_up_per_round'] / 1e3:7.1f} KB  ({row['wall_s']:.0f} s)")
    base = next(r for r in rows if r["arm"] == "FedAvg" and r["attack"] == "none")
    target = 0.9 * base["final_test_accuracy"]
    for r in rows:
        r["target_accuracy"] = target
        for prof in PROFILES:
            r[f"time_to_target_{prof}_s"] = time_to_target(r, target, prof)
    factors = _factors(rows)
    console.print(_table(rows, rounds, target))
    console.print(_factor_table(factors))
    console.print(f"(machine shared with other work; bench wall time {time.perf_counter() - t0:.0f} s)")
    meta = {"task": TASK, "clients": CLIENTS, "seed": SEED, "rounds": rounds, "local": LOCAL, "solon_m": SOLON_M,
            "server_link_mbps": _SERVER.bandwidth_mbps, "profiles": {k: {"speed": p.device.speed}
                                                                    for k, p in PROFILES.items()},
            "quick": quick, "target_accuracy": target}
    (out_dir / "robust.json").write_text(json.dumps({"meta": meta, "rows": rows, "solon_factors": factors},
                                                    indent=1, default=str))
    _plot(rows, out_dir / "robust.png", target)
    return rows


def _factors(rows: list[dict]) -> list[dict]:
    """Solon's time-to-target against Bulyan's and Draco's, per scenario and profile."""
    out = []
    keys = sorted({(r["s"], r["attack"]) for r in rows}, key=lambda k: (k[1] != "none", k[0], k[1]))
    for s, attack in keys:
        by = {r["arm"]: r for r in rows if r["s"] == s and r["attack"] == attack}
        if "Solon" not in by:
            continue
        for prof in PROFILES:
            key = f"time_to_target_{prof}_s"
            out.append({"s": s, "attack": attack, "profile": prof,
                        "solon_s": by["Solon"][key], "bulyan_s": by["Bulyan"][key], "draco_s": by["Draco"][key],
                        "vs_bulyan": _factor(by["Bulyan"][key], by["Solon"][key]),
                        "vs_draco": _factor(by["Draco"][key], by["Solon"][key])})
    return out


def _fmt_t(x):
    return "never" if x is None else f"{x:.1f}"


def _table(rows: list[dict], rounds: int, target: float) -> Table:
    t = Table(title=f"robust: digits, {CLIENTS} clients, {rounds} rounds; time to {target:.3f} "
                    "(90% of unattacked FedAvg), simulated seconds")
    for col in ("s", "attack", "arm", "r", "final acc", "t comm-bound", "t compute-bound", "up/round", "down/round",
                "not decoded"):
        t.add_column(col, justify="left" if col in ("attack", "arm") else "right")
    for r in rows:
        t.add_row(str(r["s"]), r["attack"], r["arm"], str(r["r"]), f"{r['final_test_accuracy']:.4f}",
                  _fmt_t(r["time_to_target_comm-bound_s"]), _fmt_t(r["time_to_target_compute-bound_s"]),
                  f"{r['bytes_up_per_round'] / 1e3:.1f} KB", f"{r['bytes_down_per_round'] / 1e3:.1f} KB",
                  str(r["decode_failed_rounds"]) if r["arm"] in ("Solon", "Draco") else "")
    return t


def _factor_table(factors: list[dict]) -> Table:
    t = Table(title="Solon's time to accuracy: factor over Bulyan (paper: >10x) and over Draco (paper: 1.8x); "
                    "inf = the other never reached the target, — = Solon did not")
    for col in ("s", "attack", "profile", "Solon s", "Bulyan s", "Draco s", "x Bulyan", "x Draco"):
        t.add_column(col, justify="left" if col in ("attack", "profile") else "right")

    def f(x):
        return "—" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}")

    for r in factors:
        t.add_row(str(r["s"]), r["attack"], r["profile"], _fmt_t(r["solon_s"]), _fmt_t(r["bulyan_s"]),
                  _fmt_t(r["draco_s"]), f(r["vs_bulyan"]), f(r["vs_draco"]))
    return t


def _plot(rows: list[dict], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = sorted({(r["s"], r["attack"]) for r in rows}, key=lambda k: (k[1] != "none", k[1], k[0]))
    cols = 4 if len(scen) > 4 else len(scen)
    nrows = math.ceil(len(scen) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (s, attack) in zip(axes.flat, scen):
        for i, label in enumerate(ARMS):
            r = next((x for x in rows if x["s"] == s and x["attack"] == attack and x["arm"] == label), None)
            if r is None:
                continue
            ax.plot(r["sim_time_s"]["comm-bound"], r["accuracy"], color=f"C{i}", linewidth=1.3,
                    linestyle="-" if label in ("Solon", "Draco", "FedAvg") else "--", label=label)
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"{attack}, s = {s}", fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.set_xlabel("simulated time (s, comm-bound profile)", fontsize=7)
        ax.set_ylabel("test accuracy", fontsize=7)
    for ax in list(axes.flat)[len(scen):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, loc="lower right")
    fig.suptitle(f"digits, {CLIENTS} clients: accuracy against simulated time (dotted: the target)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
