"""What every ``fedswarm`` command module shares: the consoles, one-line failures, the
``--db`` help text and the switch that quiets Flower's and Ray's logs."""

from __future__ import annotations

import logging
import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["console", "err_console", "DB_HELP", "fail", "quiet_flower"]

# Pipes and CI logs get wide tables instead of 80-column wrapping.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)

DB_HELP = "Run store: an SQLite path or a database URL (default: $FEDSWARM_DB, else ./fedswarm.db)."


def fail(message: str, code: int = 2) -> None:
    """Print one clear line and exit (2 for bad input)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def quiet_flower(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.ERROR
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(level)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
