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

Everything is deterministic for a seed: a process's windows are a function of the run's seed,
the node and the draw's number (a counter-based hash, :class:`Availability`), so they can be drawn
for every node at once as arrays (:meth:`Availability.at`, the batched engine's fleet) or node by
node (the other engines), the same windows either way. Time is the simulated time of the time model
(``--devices``), so availability needs it. The server side (:mod:`fedswarm.server.fleet_grid`)
samples only nodes that are on at the round's start, and loses the update of a node that drops
(``dropout``) or whose session ends before its own part of the round does.
"""

from __future__ import annotations

import bisect
import csv
import math
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fedswarm.errors import ConfigError

__all__ = ["OnOff", "Availability", "Trace", "parse_process", "load_trace", "availability_for", "is_trace",
           "run_availability"]

_KEYS = ("on", "off", "diurnal", "period", "dropout")
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


class Trace(NamedTuple):
    """A trace's windows as arrays, sorted by node then start and merged (no two of a node's overlap
    or touch): node ``i``'s are ``start[offsets[i]:offsets[i + 1]]`` to ``end[...]``."""

    start: np.ndarray
    end: np.ndarray
    offsets: np.ndarray

    @classmethod
    def build(cls, node, start, end, num_nodes: int) -> "Trace":
        """Windows ``(node[j], start[j], end[j])`` in any order, sorted and merged: a node's windows
        that overlap or touch become one (their union)."""
        node = np.asarray(node, dtype=np.int64)
        start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
        order = np.lexsort((start, node))
        node, start, end = node[order], start[order], end[order]
        # a window opens a new merged one when it starts after every earlier end of its node: compared as
        # int64 keys node·(R+1) + rank of the time among all R distinct times (exact; no float offsets)
        times = np.unique(np.concatenate([start, end]))
        base = node * (len(times) + 1)
        s_key, e_key = base + np.searchsorted(times, start), base + np.searchsorted(times, end)
        first = np.ones(len(node), dtype=bool)
        first[1:] = s_key[1:] > np.maximum.accumulate(e_key)[:-1]
        at = np.flatnonzero(first)
        merged_end = np.maximum.reduceat(end, at) if len(at) else end[:0]
        offsets = np.searchsorted(node[at], np.arange(num_nodes + 1))
        return cls(start[at], merged_end, offsets)

    @classmethod
    def from_windows(cls, windows: dict[int, list[tuple[float, float]]], num_nodes: int) -> "Trace":
        """From ``{node: [(start, end), ...]}``."""
        rows = [(node, s, e) for node, ws in windows.items() for s, e in ws]
        node, start, end = (list(col) for col in zip(*rows)) if rows else ([], [], [])
        return cls.build(node, start, end, num_nodes)

    def windows(self) -> dict[int, list[tuple[float, float]]]:
        """``{node: [(start, end), ...]}`` for the nodes with a window."""
        return {i: list(zip(self.start[a:b].tolist(), self.end[a:b].tolist()))
                for i, (a, b) in enumerate(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())) if b > a}


def _read_rows(p: Path, num_nodes: int) -> tuple[list[int], list[float], list[float]]:
    """A trace CSV's rows, line by line, each checked: the first bad line raises ``ConfigError``."""
    nodes, starts, ends = [], [], []
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
            nodes.append(node)
            starts.append(start)
            ends.append(end)
    return nodes, starts, ends


