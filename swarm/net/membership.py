"""Membership without a coordinator: gossip of member lists and heartbeat failure detection.

Gossip-style failure detection (van Renesse, Minsky, Hayden, Middleware 1998): every peer
keeps a table ``id -> (address, incarnation, heartbeat counter, info)``; it bumps its own
counter every interval and sends its table to a few random members, which merge it (the
larger ``(incarnation, heartbeat)`` wins) and answer with theirs. A member whose counter
has not grown for ``suspect_after`` intervals is *suspected*; after ``remove_after``
intervals it is removed and remembered as a tombstone, so stale gossip cannot bring it
back, while a restarted peer (new incarnation: its start time) rejoins at once.

Every peer derives the topology from the sorted ids of the members it has not removed
(:meth:`Membership.view`), so no coordinator is needed; views agree once gossip settles.
``info`` carries a few small facts per member (round, done, recent round stats).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedswarm.algorithms.decentralized.topology import Topology, make_topology

__all__ = ["Member", "Membership", "View"]


@dataclass
class Member:
    peer_id: str
    addr: str
    incarnation: int
    heartbeat: int
    seen: float  # local monotonic time the counter last grew
    info: dict[str, Any] = field(default_factory=dict)
    suspected: bool = False

    @property
    def version(self) -> tuple[int, int]:
        return (self.incarnation, self.heartbeat)

    def entry(self) -> dict[str, Any]:
        return {"id": self.peer_id, "addr": self.addr, "inc": self.incarnation, "hb": self.heartbeat,
                "info": self.info}


@dataclass(frozen=True)
class View:
    """One peer's view of the swarm at a moment: sorted ids, its index, the topology."""

    ids: tuple[str, ...]
    index: int
    topology: Topology | None  # None when alone

    @property
    def n(self) -> int:
        return len(self.ids)

    def neighbors(self, round: int = 0) -> list[str]:
        if self.topology is None:
            return []
        return [self.ids[j] for j in self.topology.neighbors(self.index, round)]

    def weights(self, round: int = 0) -> dict[str, float]:
        if self.topology is None:
            return {self.ids[self.index]: 1.0}
        return {self.ids[j]: w for j, w in self.topology.weights(self.index, round).items()}


class Membership:
    """This peer's member table (thread-safe).

    Parameters
    ----------
    self_id, addr : str
        Our id and listening address.
    admit : callable
        ``admit(peer_id) -> bool``; gossip about keys not on the allow list is ignored.
    interval_s : float
        Heartbeat period.
    suspect_after, remove_after : int
        Intervals without a heartbeat before a member is suspected, then removed (K).
    clock : callable
        Monotonic seconds for silence measurements (tests pass a manual clock).
    """

    def __init__(self, self_id: str, addr: str, *, admit: Callable[[str], bool] = lambda _: True,
                 interval_s: float = 0.5, suspect_after: int = 4, remove_after: int = 8,
                 fanout: int = 3, incarnation: int | None = None, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < suspect_after <= remove_after:
            raise ValueError("need 0 < suspect_after <= remove_after")
        self.self_id = self_id
        self.admit = admit
        self.interval_s = interval_s
        self.suspect_after = suspect_after
        self.remove_after = remove_after
        self.fanout = fanout
        self.clock = clock
        inc = incarnation if incarnation is not None else int(time.time() * 1000)
        self.me = Member(self_id, addr, inc, 0, clock())
        self.members: dict[str, Member] = {}
        self.tombstones: dict[str, tuple[int, int]] = {}
        self.events: list[tuple[float, str, str]] = []  # (time, event, peer id)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._topologies: dict[tuple, Topology] = {}

    # -- our own entry -------------------------------------------------------------------
    def beat(self, **info: Any) -> None:
        with self._lock:
            self.me.heartbeat += 1
            self.me.info.update(info)

    def set_info(self, **info: Any) -> None:
        """Change our info; a new version of our entry (the heartbeat counter moves), since a
        merge takes an entry's info only with a newer version: the next digest we send, a
        gossip reply included, carries it, even if we stop before our next beat."""
        with self._lock:
            self.me.heartbeat += 1
            self.me.info.update(info)

    # -- gossip --------------------------------------------------------------------------
    def digest(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self.me.entry()] + [m.entry() for m in self.members.values()]

    def merge(self, entries: Any) -> int:
        """Merge a gossiped table; returns how many entries were new or newer. Malformed
        entries are skipped."""
        if not isinstance(entries, list):
            return 0
        changed, now = 0, self.clock()
        with self._lock:
            for e in entries[:10_000]:
                try:
                    pid, addr, ver = e["id"], e["addr"], (int(e["inc"]), int(e["hb"]))
                    info = e.get("info") or {}
                    if not (isinstance(pid, str) and isinstance(addr, str) and isinstance(info, dict)):
                        continue
                except (KeyError, TypeError, ValueError):
                    continue
                if pid == self.self_id or not self.admit(pid):
                    continue
                if pid in self.tombstones and ver <= self.tombstones[pid]:
                    continue
                m = self.members.get(pid)
                if m is None:
                    self.tombstones.pop(pid, None)
                    self.members[pid] = Member(pid, addr, ver[0], ver[1], now, info)
                    self.events.append((time.time(), "joined", pid))
                    changed += 1
                elif ver > m.version:
                    m.addr, m.incarnation, m.heartbeat, m.seen, m.info = addr, ver[0], ver[1], now, info
                    if m.suspected:
                        self.events.append((time.time(), "recovered", pid))
                    m.suspected = False
                    changed += 1
        return changed

    def check(self) -> list[tuple[str, str]]:
        """Suspect and remove silent members; returns ``[(event, peer id)]``."""
        out, now = [], self.clock()
        with self._lock:
            for pid, m in list(self.members.items()):
                silent = (now - m.seen) / self.interval_s
                if silent > self.remove_after:
                    del self.members[pid]
                    self.tombstones[pid] = m.version
                    out.append(("removed", pid))
                elif silent > self.suspect_after and not m.suspected:
                    m.suspected = True
                    out.append(("suspected", pid))
            self.events.extend((time.time(), ev, pid) for ev, pid in out)
        return out

    def gossip_targets(self) -> list[Member]:
        with self._lock:
            pool = [m for m in self.members.values() if not m.suspected] or list(self.members.values())
            return self._rng.sample(pool, min(self.fanout, len(pool)))

    # -- queries -------------------------------------------------------------------------
    def get(self, peer_id: str) -> Member | None:
        with self._lock:
            return self.me if peer_id == self.self_id else self.members.get(peer_id)

    def addr_of(self, peer_id: str) -> str | None:
        m = self.get(peer_id)
        return m.addr if m is not None else None

    def info_of(self, peer_id: str) -> dict[str, Any]:
        m = self.get(peer_id)
        return dict(m.info) if m is not None else {}

    def ids(self) -> list[str]:
        """Sorted ids of every member not removed (suspected ones included), us too."""
        with self._lock:
            return sorted([self.self_id, *self.members])

    def count(self) -> int:
        with self._lock:
            return 1 + len(self.members)

    def view(self, spec: str = "ring", seed: int = 0) -> View:
        ids = tuple(self.ids())
        if len(ids) == 1:
            return View(ids, 0, None)
        key = (spec, seed, len(ids))
        topo = self._topologies.get(key)
        if topo is None:
            topo = self._topologies[key] = make_topology(spec, len(ids), seed)
        return View(ids, ids.index(self.self_id), topo)
