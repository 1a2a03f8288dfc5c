"""A node's own state on its own disk, so that a resumed run finds it again.

A deployment resume (``fedswarm resume RUN_ID --federation F``) and a resumed run on Flower's
simulation engine are new Flower runs: every node's ``Context.state`` starts empty. What the
strategies keep there (a compressed strategy's error-feedback residual and model replica, a
decentralized node's own model and algorithm memory) is needed to go on exactly, so
fedswarm's ClientApp writes it here after every train reply, and restores it when the resumed
server asks (:mod:`fedswarm.client.app`, :mod:`fedswarm.server.client_state`).

Layout: ``STATE_DIR/<fedswarm run id>/partition-<P>/round-<R>.state``, one snapshot per server
round the node trained in (its state *after* that round's reply), the newest ``keep`` kept.
Runs are kept too, not forever: when a node saves a run's first snapshot, the folders of all
but the ``keep_runs`` most recently written runs (this one counted) are removed
(``fedswarm client --state-keep-runs``, default :data:`RUNS_KEPT`; 0 keeps every run). A
removed run can still be resumed: its nodes are resynchronised by the protocol, not exactly.
The key is fedswarm's run id (the store's, which a resume keeps), never Flower's (a resume is a
new Flower run) and the node's partition (what it trains on; a restarted SuperNode gets a new
node id, not a new partition).

A snapshot file is ``MAGIC``, one JSON header line (run id, partition, round, node id, the
body's length and SHA-256) and the body: the state's :class:`~flwr.app.RecordDict` in Flower's
own protobuf serialization. It is written to a temporary file in the same folder, fsynced and
renamed over the final name, so a reader sees a whole snapshot or none; a leftover temporary
file (a node killed while writing) is never read, and is removed at the next save. A file
that is truncated, altered, too large or written for another run or partition is refused
with one log line naming the file and why: the node then has no state, and the server
resynchronises it by the protocol.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from fedswarm.procs import pid_alive

__all__ = ["ClientStateStore", "Snapshot", "StateFileError", "default_state_dir", "state_dir_of",
           "STATE_DIR_KEY", "STATE_DIR_ENV", "KEEP_RUNS_KEY", "MAX_BYTES", "RUNS_KEPT", "prune_runs"]

log = logging.getLogger("fedswarm.client")

#: Node-config key with the folder the node keeps its state in (set by ``fedswarm client``).
STATE_DIR_KEY = "state-dir"
#: Environment variable with that folder, for nodes without the node-config key (Flower's
#: simulation engine cannot set a node config; fedswarm's flower engine sets this).
STATE_DIR_ENV = "FEDSWARM_STATE_DIR"
#: Node-config key with how many runs' state the node keeps (``fedswarm client --state-keep-runs``).
KEEP_RUNS_KEY = "state-keep-runs"
#: Runs whose state a node keeps by default (the most recently written ones).
RUNS_KEPT = 5
MAGIC = b"FEDSWARM-CLIENT-STATE 1\n"
#: Largest snapshot body read back (a sanity bound: a bigger file is refused, not loaded).
MAX_BYTES = 4 << 30
_NAME = re.compile(r"^round-(\d{8})\.state$")
_TMP_PREFIX = ".tmp-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class StateFileError(ValueError):
    """A snapshot file that cannot be trusted (truncated, altered, foreign, too large)."""


def default_state_dir() -> Path:
    """The per-user data folder: ``$XDG_DATA_HOME/fedswarm/client-state`` (else
    ``~/.local/share/fedswarm/client-state``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fedswarm" / "client-state"


def state_dir_of(node_config: dict) -> Path | None:
    """The folder this node keeps its state in: its node config's ``state-dir``, else
    ``$FEDSWARM_STATE_DIR``, else None (the node keeps no state on disk)."""
    value = node_config.get(STATE_DIR_KEY) or os.environ.get(STATE_DIR_ENV)
    return Path(str(value)).expanduser() if value else None


@dataclass
class Snapshot:
    """One saved state: the round it followed, the node id the node had then, the state."""

    round: int
    node_id: int
    state: RecordDict


class ClientStateStore:
    """The snapshots of one node (``partition``) in one fedswarm run (``run_id``) under ``root``.

    ``keep``: how many snapshots (the newest rounds) stay after a save; it must cover the
    rounds between two server checkpoints plus the round in flight when a server dies.
    ``keep_runs``: how many runs' folders stay under ``root`` after this run's first save
    (:func:`prune_runs`; 0 keeps them all).
    """

    def __init__(self, root: Path | str, run_id: str, partition: int, keep: int = 3, keep_runs: int = RUNS_KEPT):
        if not str(run_id):
            raise ValueError("a client state store needs the fedswarm run id")
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if int(keep_runs) < 0:
            raise ValueError(f"keep_runs must be >= 0 (0 keeps every run), got {keep_runs}")
        self.run_id, self.partition, self.keep, self.keep_runs = str(run_id), int(partition), int(keep), int(keep_runs)
        self.root = Path(root)
        self.folder = self.root / _SAFE.sub("_", self.run_id) / f"partition-{self.partition}"

    # -- writing ---------------------------------------------------------------------------
    def save(self, server_round: int, state: RecordDict, node_id: int = 0) -> Path:
        """Write the state after ``server_round`` atomically; prune older snapshots."""
        body = recorddict_to_proto(state).SerializeToString()
        header = {"run_id": self.run_id, "partition": self.partition, "round": int(server_round),
                  "node_id": int(node_id), "nbytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        first = not self.folder.is_dir()
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"round-{int(server_round):08d}.state"
        tmp = self.folder / f"{_TMP_PREFIX}{os.getpid()}-{final.name}"
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.folder)
        self.prune()
        if first and self.keep_runs:
            prune_runs(self.root, self.keep_runs, current=self.folder.parent.name)
        return final

    def prune(self) -> None:
        """Keep the newest ``keep`` snapshots; remove leftover temporary files of this process
        and of processes that are gone."""
        for old in self.rounds()[:-self.keep]:
            (self.folder / f"round-{old:08d}.state").unlink(missing_ok=True)
        for tmp in self.folder.glob(f"{_TMP_PREFIX}*"):
            pid = tmp.name[len(_TMP_PREFIX):].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or not pid_alive(int(pid)):
                tmp.unlink(missing_ok=True)

    # -- reading ---------------------------------------------------------------------------
    def rounds(self) -> list[int]:
        """Rounds with a snapshot, oldest first (temporary files are not snapshots)."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name)))

    def load(self, at_most: int) -> Snapshot | None:
        """The newest snapshot of a round ``<= at_most`` (the node's state after the server's
        round ``at_most``: a node that sat out rounds kept the state of its last one), or None
        when there is none or it cannot be trusted (logged, with the reason)."""
        rounds = [r for r in self.rounds() if r <= int(at_most)]
        if not rounds:
            return None
        path = self.folder / f"round-{rounds[-1]:08d}.state"
        try:
            return self.read(path, expect_round=rounds[-1])
        except StateFileError as exc:
            log.warning("fedswarm: refusing client state file %s: %s; this node has no state for run %s",
                        path, exc, self.run_id)
            return None

    def read(self, path: Path, expect_round: int | None = None) -> Snapshot:
        """Read and check one snapshot file; :class:`StateFileError` saying what is wrong."""
        try:
            size = path.stat().st_size
            if size > MAX_BYTES + 4096:
                raise StateFileError(f"{size} bytes is more than the {MAX_BYTES}-byte limit")
            with open(path, "rb") as f:
                magic, line, body = f.read(len(MAGIC)), f.readline(4096), f.read()
        except OSError as exc:
            raise StateFileError(f"cannot read it ({exc})") from None
        if magic != MAGIC:
            raise StateFileError("not a fedswarm client state file (bad magic)")
        try:
            header = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested thousands deep
            raise StateFileError("its header is not JSON") from None
        if not isinstance(header, dict):
            raise StateFileError("its header is not a JSON object")
        for key in ("round", "node_id"):
            if key in header and (type(header[key]) is not int or header[key] < 0):
                raise StateFileError(f"its header's {key} is {header[key]!r}, not a non-negative integer")
        if "round" not in header:
            raise StateFileError("its header has no round")
        if header.get("run_id") != self.run_id or header.get("partition") != self.partition:
            raise StateFileError(f"it belongs to run {header.get('run_id')!r} partition {header.get('partition')!r}, "
                                 f"not run {self.run_id!r} partition {self.partition}")
        if expect_round is not None and header.get("round") != expect_round:
            raise StateFileError(f"its header says round {header.get('round')!r}, its name round {expect_round}")
        if header.get("nbytes") != len(body):
            raise StateFileError(f"truncated or padded: {len(body)} body bytes, header says {header.get('nbytes')}")
        if header.get("sha256") != hashlib.sha256(body).hexdigest():
            raise StateFileError("its checksum does not match its contents")
        proto = ProtoRecordDict()
        try:
            proto.ParseFromString(body)
            state = recorddict_from_proto(proto)
        except Exception as exc:  # protobuf's DecodeError and whatever a bad record raises
            raise StateFileError(f"its records do not parse ({type(exc).__name__})") from None
        return Snapshot(int(header["round"]), int(header.get("node_id", 0)), state)


def prune_runs(root: Path, keep: int, current: str | None = None) -> list[str]:
    """Remove the state of all but the ``keep`` runs under ``root`` written to most recently
    (a run's time: its newest snapshot file's, else its folder's); ``current`` (a run folder's
    name) always stays. Returns the removed runs' folder names, each logged."""
    runs = []
    for folder in (p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
        times = [f.stat().st_mtime for part in folder.iterdir() if part.is_dir() for f in part.iterdir()]
        runs.append((max(times, default=folder.stat().st_mtime), folder))
    runs.sort(key=lambda t: (t[1].name == current, t[0]), reverse=True)
    removed = []
    for _, folder in runs[keep:]:
        if folder.name == current:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        log.info("fedswarm: removed the node state of run %s (keeping the %d most recent runs)", folder.name, keep)
        removed.append(folder.name)
    return removed


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

