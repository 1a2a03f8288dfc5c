"""Creating the run store's schema and bringing an older store up to it, in place, safely
when several processes open one store at once (a swarm's peers, a run and the dashboard)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from sqlalchemy import inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from fedswarm.store_schema import Base

__all__ = ["create_schema", "migrate", "sqlite_pragmas"]


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
    the new columns, which every reader treats as "unknown". Works on SQLite and PostgreSQL.
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
        for index in table.indexes:
            with _made_elsewhere_ok():
                index.create(engine, checkfirst=True)


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
