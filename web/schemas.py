"""Pydantic models for every request and response of the JSON API."""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedswarm.store import RUN_STATUSES
from fedswarm.policy import DevicePolicy  # one policy schema for run config, server and dashboard

ID_PATTERN = r"^[A-Za-z0-9_.:@-]{1,64}$"
# Starts with a letter or digit, so "." and ".." (paths up the runs folder) are never run ids.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,35}$"
DISPLAY_STATUSES = (*RUN_STATUSES, "lost", "degraded")
MAX_JSON_BYTES = 64_000
MAX_JSON_DEPTH = 32


def clean(v: Any) -> Any:
    """Non-finite floats become None (JSON has no NaN), recursively."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


def json_depth_ok(v: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``v`` nests lists and dicts at most ``limit`` deep (checked without recursion:
    the encoders and :func:`clean` recurse once a level, and a body nested a thousand deep
    would overflow their stack)."""
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list, tuple)):
            if depth >= limit:
                return False
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _small_json(v: dict, limit: int = MAX_JSON_BYTES) -> dict:
    if not json_depth_ok(v):
        raise ValueError(f"must nest lists and objects at most {MAX_JSON_DEPTH} deep")
    try:  # UTF-8, as the store writes it
        size = len(json.dumps(v, default=str, ensure_ascii=False).encode())
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (JSON's \\ud800 alone, a lone surrogate, is not)") from None
    if size > limit:
        raise ValueError(f"must serialize to at most {limit} bytes of JSON")
    return v


class Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Message(Out):
    detail: str


class Health(Out):
    status: Literal["ok"] = "ok"
    version: str
    store: str = Field(description="sqlite or postgresql")


class Whoami(Out):
    name: str
    role: str
    csrf_token: str | None = Field(None, description="send as X-CSRF-Token with cookie-authenticated writes")


# -- runs ------------------------------------------------------------------------------
class RunOut(Out):
    id: str
    name: str | None
    status: str
    display_status: str = Field(description="status as shown: 'lost' when the run's process is gone or a reporter "
                                            "went silent; 'degraded'/'failed' when most nodes failed most rounds")
    strategy: str
    task: str
    engine: str
    total_rounds: int
    rounds_done: int = 0
    last_round: int | None = None
    test_accuracy: float | None = None
    best_test_accuracy: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    error: str | None = None
    pid: int | None = None
    lost_reason: str | None = Field(None, description="why the run shows as lost")
    remote: bool = Field(False, description="registered through ingest (no local process)")
    last_report_at: dt.datetime | None = None
    lost_after_s: float | None = Field(None, description="a remote run silent this long shows as lost")
    node_rounds: int = 0
    failed_node_rounds: int = Field(0, description="per-node rows that failed or were rejected")
    bad_rounds: int = Field(0, description="rounds where most nodes failed")
    rounds_with_nodes: int = 0
    pending: list[str] = Field(default_factory=list, description="controls requested and not yet applied")
    actions: dict[str, str | None] = Field(default_factory=dict,
                                           description="each action: null when valid now, else why not")


class DeviceClassOut(Out):
    device_class: str
    nodes: int = 0
    node_rounds: int = 0
    failed: int = 0
    rejected: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class RoundOut(Out):
    round: int
    train_loss: float | None = None
    test_loss: float | None = None
    test_accuracy: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    wall_s: float | None = None
    sim_time_s: float | None = None
    num_clients: int = 0
    metrics: dict[str, Any] = Field(default_factory=dict)
    created_at: dt.datetime | None = None
    node_rows: int | None = None
    failed_node_rows: int | None = None
    reported_by: str | None = None
    fed_loss: float | None = None  # federated evaluation (the nodes' own validation data)
    fed_accuracy: float | None = None
    fed_examples: int | None = None

    @field_validator("train_loss", "test_loss", "test_accuracy", "wall_s", "sim_time_s", "metrics", "fed_loss",
                     "fed_accuracy",
                     mode="before")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        return clean(v)


class NodeStatsOut(Out):
    node_id: str
    device_class: str | None = None
    rounds: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: int = 0
    failed: int = 0
    last_round: int | None = None
    last_seen: dt.datetime | None = None
    last_reason: str | None = None
    fed_accuracy: float | None = None  # its latest federated evaluation
    telemetry: dict[str, Any] | None = None  # its latest device telemetry (fedswarm.telemetry)
    device: str | None = None  # that telemetry in a few words, as the run page shows it


class ControlOut(Out):
    id: int
    kind: str
    payload: dict[str, Any]
    created_at: dt.datetime | None = None
    applied_at: dt.datetime | None = None
    actor: str | None = None


class EventOut(Out):
    id: int
    run_id: str | None
    ts: dt.datetime
    kind: str
    message: str
    actor: str | None = None


class RejectionOut(Out):
    """A reply the run's strategy refused, with the reason it gave."""

    round: int
    node_id: str
    reason: str


class RunDetailOut(RunOut):
    config: dict[str, Any]
    seed: int
    code_version: str
    summary: dict[str, Any]
    nodes: list[NodeStatsOut]
    device_classes: list[DeviceClassOut] = Field(default_factory=list)
    controls: list[ControlOut]
    policies: dict[str, dict[str, Any]]
    events: list[EventOut]
    rejections: list[RejectionOut] = Field(
        default_factory=list, description="replies the strategy rejected, newest round first (100 at most)")

    @field_validator("summary", "config", mode="before")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        return clean(v or {})


class StartRunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: dict[str, Any] = Field(description="RunConfig keys (see `fedswarm strategies --json`); "
                                   "strategy hyperparameters under 'params'. 'task' must be a registered "
                                   "task name; 'topology' a named topology (an edge list comes as "
                                   "topology_edges); 'profiles' comes as profiles_toml.")
    topology_edges: str | None = Field(None, max_length=1_000_000,
                                       description="an edge list, one 'i j' pair a line: the run's topology")
    profiles_toml: str | None = Field(None, max_length=200_000,
                                      description="device/link profiles (TOML) merged over the built-in ones")


class AddRoundsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rounds: int = Field(ge=1, le=100_000, description="rounds to add to the run's total")


class ActionOut(Out):
    run_id: str
    action: str
    control_id: int | None = None
    detail: str


# -- policies --------------------------------------------------------------------------
class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(pattern=RUN_ID_PATTERN)
    device_class: str = Field(pattern=ID_PATTERN)
    policy: DevicePolicy


class PolicyOut(Out):
    run_id: str
    device_class: str
    policy: dict[str, Any]
    pending: bool = Field(description="requested but not yet applied by the run")


# -- nodes -----------------------------------------------------------------------------
class SuperNodesOut(Out):
    configured: bool
    superlink: str | None = None
    nodes: list[dict[str, Any]] = Field(default_factory=list)
    error: str | None = None


# -- tokens and users ------------------------------------------------------------------
class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    role: Literal["reporter", "viewer", "admin"] = "reporter"
    run_id: str | None = Field(None, pattern=RUN_ID_PATTERN, description="bind a reporter token to one run")
    expires_in_days: float | None = Field(None, gt=0, le=3650, description="lifetime (default: the dashboard's)")


class TokenOut(Out):
    id: int
    name: str
    role: str
    run_id: str | None = None
    created_by: str | None = None
    created_at: dt.datetime | None = None
    last_used_at: dt.datetime | None = None
    expires_at: dt.datetime | None = None
    revoked: bool = False


class TokenCreated(TokenOut):
    token: str = Field(description="shown once; only its hash is stored")


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    username: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")
    password: str = Field(min_length=8, max_length=1024)
    role: Literal["admin", "viewer"] = "viewer"


class UserOut(Out):
    id: int
    username: str
    role: str
    created_at: dt.datetime | None = None
