"""Pydantic models of the fleet: the nodes list (``GET /api/nodes``), one node's page
(``GET /api/nodes/{node_id}``), and the telemetry a node reports (the recorder's per-node
``row["telemetry"]``, an ingest report's ``telemetry``), stored as ``Node.telemetry`` (the last
values) and ``NodeRound.telemetry`` (per round)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedswarm.web.schemas import Out, SuperNodesOut, clean

__all__ = ["TELEMETRY_KEYS", "FLEET_STATES", "TelemetryIn", "Telemetry", "FleetNodeOut", "NodesOut",
           "NodeRunOut", "NodeRoundOut", "NodeDetailOut", "telemetry_of"]

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
