"""The device and network time model: how long a round *would* take on real devices.

Every simulated node has a profile: a device class (compute speed, memory) and a link
(bandwidth, latency). The simulator reports, beside wall time, the simulated time of
each round under these profiles, so time-to-accuracy is measurable on one laptop.
Simulated time is always labeled as such (``sim_time_s``); the built-in numbers are
round, order-of-magnitude figures, not measurements — edit them with a TOML file.

Model (first order, deliberately simple):

- compute: ``samples / speed`` (or ``flops / (gflops · 1e9)``);
- one transfer: ``latency + bytes · 8 / bandwidth``;
- federated round: ``max`` over sampled clients of download + compute + upload, the
  server's link shared fairly among the clients;
- synchronous gossip round: ``max`` over nodes of compute + sending its message to all
  neighbours at once over its own uplink (sends share it; receiving is not modeled);
- asynchronous algorithms run on a :class:`VirtualClock`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "DeviceClass",
    "Link",
    "Profile",
    "BUILTIN_PROFILES",
    "load_profiles",
    "profiles_from_dict",
    "parse_devices",
    "compute_time_s",
    "transfer_time_s",
    "sync_round_time_s",
    "gossip_round_time_s",
    "VirtualClock",
]


@dataclass(frozen=True)
class DeviceClass:
    """A kind of device.

    Parameters
    ----------
    name : str
        Label, e.g. ``"gpu"``, ``"edge"``.
    speed : float
        Compute throughput in training samples per second on the reference task (only
        ratios between devices matter for comparisons).
    memory_gb : float
        Memory available for training.
    gflops : float | None
        Sustained GFLOP/s, for work given in FLOPs.
    """

    name: str
    speed: float
    memory_gb: float
    gflops: float | None = None


@dataclass(frozen=True)
class Link:
    """A node's network link: ``bandwidth_mbps`` (megabits per second, 10⁶ bit/s) and
    one-way ``latency_ms``."""

    bandwidth_mbps: float
    latency_ms: float


@dataclass(frozen=True)
class Profile:
    """A named device class plus link, e.g. ``edge-wifi``."""

    name: str
    device: DeviceClass
    link: Link
    description: str = ""


_GPU = DeviceClass("gpu", speed=5000.0, memory_gb=24.0, gflops=20000.0)
_CPU = DeviceClass("cpu", speed=500.0, memory_gb=16.0, gflops=500.0)
_EDGE = DeviceClass("edge", speed=100.0, memory_gb=4.0, gflops=50.0)
_SLOW_EDGE = DeviceClass("straggler", speed=10.0, memory_gb=4.0, gflops=5.0)

#: The built-in profiles. ``gpu`` and ``cpu`` are the names used for the device kinds a
#: client probe reports (cuda and cpu boxes on a LAN).
BUILTIN_PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("datacenter", _GPU, Link(10000.0, 0.1), "GPU server, 10 Gbit/s, 0.1 ms"),
        Profile("gpu", _GPU, Link(1000.0, 1.0), "GPU box on a LAN, 1 Gbit/s, 1 ms"),
        Profile("cpu", _CPU, Link(1000.0, 1.0), "CPU server on a LAN, 1 Gbit/s, 1 ms"),
        Profile("edge-wifi", _EDGE, Link(50.0, 10.0), "edge device on Wi-Fi, 50 Mbit/s, 10 ms"),
        Profile("edge-lte", _EDGE, Link(10.0, 50.0), "edge device on LTE, 10 Mbit/s, 50 ms"),
        Profile("straggler", _SLOW_EDGE, Link(50.0, 10.0),
                "edge device with 10x slower compute than edge-wifi, same link"),
    )
}

# --------------------------------------------------------------------------- profiles

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_NUMERIC = {  # key -> (minimum, strictly greater?)
    "speed": (0.0, True),
    "memory_gb": (0.0, True),
    "gflops": (0.0, True),
    "bandwidth_mbps": (0.0, True),
    "latency_ms": (0.0, False),
}
_KEYS = set(_NUMERIC) | {"base", "description", "device"}
_REQUIRED = ("speed", "memory_gb", "bandwidth_mbps", "latency_ms")


def _number(where: str, value: Any) -> float:
    minimum, strict = _NUMERIC[where.rsplit(".", 1)[1]]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"profile key '{where}' must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ValueError(f"profile key '{where}' must be a finite number {op} {minimum:g} (got {value!r})")
    return value


def profiles_from_dict(data: Mapping[str, Any],
                       base: Mapping[str, Profile] | None = None) -> dict[str, Profile]:
    """Merge ``{name: {key: value}}`` over ``base`` (default: the built-ins).

    Keys: ``speed``, ``memory_gb``, ``gflops``, ``bandwidth_mbps``, ``latency_ms``,
    ``description``, ``device`` (a label) and ``base`` (a profile to start from). A table
    for an existing profile changes only the keys it names; a new profile needs
    ``base`` or all of speed, memory_gb, bandwidth_mbps and latency_ms.
    """
    out = dict(BUILTIN_PROFILES if base is None else base)
    for name, table in data.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"profile name {name!r} must use only letters, digits, '_', '-', '.'")
        if not isinstance(table, Mapping):
            raise ValueError(f"profile '{name}' must be a table of keys (got {table!r})")
        for key in table:
            if key not in _KEYS:
                raise ValueError(
                    f"unknown profile key '{name}.{key}' (allowed: {', '.join(sorted(_KEYS))})"
                )
        start = out.get(name)
        if "base" in table:
            if table["base"] not in out:
                raise ValueError(
                    f"profile key '{name}.base' names unknown profile {table['base']!r} "
                    f"(available: {', '.join(sorted(out))})"
                )
            start = out[table["base"]]
        if start is None:
            missing = [k for k in _REQUIRED if k not in table]
            if missing:
                raise ValueError(
                    f"new profile '{name}' is missing key '{name}.{missing[0]}' "
                    f"(give {', '.join(_REQUIRED)}, or base = PROFILE)"
                )
            start = Profile(name, DeviceClass(name, 1.0, 1.0), Link(1.0, 0.0))
        nums = {k: _number(f"{name}.{k}", v) for k, v in table.items() if k in _NUMERIC}
        for key in ("description", "device"):
            if key in table and not isinstance(table[key], str):
                raise ValueError(f"profile key '{name}.{key}' must be a string")
        device = replace(
            start.device,
            name=table.get("device", start.device.name),
            **{k: nums[k] for k in ("speed", "memory_gb", "gflops") if k in nums},
        )
        link = replace(start.link, **{k: nums[k] for k in ("bandwidth_mbps", "latency_ms") if k in nums})
        out[name] = Profile(name, device, link, table.get("description", start.description))
    return out


def load_profiles(path: str | Path, base: Mapping[str, Profile] | None = None) -> dict[str, Profile]:
    """Profiles from a TOML file merged over ``base`` (default: the built-ins). The file
    has one table per profile (at top level or under ``[profiles]``)::

        [edge-lte]
        bandwidth_mbps = 5

        [phone]
        base = "edge-lte"
        speed = 40
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"profiles file '{p}' does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"profiles file '{p}' is not valid TOML: {exc}") from None
    if isinstance(data.get("profiles"), Mapping):
        data = data["profiles"]
    return profiles_from_dict(data, base)


