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

4. LSGD (4 groups of 4, c1 = c2 = 0.1, τ_l = 4, τ_g = 16) against EASGD (β = 0.43,
   τ = 4) and D-PSGD; 5. SQuARM-SGD (top-1 % or sign, H = 5; and an event-triggered H = 1
   arm) against D-PSGD and DSGDm-N: wire bytes to a target accuracy; 6. DaSGD (τ = 4,
   δ = 1, 2) and Prague (groups of 4 ready workers) against synchronous all-reduce
   averaging every step and local SGD (τ = 4), on ``edge-wifi:16`` and with one 10x
   straggler: simulated seconds to target. Arms 4–6 (:func:`run_extra`, ~20 s) run on the
   array engine (``fedswarm.sim.array_engine``; Prague: its virtual-clock simulation);
   their bytes are the algorithms' wire accounting, the synchronous arms' times follow
   :func:`_delayed_times` (the all-reduce is a ring over the slowest link).

One epoch is ``ceil(train examples / (16 · 16))`` iterations: 16 nodes × 16 samples each.

    fedswarm bench decentralized [--quick] --out out/

Writes ``OUT/decentralized.json`` (the rows) and ``OUT/decentralized.png``, prints a table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fedswarm.bench.arms import run_arm, scratch_store
from fedswarm.config import RunConfig
from fedswarm.timemodel import BUILTIN_PROFILES, gossip_round_time_s, sync_round_time_s
from fedswarm.store import Store
from fedswarm.train import task_data

__all__ = ["run"]

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
    """Every recorded round of ``cfg`` (AD-PSGD goes to the virtual clock: :func:`run_arm`'s engine)."""
    return run_arm(cfg, store, name=f"bench-decentralized-{cfg.strategy}").rounds


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
    with scratch_store() as store:
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
    extra = run_extra(quick=quick)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decentralized.json").write_text(json.dumps(rows + extra, indent=1))
    _plot(rows, out_dir / "decentralized.png")
    _plot_extra(extra, out_dir / "decentralized_extra.png")
    _print(rows)
    _print_extra(extra)
    return rows + extra


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


# --------------------------------------------------------------------------- extra arms
# LSGD vs EASGD vs D-PSGD; SQuARM-SGD vs D-PSGD/DSGDm bytes to target; DaSGD vs
# synchronous averaging with stragglers. These run on the array engine (every node's
# gradient computed in this process with the same trainers, seeds and minibatches as the
# other engines), which is what keeps them quick: no Flower messages. Bytes are the
# algorithms' own wire accounting where they keep one (``meta["wire_bytes"]``, the codec's
# payload size), else the serialized payloads the engine measured.

EXTRA_DEVICES = {"no straggler (edge-wifi:16)": "edge-wifi:16", "1 straggler (10x)": STRAGGLER_DEVICES}


def _array_arm(algorithm: str, params: dict, iterations: int, *, topology: str = "ring", lr: float = LR,
               partition: str = "iid") -> dict:
    """Train ``algorithm`` on the array engine (:class:`fedswarm.sim.array_engine.ArraySimulation`)
    for ``iterations``; test accuracy of the node-average model and cumulative wire bytes
    after every iteration (the algorithm's own accounting where it keeps one, else the
    serialized payloads the engine measured)."""
    from fedswarm.sim.array_engine import ArraySimulation
    from fedswarm.train import evaluate_flat

    cfg = _config(algorithm, iterations, lr=lr, partition=partition, topology=topology, params=params)
    sim = ArraySimulation(cfg)
    data = task_data(cfg)
    accs, wire, sent = [], [], 0.0
    for _ in range(iterations):
        sent += sum(sim.step()["sent"])
        accs.append(evaluate_flat(sim.task, sim.model, sim.average(), data.test_x, data.test_y,
                                  torch.device("cpu"))[1])
        wire.append(sim.state.meta.get("wire_bytes", sent))
    return {"accuracy": accs, "wire_bytes": wire, "algo": sim.algo.summary()}


def _first(values: list[float], accs: list[float], target: float) -> float | None:
    for v, a in zip(values, accs):
        if a >= target:
            return v
    return None


