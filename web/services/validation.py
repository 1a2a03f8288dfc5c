"""Checks of what the web may start and change, against the strategy catalog (the registry
as ``fedswarm strategies --json`` prints it), before anything is accepted.

* :func:`check_value`: one hyperparameter value against its catalog entry (type, bounds,
  choices); strategy ``params`` and a policy's ``codec_params`` both go through it.
* :func:`check_policy`: a device-class policy against the run's strategy: only keys the
  strategy honours, a registered codec, codec parameters that codec has, in range.
* :func:`web_task_and_files`: tasks and topologies started from the web are registered names
  or files uploaded with the request, never import paths (``module:function``) or paths on
  the server; only the CLI may use those.

Every refusal is a :class:`ValidationFailed` whose message names the key.
"""

from __future__ import annotations

import re
from typing import Any

from fedswarm.errors import ConfigError
from fedswarm.hyperparams import HyperParam
from fedswarm.web.services.catalog import CatalogData

__all__ = ["ValidationFailed", "check_value", "check_params", "check_policy", "web_task_and_files",
           "parse_edge_list", "NAMED_TOPOLOGY"]

NAMED_TOPOLOGY = re.compile(r"^(ring|torus|exp|onepeer-exp|complete|random:[0-9]{1,4}|edges)(\+lazy)?$")


class ValidationFailed(ValueError):
    """Refused input; ``str()`` is one line naming the key."""


def check_value(spec: dict, value: Any, where: str) -> Any:
    """``value`` coerced to the type of ``spec['default']`` and checked against its bounds and
    choices: the registry's own check (:meth:`fedswarm.hyperparams.HyperParam.check`, pydantic)."""
    try:
        return HyperParam.from_spec(spec).check(value, "", where=where)
    except ConfigError as exc:
        raise ValidationFailed(str(exc)) from None


def check_params(specs: list[dict], values: dict[str, Any], owner: str) -> dict[str, Any]:
    known = {h["name"]: h for h in specs or []}
    out = {}
    for k, v in values.items():
        if k not in known:
            raise ValidationFailed(f"unknown hyperparameter '{owner}.{k}' (allowed: {', '.join(known) or 'none'})")
        out[k] = check_value(known[k], v, f"{owner}.{k}")
    return out


def check_policy(cat: CatalogData, strategy: str, params: dict[str, Any], device_class: str,
                 policy: dict[str, Any], current: dict[str, Any] | None = None) -> dict[str, Any]:
    """``policy`` (keys already typed by DevicePolicy) if the run's strategy can apply it."""
    if cat.error is not None:
        raise ValidationFailed(f"cannot check the policy: {cat.error}")
    entry = cat.strategy(strategy)
    if entry is None:
        raise ValidationFailed(f"cannot check the policy: strategy '{strategy}' is not in the catalog")
    honoured = list(entry.get("policy_keys") or [])
    for key in policy:
        if key not in honoured:
            raise ValidationFailed(
                f"invalid policy key '{key}' for device class '{device_class}': strategy '{strategy}' does not "
                f"use it (keys it honours: {', '.join(honoured) or 'none; it takes no per-class policy'})")
    out = dict(policy)
    if "codec" in policy or "codec_params" in policy:
        codecs = {c["name"]: c for c in cat.codecs}
        codec = policy.get("codec") or (current or {}).get("codec") or params.get("codec") or next(
            (h.get("default") for h in entry.get("hyperparams") or [] if h["name"] == "codec"), None)
        if codec not in codecs:
            raise ValidationFailed(f"invalid policy key 'codec': unknown codec '{codec}' "
                                   f"(allowed: {', '.join(sorted(codecs))})")
        if "codec_params" in policy:
            out["codec_params"] = check_params(codecs[codec].get("hyperparams") or [],
                                               policy["codec_params"] or {}, f"codec_params.{codec}")
    return out


def parse_edge_list(text: str, nodes: int) -> str:
    """An uploaded topology: one ``i j`` pair a line (``#`` comments), node ids in [0, nodes).
    Returns it normalized; errors name the line."""
    out, seen = [], 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValidationFailed(f"invalid value for 'topology_edges': line {n} is not two node numbers")
        i, j = int(parts[0]), int(parts[1])
        if not (i < nodes and j < nodes) or i == j:
            raise ValidationFailed(f"invalid value for 'topology_edges': line {n} names a self-loop or a node "
                                   f"outside 0..{nodes - 1}")
        out.append(f"{i} {j}")
        seen += 1
    if not seen:
        raise ValidationFailed("invalid value for 'topology_edges': the edge list is empty")
    return "\n".join(out) + "\n"


def web_task_and_files(config: dict[str, Any], cat: CatalogData, has_edges: bool, has_profiles: bool) -> None:
    """Refuse what only the CLI may do: import paths as tasks, server paths as files."""
    task = config.get("task")
    if isinstance(task, str) and ":" in task:
        raise ValidationFailed(f"invalid value for 'task': '{task}' is an import path; runs started from the "
                               "dashboard use a registered task (module:function tasks are for the CLI)")
    tasks = [t.get("name") for t in cat.tasks]
    if task is not None and tasks and task not in tasks:
        raise ValidationFailed(f"invalid value for 'task': unknown task '{task}' "
                               f"(allowed: {', '.join(map(str, tasks))})")
    topo = config.get("topology")
    if topo is not None and not has_edges and not (isinstance(topo, str) and NAMED_TOPOLOGY.match(topo)):
        raise ValidationFailed("invalid value for 'topology': use ring, torus, exp, onepeer-exp, complete or "
                               "random:D; an edge list is uploaded (topology_edges), never a path on the server")
    if config.get("profiles") is not None:
        raise ValidationFailed("invalid value for 'profiles': upload the profiles file (profiles_toml); "
                               "paths on the server are not accepted from the web")
    if has_profiles and not config.get("devices"):
        raise ValidationFailed("invalid value for 'profiles_toml': profiles need 'devices' to name the classes")
