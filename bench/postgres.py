"""A throwaway PostgreSQL server for benchmarks and tests: Debian's ``postgresql`` binaries
(initdb, pg_ctl under /usr/lib/postgresql/*/bin), a data directory in a temp dir, listening on
127.0.0.1 only, stopped and deleted on exit. initdb refuses to run as root, so as root the
server runs as the ``postgres`` user (runuser)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Iterator

__all__ = ["pg_bindir", "temp_postgres", "create_database"]


def pg_bindir() -> str | None:
    """The newest installed server's bin directory, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(found[-1]) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def temp_postgres(max_connections: int = 200) -> Iterator[int]:
    """Start a server (fsync off: a benchmark's data is thrown away) and yield its port; its
    superuser is ``fedswarm`` with trust auth on loopback. RuntimeError says what is missing."""
    bindir = pg_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL server binaries missing: apt-get install -y postgresql")
    root = tempfile.mkdtemp(prefix="fedswarm-pg-")
    prefix: list[str] = []
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError("running as root and there is no 'postgres' user to run initdb as") from None
        os.chown(root, pw.pw_uid, pw.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), _free_port()
    started = False
    try:
        subprocess.run([*prefix, f"{bindir}/initdb", "-D", data, "-U", "fedswarm", "--auth=trust", "-E", "UTF8",
                        "--no-sync"], check=True, capture_output=True)
        opts = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                f"-c max_connections={max_connections}")
        subprocess.run([*prefix, f"{bindir}/pg_ctl", "-D", data, "-o", opts, "-l", os.path.join(root, "log"),
                        "-w", "-t", "60", "start"], check=True, capture_output=True)
        started = True
        yield port
    finally:
        if started:
            subprocess.run([*prefix, f"{bindir}/pg_ctl", "-D", data, "-m", "fast", "-w", "stop"],
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def create_database(port: int, name: str) -> str:
    """Create database ``name`` on the server at ``port``; its SQLAlchemy URL (psycopg 3)."""
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={port} user=fedswarm dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://fedswarm@127.0.0.1:{port}/{name}"
