"""Running one simulation from the command line: store row, engine, progress bar,
summary table, ``result.json`` and a plot."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.store.liveness import Heartbeat, owner_fields
from fedswarm.sim.engines import Checked, engine_for, run_engine
from fedswarm.sim.report import plot_run, summary_table

__all__ = ["run_engine", "run_simulation_cli"]  # run_engine is fedswarm.sim.engines', here for its callers


def run_simulation_cli(cfg: RunConfig, *, db: str | None, run_id: str | None, out: Path | None,
                       console: Console, resume: Any = None, checked: Checked | None = None) -> str:
    """``resume``: a checkpoint of run ``run_id`` to continue from (``fedswarm resume``); ``checked``:
    :func:`fedswarm.sim.engines.check_run` of ``cfg`` (the run takes the strategy it built)."""
    engine = engine_for(cfg)
    if engine.name == "array" and cfg.engine != "array":
        cfg = cfg.model_copy(update={"engine": "array"})  # it runs nowhere else: record what runs it
    store = Store(db)
    if run_id is not None:
        run = store.get_run(run_id)
        if run is None:
            raise SystemExit(f"error: no run '{run_id}' in {store.url}")
        if resume is None:
            store.update_run(run_id, config=cfg.model_dump(), strategy=cfg.strategy, task=cfg.task,
                             engine=cfg.engine, total_rounds=cfg.rounds)
    else:
        run_id = store.create_run(cfg.model_dump(), name=cfg.name)
    store.update_run(run_id, **owner_fields())  # from now on: a killed process shows its run as lost
    console.print(f"run [bold]{run_id}[/]: {cfg.strategy} on {cfg.task}, {cfg.clients} clients, "
                  f"{cfg.rounds} rounds, " + (f"own data {cfg.client_data}" if cfg.client_data else
                                              f"partition {cfg.partition}") + f", engine {cfg.engine} -> {store.url}")
    t0 = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]{task.description}"), MofNCompleteColumn(), BarColumn(),
        TextColumn("acc {task.fields[acc]}"), TextColumn("up {task.fields[up]}"), TextColumn("{task.fields[eps]}"),
        TimeElapsedColumn(), console=console, transient=False,
    )
    status = "failed"
    with Heartbeat(store, run_id), progress:  # a host sharing the store sees this process is alive
        bar = progress.add_task("rounds", total=cfg.rounds, completed=getattr(resume, "round", 0), acc="-",
                                up="0 B", eps="")
        on_clients = None
        if engine.reports_clients:  # within a round: clients trained and clients per second
            clients_bar = progress.add_task("clients", total=1, acc="-", up="", eps="")
            t_round = [time.perf_counter()]

            def on_clients(done: int, total: int) -> None:
                if done <= 0:
                    return
                rate = done / max(time.perf_counter() - t_round[0], 1e-9)
                progress.update(clients_bar, completed=done, total=total, eps=f"{rate:,.0f} clients/s")
                if done >= total:
                    t_round[0] = time.perf_counter()
        totals = {"up": 0}

        def on_round(rnd: int, row: dict[str, Any]) -> None:
            if rnd == 0:
                return
            totals["up"] += row.get("bytes_up") or 0
            run = store.get_run(run_id)
            total = run.total_rounds if run is not None else cfg.rounds
            acc = row.get("test_accuracy")
            eps = " ".join(f"{label} {row[key]:.3f}" for key, label in (("epsilon", "ε"), ("epsilon_example",
                                                                                           "ε/example"))
                           if row.get(key) is not None)
            progress.update(bar, completed=rnd, total=total, acc=f"{acc:.3f}" if acc is not None else "-",
                            up=human_bytes(totals["up"]), eps=eps)
            if eps:  # a DP run prints its privacy spent every round
                progress.console.print(f"round {rnd}: test accuracy {acc:.4f}, {eps} (δ = "
                                       f"{row.get('delta', row.get('delta_example'))})")

        try:
            status = run_engine(cfg, store=store, run_id=run_id, listeners=[on_round], on_clients=on_clients,
                                resume=resume, checked=checked)
        except KeyboardInterrupt:  # recorded by the run's lifecycle once the run started
            if store.get_run(run_id).status not in ("failed", "stopped"):
                store.set_status(run_id, "stopped", error="interrupted from the keyboard")
            status = "stopped"
        except Exception as exc:  # recorded by the run's lifecycle once the run started; show one line
            if store.get_run(run_id).status not in ("failed", "stopped"):
                store.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}")
            console.print(f"[bold red]run failed:[/] {type(exc).__name__}: {exc}")
            status = "failed"
    result = store.export_result(run_id)
    result["summary"]["process_wall_s"] = time.perf_counter() - t0
    store.update_run(run_id, summary={"process_wall_s": result["summary"]["process_wall_s"]})
    console.print(summary_table(result))
    if out is not None:
        path = store.write_result(run_id, out)
        png = plot_run(result, Path(out) / "accuracy.png")
        console.print(f"wrote {path}" + (f" and {png}" if png else ""))
    return status


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
