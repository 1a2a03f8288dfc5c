"""``fedswarm bench engines-ray`` (and the Ray section of ``fedswarm bench engines``): the
batched engine on a Ray cluster (``--ray-address``, :mod:`fedswarm.sim.batched_ray`) with 1
and 2 workers against the same run in one process, on a one-node cluster of our own on this
machine (:func:`fedswarm.bench.ray_cluster.local_ray_cluster`, 2 CPUs).

The runs: digits-mlp, iid, every client every round, one local step: FedAvg (as ``bench
engines``) and top-k 1% with error feedback (``compressed_fedavg``), at 1,000 and 10,000
clients (``--quick``: 1,000), federated evaluation off; and (not with ``--quick``) at 1,000
clients the cases the sharded engine gained since: FedAvg with federated evaluation every round (each worker scores
its clients: the ``eval_shard_*`` figures), FedAvg with ``--dp`` (the workers clip, the driver
noises), the median rule under a sign-flip ``--byzantine`` attack (every client's vector
gathered to the driver) and gTop-k. One process runs twice: with the engine's own two
threads and with one (what each worker has), so that threads and Ray are told apart.
Columns: steady seconds per round (the median round after the first), client-rounds per
second, the first round and the start-up outside rounds (the actors' start and their
trainers' build), and per round what Ray costs: the bytes pickled to and from the workers,
the driver's wait for them beside the slowest worker's own compute (their difference is
Ray's overhead: scheduling, (de)serialization, the object store), and the ratio to one
process. JSON (engines-ray.json) + PNG (engines-ray.png).

On one machine the workers share its cores with the driver and each other: this measures
Ray's cost, not the gain a second machine brings (its cores and memory for its shard).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

__all__ = ["run", "CASES"]

_BASE = dict(task="digits-mlp", partition="iid", local_steps=1, batch_size=16, lr=0.3, fraction=1.0, seed=0,
             eval_every=1_000_000)
#: name -> the strategy's part of the config
CASES = {
    "fedavg": dict(strategy="fedavg"),
    "topk-ef": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.01"}),
    "fedavg-fedeval": dict(strategy="fedavg", eval_every=1),
    "fedavg-dp": dict(strategy="fedavg", dp="noise_multiplier=1.0,clip=1.0"),
    "median-signflip": dict(strategy="median", byzantine=10),
    "gtopk": dict(strategy="gtopk", params={"density": 0.01}),
}
#: the cases run at 1,000 clients only (what they add is their reduction, not scale; the median's
#: gathered vectors at 10,000 clients are 10,000 dense models on the driver)
SMALL_ONLY = ("fedavg-fedeval", "fedavg-dp", "median-signflip", "gtopk")
_FIGURES = ("shard_bytes_out", "shard_bytes_in", "shard_wait_s", "shard_compute_s",
            "eval_shard_bytes_out", "eval_shard_bytes_in", "eval_shard_wait_s", "eval_shard_compute_s")


def _cell(cfg, t0: float) -> dict:
    """Run ``cfg`` in a throwaway store; its figures, each round's the median over the rounds after
    the first (the first, with the actors' warm-up, apart; ``setup_s``: the time outside rounds)."""
    from fedswarm.bench.arms import run_arm, scratch_store

    with scratch_store() as store:
        arm = run_arm(cfg, store, ok=None)  # the row reports the status
    total = time.perf_counter() - t0
    rounds = [r for r in arm.result["rounds"] if r["round"] > 0]
    walls = [r["wall_s"] for r in rounds]
    row = {"status": arm.status, "rounds_run": len(rounds), "first_round_s": walls[0] if walls else None,
           "setup_s": total - sum(walls), "final_test_accuracy": arm.result["summary"]["final_test_accuracy"]}
    steady = rounds[1:] or rounds
    for key, out in (("wall_s", "steady_round_s"), *((k, k) for k in _FIGURES)):
        values = sorted(r[key] for r in steady if r.get(key) is not None)
        if values:
            row[out] = values[len(values) // 2]
    if "shard_wait_s" in row:
        row["ray_overhead_s"] = (row["shard_wait_s"] + row.get("eval_shard_wait_s", 0.0)
                                 - row["shard_compute_s"] - row.get("eval_shard_compute_s", 0.0))
    return row


def run(out_dir: Path, quick: bool = False, *, sizes: list[int] | None = None, rounds: int | None = None,
        workers: tuple[int, ...] = (1, 2), cases: tuple[str, ...] = tuple(CASES)) -> list[dict]:
    import torch

    from fedswarm.bench.ray_cluster import local_ray_cluster
    from fedswarm.config import RunConfig

    sizes = sizes or ([1000] if quick else [1000, 10_000])
    if quick:  # the first two: FedAvg's sum and top-k's gathered payloads (under two minutes on 2 cores)
        cases = tuple(c for c in cases if c not in SMALL_ONLY)
    rounds = rounds or (3 if quick else 5)
    console = Console(width=200)
    rows: list[dict] = []
    default_threads = torch.get_num_threads()
    with local_ray_cluster(nodes=1, cpus=2) as (address, _):
        for case in cases:
            for clients in [n for n in sizes if case not in SMALL_ONLY or n <= 1000]:
                # one process with the engine's own threads (2), with one (as each worker has), then the workers
                for w, threads in ((0, None), (0, 1), *((w, None) for w in workers)):
                    kw = dict(_BASE, clients=clients, rounds=rounds, engine="batched", **CASES[case])
                    if w:
                        kw.update(ray_address=address, workers=w)
                    label = f"ray x{w}" if w else "one process" + (f", {threads} thread" if threads else "")
                    console.print(f"[dim]engines-ray: {case}, {clients} clients, {label} ...[/]")
                    row = {"case": case, "clients": clients, "workers": w, "engine": label, "threads": threads}
                    torch.set_num_threads(threads or default_threads)  # the engine lowers it to its own
                    row.update(_cell(RunConfig(**kw), time.perf_counter()))
                    if row.get("steady_round_s"):
                        row["client_rounds_per_s"] = clients / row["steady_round_s"]
                    rows.append(row)
    torch.set_num_threads(default_threads)
    one = {(r["case"], r["clients"]): r for r in rows if r["engine"] == "one process"}
    for r in rows:
        base = one[(r["case"], r["clients"])]
        if r is not base and r.get("steady_round_s") and base.get("steady_round_s"):
            r["x_one_process"] = r["steady_round_s"] / base["steady_round_s"]
    _print(rows, console)
    meta = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "base": _BASE, "cases": CASES,
            "cluster": "one local Ray node, 2 CPUs, on this machine"}
    (out_dir / "engines-ray.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _plot(rows, out_dir / "engines-ray.png")
    return rows


def _both(row: dict, key: str):
    """A round's figure of the training's calls and the evaluation's together (None: not sharded)."""
    if row.get(key) is None:
        return None
    return row[key] + row.get(f"eval_{key}", 0)


def _print(rows: list[dict], console: Console) -> None:
    load = os.getloadavg()
    table = Table(title=f"batched engine on Ray (one local node) against one process, per round "
                        f"(load {load[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("case", "clients", "engine", "s/round", "x one process", "client-rounds/s", "first round s",
                "setup s", "KB to workers", "KB from workers", "wait s", "worker compute s", "Ray overhead s",
                "final acc"):
        table.add_column(col)

    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v / scale, spec)

    for r in rows:
        table.add_row(r["case"], str(r["clients"]), r["engine"], f(r.get("steady_round_s"), ".3f"),
                      f(r.get("x_one_process"), ".2f"), f(r.get("client_rounds_per_s"), ",.0f"),
                      f(r.get("first_round_s"), ".2f"), f(r.get("setup_s"), ".1f"),
                      f(_both(r, "shard_bytes_out"), ",.0f", 1e3), f(_both(r, "shard_bytes_in"), ",.0f", 1e3),
                      f(_both(r, "shard_wait_s"), ".3f"), f(_both(r, "shard_compute_s"), ".3f"),
                      f(r.get("ray_overhead_s"), ".3f"), f(r.get("final_test_accuracy"), ".4f"))
    console.print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["case"], r["clients"]) for r in rows))
    labels = list(dict.fromkeys(r["engine"] for r in rows))
    by = {(r["case"], r["clients"], r["engine"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [g + i * width for g in range(len(groups))]
        total = [by.get((*grp, label), {}).get("steady_round_s") or 0.0 for grp in groups]
        over = [by.get((*grp, label), {}).get("ray_overhead_s") or 0.0 for grp in groups]
        ax.bar(xs, total, width, color=f"C{i}", label=label)
        if any(over):
            ax.bar(xs, over, width, color="none", edgecolor="k", hatch="//",
                   label="Ray's overhead" if i == len(labels) - 1 else None)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{c}\n{n:,} clients" for c, n in groups])
    ax.set_ylabel("seconds per round (steady)")
    ax.set_title("batched engine: one process against Ray workers on one machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
