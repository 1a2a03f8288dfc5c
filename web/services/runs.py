"""Starting and steering runs: the business logic behind the runs API and pages.

Every action is an event in the store with the actor's name; controls are rows the running
ServerApp polls after each round (pause blocks until resume, stop ends the run, add_rounds
raises its total, policy changes a device class from the next round). Whether an action is
valid is decided once, by :func:`fedswarm.web.services.run_state.allowed_actions`; a policy is checked
against the run's strategy and the catalog before it is queued.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.policy import DEFAULT_CLASS
from fedswarm.store import Run, Store
from fedswarm.store.liveness import owner_fields
from fedswarm.web.services.catalog import Catalog
from fedswarm.web.services.launcher import log_tail, spawn_run, spawn_resume, terminate
from fedswarm.web.services.queries import policies, stats_for
from fedswarm.web.services.run_state import allowed_actions, display_status
from fedswarm.web.settings import Settings
from fedswarm.web.services.validation import (ValidationFailed, check_params, check_policy, parse_edge_list,
                                              web_task_and_files)

__all__ = ["RunError", "RunService"]


class RunError(Exception):
    """A refused request, with the HTTP status and the message to show."""

    def __init__(self, status_code: int, detail: str):
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


class RunService:
    def __init__(self, store: Store, settings: Settings, catalog: Catalog):
        self.store = store
        self.settings = settings
        self.catalog = catalog
        self._resume_cmd: bool | None = None
        self._resume_lock = threading.Lock()

    def get(self, run_id: str) -> Run:
        run = self.store.get_run(run_id)
        if run is None:
            raise RunError(404, f"no run '{run_id}' in the store")
        return run

    # -- starting ----------------------------------------------------------------------
    def validate(self, raw: dict[str, Any], *, has_edges: bool = False,
                 profiles_path: Path | None = None) -> dict[str, Any]:
        """Check a config from the web against RunConfig and the catalog; the config to store.
        ``profiles_path`` is an uploaded profiles file already written into the run's folder."""
        cat = self.catalog.get(wait_s=5.0)
        try:
            web_task_and_files(raw, cat, has_edges, profiles_path is not None)
            topo = str(raw.get("topology", ""))
            if topo.startswith("edges") and not has_edges:
                raise ValidationFailed("invalid value for 'topology': an edge-list topology needs the edge list "
                                       "uploaded with the request (topology_edges)")
            if profiles_path is not None:
                raw = raw | {"profiles": str(profiles_path)}
            chosen = cat.strategy(str(raw.get("strategy") or RunConfig.model_fields["strategy"].default))
            if chosen is not None:  # the run options the strategy needs, where the form leaves them (registry)
                raw = (chosen.get("run_defaults") or {}) | raw
            try:
                cfg = RunConfig.build(raw)
            except ConfigError as exc:  # name the upload, not where the server keeps it
                raise ConfigError(str(exc).replace(str(profiles_path), "profiles_toml")) from None
            if cat.error is None:
                entry = cat.strategy(cfg.strategy)
                if cat.strategies and entry is None:
                    names = ", ".join(str(s.get("name")) for s in cat.strategies)
                    raise ValidationFailed(f"invalid value for 'strategy': unknown strategy '{cfg.strategy}' "
                                           f"(allowed: {names})")
                if entry is not None:
                    cfg.params = check_params(entry.get("hyperparams") or [], cfg.params, cfg.strategy)
                    for dc, pol in cfg.policies.items():
                        check_policy(cat, cfg.strategy, cfg.params, dc, pol)
        except (ConfigError, ValidationFailed) as exc:
            raise RunError(422, str(exc)) from None
        return cfg.model_dump(exclude_none=True)

    def start(self, raw: dict[str, Any], actor: str, *, topology_edges: str | None = None,
              profiles_toml: str | None = None) -> Run:
        """Validate, register and launch a run. Uploaded files are written into the run's own
        folder (the only server paths a web-started run reads)."""
        run_id = uuid.uuid4().hex[:12]
        run_dir = self.settings.runs_dir / run_id
        raw = dict(raw)
        try:
            if topology_edges is not None:
                clients = int(raw.get("clients", RunConfig.model_fields["clients"].default))
                edges = parse_edge_list(topology_edges, clients)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "topology.edges").write_text(edges)
                lazy = "+lazy" if str(raw.get("topology", "")).endswith("+lazy") else ""
                raw["topology"] = f"edges:{run_dir / 'topology.edges'}{lazy}"
            profiles = None
            if profiles_toml is not None:
                run_dir.mkdir(parents=True, exist_ok=True)
                profiles = run_dir / "profiles.toml"
                profiles.write_text(profiles_toml)
            config = self.validate(raw, has_edges=topology_edges is not None, profiles_path=profiles)
        except ValidationFailed as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise RunError(422, str(exc)) from None
        except RunError:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        self.store.create_run(config, run_id=run_id, status="pending")
        self.store.update_run(run_id, owner="dashboard")
        try:
            pid, log_path = spawn_run(self.settings.runner, self.store.url, run_id, config, self.settings.runs_dir)
        except OSError as exc:
            self.store.set_status(run_id, "failed", error=f"could not start the run's process: {exc}", actor=actor)
            raise RunError(503, f"could not start run '{run_id}': {exc}") from None
        self.store.update_run(run_id, **owner_fields(pid))
        self.store.add_event(run_id, "started", f"run started by {actor} (pid {pid})", actor=actor,
                             data={"pid": pid, "log": str(log_path)})
        return self.get(run_id)

    def log_path(self, run_id: str) -> Path:
        path = (self.settings.runs_dir / run_id / "run.log").resolve()
        if self.settings.runs_dir.resolve() not in path.parents:
            raise RunError(404, f"no run '{run_id}'")
        return path

    def error_hint(self, run: Run, why: str) -> str | None:
        """For a lost run whose process ended without saying why (``why``, its
        :func:`lost_reason`): the reason and the log's end. None for a run with no process here."""
        if not run.pid:
            return None
        tail = [ln for ln in log_tail(self.log_path(run.id), 4000).splitlines() if ln.strip()][-6:]
        return f"the run's process ended without reporting: {why}" + (
            ". Its log ends:\n" + "\n".join(tail) if tail else "; it printed nothing")

    # -- state and controls ------------------------------------------------------------
    def state(self, run_id: str) -> tuple[Run, str, dict[str, str | None]]:
        """The run, its shown status and each action's validity, read in one snapshot: a
        runner marks a control applied and writes the new status in two commits, and reading
        them apart could see neither (a second pause would look valid)."""
        with self.store.snapshot() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise RunError(404, f"no run '{run_id}' in the store")
            stats = stats_for(self.store, [run_id], s).get(run_id, {})
            s.expunge(run)
        shown = display_status(run, self.settings.report_timeout_s, stats.get("_health"))
        return run, shown, allowed_actions(run, shown, set(stats.get("pending", ())), self.can_restart(run))

    def control(self, run_id: str, kind: str, actor: str, payload: dict | None = None) -> tuple[int | None, str]:
        """Queue a control for a live run; returns (control id, what happened)."""
        run, shown, actions = self.state(run_id)
        if actions.get(kind) is not None:
            raise RunError(409, f"cannot {kind.replace('_', ' ')} run '{run_id}': {actions[kind]}")
        if shown == "lost" and kind == "stop":
            self.store.set_status(run_id, "stopped", error="no report or process when stop was requested", actor=actor)
            self.store.add_event(run_id, "control.stop", "stopped a lost run", actor=actor)
            return None, f"run '{run_id}' had no live process or reporter; marked stopped"
        if kind == "add_rounds" and run.total_rounds + int((payload or {}).get("rounds", 0)) > 1_000_000:
            raise RunError(422, "invalid value for 'rounds': a run has at most 1000000 rounds "
                                f"(it has {run.total_rounds})")
        cid = self.store.add_control(run_id, kind, payload or {}, actor=actor)
        return cid, f"{kind} requested for run '{run_id}'; it applies after the current round"

    def set_policy(self, run_id: str, device_class: str, policy: dict[str, Any], actor: str) -> tuple[int | None, str]:
        """Validate a policy against the run's strategy and the catalog, then queue it."""
        run = self.get(run_id)
        current = next((p.policy for p in policies(self.store, run_id) if p.device_class == device_class), {})
        current = current or (run.config or {}).get("policies", {}).get(device_class) or \
            (run.config or {}).get("policies", {}).get(DEFAULT_CLASS) or {}
        try:
            checked = check_policy(self.catalog.get(wait_s=5.0), run.strategy, (run.config or {}).get("params") or {},
                                   device_class, policy, current)
        except ValidationFailed as exc:
            raise RunError(422, str(exc)) from None
        return self.control(run_id, "policy", actor, {"device_class": device_class, "policy": checked})

    def force_stop(self, run_id: str, actor: str) -> str:
        """Stop now: SIGTERM the run's process group and mark it stopped."""
        run, _, actions = self.state(run_id)
        if actions["kill"] is not None:
            raise RunError(409, f"cannot force-stop run '{run_id}': {actions['kill']}")
        signalled = terminate(run.pid)
        self.store.set_status(run_id, "stopped", error=f"killed by {actor}" if signalled else None, actor=actor)
        self.store.add_event(run_id, "control.kill", "run process terminated" if signalled
                             else "no live process; marked stopped", actor=actor)
        return f"run '{run_id}' stopped" + (" (process terminated)" if signalled else "")

    # -- resuming from a checkpoint (`fedswarm resume RUN_ID`) -----------------------------
    def resume_command_available(self) -> bool:
        """Whether the runner has a ``resume`` command (asked once, in a subprocess)."""
        with self._resume_lock:
            if self._resume_cmd is None:
                try:
                    proc = subprocess.run([*self.settings.runner, "resume", "--help"], capture_output=True,
                                          timeout=60, stdin=subprocess.DEVNULL)
                    self._resume_cmd = proc.returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    self._resume_cmd = False
            return self._resume_cmd

    def can_restart(self, run: Run) -> bool:
        return (run.owner == "dashboard" and self.store.latest_checkpoint(run.id) is not None
                and bool(self._resume_cmd))

    def restart(self, run_id: str, actor: str) -> str:
        self.resume_command_available()
        run, _, actions = self.state(run_id)
        if actions["restart"] is not None:
            raise RunError(409, f"cannot resume run '{run_id}': {actions['restart']}")
        try:
            pid = spawn_resume(self.settings.runner, self.store.url, run_id, self.settings.runs_dir)
        except OSError as exc:
            raise RunError(503, f"could not resume run '{run_id}': {exc}") from None
        self.store.update_run(run_id, **owner_fields(pid))
        self.store.add_event(run_id, "resumed", f"run resumed from its checkpoint by {actor} (pid {pid})", actor=actor)
        return f"run '{run_id}' resumes from its last checkpoint (pid {pid})"
