"""When simulated nodes are there: an on/off process per device class, or a replayed trace.

``--availability`` (run config ``availability``) takes one of:

- **a process**, ``on=S,off=S[,diurnal=A][,period=S][,dropout=P]`` for every device class, or
  ``CLASS:on=...;CLASS:on=...`` per class (a class not named is always there, never drops). A
  node alternates on and off periods of exponential length, ``on`` and ``off`` seconds on average
  (it starts on with probability ``on / (on + off)``, the long-run share of time it is on).
  ``diurnal=A`` (0 <= A < 1) scales the mean of an off period that starts at time ``t`` by
  ``1 + A·cos(2πt / period)`` (``period`` default 86400 s): off periods are longest at ``t = 0``
  (midnight) and shortest at ``period / 2`` (noon). ``dropout=P``: each round, a node that was
  sampled loses its update mid-round with probability ``P``.
- **a trace**, the path of a CSV file whose first line is ``node,start_s,end_s`` and each further
  line one window in which node ``node`` (its partition id, 0-based, the order of ``--devices``)
  is available, from ``start_s`` to ``end_s`` simulated seconds after the run started. A node may
  have many windows; a node with none is never available; the trace is not repeated.

Everything is deterministic for a seed. Time is the simulated time of the time model
(``--devices``), so availability needs it. The server side (:mod:`fedswarm.server.fleet_grid`)
samples only nodes that are on at the round's start, and loses the update of a node that drops
(``dropout``) or whose session ends before its own part of the round does.
"""

from __future__ import annotations

import bisect
import csv
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedswarm.errors import ConfigError

__all__ = ["OnOff", "Availability", "parse_process", "load_trace", "availability_for", "is_trace",
           "run_availability"]

_KEYS = ("on", "off", "diurnal", "period", "dropout")
NEXT_ON_STEP_S = 3600.0  # next_on draws a process's windows this far ahead first, then 4x as far each time
_CLASS = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class OnOff:
    """One device class's process: mean on and off lengths (s), diurnal amplitude and period, dropout."""

    on: float
    off: float
    diurnal: float = 0.0
    period: float = 86_400.0
    dropout: float = 0.0

    @property
    def fraction(self) -> float:
        """The long-run share of time a node is on (without ``diurnal``)."""
        return self.on / (self.on + self.off)


def is_trace(spec: str) -> bool:
    """Whether ``spec`` names a trace file (it ends in ``.csv``) rather than a process."""
    return str(spec).strip().lower().endswith(".csv")


def _process(text: str, where: str) -> OnOff:
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, raw = item.strip().partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ConfigError(f"availability: bad item '{item.strip()}'{where}: use KEY=VALUE with KEY one of "
                              f"{', '.join(_KEYS)} (e.g. on=1800,off=600,dropout=0.1)")
        try:
            values[key] = float(raw)
        except ValueError:
            raise ConfigError(f"availability: '{key}' must be a number{where}, got '{raw.strip()}'") from None
        if not math.isfinite(values[key]):
            raise ConfigError(f"availability: '{key}' must be finite{where}")
    for key in ("on", "off"):
        if key not in values:
            raise ConfigError(f"availability: '{key}' (mean {key} period, seconds) is missing{where}")
        if values[key] <= 0:
            raise ConfigError(f"availability: '{key}' must be > 0 seconds{where}, got {values[key]:g}")
    if not 0 <= values.get("diurnal", 0.0) < 1:
        raise ConfigError(f"availability: 'diurnal' must be in [0, 1){where}, got {values['diurnal']:g}")
    if values.get("period", 1.0) <= 0:
        raise ConfigError(f"availability: 'period' must be > 0 seconds{where}")
    if not 0 <= values.get("dropout", 0.0) < 1:
        raise ConfigError(f"availability: 'dropout' must be in [0, 1){where}, got {values['dropout']:g}")
    return OnOff(**values)


