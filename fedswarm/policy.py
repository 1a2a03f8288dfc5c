"""Per-device-class policies: what a node of each class does in a round.

A policy sets local work (``local_steps``, ``local_epochs``, ``batch_size``, ``lr``) and
the knobs of the strategies that use them (``codec``/``codec_params`` for compressed
strategies, ``pvt_fraction`` for partial-variable training, ``progfed_max_stage`` for
progressive training). Policies live in the run config (``policies``) and can be changed
between rounds through the store (a ``policy`` control, e.g. from the dashboard): the
change applies from the next round.

The server sends every class's policy in each train message's config (keys
``policy.<class>.<key>``), so it never needs to know which node is which class: each node
applies its own class's policy and reports the class and policy it trained under.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["DevicePolicy", "PolicyBook", "DEFAULT_CLASS", "policy_for", "device_class_of"]

DEFAULT_CLASS = "default"  # the class of a node nobody assigned one
_PREFIX = "policy."


class DevicePolicy(BaseModel):
    """What a device class does from the next round on; unset keys keep the run's values."""

    model_config = ConfigDict(extra="forbid")
    local_steps: int | None = Field(None, ge=1, le=1_000_000, description="local SGD steps per round")
    local_epochs: int | None = Field(None, ge=1, le=10_000, description="local epochs per round")
    batch_size: int | None = Field(None, ge=1, le=1_000_000, description="local minibatch size")
    lr: float | None = Field(None, gt=0, le=100, allow_inf_nan=False, description="client learning rate")
    codec: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                              description="uplink codec (compressed strategies)")
    codec_params: dict[str, Any] | None = Field(None, description="codec hyperparameters")
    pvt_fraction: float | None = Field(None, gt=0, le=1, allow_inf_nan=False,
                                       description="share of variables trained (partial-variable training)")
    progfed_max_stage: int | None = Field(None, ge=1, le=64, description="highest ProgFed stage this class trains")
    eligible: str | None = Field(None, max_length=500, description="eligibility rules of this class's nodes "
                                 "(fedswarm.eligibility), instead of the run's")

    @field_validator("eligible")
    @classmethod
    def _rules(cls, v: str | None) -> str | None:
        if v is not None:
            from fedswarm.eligibility import parse_rules
            from fedswarm.errors import ConfigError

            try:
                return str(parse_rules(v))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("codec_params")
    @classmethod
    def _small(cls, v: dict | None) -> dict | None:
        if v is not None and len(json.dumps(v)) > 4096:
            raise ValueError("codec_params is larger than 4 KB")
        return v

    def set_keys(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def _check(device_class: str, policy: dict) -> dict[str, Any]:
    from fedswarm.errors import ConfigError

    if not device_class or not all(c.isalnum() or c in "-_." for c in device_class):
        raise ConfigError(f"invalid device class '{device_class}': use letters, digits, '-', '_' or '.'")
    try:
        return DevicePolicy.model_validate(policy).set_keys()
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"invalid policy for device class '{device_class}': '{key}': "
                          f"{err['msg']} (allowed keys: {', '.join(DevicePolicy.model_fields)})") from None


class PolicyBook:
    """The current policy of every device class in a run."""

    def __init__(self, policies: dict[str, dict] | None = None):
        self._policies: dict[str, dict[str, Any]] = {}
        for cls, pol in (policies or {}).items():
            self.update(cls, pol)

    def update(self, device_class: str, policy: dict) -> dict[str, Any]:
        """Fold a change into the class's policy; returns the class's new policy."""
        merged = {**self._policies.get(device_class, {}), **_check(device_class, policy)}
        self._policies[device_class] = merged
        return dict(merged)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self._policies.items()}

    def write(self, config: Any) -> None:
        """Write every policy into a Flower ConfigRecord (or dict) as ``policy.<class>``
        JSON strings, replacing what was there."""
        for key in [k for k in config.keys() if k.startswith(_PREFIX)]:
            del config[key]
        for cls, pol in self._policies.items():
            config[_PREFIX + cls] = json.dumps(pol, sort_keys=True)


def policy_for(config: Any, device_class: str) -> dict[str, Any]:
    """The policy a node of ``device_class`` applies, read from a train message's config
    (falling back to the ``default`` class's policy)."""
    raw = config.get(_PREFIX + device_class) or config.get(_PREFIX + DEFAULT_CLASS)
    return json.loads(raw) if raw else {}


def device_class_of(node_config: dict, devices: str | None, partition_id: int, num_partitions: int) -> str:
    """A node's class: its node config's ``device-class`` (deployment: `fedswarm client
    --device-class`), else its entry in the run's ``devices`` spec (simulation), else
    ``default``."""
    if node_config.get("device-class"):
        return str(node_config["device-class"])
    if devices:
        from fedswarm.timemodel import parse_devices

        return parse_devices(devices, num_partitions)[partition_id]
    return DEFAULT_CLASS