def parse_devices(spec: str, n_nodes: int,
                  profiles: Mapping[str, Profile] | None = None) -> list[str]:
    """Per-node profile names from ``"gpu:4,edge-wifi:12"`` (node 0..3 gpu, then 12
    edge-wifi). Counts must sum to ``n_nodes``; a single name without a count means all
    nodes; one entry without a count takes the remaining nodes (``"gpu:2,edge-lte"``)."""
    profiles = BUILTIN_PROFILES if profiles is None else profiles
    if n_nodes < 1:
        raise ValueError(f"devices: need at least one node (got {n_nodes})")
    entries = [e.strip() for e in spec.split(",")]
    if not spec.strip() or any(not e for e in entries):
        raise ValueError(f"devices '{spec}': expected NAME or NAME:COUNT[,NAME:COUNT...]")
    parsed: list[tuple[str, int | None]] = []
    for e in entries:
        name, sep, count = e.partition(":")
        name = name.strip()
        if name not in profiles:
            raise ValueError(
                f"devices '{spec}': unknown profile '{name}' (available: {', '.join(sorted(profiles))})"
            )
        if any(name == p for p, _ in parsed):
            raise ValueError(f"devices '{spec}': profile '{name}' is listed twice")
        if sep:
            count = count.strip()
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"devices '{spec}': count for '{name}' must be an integer >= 1 (got '{count}')")
            parsed.append((name, int(count)))
        else:
            parsed.append((name, None))
    open_ = [p for p, c in parsed if c is None]
    if len(open_) > 1:
        raise ValueError(f"devices '{spec}': only one profile may omit its count (got {', '.join(open_)})")
    fixed = sum(c for _, c in parsed if c is not None)
    if open_:
        rest = n_nodes - fixed
        if rest < 1:
            raise ValueError(
                f"devices '{spec}': counts already use {fixed} of {n_nodes} nodes, none left for '{open_[0]}'"
            )
        parsed = [(p, rest if c is None else c) for p, c in parsed]
    elif fixed != n_nodes:
        raise ValueError(f"devices '{spec}': counts sum to {fixed} but there are {n_nodes} nodes")
    return [p for p, c in parsed for _ in range(c)]


# --------------------------------------------------------------------------- times


