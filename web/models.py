"""Pydantic models for every request and response of the JSON API: runs, rounds, controls, users and
tokens, policies; and the fleet's (the nodes list, ``GET /api/nodes``; one node's page,
``GET /api/nodes/{node_id}``; the telemetry a node reports: the recorder's per-node
``row["telemetry"]``, an ingest report's ``telemetry``, stored as ``Node.telemetry``, the last
values, and ``NodeRound.telemetry``, per round)."""

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


# -- the fleet -----------------------------------------------------------------------------------

FLEET_STATES = ("training", "online", "failed", "offline")


class Telemetry(Out):
    """What a node measured (absent: not measured). Numbers are of its last round."""

    train_s: float | None = Field(None, description="seconds of local training")
    examples_per_s: float | None = None
    peak_rss_mb: float | None = Field(None, description="peak resident memory of the node's process")
    cpu_count: int | None = None
    cpu_model: str | None = None
    accelerator: str | None = Field(None, description="cuda, mps, ... or none")
    accelerator_mem_mb: float | None = None
    battery_pct: float | None = None
    power_source: str | None = Field(None, description="battery, ac, ...")
    cpu_temp_c: float | None = None


TELEMETRY_KEYS = tuple(Telemetry.model_fields)
_Num = dict(allow_inf_nan=False)


class TelemetryIn(BaseModel):
    """A report's telemetry: known keys only, finite numbers in range, short strings."""

    model_config = ConfigDict(extra="forbid")
    train_s: float | None = Field(None, ge=0, le=1e7, **_Num)
    examples_per_s: float | None = Field(None, ge=0, le=1e10, **_Num)
    peak_rss_mb: float | None = Field(None, ge=0, le=1e8, **_Num)
    cpu_count: int | None = Field(None, ge=1, le=1_000_000)
    cpu_model: str | None = Field(None, max_length=200)
    accelerator: str | None = Field(None, max_length=200)
    accelerator_mem_mb: float | None = Field(None, ge=0, le=1e8, **_Num)
    battery_pct: float | None = Field(None, ge=0, le=100, **_Num)
    power_source: str | None = Field(None, max_length=32)
    cpu_temp_c: float | None = Field(None, ge=-100, le=250, **_Num)


assert TELEMETRY_KEYS == tuple(TelemetryIn.model_fields)  # one list of keys, in and out


_STR_KEYS = ("cpu_model", "accelerator", "power_source")


def telemetry_of(value: Any) -> Telemetry:
    """A stored telemetry dict as :class:`Telemetry`: unknown keys and values of the wrong type
    (an older or newer writer) are left out, never an error on a page."""
    out: dict[str, Any] = {}
    for k, v in (value if isinstance(value, dict) else {}).items():
        if k not in Telemetry.model_fields or v is None or isinstance(v, bool):
            continue
        if k in _STR_KEYS:
            if isinstance(v, str):
                out[k] = v[:200]
        elif k == "cpu_count":
            if isinstance(v, int):
                out[k] = v
        elif isinstance(v, (int, float)):
            out[k] = clean(float(v))
    return Telemetry(**out)


class FleetNodeOut(Out):
    id: str
    kind: str = Field(description="supernode (Flower), peer (swarm) or serverapp")
    state: Literal[FLEET_STATES] = Field(  # type: ignore[valid-type]
        description="training (in a live run), online, failed (its last round failed or was rejected), offline")
    state_detail: str = Field("", description="the state in words: 'training in run R', 'offline since T', ...")
    online: bool = Field(False, description="reachable now: any state but offline")
    since: dt.datetime | None = Field(None, description="when it went offline (or online), where known")
    run_id: str | None = Field(None, description="the run it was last seen in")
    run_status: str | None = None
    device_class: str | None = None
    superlink_status: str | None = Field(None, description="what the SuperLink says (online, offline, registered)")
    owner_name: str | None = None
    rejected_updates: int = 0
    last_seen: dt.datetime | None = None
    telemetry: Telemetry = Field(default_factory=Telemetry)
    info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("info", mode="before")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        return clean(v or {})


class NodesOut(Out):
    nodes: list[FleetNodeOut] = Field(description="one page of the fleet, sorted and filtered")
    total: int = Field(description="fleet nodes matching the filters")
    limit: int
    offset: int
    counts: dict[str, int] = Field(description="fleet nodes per state (before the state filter)")
    device_classes: list[str] = Field(default_factory=list, description="classes in the fleet (filter choices)")
    runs: list[str] = Field(default_factory=list, description="runs the fleet was last seen in (filter choices)")
    simulated_nodes: int = Field(0, description="simulated nodes in the store, listed under their runs only")
    supernodes: SuperNodesOut


class NodeRunOut(Out):
    run_id: str
    name: str | None = None
    status: str | None = None
    rounds: int = 0
    failed: int = 0
    rejected: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    first_round: int | None = None
    last_round: int | None = None


class NodeRoundOut(Out):
    run_id: str
    round: int
    at: dt.datetime | None = Field(None, description="when the round was recorded")
    status: str
    reason: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    train_loss: float | None = None
    telemetry: Telemetry = Field(default_factory=Telemetry)


class NodeDetailOut(Out):
    node: FleetNodeOut | None = Field(None, description="the fleet entry (none for a simulated node)")
    simulated: bool = Field(False, description="a simulated node of one run")
    runs: list[NodeRunOut] = Field(default_factory=list, description="its runs, newest first")
    rounds: list[NodeRoundOut] = Field(default_factory=list, description="its rounds, oldest first (the last 2000)")
