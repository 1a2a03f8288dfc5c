"""Creating the run store's schema and bringing an older store up to it, in place, safely
when several processes open one store at once (a swarm's peers, a run and the dashboard)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

from sqlalchemy import delete, func, inspect, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from fedswarm.store.schema import NODE_ROUND_KEY, Base, NodeRound

log = logging.getLogger("fedswarm.store")

__all__ = ["create_schema", "migrate", "unique_node_rounds", "sqlite_pragmas"]


def create_schema(engine: Engine) -> None:
    """Create the tables (and indexes) the store lacks. Several processes often open one
    new store at the same moment (a swarm's peers, a run and whoever polls it, the
    dashboard); ``create_all`` checks which tables exist and then creates them, so a table
    another process created in between fails with "already exists". That object is there
    now and the next pass skips it, so the retries end: at most one per schema object."""
    objects = sum(1 + len(table.indexes) for table in Base.metadata.tables.values())
    for attempt in range(objects + 1):
        try:
            Base.metadata.create_all(engine)
            return
        except DBAPIError as exc:
            if "already exists" not in str(exc) or attempt == objects:
                raise


def migrate(engine: Engine) -> None:
    """Bring a store made by an older fedswarm up to this schema, in place.

    New tables come from ``create_all``; columns added since (all nullable) are added with
    ``ALTER TABLE ... ADD COLUMN``, and missing indexes are created. Old rows keep NULL in
    the new columns, which every reader treats as "unknown". Unique indexes that old rows may
    violate have their own step (:func:`unique_node_rounds`). Works on SQLite and PostgreSQL.
    """
    create_schema(engine)
    insp = inspect(engine)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in insp.get_columns(table.name)}
        for col in (c for c in table.columns if c.name not in have):
            ddl = col.type.compile(dialect=engine.dialect)
            with _made_elsewhere_ok():  # another process may migrate the same store at once
                with engine.begin() as conn:
                    conn.exec_driver_sql(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {ddl}')
    unique_node_rounds(engine)
    for table in Base.metadata.sorted_tables:
        for index in table.indexes:
            with _made_elsewhere_ok():
                index.create(engine, checkfirst=True)


def unique_node_rounds(engine: Engine) -> int:
    """Make node_rounds unique per (run_id, round, node_id) in a store from before that rule,
    whose writers (a round's rows written twice, by a retry or two engines) may have left
    duplicates: the oldest row of each is kept, the others deleted and their number logged,
    and the unique index created in the same transaction, writers locked out in between (on
    SQLite the DELETE holds the write lock; on PostgreSQL an explicit lock). Returns how many
    rows it deleted (0 when the index was there)."""
    if any(ix["name"] == NODE_ROUND_KEY for ix in inspect(engine).get_indexes(NodeRound.__tablename__)):
        return 0
    index = next(ix for ix in NodeRound.__table__.indexes if ix.name == NODE_ROUND_KEY)
    key = (NodeRound.run_id, NodeRound.round, NodeRound.node_id)
    dropped = 0
    with _made_elsewhere_ok():  # another process made the index first: its pass removed the duplicates
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"LOCK TABLE {NodeRound.__tablename__} IN SHARE ROW EXCLUSIVE MODE")
            oldest = select(func.min(NodeRound.id)).group_by(*key)
            deleted = conn.execute(delete(NodeRound).where(NodeRound.id.not_in(oldest))).rowcount
            index.create(conn)
        dropped = int(deleted or 0)  # committed
    if dropped:
        log.warning("store migration: deleted %d duplicate node_rounds rows (same run, round and node; the oldest "
                    "of each kept); node rows are now unique per run, round and node", dropped)
    return dropped


@contextmanager
def _made_elsewhere_ok():
    """Ignore the error of creating a schema object that another process just created."""
    try:
        yield
    except DBAPIError as exc:
        msg = str(exc).lower()
        if "already exists" not in msg and "duplicate column" not in msg:
            raise


def sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
