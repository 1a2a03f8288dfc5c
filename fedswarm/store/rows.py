"""How a round's node rows and rejections are written (:class:`fedswarm.store.Store`): one row
per node per round, a re-sent identical row skipped, a differing one refused by name."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from fedswarm.store.schema import NodeRound, Rejection

__all__ = ["NOT_PICKED", "RowConflict"]

#: A node row's statuses for a node its round's sampling left out, the row's reason saying why
#: (``fedswarm.server.fleet_grid`` writes them; the dashboard's Nodes page shows the reason).
NOT_PICKED = ("ineligible", "unavailable")


class RowConflict(ValueError):
    """A write that contradicts a row the store holds: a node's row of a round sent again
    with other values. The message names the run, round, node and the differing columns."""


_NODE_COLUMNS = {c.name: c for c in NodeRound.__table__.columns if c.name not in ("id", "run_id", "round")}


def _node_value(row: dict, name: str) -> Any:
    """Column ``name`` of a node row as the store would hold it (its default when left out)."""
    if name in row:
        return str(row[name]) if name == "node_id" else row[name]
    default = _NODE_COLUMNS[name].default
    if default is None:
        return None
    return default.arg(None) if default.is_callable else default.arg


def _add_node_rows(s: Session, run_id: str, round: int, rows: list[dict]) -> list[dict]:
    """Insert the rows the store lacks (one per node per round, the unique index's rule)
    and return them; a row it holds is skipped when identical and a :class:`RowConflict`
    otherwise."""
    wanted = [{k: _node_value(r, k) for k in _NODE_COLUMNS} for r in rows]
    ids = list({r["node_id"] for r in wanted})
    held: dict[str, dict] = {}
    for i in range(0, len(ids), 500):  # bounded IN lists (SQLite's parameter limit)
        q = select(NodeRound).where(NodeRound.run_id == run_id, NodeRound.round == round,
                                    NodeRound.node_id.in_(ids[i:i + 500]))
        held.update((nr.node_id, {k: getattr(nr, k) for k in _NODE_COLUMNS}) for nr in s.scalars(q))
    fresh = []
    for r in wanted:
        have = held.get(r["node_id"])
        if have is None:
            held[r["node_id"]] = r
            fresh.append(r)
        elif have != r:
            diff = ", ".join(f"{k}: {have[k]!r} held, {r[k]!r} sent" for k in _NODE_COLUMNS if have[k] != r[k])
            raise RowConflict(f"node '{r['node_id']}' of round {round} of run '{run_id}' is already recorded with "
                              f"other values ({diff}); a node has one row per round")
    s.add_all(NodeRound(run_id=run_id, round=round, **r) for r in fresh)
    return fresh


def _add_rejections(s: Session, run_id: str, round: int, reasons: dict[str, str]) -> None:
    for node_id, reason in reasons.items():
        s.add(Rejection(run_id=run_id, round=round, node_id=str(node_id)[:64], reason=str(reason)[:2000]))
