"""Starting runs as detached processes, and telling whether their process still lives.

A run started from the dashboard is ``RUNNER sim --db URL --run-id ID --config TOML --verbose``
in its own session (``start_new_session=True``), so it survives a dashboard restart; its
stdout and stderr, Flower's log included, go to ``RUNS_DIR/ID/run.log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import tomli_w

from fedswarm.procs import pid_alive

__all__ = ["to_toml", "spawn_run", "spawn_resume", "pid_alive", "terminate", "log_tail"]


def _without_none(value: Any) -> Any:
    """TOML has no null: an unset key is left out, in tables too."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def to_toml(config: dict[str, Any]) -> str:
    """A run config as TOML (tomli-w): RunConfig keys at top level, dicts (``params``, ...) as tables."""
    return tomli_w.dumps(_without_none(config))


def spawn_run(runner: list[str], db_url: str, run_id: str, config: dict[str, Any],
              runs_dir: Path) -> tuple[int, Path]:
    """Write the run's TOML, start the runner detached; return (pid, log path)."""
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    toml_path = run_dir / "config.toml"
    toml_path.write_text(to_toml(config))
    log_path = run_dir / "run.log"
    # --verbose: run.log is the run's log file, Flower's log included (the dashboard shows its tail)
    cmd = [*runner, "sim", "--db", db_url, "--run-id", run_id, "--config", str(toml_path), "--verbose"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(run_dir), close_fds=True)
    return proc.pid, log_path


def spawn_resume(runner: list[str], db_url: str, run_id: str, runs_dir: Path) -> int:
    """``RUNNER resume RUN_ID --db URL`` detached, appending to the run's log; its pid."""
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "run.log", "ab") as log:
        proc = subprocess.Popen([*runner, "resume", run_id, "--db", db_url, "--verbose"], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=str(run_dir), close_fds=True)
    return proc.pid


def terminate(pid: int | None) -> bool:
    """SIGTERM the run's process group (it has its own session). True if signalled."""
    if not pid_alive(pid):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)  # type: ignore[arg-type]
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGTERM)  # type: ignore[arg-type]
        except OSError:
            return False
    return True


def log_tail(path: Path, max_bytes: int = 8000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