def parse_process(spec: str) -> dict[str, OnOff]:
    """``on=..,off=..`` -> ``{"*": OnOff}``; ``CLASS:on=..;CLASS:..`` -> one per class."""
    text = str(spec).strip()
    if not text:
        raise ConfigError("availability: empty (give on=S,off=S[,diurnal=A,period=S,dropout=P] or a trace .csv)")
    if ":" not in text:
        return {"*": _process(text, "")}
    out: dict[str, OnOff] = {}
    for part in text.split(";"):
        cls, sep, rest = part.strip().partition(":")
        cls = cls.strip()
        if not sep or not _CLASS.match(cls):
            raise ConfigError(f"availability: bad part '{part.strip()}': use CLASS:on=S,off=S[,...] separated by ';'")
        if cls in out:
            raise ConfigError(f"availability: device class '{cls}' given twice")
        out[cls] = _process(rest, f" (class '{cls}')")
    return out


def load_trace(path: str | Path, num_nodes: int) -> dict[int, list[tuple[float, float]]]:
    """Read a trace CSV (``node,start_s,end_s``): each node's windows, sorted and merged. A
    malformed file raises ``ConfigError`` naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"availability trace '{p}' does not exist")
    windows: dict[int, list[tuple[float, float]]] = {}
    with p.open(newline="") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            where = f"availability trace '{p}' line {lineno}"
            cells = [c.strip() for c in row]
            if lineno == 1:
                if cells != ["node", "start_s", "end_s"]:
                    raise ConfigError(f"{where}: the header must be 'node,start_s,end_s', got '{','.join(row)}'")
                continue
            if not cells or cells == [""]:
                continue
            if len(cells) != 3:
                raise ConfigError(f"{where}: expected 3 fields (node,start_s,end_s), got {len(cells)}")
            try:
                node = int(cells[0])
                start, end = float(cells[1]), float(cells[2])
            except ValueError:
                raise ConfigError(f"{where}: node must be an integer and start_s, end_s numbers, "
                                  f"got '{','.join(row)}'") from None
            if not 0 <= node < num_nodes:
                raise ConfigError(f"{where}: node {node} is not a partition id of this run (0..{num_nodes - 1})")
            if not (math.isfinite(start) and math.isfinite(end)) or start < 0 or end <= start:
                raise ConfigError(f"{where}: need 0 <= start_s < end_s, got {start:g}, {end:g}")
            windows.setdefault(node, []).append((start, end))
    if not windows:
        raise ConfigError(f"availability trace '{p}' has no windows: its first line must be the header "
                          "'node,start_s,end_s', then one line per window a node is on")
    for node, ws in windows.items():
        ws.sort()
        merged = [ws[0]]
        for s, e in ws[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        windows[node] = merged
    return windows


class Availability:
    """Each node's on-windows (generated lazily for a process, fixed for a trace) and dropouts."""

    def __init__(self, num_nodes: int, *, processes: list[OnOff | None] | None = None,
                 trace: dict[int, list[tuple[float, float]]] | None = None, seed: int = 0):
        self.num_nodes = num_nodes
        self.seed = int(seed)
        self.processes = processes
        self._windows: list[list[tuple[float, float]]] = [list((trace or {}).get(i, [])) for i in range(num_nodes)]
        self._horizon = [math.inf if trace is not None else 0.0] * num_nodes  # windows known up to here
        self._starts: list[list[float]] = [[s for s, _ in w] for w in self._windows]
        self._rngs: dict[int, np.random.Generator] = {}
        self._on_now: list[bool] = [False] * num_nodes

    def _extend(self, pid: int, until: float) -> None:
        proc = self.processes[pid] if self.processes is not None else None
        if proc is None:
            self._windows[pid], self._starts[pid], self._horizon[pid] = [(0.0, math.inf)], [0.0], math.inf
            return
        rng = self._rngs.get(pid)
        if rng is None:
            rng = self._rngs[pid] = np.random.default_rng([self.seed, 0xA7A1, pid])
            self._on_now[pid] = bool(rng.random() < proc.fraction)
        t = self._horizon[pid]
        while t <= until:
            if self._on_now[pid]:
                end = t + float(rng.exponential(proc.on))
                self._windows[pid].append((t, end))
                self._starts[pid].append(t)
            else:
                scale = 1.0 + proc.diurnal * math.cos(2 * math.pi * t / proc.period)
                end = t + float(rng.exponential(proc.off * scale))
            self._on_now[pid] = not self._on_now[pid]
            t = end
        self._horizon[pid] = t

    def _window(self, pid: int, t: float) -> tuple[float, float] | None:
        if t >= self._horizon[pid]:
            self._extend(pid, t)
        i = bisect.bisect_right(self._starts[pid], t) - 1
        if i >= 0:
            s, e = self._windows[pid][i]
            if s <= t < e:
                return s, e
        return None

    def available(self, pid: int, t: float) -> bool:
        """Whether node ``pid`` is on at simulated time ``t``."""
        return self._window(pid, t) is not None

    def session_end(self, pid: int, t: float) -> float | None:
        """The end of the on period node ``pid`` is in at time ``t`` (None: it is off)."""
        w = self._window(pid, t)
        return None if w is None else w[1]

    def next_on(self, pid: int, t: float, limit: float = 365 * 86_400.0) -> float | None:
        """The first time >= ``t`` node ``pid`` is on (None: never, within ``limit`` seconds after ``t``)."""
        if self.available(pid, t):
            return t
        reach = min(limit, NEXT_ON_STEP_S)  # windows drawn only as far as the answer needs, not all of limit
        while True:
            if self._horizon[pid] < t + reach:
                self._extend(pid, t + reach)
            i = bisect.bisect_right(self._starts[pid], t)
            if i < len(self._starts[pid]) and self._starts[pid][i] <= t + limit:
                return self._starts[pid][i]
            if reach >= limit:
                return None
            reach = min(limit, 4 * reach)

    def drops(self, pid: int, server_round: int) -> bool:
        """Whether node ``pid``, sampled in ``server_round``, drops mid-round (its class's ``dropout``)."""
        proc = self.processes[pid] if self.processes is not None else None
        if proc is None or proc.dropout <= 0:
            return False
        return bool(np.random.default_rng([self.seed, 0xD809, server_round, pid]).random() < proc.dropout)

    def first_on(self, pids: Iterable[int], t: float) -> float | None:
        """The first time >= ``t`` any of ``pids`` is on (None: none is, within a year after ``t``)."""
        pids = list(pids)
        if any(self.available(pid, t) for pid in pids):
            return t
        times = [on for pid in pids if (on := self.next_on(pid, t)) is not None]
        return min(times) if times else None

    def lost(self, pid: int, draw: int, start: float, finish: float | None) -> str | None:
        """Why node ``pid``, sent work at ``start`` that it would deliver at ``finish`` (simulated seconds;
        None: not known), loses its update: it drops (:meth:`drops` for ``draw``, the round or the
        dispatch number) or its session ends first. None: the update arrives."""
        if self.drops(pid, draw):
            return "dropped mid-round (its class's dropout probability); update lost"
        end = self.session_end(pid, start)
        if end is not None and finish is not None and finish > end:
            return (f"went offline mid-round at t={end:.0f} s, before its part of the round ended at "
                    f"t={finish:.0f} s (simulated); update lost")
        return None