def _allreduce_s(profiles, nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over the slowest link: 2(P−1) hops of
    ``nbytes/P`` each."""
    from fedswarm.timemodel import transfer_time_s

    p = len(profiles)
    worst = min(profiles, key=lambda q: q.link.bandwidth_mbps)
    return 2 * (p - 1) * transfer_time_s(worst.link, nbytes / p)


def _delayed_times(compute: list[float], comm: float, iterations: int, period: int, delay: int) -> list[float]:
    """Simulated time at which every node has finished iteration t (t = 0..T−1) for local
    SGD averaging every ``period`` steps whose all-reduce (``comm`` s, starting once
    every node has reached the snapshot) must be done before step ``t0 + delay`` ends.
    ``period = 1, delay = 0`` is fully synchronous averaging."""
    n = len(compute)
    T = [0.0] * n
    done, ready = [], None  # ready: (step the merge is due, time the all-reduce ends)
    for t in range(iterations):
        T = [T[i] + compute[i] for i in range(n)]
        if (t + 1) % period == 0:
            ready = (t + delay, max(T) + comm)
        if ready is not None and ready[0] == t:
            T = [max(x, ready[1]) for x in T]
            ready = None
        done.append(max(T))
    return done


def _prague_arm(profiles, group_size: int, iters: int) -> tuple[dict, list[float]]:
    """Prague on the virtual clock with the same gradients; accuracy of the node average
    and simulated time every NODES local steps (one synchronous iteration's worth)."""
    from fedswarm.local import round_seed
    from fedswarm.params import get_flat
    from fedswarm.sim.async_groups import PragueSimulation
    from fedswarm.strategies.decentralized.node import minibatch_gradient
    from fedswarm.tasks import get_task
    from fedswarm.train import evaluate_flat, trainer_for

    cfg = _config("prague", 1)
    task = get_task(TASK)
    model = task.model(SEED)
    x0 = get_flat(model).detach().cpu()
    data = task_data(cfg)
    trainers = [trainer_for(cfg, i, NODES) for i in range(NODES)]

    def gradient(i, x, k):
        return minibatch_gradient(trainers[i], x, BATCH, round_seed(SEED, k, i))

    sim = PragueSimulation(x0.repeat(NODES, 1), profiles, gradient, lr=LR, samples_per_step=BATCH,
                           message_bytes=4 * x0.numel(), group_size=group_size)
    accs, wire, ts, sent = [], [], [], 0
    for _ in range(iters):
        sim.advance(NODES)
        sent += sum(st["bytes_sent"] for st in sim.take_stats())
        accs.append(evaluate_flat(task, model, sim.x.mean(dim=0), data.test_x, data.test_y, torch.device("cpu"))[1])
        wire.append(float(sent))
        ts.append(sim.now)
    return {"accuracy": accs, "wire_bytes": wire, "algo": f"prague(group_size={group_size})"}, ts


def run_extra(quick: bool = True) -> list[dict]:
    """The LSGD / SQuARM-SGD / DaSGD comparisons (rows for ``decentralized.json``)."""
    from fedswarm.timemodel import compute_time_s, parse_devices

    torch.set_num_threads(1)
    ipe = _iters_per_epoch()
    epochs = 10 if quick else 30
    iters = epochs * ipe
    target = 0.85 if quick else 0.92
    rows: list[dict] = []

    cache: dict[tuple, dict] = {}

    def arm_run(name: str, params: dict, **kw) -> dict:
        key = (name, tuple(sorted(params.items())), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = _array_arm(name, params, iters, **kw)
        return cache[key]

    def add(comparison: str, arm: str, res: dict, **extra) -> None:
        accs = res["accuracy"]
        rows.append({"comparison": comparison, "arm": arm, "strategy": res["algo"], "partition": "iid",
                     "epochs": epochs, "final_accuracy": accs[-1], "best_accuracy": max(accs),
                     "accuracy_per_epoch": [accs[e * ipe - 1] for e in range(1, epochs + 1)],
                     "target_accuracy": target, "total_wire_bytes": res["wire_bytes"][-1],
                     "wire_bytes_to_target": _first(res["wire_bytes"], accs, target),
                     "epochs_to_target": (None if (i := _first(list(range(1, iters + 1)), accs, target)) is None
                                          else i / ipe), **extra})

    # 1. LSGD vs EASGD vs D-PSGD (4 groups of 4; EASGD's center over all 16)
    for arm, name, params, topo in (
        ("D-PSGD, ring", "dpsgd", {}, "ring"),
        ("EASGD (β=0.43, τ=4)", "easgd", {"beta": 0.43, "period": 4}, "complete"),
        ("LSGD (4 groups, c=0.1, τ_l=4, τ_g=16)", "lsgd",
         {"groups": 4, "c1": 0.1, "c2": 0.1, "tau_local": 4, "tau_global": 16}, "complete"),
    ):
        add("LSGD vs EASGD vs D-PSGD", arm, arm_run(name, params, topology=topo))
    # 2. SQuARM-SGD vs D-PSGD / DSGDm-N: bytes to target (momentum arms at lr 0.05)
    for arm, name, params, lr in (
        ("D-PSGD, ring", "dpsgd", {}, LR),
        ("DSGDm-N, ring (lr 0.05)", "dsgdm", {"nesterov": True}, 0.05),
        ("SQuARM top-1%, H=5, c=0 (lr 0.05)", "squarm", {"codec": "topk", "ratio": 0.01, "period": 5,
                                                         "gamma": 0.5}, 0.05),
        ("SQuARM sign, H=5, c=0 (lr 0.05)", "squarm", {"codec": "sign", "period": 5, "gamma": 0.5}, 0.05),
        ("SQuARM top-1%, H=1, c=100 (lr 0.05)", "squarm", {"codec": "topk", "ratio": 0.01, "period": 1,
                                                           "threshold": 100.0, "gamma": 0.5}, 0.05),
    ):
        res = arm_run(name, params, lr=lr, topology="ring")
        add("SQuARM-SGD bytes to target", arm, res, lr=lr)
    base = rows[-5]["wire_bytes_to_target"]
    for r in rows[-3:]:
        b = r["wire_bytes_to_target"]
        r["note"] = (f"{base / b:.1f}x fewer bytes to target than D-PSGD" if base and b else "target not reached")
    # 3. DaSGD vs synchronous averaging, simulated time with stragglers
    d = 4 * 4810
    arms = (("sync averaging every step", 1, 0), ("local SGD τ=4", 4, 0), ("DaSGD τ=4, δ=1", 4, 1),
            ("DaSGD τ=4, δ=2", 4, 2))
    results = {arm: _array_arm("dasgd", {"period": p, "delay": dl}, iters, topology="complete")
               for arm, p, dl in arms}
    for res in results.values():  # gossip over the complete graph counts 4d·(P−1); a ring all-reduce 2(P−1)/P·4d
        res["wire_bytes"] = [b * 2.0 / NODES for b in res["wire_bytes"]]
    for devices_name, spec in EXTRA_DEVICES.items():
        profiles = [BUILTIN_PROFILES[p] for p in parse_devices(spec, NODES)]
        compute = [compute_time_s(p, samples=BATCH) for p in profiles]
        comm = _allreduce_s(profiles, d)
        for arm, p, dl in arms:
            ts = _delayed_times(compute, comm, iters, p, dl)
            res = results[arm]
            add(f"DaSGD vs sync averaging: {devices_name}", arm, res, devices=spec,
                sim_s_per_epoch=ts[-1] / epochs, sim_s_to_target=_first(ts, res["accuracy"], target),
                sim_curve=[[t, a] for t, a in zip(ts, res["accuracy"])], allreduce_s=comm)
        for g in (4,):
            res, ts = _prague_arm(profiles, g, iters)
            add(f"DaSGD vs sync averaging: {devices_name}", f"Prague, groups of {g} ready workers", res,
                devices=spec, sim_s_per_epoch=ts[-1] / epochs, sim_s_to_target=_first(ts, res["accuracy"], target),
                sim_curve=[[t, a] for t, a in zip(ts, res["accuracy"])])
        rs = [r for r in rows if r["comparison"] == f"DaSGD vs sync averaging: {devices_name}"]
        t_sync = rs[0]["sim_s_to_target"]
        for r in rs[1:]:
            if t_sync and r["sim_s_to_target"]:
                r["note"] = f"{t_sync / r['sim_s_to_target']:.1f}x faster to target than sync averaging"
    return rows


def _print_extra(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decentralized extra arms (times are SIMULATED seconds; bytes = algorithms' wire accounting)")
    for c in ("comparison", "arm", "final acc", "best acc", "epochs to target", "MB to target", "total MB",
              "sim s/epoch", "sim s to target", "note"):
        table.add_column(c)
    for r in rows:
        mb = r.get("wire_bytes_to_target")
        table.add_row(r["comparison"], r["arm"], f"{r['final_accuracy']:.3f}", f"{r['best_accuracy']:.3f}",
                      _fmt(r.get("epochs_to_target"), ".2f"), _fmt(None if mb is None else mb / 1e6, ".3f"),
                      f"{r['total_wire_bytes'] / 1e6:.3f}", _fmt(r.get("sim_s_per_epoch"), ".2f"),
                      _fmt(r.get("sim_s_to_target"), ".1f"), r.get("note", ""))
    Console(width=240).print(table)


def _plot_extra(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["comparison"], []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2))
    for ax, (name, rs) in zip(axes, groups.items()):
        for r in rs:
            if "sim_curve" in r:
                ts, accs = zip(*r["sim_curve"])
                ax.plot(ts, accs, label=r["arm"])
                ax.set(xlabel="SIMULATED seconds")
            elif name.startswith("SQuARM"):
                ax.plot(range(1, r["epochs"] + 1), r["accuracy_per_epoch"], marker=".",
                        label=f"{r['arm']} ({r['total_wire_bytes'] / 1e6:.2f} MB)")
                ax.set(xlabel="epoch")
            else:
                ax.plot(range(1, r["epochs"] + 1), r["accuracy_per_epoch"], marker=".", label=r["arm"])
                ax.set(xlabel="epoch")
        ax.axhline(rs[0]["target_accuracy"], color="grey", ls="--", lw=0.8)
        ax.set(title=name, ylabel="test accuracy (node average)", ylim=(0.5, 1.0))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
