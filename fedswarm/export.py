"""One run's rounds, or its per-node rounds, as CSV or JSON Lines, written as a stream.

The one writer behind ``GET /api/runs/{id}/rounds.csv`` (``.jsonl``, ``nodes.csv``) and
``fedswarm runs export``: for the same run and store both give the same bytes.

Columns come from the store's tables, so a column added to ``rounds`` or ``node_rounds``
later is exported with no change here:

* every column of the table in table order, except the surrogate key ``id``;
* a JSON column (``metrics`` of a round, ``policy`` of a node-round, any added later) is
  flattened in its place, in CSV, into one column per key found in any row of the run,
  named ``<column>.<key>`` (nested objects: ``<column>.<key>.<subkey>``), keys sorted; a
  list is written as compact JSON text. A row without a key leaves that cell empty.
  JSON Lines keeps the object as it is, nested, under the column's name.

Cells: empty for NULL, ``true``/``false`` for booleans, numbers as Python prints them
(shortest exact form), non-finite numbers empty (JSON Lines: ``null``, as in the JSON API),
times as ISO 8601 in UTC without an offset. CSV follows RFC 4180 (``\\r\\n`` line ends,
fields quoted when needed). Rows are ordered by round (per-node rows: round, node id).

Rows are read ``CHUNK_ROWS`` at a time (``yield_per``) and written out a chunk at a time,
so a run with 10,000 nodes is never held in memory whole.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
from typing import Any, Iterator

from sqlalchemy import JSON, Column, Table, Text, cast, select
from sqlalchemy.orm import Session

from fedswarm.store import NodeRound, Round, Store

__all__ = ["KINDS", "FORMATS", "CHUNK_ROWS", "export", "columns", "describe", "filename", "flatten"]

KINDS = {"rounds": Round.__table__, "nodes": NodeRound.__table__}
FORMATS = {"csv": "text/csv; charset=utf-8", "jsonl": "application/jsonl"}
CHUNK_ROWS = 1000
_SKIP = {"id"}
_ORDER = {"rounds": ("round",), "nodes": ("round", "node_id", "id")}


def columns(kind: str) -> list[Column]:
    """The exported columns of ``kind`` ("rounds" or "nodes"), in table order."""
    return [c for c in _table(kind).columns if c.name not in _SKIP]


def _table(kind: str) -> Table:
    if kind not in KINDS:
        raise ValueError(f"unknown export '{kind}' (one of: {', '.join(KINDS)})")
    return KINDS[kind]


def _is_json(col: Column) -> bool:
    return isinstance(col.type, JSON)


def describe(kind: str) -> str:
    """The columns of an export, in words (the API's documentation is built from this)."""
    names = [f"`{c.name}.<key>`" if _is_json(c) else f"`{c.name}`" for c in columns(kind)]
    return ("Columns, in this order: " + ", ".join(names) + ". A JSON column is flattened into one CSV column "
            "per key found in any row of the run (`metrics.<key>`, nested objects `metrics.<key>.<subkey>`, keys "
            "sorted, lists as JSON text); JSON Lines keeps it as a nested object. Empty cell: NULL or a non-finite "
            "number; booleans `true`/`false`; times ISO 8601 UTC.")


def filename(run_id: str, kind: str, fmt: str) -> str:
    return f"run-{run_id}-{kind}.{fmt}"


def flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": 2}`` under ``metrics`` -> ``{"metrics.a.b": 1, "metrics.c": 2}``."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = value
    return out


def export(store: Store, run_id: str, kind: str = "rounds", fmt: str = "csv") -> Iterator[bytes]:
    """The export as chunks of UTF-8 bytes. Raises ValueError for an unknown ``kind`` or
    ``fmt`` and KeyError for a run not in the store, before anything is written."""
    _table(kind)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format '{fmt}' (one of: {', '.join(FORMATS)})")
    if store.get_run(run_id) is None:
        raise KeyError(f"no run '{run_id}' in the store")
    return _csv(store, run_id, kind) if fmt == "csv" else _jsonl(store, run_id, kind)


def _rows(s: Session, run_id: str, kind: str) -> Iterator[tuple[list[Column], Any]]:
    """(columns, row) in export order; JSON columns come as their raw text."""
    table, cols = _table(kind), columns(kind)
    picked = [cast(c, Text).label(c.name) if _is_json(c) else c for c in cols]
    q = (select(*picked).where(table.c.run_id == run_id)
         .order_by(*(table.c[name] for name in _ORDER[kind])).execution_options(yield_per=CHUNK_ROWS))
    for row in s.execute(q):
        yield cols, row


class _Decoded:
    """Raw JSON text -> its flattened keys, memoized (per-node policies repeat a lot)."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, str | None], dict[str, Any]] = {}

    def __call__(self, name: str, raw: str | None) -> dict[str, Any]:
        key = (name, raw)
        hit = self._memo.get(key)
        if hit is None:
            value = json.loads(raw) if raw else None
            hit = flatten(value, name, {}) if value is not None else {}
            if len(self._memo) > 50_000:
                self._memo.clear()
            self._memo[key] = hit
        return hit


def _json_keys(s: Session, run_id: str, kind: str) -> dict[str, list[str]]:
    """Each JSON column's flattened keys over the whole run (distinct texts only)."""
    table = _table(kind)
    decode = _Decoded()
    out: dict[str, list[str]] = {}
    for col in (c for c in columns(kind) if _is_json(c)):
        keys: set[str] = set()
        q = select(cast(col, Text)).where(table.c.run_id == run_id).distinct()
        for (raw,) in s.execute(q.execution_options(yield_per=CHUNK_ROWS)):
            keys.update(decode(col.name, raw))
        out[col.name] = sorted(keys)
    return out


def _header(s: Session, run_id: str, kind: str) -> list[str]:
    keys = _json_keys(s, run_id, kind)
    out: list[str] = []
    for c in columns(kind):
        out.extend(keys[c.name] if _is_json(c) else [c.name])
    return out


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(_clean(v), separators=(",", ":"), sort_keys=True)
    return str(v)


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    return v


def _csv(store: Store, run_id: str, kind: str) -> Iterator[bytes]:
    with store.snapshot() as s:  # the header's keys and the rows from one state of the store
        yield from _csv_rows(s, run_id, kind)


def _csv_rows(s: Session, run_id: str, kind: str) -> Iterator[bytes]:
    head = _header(s, run_id, kind)
    index = {name: i for i, name in enumerate(head)}
    decode = _Decoded()
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(head)
    n = 0
    for cols, row in _rows(s, run_id, kind):
        cells = [""] * len(head)
        for col, value in zip(cols, row):
            if _is_json(col):
                for key, v in decode(col.name, value).items():
                    cells[index[key]] = _cell(v)
            else:
                cells[index[col.name]] = _cell(value)
        writer.writerow(cells)
        n += 1
        if n % CHUNK_ROWS == 0:
            yield buf.getvalue().encode()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue().encode()


def _jsonl(store: Store, run_id: str, kind: str) -> Iterator[bytes]:
    with store.snapshot() as s:
        yield from _jsonl_rows(s, run_id, kind)


def _jsonl_rows(s: Session, run_id: str, kind: str) -> Iterator[bytes]:
    lines: list[str] = []
    for cols, row in _rows(s, run_id, kind):
        obj = {c.name: (json.loads(v) if v else None) if _is_json(c) else v for c, v in zip(cols, row)}
        lines.append(json.dumps(_clean(obj), separators=(",", ":"), allow_nan=False))
        if len(lines) == CHUNK_ROWS:
            yield ("\n".join(lines) + "\n").encode()
            lines = []
    if lines:
        yield ("\n".join(lines) + "\n").encode()
