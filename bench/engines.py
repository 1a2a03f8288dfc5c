"""``fedswarm bench engines``: the in-process engine beside Flower's Simulation Engine (Ray).

The same FedAvg run (digits-mlp, 20 clients, iid) on both engines, twice: with the
default local work, and with one local step per client so that a round's wall time is
almost all engine overhead (message routing, serialization, actor calls, polling).
Reports total wall time, the first round (Ray starts its actors then), the steady-state
round time, and the final accuracy, which must agree between engines.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedswarm.config import RunConfig
from fedswarm.store import Store

__all__ = ["run"]


def _one(cfg: RunConfig, db: Path) -> dict:
    from fedswarm.sim.run import run_engine

    store = Store(db)
    rid = store.create_run(cfg.model_dump())
    t0 = time.perf_counter()
    status = run_engine(cfg, store=store, run_id=rid)
    total = time.perf_counter() - t0
    res = store.export_result(rid)
    rounds = [r for r in res["rounds"] if r["round"] > 0]
    steady = [r["wall_s"] for r in rounds[1:]] or [rounds[0]["wall_s"]]
    store.close()
    return {
        "engine": cfg.engine,
        "work": "one local step" if cfg.local_steps == 1 else f"{cfg.local_epochs} local epochs",
        "clients": cfg.clients,
        "rounds": cfg.rounds,
        "status": status,
        "total_wall_s": round(total, 3),
        "first_round_s": round(rounds[0]["wall_s"], 3),
        "steady_round_s": round(sorted(steady)[len(steady) // 2], 4),
        "final_test_accuracy": res["summary"]["final_test_accuracy"],
        "bytes_up": res["summary"]["total_bytes_up"],
    }


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    rounds = 5 if quick else 10
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (engine, steps) in enumerate([("inprocess", None), ("flower", None), ("inprocess", 1), ("flower", 1)]):
            cfg = RunConfig(clients=20, rounds=rounds, partition="iid", engine=engine, local_steps=steps)
            rows.append(_one(cfg, Path(tmp) / f"bench{i}.db"))
    table = Table(title="engines: FedAvg, digits-mlp, 20 clients (wall time on this machine)")
    for col in ("engine", "work", "rounds", "total wall s", "first round s", "steady round s", "final acc"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["engine"], r["work"], str(r["rounds"]), f"{r['total_wall_s']:.2f}",
                      f"{r['first_round_s']:.3f}", f"{r['steady_round_s']:.4f}", f"{r['final_test_accuracy']:.4f}")
    Console().print(table)
    (out_dir / "engines.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, out_dir / "engines.png")
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['engine']}\n{r['work']}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(labels, [r["total_wall_s"] for r in rows], color=["C0", "C1", "C0", "C1"])
    a.set_ylabel("total wall time (s)")
    b.bar(labels, [r["steady_round_s"] for r in rows], color=["C0", "C1", "C0", "C1"])
    b.set_ylabel("steady-state round wall time (s)")
    b.set_yscale("log")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("fedswarm in-process engine vs Flower Simulation Engine (same run, same machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