def _parse_rows(p: Path, num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The rows of a well-formed trace CSV as arrays, in one numpy parse; None when anything in it is
    not plainly well formed (then :func:`_read_rows` reads it, and names the line that is wrong). It
    accepts only what :func:`_read_rows` accepts, with the same values (numpy's parser is Python's)."""
    with p.open(newline="") as f:
        if [c.strip() for c in next(csv.reader([f.readline()]), [])] != ["node", "start_s", "end_s"]:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (a trace of no windows: "input contained no data")
                rows = np.loadtxt(f, delimiter=",", comments=None, ndmin=1,
                                  dtype=[("node", np.int64), ("start", np.float64), ("end", np.float64)])
        except ValueError:
            return None
    node, start, end = rows["node"], rows["start"], rows["end"]
    ok = ((node >= 0) & (node < num_nodes) & np.isfinite(start) & np.isfinite(end) & (start >= 0)
          & (end > start))
    return (node, start, end) if ok.all() else None


def load_trace(path: str | Path, num_nodes: int) -> Trace:
    """Read a trace CSV (``node,start_s,end_s``): each node's windows, sorted and merged. A
    malformed file raises ``ConfigError`` naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"availability trace '{p}' does not exist")
    rows = _parse_rows(p, num_nodes) or _read_rows(p, num_nodes)
    if not len(rows[0]):  # (every node off for ever: a run on it would wait for nothing)
        raise ConfigError(f"availability trace '{p}' has no windows: its first line must be the header "
                          "'node,start_s,end_s', then one line per window a node is on")
    return Trace.build(*rows, num_nodes)


_BLOCK = 64  # a node's uniforms drawn at once when its periods are drawn one by one (Availability._extend)


class _Windows(dict):
    """``pid -> [(start, end), ...]``: a node's on-windows drawn so far (a process) or given (a trace),
    built on first use (a process's are kept as arrays, :meth:`Availability._history`, until asked for)."""

    def __init__(self, fill):
        super().__init__()
        self._fill = fill

    def __missing__(self, pid: int) -> list[tuple[float, float]]:
        return self._fill(pid)


