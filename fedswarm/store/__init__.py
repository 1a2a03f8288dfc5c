"""The run store: every runtime writes it, the dashboard reads it.

- :mod:`fedswarm.store.db`: :class:`Store`, the queries (runs, rounds, node rows, events,
  checkpoints, controls, the ``result.json`` export) over SQLAlchemy: an SQLite file by default,
  PostgreSQL by URL;
- :mod:`fedswarm.store.schema`: the tables;
- :mod:`fedswarm.store.migrations`: creating and upgrading them;
- :mod:`fedswarm.store.rows`: how a round's node rows and rejections are written;
- :mod:`fedswarm.store.liveness`: whether a live run still has a process behind it.

What ``fedswarm.store`` names (:class:`Store`, the tables, :func:`migrate`, ...) is imported from
here; the other modules' names from their module.
"""

from fedswarm.store.db import (CONTROL_KINDS, RUN_STATUSES, Base, Checkpoint, Control, Event, Node, NodeRound,
                               Rejection, Round, RowConflict, Run, Store, create_schema, default_db_url, migrate,
                               to_url)

__all__ = ["Base", "Run", "Round", "NodeRound", "Rejection", "Node", "Event", "Checkpoint", "Control", "Store",
           "RowConflict", "default_db_url", "create_schema", "migrate", "to_url", "RUN_STATUSES", "CONTROL_KINDS"]