def check_classes(per_class: dict[str, OnOff], classes: Iterable[str]) -> None:
    """Refuse a process for a device class the run's ``--devices`` does not have."""
    unknown = sorted(set(per_class) - set(classes) - {"*"})
    if unknown:
        raise ConfigError(f"availability: device class(es) {', '.join(unknown)} not in this run's --devices "
                          f"({', '.join(sorted(set(classes)))})")


def availability_for(spec: str, classes: list[str], seed: int) -> Availability:
    """The availability of a run's nodes (``classes``: each node's device class, by partition id)."""
    if is_trace(spec):
        return Availability(len(classes), trace=load_trace(spec, len(classes)), seed=seed)
    per_class = parse_process(spec)
    check_classes(per_class, classes)
    procs = [per_class.get(c, per_class.get("*")) for c in classes]
    return Availability(len(classes), processes=procs, seed=seed)


def run_availability(cfg) -> Availability | None:
    """The availability of ``cfg``'s simulated fleet (``--availability`` over ``--devices``'s classes),
    None when the run has none."""
    if getattr(cfg, "availability", None) is None:
        return None
    from fedswarm.policy import DEFAULT_CLASS
    from fedswarm.timemodel import parse_devices

    # each partition's class, as device_class_of reads --devices (parsed once, not once per partition)
    classes = parse_devices(cfg.devices, cfg.clients) if cfg.devices else [DEFAULT_CLASS] * cfg.clients
    return availability_for(cfg.availability, classes, cfg.seed)
