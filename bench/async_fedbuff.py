"""Fleets that never wait for their slowest device: FedBuff against synchronous FedAvg.

``digits-mlp``, 100 nodes, ``--devices edge-wifi:80,straggler:20`` (a straggler computes 10x
slower, same link), 10 local steps of batch 32, seeds 0-2, on the in-process engine (its rounds
carry the time model's simulated seconds; FedBuff runs on its virtual clock). Every arm gets the
same budget, :data:`BUDGET` client updates *folded into the model* (one count for every arm:
a synchronous round's replies less those failed, refused, dropped or late; a FedBuff aggregation's
``updates``), and is stopped after the round that reaches it: synchronous FedAvg samples 10% of the
nodes on offer each round; FedBuff keeps 20 nodes training and folds K = 10 updates per
aggregation at server learning rate :data:`SERVER_LR` (chosen on other seeds); a second FedBuff arm
keeps 10 training (concurrency = K: half the staleness, the accuracy-gap diagnosis);
``FEDSWARM_ASYNC_SERVER_LRS`` adds one FedBuff arm per server learning rate (the sweep). Figures, all on
*simulated* time: the time to 0.90 test accuracy (the first recorded round at or above it) and the
final accuracy, per seed and their mean, and each arm's time to target as a multiple of synchronous
FedAvg's.

A second section runs every arm again on a fleet that sleeps (:data:`AVAILABILITY`: a diurnal on/off
process and 10% mid-training dropouts). The same budget holds there: a dropped node's update is
never folded, so it does not count, and the arms that sample 10% of the ~half of the fleet that is
on run more rounds to reach it. One timeout rule for every arm (:data:`TIMEOUT_RULE`): the server
gives up on a node that dropped after ``round_timeout`` (600 s simulated); a synchronous round that
waits for it (no quorum, or a quorum the drops left short) takes those 600 s, a FedBuff slot whose
node dropped stays taken for them while the other slots go on. The arms and sections that need
issue 45's fleet work (RunConfig ``quorum``/``over_select``, ``availability``) run only where this
checkout has those options; the JSON says which were left out and why.

    fedswarm bench async [--quick] --out DIR
    FEDSWARM_ASYNC_SEEDS=0-9 FEDSWARM_ASYNC_ARMS="fedavg (sync),fedbuff" fedswarm bench async --out DIR
    FEDSWARM_ASYNC_SEEDS=10-39 FEDSWARM_ASYNC_SERVER_LRS=1,1.5 FEDSWARM_ASYNC_ARMS=fedbuff fedswarm bench async

Writes ``DIR/async.json`` (per-seed rows and the per-arm means) and ``DIR/async.png`` (accuracy
against simulated time); prints the table. Each arm's final accuracy comes with its spread over
the seeds (sample standard deviation), and its points against synchronous FedAvg with the spread of
the per-seed differences (paired by seed: the same initial model and partition): digits' test set
has 359 examples, so one example is 0.28 points and a difference of a point is within seed noise.
``FEDSWARM_ASYNC_SEEDS`` (``0-9`` or ``0,3,5``) runs other seeds, ``FEDSWARM_ASYNC_ARMS`` (arm names,
comma-separated; synchronous FedAvg, the reference, always runs) a subset of the arms (the sweep's arms are
always kept when ``FEDSWARM_ASYNC_SERVER_LRS`` is set).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

from fedswarm.bench.arms import run_arm, scratch_store, start_bench
from fedswarm.bench.papers.report import seed_stats
from fedswarm.config import RunConfig

__all__ = ["run", "TARGET", "arms", "seeds_from_env"]

TARGET = 0.90
BASE = dict(task="digits-mlp", clients=100, devices="edge-wifi:80,straggler:20", local_steps=10, batch_size=32,
            eval_every=1_000_000)
PER_ROUND = 10  # client updates per round (FedAvg) and per aggregation (FedBuff's K)
ROUNDS = 40
#: Every arm's budget: client updates folded into the model (FedBuff's 40 aggregations of K = 10).
BUDGET = ROUNDS * PER_ROUND
#: No arm runs more rounds than this to reach the budget (a synchronous round on a half-asleep
#: fleet folds about 4 updates); an arm that stops short says so in ``client_updates``.
MAX_ROUNDS = 4 * ROUNDS
BUDGET_RULE = ("client updates folded into the model, counted the same way for every arm: a synchronous "
               "round's replies less those failed, refused, dropped or late, a FedBuff aggregation's 'updates' "
               "(never the lost or refused); every arm stops after the round that reaches the budget")
TIMEOUT_RULE = ("a node that drops mid-training (availability dropout, or its session ends first) is given up "
                "after round_timeout (600 s simulated) in every arm: a synchronous round waiting for it (no "
                "quorum, or a quorum the drops left short) takes 600 s; a FedBuff slot stays taken for 600 s")
#: FedBuff's server learning rate in its arms. Its fold, ``x + server_lr (1/K) sum w(tau) delta``, shrinks a
#: stale update by ``w`` = 1/sqrt(1 + tau) (about 0.6 at the 2K arm's mean staleness of 1.7 versions), so at rate 1
#: an aggregation moves the model less than a synchronous round of as many updates. 1.5 was the best of 1, 1.25,
#: 1.5, 1.75 and 2 on seeds 10-39 (not the bench's seeds 0-2): -0.42 points against synchronous FedAvg on 30
#: seeds, against -0.85 at rate 1 (`FEDSWARM_ASYNC_SEEDS=10-39 FEDSWARM_ASYNC_SERVER_LRS=1,1.25,1.5,1.75,2
#: FEDSWARM_ASYNC_ARMS=fedbuff fedswarm bench async` reruns the sweep). The strategy's own default stays 1.
SERVER_LR = 1.5
QUICK = dict(clients=8, devices="edge-wifi:6,straggler:2", local_steps=2)
QUICK_PER_ROUND = 2
#: The second section's fleet (fedswarm/availability.py): sessions of 30 min on and 30 min off on
#: average, off periods up to 1.5x longer at night (a day of 86,400 s), and each dispatched node
#: dropping mid-training with probability 0.1; a dropped node is given up after round_timeout (600 s).
AVAILABILITY = "on=1800,off=1800,diurnal=0.5,dropout=0.1"


def arms(quick: bool) -> tuple[dict[str, dict], list[str]]:
    """The arms' run options (name -> RunConfig fields beyond BASE and the seed) and the notes on
    the arms left out."""
    clients = QUICK["clients"] if quick else BASE["clients"]
    k = QUICK_PER_ROUND if quick else PER_ROUND
    fraction = k / clients
    out = {
        "fedavg (sync)": dict(strategy="fedavg", fraction=fraction),
        "fedbuff": dict(strategy="fedbuff", params={"buffer_size": k, "concurrency": 2 * k, "server_lr": SERVER_LR}),
    }
    # the same FedBuff with as many nodes in flight as it folds (concurrency = K): about half the
    # staleness of 2K (mean ~0.9 versions against ~1.7), the diagnosis of the 2K arm's accuracy gap
    out["fedbuff (concurrency K)"] = dict(strategy="fedbuff", params={"buffer_size": k, "concurrency": k,
                                                                      "server_lr": SERVER_LR})
    # the server learning rate's sweep (FEDSWARM_ASYNC_SERVER_LRS): FedBuff at concurrency 2K, one arm a rate
    for lr in server_lrs_from_env():
        out[f"fedbuff (server_lr {lr:g})"] = dict(strategy="fedbuff", params={"buffer_size": k, "concurrency": 2 * k,
                                                                               "server_lr": lr})
    missing = []
    if "quorum" in RunConfig.model_fields:
        # the quorum is the run's default with --over-select: the nodes the round needs (fraction of those on).
        # A fixed K = 10 asked more replies than a round samples on a half-asleep fleet (10% of ~50 on, x1.3:
        # 6), so every round waited for all of them, a dropped one for round_timeout: no quorum at all
        out["fedavg --over-select 1.3 --quorum"] = dict(strategy="fedavg", fraction=fraction, over_select=1.3)
    else:
        missing.append("fedavg --over-select 1.3 --quorum: this checkout has no quorum rounds (issue 45 item 2)")
    return out, missing


def seeds_from_env(default: list[int]) -> list[int]:
    """``FEDSWARM_ASYNC_SEEDS`` (``0-9``, ``0,3,5``) or ``default``; SystemExit naming a bad value."""
    text = os.environ.get("FEDSWARM_ASYNC_SEEDS", "").strip()
    if not text:
        return default
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(x) for x in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise SystemExit(f"FEDSWARM_ASYNC_SEEDS must be 'A-B' or 'A,B,...' of seeds >= 0 (e.g. 0-9), got {text!r}")
    return seeds


def server_lrs_from_env() -> list[float]:
    """``FEDSWARM_ASYNC_SERVER_LRS`` (``1,1.25,1.5``): one extra FedBuff arm per server learning rate
    (the sweep :data:`SERVER_LR` was chosen by, on other seeds); none when unset. SystemExit naming a
    bad value."""
    text = os.environ.get("FEDSWARM_ASYNC_SERVER_LRS", "").strip()
    if not text:
        return []
    try:
        lrs = [float(x) for x in text.split(",")]
    except ValueError:
        lrs = []
    if not lrs or not all(0 < lr < float("inf") for lr in lrs):
        raise SystemExit(f"FEDSWARM_ASYNC_SERVER_LRS must be server learning rates > 0, comma-separated "
                         f"(e.g. 1,1.5,2), got {text!r}")
    return lrs


def _arms_from_env(options: dict[str, dict]) -> dict[str, dict]:
    """The arms ``FEDSWARM_ASYNC_ARMS`` names (synchronous FedAvg and the server learning rate sweep's
    always), or all; SystemExit naming an unknown arm."""
    names = [x.strip() for x in os.environ.get("FEDSWARM_ASYNC_ARMS", "").split(",") if x.strip()]
    unknown = [n for n in names if n not in options]
    if unknown:
        raise SystemExit(f"FEDSWARM_ASYNC_ARMS: no arm {', '.join(map(repr, unknown))} (arms: {', '.join(options)})")
    return {k: v for k, v in options.items()
            if not names or k == "fedavg (sync)" or k in names or k.startswith("fedbuff (server_lr ")}


def sections() -> tuple[dict[str, dict], list[str]]:
    """The fleet of each section (name -> RunConfig fields), and the notes on those left out."""
    out: dict[str, dict] = {"always available": {}}
    if "availability" in RunConfig.model_fields:
        out["diurnal availability, 10% dropouts"] = {"availability": AVAILABILITY}
        return out, []
    return out, ["the diurnal-availability section with 10% mid-round dropouts: this checkout has no "
                 "simulated availability (issue 45 item 4)"]


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
    options = _arms_from_env(options)
    fleets, left = sections()
    missing += left
    seeds = seeds_from_env([0] if quick else [0, 1, 2])
    rounds = 2 if quick else ROUNDS
    budget = rounds * (QUICK_PER_ROUND if quick else PER_ROUND)
    base = {**BASE, **(QUICK if quick else {})}
    rows: list[dict] = []
    with scratch_store("async.db") as store:
        for section, fleet in fleets.items():
            for name, opts in options.items():
                for seed in seeds:
                    rows.append(_arm(store, section, name, budget,
                                     {**base, **opts, **fleet, "seed": seed, "rounds": MAX_ROUNDS * rounds // ROUNDS}))
    summary = _summarize(rows)
    (out_dir / "async.json").write_text(json.dumps({"target": TARGET, "config": base, "budget": budget,
                                                    "budget_rule": BUDGET_RULE, "timeout_rule": TIMEOUT_RULE,
                                                    "max_rounds": MAX_ROUNDS * rounds // ROUNDS,
                                                    "seeds": seeds, "sections": fleets, "left_out": missing,
                                                    "summary": summary, "rows": rows}, indent=1))
    _plot(rows, out_dir / "async.png")
    _print(summary, missing)
    return rows


def _updates(row: dict) -> int:
    """The client updates a recorded round folded in: FedBuff's ``updates``; a synchronous round's
    replies less those that failed or were refused."""
    if "updates" in row:
        return int(row["updates"])
    return int(row.get("num_clients") or 0) - int(row.get("nodes_failed") or 0) - int(row.get("rejected") or 0)


def _arm(store, section: str, name: str, budget: int, options: dict) -> dict:
    """One arm for one seed, stopped after the round whose folded updates reach ``budget``."""
    cfg = RunConfig.model_validate(options)
    run_id = store.create_run(cfg.model_dump(), name=f"bench-async {section}: {name} seed {cfg.seed}")
    folded = [0]

    def stop_at_budget(rnd: int, row: dict) -> None:
        if rnd > 0:
            folded[0] += _updates(row)
            if folded[0] >= budget:
                store.add_control(run_id, "stop", {})

    arm = run_arm(cfg, store, run_id=run_id, listeners=[stop_at_budget], ok=("finished", "stopped"))
    trained = arm.trained_rounds
    times, accs = _curve(trained)
    updates = list(itertools.accumulate(_updates(r) for r in trained))
    return {"section": section, "arm": name, "seed": cfg.seed, "rounds": len(trained),
            "client_updates": updates[-1], "time_to_target_s": _time_to(times, accs, TARGET),
            "final_acc": accs[-1], "sim_time_s": times[-1], "wall_s": arm.wall_s, "curve_t": times, "curve_acc": accs,
            "curve_updates": updates}


def _summarize(rows: list[dict]) -> list[dict]:
    out = []
    for section in dict.fromkeys(r["section"] for r in rows):
        out += _summarize_section([r for r in rows if r["section"] == section])
    return out


def _summarize_section(rows: list[dict]) -> list[dict]:
    out = []
    ref = [r for r in rows if r["arm"] == "fedavg (sync)"]
    ref_t = _mean([r["time_to_target_s"] for r in ref])
    ref_acc = _mean([r["final_acc"] for r in ref])
    ref_by_seed = {r["seed"]: r["final_acc"] for r in ref}
    for name in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == name]
        t = _mean([r["time_to_target_s"] for r in mine])
        acc = _mean([r["final_acc"] for r in mine])
        paired = [100 * (r["final_acc"] - ref_by_seed[r["seed"]]) for r in mine if r["seed"] in ref_by_seed]
        out.append({"section": mine[0]["section"], "arm": name, "seeds": len(mine),
                    "final_acc_std": seed_stats([r["final_acc"] for r in mine])["std"],
                    # the spread of the per-seed differences (same seed: same initial model and partition)
                    "acc_points_vs_sync_std": seed_stats(paired)["std"],
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

    table = Table(title=f"async: time to {TARGET:.2f} test accuracy, simulated seconds (means over seeds; "
                        f"± the seeds' standard deviation)")
    for c in ("section", "arm", "reached", "client updates", "to target (s)", "x sync", "final acc",
              "vs sync (points)", "simulated s"):
        table.add_column(c, justify="left" if c in ("section", "arm") else "right")

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in summary:
        table.add_row(r["section"], r["arm"], f"{r['reached']}/{r['seeds']}", f(r["client_updates"], ".0f"),
                      f(r["time_to_target_s"], ".1f"), f(r["x_sync"], ".2f"),
                      f"{f(r['final_acc'], '.4f')} ± {f(r['final_acc_std'], '.4f')}",
                      f"{f(r['acc_points_vs_sync'], '+.2f')} ± {f(r['acc_points_vs_sync_std'], '.2f')}",
                      f(r["sim_time_s"], ".1f"))
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)
    for m in missing:
        console.print(f"left out: {m}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["section"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(8 * len(names), 4.5), squeeze=False)
    colors: dict[str, str] = {}
    for ax, section in zip(axes[0], names):
        for r in (r for r in rows if r["section"] == section):
            c = colors.setdefault(r["arm"], f"C{len(colors)}")
            ax.plot(r["curve_t"], r["curve_acc"], color=c, alpha=0.8,
                    label=r["arm"] if r["seed"] == rows[0]["seed"] else None)
        ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
        ax.set(xscale="log", xlabel="simulated seconds (time model)", ylabel="test accuracy",
               title=f"digits-mlp, edge-wifi + straggler: {section}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
