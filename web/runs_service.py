"""Starting and steering runs: the business logic behind the runs API and pages.

Every action is an event in the store with the actor's name; controls are rows the running
ServerApp polls after each round (pause blocks until resume, stop ends the run, add_rounds
raises its total, policy changes a device class from the next round).
"""

from __future__ import annotations

from typing import Any

from fedswarm.config import ConfigError, RunConfig
from fedswarm.store import Run, Store
from fedswarm.web.catalog import Catalog
from fedswarm.web.launcher import spawn_run, terminate
from fedswarm.web.queries import LIVE_STATUSES, display_status
from fedswarm.web.settings import Settings

__all__ = ["RunError", "RunService"]


class RunError(Exception):
    """A refused request, with the HTTP status and the message to show."""

    def __init__(self, status_code: int, detail: str):
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


def _coerce(value: Any, default: Any, where: str) -> Any:
    """A form or JSON value as the type of the hyperparameter's default."""
    try:
        if isinstance(default, bool):
            if isinstance(value, str) and value.lower() in ("true", "false", "on", "1", "0"):
                return value.lower() in ("true", "on", "1")
            if isinstance(value, bool):
                return value
            raise ValueError
        if isinstance(default, int) and not isinstance(value, bool):
            f = float(value)
            if not f.is_integer():
                raise ValueError
            return int(f)
        if isinstance(default, float) and not isinstance(value, bool):
            return float(value)
        if isinstance(default, str) and isinstance(value, (int, float, str)):
            return str(value)
    except (TypeError, ValueError):
        raise RunError(422, f"invalid value for '{where}': expected {type(default).__name__} "
                            f"(got {value!r})") from None
    return value


class RunService:
    def __init__(self, store: Store, settings: Settings, catalog: Catalog):
        self.store = store
        self.settings = settings
        self.catalog = catalog

    def get(self, run_id: str) -> Run:
        run = self.store.get_run(run_id)
        if run is None:
            raise RunError(404, f"no run '{run_id}' in the store")
        return run

    # -- starting ----------------------------------------------------------------------
    def validate(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Check a config against RunConfig and the catalog; the config to store."""
        try:
            cfg = RunConfig.build(raw)
        except ConfigError as exc:
            raise RunError(422, str(exc)) from None
        cat = self.catalog.get(wait_s=5.0)
        if cat.error is None:
            tasks = [t.get("name") for t in cat.tasks]
            if tasks and cfg.task not in tasks and ":" not in cfg.task:
                raise RunError(422, f"invalid value for 'task': unknown task '{cfg.task}' "
                                    f"(allowed: {', '.join(map(str, tasks))} or 'module:function')")
            entry = cat.strategy(cfg.strategy)
            if cat.strategies and entry is None:
                names = ", ".join(str(s.get("name")) for s in cat.strategies)
                raise RunError(422, f"invalid value for 'strategy': unknown strategy '{cfg.strategy}' "
                                    f"(allowed: {names})")
            if entry is not None:
                hp = {h["name"]: h.get("default") for h in entry.get("hyperparams") or []}
                params = {}
                for k, v in cfg.params.items():
                    if k not in hp:
                        raise RunError(422, f"unknown hyperparameter '{cfg.strategy}.{k}' "
                                            f"(allowed: {', '.join(hp) or 'none'})")
                    params[k] = _coerce(v, hp[k], f"{cfg.strategy}.{k}")
                cfg.params = params
        return cfg.model_dump(exclude_none=True)

    def start(self, raw: dict[str, Any], actor: str) -> Run:
        config = self.validate(raw)
        run_id = self.store.create_run(config, status="pending")
        try:
            pid, log_path = spawn_run(self.settings.runner, self.store.url, run_id, config,
                                      self.settings.runs_dir)
        except OSError as exc:
            self.store.set_status(run_id, "failed", error=f"could not start the run's process: {exc}")
            raise RunError(503, f"could not start run '{run_id}': {exc}") from None
        self.store.update_run(run_id, pid=pid)
        self.store.add_event(run_id, "started", f"run started by {actor} (pid {pid})", actor=actor,
                             data={"pid": pid, "log": str(log_path)})
        return self.get(run_id)

    def log_path(self, run_id: str):
        return self.settings.runs_dir / run_id / "run.log"

    # -- controls ----------------------------------------------------------------------
    def control(self, run_id: str, kind: str, actor: str, payload: dict | None = None) -> tuple[int | None, str]:
        """Queue a control for a live run; returns (control id, what happened)."""
        run = self.get(run_id)
        shown = display_status(run)
        if shown == "lost":
            if kind == "stop":
                self.store.set_status(run_id, "stopped", error="process was gone when stop was requested")
                self.store.add_event(run_id, "control.stop", "stopped a lost run", actor=actor)
                return None, f"run '{run_id}' had no live process; marked stopped"
            raise RunError(409, f"run '{run_id}' is lost (its process {run.pid} is gone); only stop is possible")
        if run.status not in LIVE_STATUSES:
            raise RunError(409, f"run '{run_id}' is {run.status}; {kind} needs a pending, running or paused run")
        if kind == "pause" and run.status == "paused":
            raise RunError(409, f"run '{run_id}' is already paused")
        if kind == "resume" and run.status != "paused" and not self._pending(run_id, "pause"):
            raise RunError(409, f"run '{run_id}' is {run.status}, not paused")
        cid = self.store.add_control(run_id, kind, payload or {}, actor=actor)
        return cid, f"{kind} requested for run '{run_id}'; it applies after the current round"

    def _pending(self, run_id: str, kind: str) -> bool:
        return any(c.kind == kind for c in self.store.pending_controls(run_id))

    def force_stop(self, run_id: str, actor: str) -> str:
        """Stop now: SIGTERM the run's process group and mark it stopped."""
        run = self.get(run_id)
        if run.status not in LIVE_STATUSES:
            raise RunError(409, f"run '{run_id}' is {run.status}; nothing to stop")
        signalled = terminate(run.pid)
        self.store.set_status(run_id, "stopped", error=f"killed by {actor}" if signalled else None)
        self.store.add_event(run_id, "control.kill", "run process terminated" if signalled
                             else "no live process; marked stopped", actor=actor)
        return f"run '{run_id}' stopped" + (" (process terminated)" if signalled else "")
