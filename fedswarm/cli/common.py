"""What every ``fedswarm`` command module shares: the consoles, one-line failures, the
``--db`` help text and where Flower's and Ray's logs go (:func:`route_logs`)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

import click
import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["console", "err_console", "DB_HELP", "VERBOSE_HELP", "fail", "log_file_for", "route_logs", "say_log_file"]

# Pipes and CI logs get wide tables instead of 80-column wrapping.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)

DB_HELP = "Run store: an SQLite path or a database URL (default: $FEDSWARM_DB, else ./fedswarm.db)."


def fail(message: str, code: int = 2) -> None:
    """Print one clear line and exit (2 for bad input)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


VERBOSE_HELP = ("Show Flower's and Ray's logs on the console too (they always go to OUT/flower.log, without --out "
                "to a file under $XDG_STATE_HOME/fedswarm/logs, named at the end).")

# Loggers of the libraries under fedswarm: their INFO log is for the log file, not the console.
LIBRARY_LOGGERS = ("flwr", "ray")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SILENT = logging.CRITICAL + 1


def log_file_for(out: Path | None) -> Path:
    """The run's log file: ``OUT/flower.log``, else a new file under ``$XDG_STATE_HOME/fedswarm/logs``
    (default ``~/.local/state/fedswarm/logs``)."""
    if out is not None:
        return Path(out) / "flower.log"
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "fedswarm" / "logs"
    return base / f"flower-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def say_log_file(log_file: Path, verbose: bool) -> None:
    """The summary's last line: where Flower's log went (nothing when nothing was logged)."""
    if log_file.exists():
        console.print(f"Flower's log: {log_file}" + ("" if verbose else " (--verbose shows it here)"), highlight=False)


class _LogFile(logging.FileHandler):
    """The run's log file, in one format: ``ray.init`` sets its own formatter on every handler
    of the ``ray`` logger, this one included."""

    formatter_ = logging.Formatter(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return self.formatter_.format(record)


class _FedswarmWarnings(logging.Handler):
    """fedswarm's own warnings (a node failed, a round timed out, a run stopped) on the
    console in its words, above any progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        err_console.print(f"[yellow]warning:[/] {escape(record.getMessage())}", highlight=False, soft_wrap=True)


def route_logs(verbose: bool, log_file: Path, *, ray: bool = False) -> Callable[[], None]:
    """Send Flower's and Ray's log to ``log_file``, and to the console only when ``verbose``;
    fedswarm's warnings go to the console either way. Returns the undo, also run when the
    command's click context closes.

    Both libraries set their loggers up when first imported (level, console handler), so they
    are imported here first: Flower always; Ray only when ``ray`` (importing it takes seconds)."""
    import flwr.common.logger  # noqa: F401  (Flower's console handler exists from here on)

    if ray and importlib.util.find_spec("ray") is not None:  # without it the engine's own check says what to install
        import ray as _ray  # noqa: F401  (Ray's console handler exists from here on)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file_handler = _LogFile(log_file, encoding="utf-8", delay=True)
    file_handler.setLevel(logging.INFO)
    warnings = _FedswarmWarnings(logging.WARNING)
    undo: list[Callable[[], None]] = []
    for name in (*LIBRARY_LOGGERS, "fedswarm"):
        logger = logging.getLogger(name)
        if name != "fedswarm" and not verbose:
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    undo.append(lambda h=handler, level=handler.level: h.setLevel(level))
                    handler.setLevel(SILENT)
        undo.append(lambda lg=logger, level=logger.level: lg.setLevel(level))
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.addHandler(file_handler)
        undo.append(lambda lg=logger: lg.removeHandler(file_handler))
    fedswarm_logger = logging.getLogger("fedswarm")
    fedswarm_logger.addHandler(warnings)
    undo.append(lambda: fedswarm_logger.removeHandler(warnings))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")

    def restore() -> None:
        while undo:
            undo.pop()()
        file_handler.close()

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(restore)
    return restore
