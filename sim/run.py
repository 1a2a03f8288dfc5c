"""Running one simulation from the command line: store row, engine, progress bar,
summary table, ``result.json`` and a plot."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.sim.report import plot_run, summary_table

__all__ = ["run_engine", "run_simulation_cli"]

# Models below this many parameters train faster on one intra-op thread.
SMALL_MODEL = 1_000_000


def run_engine(cfg: RunConfig, *, store: Store, run_id: str, listeners: list | None = None,
               on_clients=None, resume: Any = None) -> str:
    """Run ``cfg`` on its engine, recording into ``run_id``; return the final status.

    ``on_clients(done, total)`` hears the batched engine's progress within a round.

    Asynchronous algorithms (registry kind ``async``) run on the virtual-clock engine
    whatever ``cfg.engine`` says: Flower's synchronous rounds cannot express them (with
    ``--set schedule=fixed`` they replay a seeded schedule on the engine asked for); those of
    kind ``array`` (LSGD: it needs every worker's loss) run on the array engine, LSGD's
    asynchronous mode also on the virtual clock (``--engine clock``).
    ``resume``: a checkpoint of this run to continue from (fedswarm.server.resume)."""
    from fedswarm.strategies import registry

    kind = registry.get(cfg.strategy).kind
    if cfg.engine == "clock" and cfg.strategy == "lsgd":  # LSGD's asynchronous mode on the virtual clock
        if resume is not None:
            raise RuntimeError("the virtual-clock engine cannot resume a run yet")
        from fedswarm.sim.async_leaders import run_lsgd_async

        if cfg.device == "cpu":
            torch.set_num_threads(1)
        return run_lsgd_async(cfg, store, run_id, listeners)
    if cfg.engine == "array" or kind == "array":
        if resume is not None:
            raise RuntimeError(f"'{cfg.strategy}' on the array engine cannot resume a run yet")
        from fedswarm.sim.array_engine import run_array

        if cfg.device == "cpu":
            torch.set_num_threads(1)
        return run_array(cfg, store, run_id, listeners)
    if kind == "async" and cfg.params.get("schedule", "clock") == "clock":  # schedule=fixed: a Flower engine
        if resume is not None:
            raise RuntimeError(f"'{cfg.strategy}' runs on the virtual-clock engine, which cannot resume a run yet")
        from fedswarm.sim.async_engine import run_async

        if cfg.device == "cpu":
            torch.set_num_threads(1)
        return run_async(cfg, store, run_id, listeners)
    if cfg.engine == "clock":
        raise ValueError(f"the virtual-clock engine runs adpsgd, prague and lsgd (mode=async), not '{cfg.strategy}'")
    if cfg.engine == "flower":
        from fedswarm.sim.flower_engine import run_flower

        return run_flower(cfg, store=store, run_id=run_id, listeners=listeners, resume=resume)
    if cfg.engine == "batched":
        if resume is not None:
            raise RuntimeError("the batched engine cannot resume a run yet: resume it with --engine inprocess")
        from fedswarm.sim.batched import run_batched

        if cfg.device == "cpu":
            torch.set_num_threads(min(2, torch.get_num_threads()))  # batched math does use a second core
        return run_batched(cfg, store=store, run_id=run_id, listeners=listeners, on_clients=on_clients)
    from fedswarm.sim.inprocess import run_inprocess

    if cfg.device == "cpu":
        torch.set_num_threads(1)  # tiny models: thread fan-out costs more than it gains
    return run_inprocess(cfg, store=store, run_id=run_id, listeners=listeners, resume=resume)


def run_simulation_cli(cfg: RunConfig, *, db: str | None, run_id: str | None, out: Path | None,
                       console: Console, resume: Any = None) -> str:
    """``resume``: a checkpoint of run ``run_id`` to continue from (``fedswarm resume``)."""
    from fedswarm.strategies import registry

    if registry.get(cfg.strategy).kind == "array" and cfg.engine not in ("array", "clock"):
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
    import os

    store.update_run(run_id, pid=os.getpid())
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
    with progress:
        bar = progress.add_task("rounds", total=cfg.rounds, completed=getattr(resume, "round", 0), acc="-",
                                up="0 B", eps="")
        on_clients = None
        if cfg.engine == "batched":  # within a round: clients trained and clients per second
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
                                resume=resume)
        except KeyboardInterrupt:
            store.set_status(run_id, "stopped", error="interrupted from the keyboard")
            status = "stopped"
        except Exception as exc:  # recorded in the store by the server; show one line
            run = store.get_run(run_id)
            if run is not None and run.status not in ("failed", "stopped"):
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
