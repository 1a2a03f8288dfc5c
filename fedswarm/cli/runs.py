"""``fedswarm runs`` (and ``runs export``) and ``fedswarm strategies``: what the store holds,
and every registered strategy, codec and task."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from fedswarm.cli.common import DB_HELP, console, fail

__all__ = ["runs_app", "runs", "runs_export", "strategies"]

runs_app = typer.Typer(no_args_is_help=False, rich_markup_mode="rich")


@runs_app.callback(invoke_without_command=True)
def runs(
    ctx: typer.Context,
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    limit: int = typer.Option(50, "--limit", min=1, help="How many runs, newest first."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the runs in the store: status, strategy, progress, accuracy, bytes.

    A run the store calls live whose process is gone (killed, crashed) shows as lost; so does one
    whose process runs on another host sharing the store once its heartbeat (every 30 s) is over
    2 minutes old. `fedswarm resume RUN_ID` continues it from its last checkpoint.

    `fedswarm runs export RUN_ID` writes one run's rounds (or per-node rounds) as CSV or JSON Lines."""
    if ctx.invoked_subcommand is not None:
        return
    from fedswarm.sim.report import runs_table
    from fedswarm.store import Store

    store = Store(db)
    runs = store.list_runs(limit)
    rows = [store.export_result(r.id) for r in runs]
    if as_json:
        from fedswarm.store.liveness import lost_reason

        why = [lost_reason(r) for r in runs]  # read once: status and reason agree
        print(json.dumps([{"run_id": r["run_id"], "status": "lost" if w else run.status, "lost_reason": w,
                           "config": r["config"], "summary": r["summary"]} for r, run, w in zip(rows, runs, why)],
                         indent=2, default=str))
        return
    if not rows:
        console.print(f"No runs in {store.url}. Start one with [bold]fedswarm sim[/].")
        return
    console.print(runs_table(store, rows))


@runs_app.command("export")
def runs_export(
    run_id: str = typer.Argument(..., help="The run to export (see `fedswarm runs`)."),
    fmt: str = typer.Option("csv", "--format", "-f", help="csv or jsonl (JSON Lines)."),
    nodes: bool = typer.Option(False, "--nodes", help="Per-node rounds (one row per node and round) instead of "
                                                      "rounds."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write to this file (default: standard output)."),
) -> None:
    """Write one run's rounds as CSV or JSON Lines, the same bytes as the dashboard's download
    (GET /api/runs/RUN_ID/rounds.csv). JSON columns such as metrics become metrics.<key>
    columns in CSV; see the dashboard's /docs for every column."""
    from fedswarm.export import export
    from fedswarm.store import Store

    try:
        chunks = export(Store(db), run_id, "nodes" if nodes else "rounds", fmt)
    except (KeyError, ValueError) as exc:
        fail(str(exc.args[0]))
    if out is None:
        for chunk in chunks:
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    with open(out, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
    console.print(f"wrote {out}", highlight=False)


def strategies(
    as_json: bool = typer.Option(False, "--json", help=(
        "Print the catalog as JSON (the dashboard's form is built from it)."
    )),
    markdown: bool = typer.Option(False, "--markdown", help=(
        "Print the table of every strategy and what it can do (engines, --dp, --byzantine, policy keys) as Markdown: "
        "the README's table."
    )),
) -> None:
    """Every registered strategy, codec and task: hyperparameters, defaults, what each can do.

    What a strategy can do (the engines that run it, --dp, --byzantine, the device-class policy
    keys) comes from its registry entry."""
    from fedswarm.sim.report import catalog, catalog_tables, strategy_table

    if markdown:
        print(strategy_table(), end="")
        return
    cat = catalog()
    if as_json:
        print(json.dumps(cat, indent=2, default=str))
        return
    for table in catalog_tables(cat):
        console.print(table)