def _uniform(seed: int, tag: int, a, b) -> np.ndarray:
    """Uniform draws in (0, 1), one per ``(a, b)`` (broadcast): a counter-based hash of ``(seed, tag,
    a, b)`` (:func:`~fedswarm.algorithms.local_sgd.sort_keys`, splitmix64), so any set of them is one
    array expression and none depends on which others were drawn, or in which order."""
    from fedswarm.algorithms.local_sgd import sort_keys

    keys = sort_keys(sort_keys(seed, tag, 0), np.asarray(a, dtype=np.uint64), np.asarray(b, dtype=np.uint64))
    return ((keys >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


class Availability:
    """Each node's on-windows (drawn lazily for a process, fixed for a trace) and dropouts.

    **A process's windows** (the definition every engine reads, here only): node ``pid``'s ``k``-th
    draw is ``u_k`` = :func:`_uniform` ``(seed, pid, k)`` in (0, 1). It starts on iff
    ``u_0 < on / (on + off)``; its ``k``-th period (``k >= 1``), starting at ``t`` (the first at 0),
    lasts ``-ln(u_k)`` times its mean (``on``; ``off · (1 + diurnal · cos(2πt / period))``), at
    least one ulp, and on and off periods alternate. :meth:`at` draws them for many nodes at once
    (arrays over the nodes, one period per step, :meth:`_advance`); the one-node queries draw a
    node's periods in a loop (:meth:`_extend`) from the same draws with the same arithmetic, so
    both see the same windows, bit for bit (tests/test_availability_arrays.py holds them equal).
    A node's state is kept as arrays (its next draw, the start and end of its current period); its
    past on-windows only for a query about an earlier time (kept as arrays until one asks).
    """

    def __init__(self, num_nodes: int, *, processes: list[OnOff | None] | None = None,
                 trace: "dict[int, list[tuple[float, float]]] | Trace | None" = None, seed: int = 0):
        self.num_nodes = num_nodes
        self.seed = int(seed)
        self.processes = processes
        self.trace = None if trace is None else (trace if isinstance(trace, Trace) else
                                                 Trace.from_windows(trace, num_nodes))
        if processes is not None and len(processes) != num_nodes:
            raise ValueError(f"processes: {len(processes)} given for {num_nodes} nodes")
        table = list(dict.fromkeys(processes or []))  # the distinct processes (None: always on)
        index = {proc: i for i, proc in enumerate(table)}
        self._code = np.fromiter((index[proc] for proc in processes), np.int64, num_nodes) if processes else None
        if self._code is not None:
            procs = [p or OnOff(1.0, 1.0) for p in table]
            self._none = np.array([p is None for p in table])
            self._on_mean = np.array([p.on for p in procs])
            self._off_mean = np.array([p.off for p in procs])
            self._diurnal = np.array([p.diurnal for p in procs])
            self._period = np.array([p.period for p in procs])
            self._fraction = np.array([p.fraction for p in procs])
            self._k = np.zeros(num_nodes, dtype=np.int64)  # the next draw (0: not started)
            self._start = np.zeros(num_nodes)  # the current period's start ...
            self._end = np.zeros(num_nodes)  # ... and end: windows are drawn up to here
            self._next_on = np.zeros(num_nodes, dtype=bool)  # the next period (from _end) is on
        self._drawn: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # on-windows not yet in _windows
        self._windows = _Windows(self._node_windows)

    # -- drawing a process's windows ---------------------------------------------------------------
    def _advance(self, pids: np.ndarray, until: float) -> None:
        """Draw periods of process nodes ``pids`` (int64) until each one's current period ends after ``until``."""
        fresh = pids[self._k[pids] == 0]
        if len(fresh):
            code = self._code[fresh]
            self._next_on[fresh] = _uniform(self.seed, 0xA7A1, fresh, 0) < self._fraction[code]
            self._k[fresh] = 1
        pids = pids[self._end[pids] <= until]
        while len(pids):
            k, t, on, code = self._k[pids], self._end[pids], self._next_on[pids], self._code[pids]
            scale = 1.0 + self._diurnal[code] * np.cos(2 * math.pi * t / self._period[code])
            mean = np.where(on, self._on_mean[code], self._off_mean[code] * scale)
            end = t + mean * -np.log(_uniform(self.seed, 0xA7A1, pids, k))
            end = np.where(end > t, end, np.nextafter(t, math.inf))
            if on.any():
                self._drawn.append((pids[on], t[on], end[on]))
            self._start[pids], self._end[pids], self._next_on[pids], self._k[pids] = t, end, ~on, k + 1
            pids = pids[end <= until]

    def _extend(self, pid: int, until: float) -> None:
        """:meth:`_advance` for one node, ``pid``: the same periods, drawn in a loop over its periods
        (a node may need many, one by one: the uniforms are drawn :data:`_BLOCK` at a time; ``np.log``
        and ``np.cos``, numpy's loops as in :meth:`_advance`: ``math``'s may differ in the last bit)."""
        if self._code is None or self._none[self._code[pid]] or self._end[pid] > until:
            return
        one = np.array([pid], dtype=np.int64)
        if self._k[pid] == 0:
            self._advance(one, -math.inf)  # its first draw: on or off at 0
        code = int(self._code[pid])
        on_mean, off_mean = float(self._on_mean[code]), float(self._off_mean[code])
        diurnal, period = float(self._diurnal[code]), float(self._period[code])
        k, t, on = int(self._k[pid]), float(self._end[pid]), bool(self._next_on[pid])
        start, starts, ends = t, [], []
        while t <= until:
            e = (-np.log(_uniform(self.seed, 0xA7A1, pid, np.arange(k, k + _BLOCK, dtype=np.uint64)))).tolist()
            for j in range(_BLOCK):
                if on:
                    mean = on_mean
                elif diurnal:  # (without: 1 + 0·cos = 1 exactly)
                    mean = off_mean * (1.0 + diurnal * float(np.cos(2 * math.pi * t / period)))
                else:
                    mean = off_mean
                end = t + mean * e[j]
                if not end > t:
                    end = math.nextafter(t, math.inf)
                if on:
                    starts.append(t)
                    ends.append(end)
                start, t, on, k = t, end, not on, k + 1
                if t > until:
                    break
        if starts:
            self._drawn.append((np.full(len(starts), pid, dtype=np.int64), np.array(starts), np.array(ends)))
        self._start[pid], self._end[pid], self._next_on[pid], self._k[pid] = start, t, on, k

    def _node_windows(self, pid: int) -> list[tuple[float, float]]:
        if self.trace is not None:
            a, b = self.trace.offsets[pid], self.trace.offsets[pid + 1]
            return list(zip(self.trace.start[a:b].tolist(), self.trace.end[a:b].tolist()))
        if self._code is None or self._none[self._code[pid]]:
            return [(0.0, math.inf)]
        for pids, starts, ends in self._drawn:  # what was drawn so far, for every node, in order
            for p, s, e in zip(pids.tolist(), starts.tolist(), ends.tolist()):
                dict.setdefault(self._windows, p, []).append((s, e))
        self._drawn.clear()
        return dict.setdefault(self._windows, pid, [])

    def _history(self, pid: int) -> list[tuple[float, float]]:
        if self._drawn:
            self._node_windows(pid)  # (files what is pending)
        return self._windows[pid]

    # -- queries ---------------------------------------------------------------------------------
    def at(self, pids, t: float, limit: float = 365 * 86_400.0) -> tuple[np.ndarray, np.ndarray]:
        """Nodes ``pids`` at time ``t``, as arrays: whether each is on, and when that changes (an on
        node's session end, ``inf`` for one always there; an off node's next on, ``inf`` when not
        within ``limit`` seconds after ``t``): :meth:`session_end` and :meth:`next_on`, for many nodes."""
        pids = np.asarray(pids, dtype=np.int64)
        on, change = np.zeros(len(pids), dtype=bool), np.full(len(pids), math.inf)
        if self.trace is not None:
            tr = self.trace
            upto = np.concatenate([[0], np.cumsum(tr.start <= t)])  # windows starting at or before t, cumulated
            a, b = tr.offsets[pids], tr.offsets[pids + 1]
            last = a + (upto[b] - upto[a]) - 1  # each node's last window starting at or before t (< a: none)
            has = last >= a
            end = tr.end[np.where(has, last, 0)] if len(tr.end) else np.zeros(len(pids))
            on = has & (t < end)
            nxt = last + 1
            more = nxt < b
            start = tr.start[np.where(more, nxt, 0)] if len(tr.start) else np.zeros(len(pids))
            change = np.where(on, end, np.where(more & (start <= t + limit), start, math.inf))
            return on, change
        if self._code is None:
            return ~on, change
        always = self._none[self._code[pids]]
        on[always] = t >= 0
        drawn = pids[~always]
        self._advance(drawn, t)
        now = self._start[drawn] <= t  # else t is before the current period: ask the past, node by node
        cur = ~self._next_on[drawn]
        end = self._end[drawn]
        on[~always] = now & cur
        change[~always] = np.where(cur, end, np.where(end <= t + limit, end, math.inf))
        for i in np.flatnonzero(~always)[~now].tolist():
            pid = int(pids[i])
            w = self._window(pid, t)
            on[i] = w is not None
            nxt = w[1] if w is not None else self.next_on(pid, t, limit)
            change[i] = math.inf if nxt is None else nxt
        return on, change

    def _window(self, pid: int, t: float) -> tuple[float, float] | None:
        if self.trace is not None:
            tr = self.trace
            a = int(tr.offsets[pid])
            i = a + int(np.searchsorted(tr.start[a:tr.offsets[pid + 1]], t, side="right")) - 1
            return (float(tr.start[i]), float(tr.end[i])) if i >= a and t < tr.end[i] else None
        if self._code is None or self._none[self._code[pid]]:
            return (0.0, math.inf) if t >= 0 else None
        self._extend(pid, t)
        if self._start[pid] <= t:  # the current period
            return None if self._next_on[pid] else (float(self._start[pid]), float(self._end[pid]))
        ws = self._history(pid)
        i = bisect.bisect_right(ws, (t, math.inf)) - 1
        return ws[i] if i >= 0 and ws[i][0] <= t < ws[i][1] else None

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
        if self.trace is not None:
            tr = self.trace
            a, b = int(tr.offsets[pid]), int(tr.offsets[pid + 1])
            i = a + int(np.searchsorted(tr.start[a:b], t, side="right"))
            nxt = float(tr.start[i]) if i < b else None
        elif self._start[pid] <= t:  # off in its current period: the next one is on
            nxt = float(self._end[pid])
        else:  # before the current period: the first window drawn after t (the current one at the latest)
            ws = self._history(pid)
            i = bisect.bisect_right(ws, (t, math.inf))
            nxt = ws[i][0] if i < len(ws) else float(self._end[pid])
        return nxt if nxt is not None and nxt <= t + limit else None

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
