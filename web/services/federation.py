"""A connected Flower federation, driven through the ``flwr`` CLI (the SuperLink's Control
API) in subprocesses: list SuperNodes and runs, start fedswarm's Flower App, stop a run,
read its log. ``superlink`` names a SuperLink connection in the flwr CLI's config; with
none configured every call says so instead of guessing an address.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import fedswarm
from fedswarm.web.settings import Settings

__all__ = ["Federation", "FederationError"]

_RUN_CONFIG_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class FederationError(Exception):
    pass


def default_app_dir() -> Path | None:
    root = Path(fedswarm.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


class Federation:
    def __init__(self, settings: Settings, timeout_s: float = 30.0):
        self.superlink = settings.superlink
        self.flwr = settings.flwr_cmd
        self.app_dir = settings.flwr_app_dir or default_app_dir()
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._supernodes: tuple[float, list[dict[str, Any]]] | None = None  # (when, answer)

    @property
    def configured(self) -> bool:
        return bool(self.superlink)

    def _call(self, *args: str, timeout_s: float | None = None) -> str:
        if not self.configured:
            raise FederationError("no SuperLink is configured (start the dashboard with --superlink NAME "
                                  "or FEDSWARM_SUPERLINK=NAME, a connection of `flwr config list`)")
        cmd = [*self.flwr, *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=timeout_s or self.timeout_s)
        except FileNotFoundError:
            raise FederationError(f"`{self.flwr[0]}` is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            limit = timeout_s or self.timeout_s
            raise FederationError(f"`{shlex.join(cmd)}` did not answer in {limit:.0f} s") from None
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
            raise FederationError(f"`{shlex.join(cmd)}` exited {proc.returncode}: {' '.join(tail)}")
        return proc.stdout

    @staticmethod
    def _json(text: str, key: str) -> list[dict[str, Any]]:
        try:
            data = json.loads(text)
        except ValueError:
            raise FederationError(f"flwr printed no JSON: {text.strip()[:200]}") from None
        if isinstance(data, dict):
            if data.get("success") is False:
                raise FederationError(str(data.get("error-message") or data.get("error") or data))
            data = data.get(key, [])
        return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []

    def supernodes(self, max_age_s: float = 0.0) -> list[dict[str, Any]]:
        """The SuperLink's SuperNodes. ``max_age_s``: an answer at most that old may be reused (the
        fleet's pages ask on every view, and each ask is a ``flwr`` subprocess); errors never are."""
        with self._lock:
            if self._supernodes is not None and time.monotonic() - self._supernodes[0] <= max_age_s:
                return self._supernodes[1]
        nodes = self._json(self._call("supernode", "list", self.superlink or "", "--format", "json"), "nodes")
        with self._lock:
            self._supernodes = (time.monotonic(), nodes)
        return nodes

    def runs(self) -> list[dict[str, Any]]:
        return self._json(self._call("ls", self.superlink or "", "--format", "json"), "runs")

    def start(self, run_config: dict[str, Any]) -> str:
        """``flwr run APP SUPERLINK`` with fedswarm's Flower App; returns flwr's answer."""
        if self.app_dir is None:
            raise FederationError("fedswarm's Flower App directory (its pyproject.toml) was not found")
        args = ["run", str(self.app_dir), self.superlink or "", "--format", "json"]
        pairs = []
        for k, v in run_config.items():
            if not _RUN_CONFIG_KEY.match(k):
                raise FederationError(f"invalid run-config key {k!r}")
            pairs.append(f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}")
        if pairs:
            args += ["--run-config", " ".join(pairs)]
        return self._call(*args, timeout_s=120)

    def stop(self, run_id: int) -> str:
        return self._call("stop", str(int(run_id)), self.superlink or "")

    def log(self, run_id: int) -> str:
        return self._call("log", str(int(run_id)), self.superlink or "", "--show", timeout_s=20)