def compute_time_s(profile: Profile | DeviceClass, samples: float | None = None,
                   flops: float | None = None) -> float:
    """Seconds to process ``samples`` (at ``speed`` samples/s) or ``flops`` (at
    ``gflops``); give exactly one."""
    dev = profile.device if isinstance(profile, Profile) else profile
    if (samples is None) == (flops is None):
        raise ValueError("compute_time_s needs exactly one of samples= or flops=")
    if samples is not None:
        if samples < 0:
            raise ValueError(f"samples must be >= 0 (got {samples})")
        return float(samples) / dev.speed
    if flops < 0:
        raise ValueError(f"flops must be >= 0 (got {flops})")
    if dev.gflops is None:
        raise ValueError(f"device '{dev.name}' has no gflops; give samples= instead")
    return float(flops) / (dev.gflops * 1e9)


def transfer_time_s(link: Link | Profile, nbytes: float) -> float:
    """``latency + nbytes · 8 / bandwidth`` seconds; 0 when nothing is sent."""
    link = link.link if isinstance(link, Profile) else link
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0 (got {nbytes})")
    if nbytes == 0:
        return 0.0
    return link.latency_ms / 1e3 + nbytes * 8.0 / (link.bandwidth_mbps * 1e6)


def _per_node(value: Any, k: int, what: str) -> list:
    if isinstance(value, (int, float)):
        return [value] * k
    values = list(value)
    if len(values) != k:
        raise ValueError(f"{what} has {len(values)} entries for {k} nodes")
    return values


def sync_round_time_s(clients: Sequence[Profile], samples: float | Sequence[float],
                      bytes_down: float | Sequence[float], bytes_up: float | Sequence[float],
                      server_link: Link | None = None) -> float:
    """Simulated seconds of one federated round: ``max_k`` (download + compute + upload)
    over the sampled clients. With ``server_link``, its latency adds to each transfer and
    its bandwidth is shared fairly by the K concurrent transfers (each gets
    ``min(client, server / K)``)."""
    k = len(clients)
    if k == 0:
        return 0.0
    samples = _per_node(samples, k, "samples")
    down = _per_node(bytes_down, k, "bytes_down")
    up = _per_node(bytes_up, k, "bytes_up")
    worst = 0.0
    for c, s, bd, bu in zip(clients, samples, down, up):
        link = c.link
        if server_link is not None:
            link = Link(min(link.bandwidth_mbps, server_link.bandwidth_mbps / k),
                        link.latency_ms + server_link.latency_ms)
        t = transfer_time_s(link, bd) + compute_time_s(c, samples=s) + transfer_time_s(link, bu)
        worst = max(worst, t)
    return worst


def gossip_round_time_s(nodes: Sequence[Profile], degrees: Sequence[int],
                        message_bytes: float | Sequence[float],
                        samples: float | Sequence[float] = 0, overlap: bool = False) -> float:
    """Simulated seconds of one synchronous decentralized round: ``max_i`` of compute plus
    sending its message to its ``deg_i`` neighbours concurrently over its own uplink
    (``latency + deg_i · bytes · 8 / bandwidth``). ``overlap=True`` takes ``max`` of the
    two instead of the sum (D-PSGD sends the pre-step model while computing)."""
    n = len(nodes)
    if n == 0:
        return 0.0
    degrees = [int(d) for d in _per_node(degrees, n, "degrees")]
    sizes = _per_node(message_bytes, n, "message_bytes")
    samples = _per_node(samples, n, "samples")
    worst = 0.0
    for p, deg, b, s in zip(nodes, degrees, sizes, samples):
        comm = transfer_time_s(p.link, deg * b)
        comp = compute_time_s(p, samples=s)
        worst = max(worst, max(comm, comp) if overlap else comm + comp)
    return worst


# --------------------------------------------------------------------------- clock


class VirtualClock:
    """A deterministic event queue in simulated seconds.

    ``schedule(t, event)`` files an event at absolute time ``t`` (never before ``now``);
    ``pop()`` returns the earliest ``(t, event)`` and advances ``now`` to ``t``. Events at
    the same time come out in the order they were scheduled.
    """

    def __init__(self, start: float = 0.0):
        self._now = float(start)
        self._queue: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()

    @property
    def now(self) -> float:
        return self._now

    def schedule(self, t: float, event: Any) -> None:
        t = float(t)
        if not math.isfinite(t):
            raise ValueError(f"cannot schedule an event at t={t}")
        if t < self._now:
            raise ValueError(f"cannot schedule an event in the past (t={t} < now={self._now})")
        heapq.heappush(self._queue, (t, next(self._seq), event))

    def schedule_in(self, delay: float, event: Any) -> None:
        """Schedule ``event`` at ``now + delay``."""
        if delay < 0:
            raise ValueError(f"delay must be >= 0 (got {delay})")
        self.schedule(self._now + delay, event)

    def pop(self) -> tuple[float, Any]:
        if not self._queue:
            raise IndexError("pop from an empty VirtualClock")
        t, _, event = heapq.heappop(self._queue)
        self._now = t
        return t, event

    def peek_time(self) -> float | None:
        """Time of the next event, or None when the queue is empty."""
        return self._queue[0][0] if self._queue else None

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)
