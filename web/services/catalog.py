"""The catalog behind the new-run form: strategies, codecs, tasks and the run-config schema.

It comes from ``fedswarm strategies --json`` run once in a subprocess (the web app must not
import torch or flwr) and is cached. If that fails, the generic fields still come from
:class:`fedswarm.config.RunConfig`'s own schema, and the page says what went wrong.
"""

from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

from fedswarm.config import RunConfig

__all__ = ["Catalog", "CatalogData", "FieldSpec", "config_fields"]


@dataclass
class CatalogData:
    """The catalog as ``fedswarm strategies --json`` prints it. Each strategy carries what its
    registry entry says it can do (``engines``, ``batched``, ``dp``, ``byzantine``, ``secagg``,
    ``policy_keys``, ``run_defaults``): the form offers and checks only those."""

    strategies: list[dict] = field(default_factory=list)
    codecs: list[dict] = field(default_factory=list)
    tasks: list[dict] = field(default_factory=list)
    config_schema: dict = field(default_factory=dict)
    error: str | None = None  # why the full catalog is missing (None when it is complete)

    def strategy(self, name: str) -> dict | None:
        return next((s for s in self.strategies if s.get("name") == name), None)

    def as_json(self) -> dict:
        return {"strategies": self.strategies, "codecs": self.codecs, "tasks": self.tasks,
                "config": self.config_schema, "error": self.error}


class Catalog:
    """Runs the catalog command once (in a background thread at startup) and caches it."""

    def __init__(self, cmd: list[str], timeout_s: float = 180.0):
        self.cmd = cmd
        self.timeout_s = timeout_s
        self._data: CatalogData | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._load, name="fedswarm-catalog", daemon=True).start()

    def get(self, wait_s: float = 30.0) -> CatalogData:
        self.start()
        if not self._done.wait(wait_s):
            return _fallback("the strategy catalog is still loading; reload the page in a few seconds")
        assert self._data is not None
        return self._data

    def _load(self) -> None:
        try:
            proc = subprocess.run(self.cmd, capture_output=True, text=True, timeout=self.timeout_s,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"`{' '.join(self.cmd[-3:])}` exited {proc.returncode}: {last[0]}")
            raw = json.loads(proc.stdout)
            data = CatalogData(
                strategies=list(raw.get("strategies") or []),
                codecs=list(raw.get("codecs") or []),
                tasks=list(raw.get("tasks") or []),
                config_schema=dict(raw.get("config") or RunConfig.model_json_schema()),
            )
        except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
            data = _fallback(f"could not read the strategy catalog ({exc}); "
                             "only the generic run fields are offered")
        self._data = data
        self._done.set()


def _fallback(reason: str) -> CatalogData:
    return CatalogData(config_schema=RunConfig.model_json_schema(), error=reason)


@dataclass
class FieldSpec:
    """One generic run-config input of the new-run form."""

    name: str
    kind: str  # int | float | bool | choice | text | json
    help: str = ""
    default: Any = None
    nullable: bool = False
    choices: list[Any] = field(default_factory=list)
    min: float | None = None
    max: float | None = None

    @property
    def input_value(self) -> str:
        if self.default is None:
            return ""
        if self.kind == "json":
            return json.dumps(self.default)
        if self.kind == "bool":
            return "true" if self.default else "false"
        return str(self.default)


# Fields the form lays out itself (task and strategy selects, hyperparameters per strategy).
SPECIAL_FIELDS = ("task", "strategy", "params", "profiles")  # profiles: uploaded, never a server path


def config_fields(schema: dict) -> list[FieldSpec]:
    """Form fields for every run-config key in a pydantic JSON schema."""
    out = []
    for name, prop in (schema.get("properties") or {}).items():
        if name in SPECIAL_FIELDS:
            continue
        variants = prop.get("anyOf") or [prop]
        nullable = any(v.get("type") == "null" for v in variants)
        main = next((v for v in variants if v.get("type") != "null"), {})
        spec = FieldSpec(name=name, kind="text", help=prop.get("description", ""),
                         default=prop.get("default"), nullable=nullable)
        if "enum" in main or "const" in main:
            spec.kind, spec.choices = "choice", list(main.get("enum") or [main["const"]])
        elif main.get("type") in ("integer", "number"):
            spec.kind = "int" if main["type"] == "integer" else "float"
            spec.min = main.get("minimum", main.get("exclusiveMinimum"))
            spec.max = main.get("maximum", main.get("exclusiveMaximum"))
        elif main.get("type") == "boolean":
            spec.kind = "bool"
        elif main.get("type") in ("object", "array") or "$ref" in main:
            spec.kind = "json"
        out.append(spec)
    return out
