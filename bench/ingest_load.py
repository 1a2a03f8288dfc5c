"""The load side of ``fedswarm bench ingest``: logging in, issuing tokens, and the reporters.

Each reporter has its own token and its own run. A swarm peer posts rounds with 3 node rows,
a remote ServerApp rounds with 10; both post a node heartbeat every other round. A request
that times out or loses its connection is sent again with the same body until it is
answered (as :mod:`fedswarm.swarm.report` peers and remote ServerApps would); a 409 answering
such a retry means the first try was stored, so it counts as acknowledged. 429 waits its
Retry-After and retries; a 5xx is counted and retried.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from fedswarm.bench.dashboard_load import _pct

__all__ = ["LoadResult", "login", "issue_tokens", "run_load"]

TIMEOUT_S = 10.0  # a reporter's patience for one request
GRACE_S = 60.0  # after the run's end, unanswered requests are retried this much longer
SERVERAPP_EVERY = 3  # one reporter in three is a remote ServerApp, the others swarm peers
READ_GAP_S = 0.25


@dataclass
class LoadResult:
    sent: dict = field(default_factory=dict)  # (run, round) -> node ids, every round body sent
    acked: dict = field(default_factory=dict)  # (run, round) -> node ids, acknowledged ones
    run_ids: list = field(default_factory=list)
    ingest_ms: list = field(default_factory=list)
    reads_ms: dict = field(default_factory=dict)  # endpoint -> latencies
    statuses: Counter = field(default_factory=Counter)
    read_statuses: Counter = field(default_factory=Counter)
    retries: int = 0
    unexpected: list = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def summary(self) -> dict:
        reads = [x for v in self.reads_ms.values() for x in v]
        acked_rows = len(self.acked) + sum(len(v) for v in self.acked.values())
        return {
            "requests": len(self.ingest_ms), "requests_per_s": len(self.ingest_ms) / self.wall_s,
            "rows_per_s": acked_rows / self.wall_s,
            "ingest_p50_ms": statistics.median(self.ingest_ms) if self.ingest_ms else float("nan"),
            "ingest_p99_ms": _pct(self.ingest_ms, 99),
            "read_p50_ms": statistics.median(reads) if reads else float("nan"), "read_p99_ms": _pct(reads, 99),
            "read_p99_by_endpoint_ms": {k: round(_pct(v, 99), 1) for k, v in self.reads_ms.items()},
            "reads": sum(len(v) for v in self.reads_ms.values()),
            "status_5xx": sum(c for s, c in self.statuses.items() if isinstance(s, int) and s >= 500)
            + sum(c for s, c in self.read_statuses.items() if isinstance(s, int) and s >= 500),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
            "read_statuses": {str(k): v for k, v in sorted(self.read_statuses.items(), key=str)},
            "retries": self.retries, "unexpected": self.unexpected[:10], "loadgen_cpu_s": round(self.cpu_s, 1),
        }


def login(url: str, username: str, password: str) -> tuple[httpx.Cookies, str]:
    """Log in through the form as a browser does; (session cookies, the session's CSRF token)."""
    with httpx.Client(base_url=url, timeout=30) as c:
        token = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/login").text).group(1)
        r = c.post("/login", data={"username": username, "password": password, "csrf_token": token, "next": "/runs"})
        if r.status_code != 303:
            raise RuntimeError(f"login as {username} failed: {r.status_code} {r.text[:200]}")
        csrf = re.search(r'name="csrf-token" content="([^"]+)"', c.get("/runs").text).group(1)
        return c.cookies, csrf


async def issue_tokens(url: str, cookies: httpx.Cookies, csrf: str, n: int, concurrency: int = 8) -> list[str]:
    """``n`` reporter tokens through ``POST /api/tokens``, as the logged-in admin."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, cookies=cookies, headers={"X-CSRF-Token": csrf}, timeout=60) as c:
        async def one(i: int) -> str:
            async with sem:
                r = await c.post("/api/tokens", json={"name": f"reporter-{i}", "role": "reporter"})
                if r.status_code != 201:
                    raise RuntimeError(f"issuing token {i} failed: {r.status_code} {r.text[:200]}")
                return r.json()["token"]
        return list(await asyncio.gather(*(one(i) for i in range(n))))


class _Reporter:
    def __init__(self, i: int, token: str, client: httpx.AsyncClient, res: LoadResult, tag: str):
        self.i, self.client, self.res = i, client, res
        self.serverapp = i % SERVERAPP_EVERY == 0
        self.run_id = f"{'sa' if self.serverapp else 'sw'}-{tag}-{i}"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.nodes = [f"{self.run_id}-n{j}" for j in range(10 if self.serverapp else 3)]

    async def post(self, path: str, body: dict, give_up_at: float) -> tuple[int | None, int]:
        """(final status or None if never answered, retries it took)."""
        tries = 0
        while True:
            t0 = time.perf_counter()
            try:
                r = await self.client.post(path, json=body, headers=self.headers, timeout=TIMEOUT_S)
            except httpx.TransportError as exc:  # timeouts, refused or dropped connections
                self.res.statuses[type(exc).__name__] += 1
                status, wait = None, min(8.0, 0.5 * 2 ** tries)
            else:
                self.res.ingest_ms.append((time.perf_counter() - t0) * 1e3)
                self.res.statuses[r.status_code] += 1
                status = r.status_code
                if status == 429:
                    wait = float(r.headers.get("retry-after", 1))
                elif status >= 500:
                    wait = min(8.0, 0.5 * 2 ** tries)
                else:
                    return status, tries
            if time.monotonic() + wait > give_up_at:
                return status, tries
            tries += 1
            self.res.retries += 1
            await asyncio.sleep(wait * random.uniform(0.8, 1.2))

    def _ok(self, what: str, status: int | None, tries: int) -> bool:
        if status in (200, 201) or (status == 409 and tries > 0):
            return True
        if len(self.res.unexpected) < 50:
            self.res.unexpected.append(f"{self.run_id} {what}: {status} after {tries} retries")
        return False

    def round_body(self, r: int) -> dict:
        rng = random.Random(hash((self.run_id, r)))
        nodes = [{"node_id": n, "bytes_up": rng.randrange(10**6), "bytes_down": rng.randrange(10**6),
                  "num_examples": 600, "train_loss": rng.random(), "device_class": "edge-wifi",
                  "status": "failed" if rng.random() < 0.02 else "ok"} for n in self.nodes]
        return {"round": r, "train_loss": rng.random(), "test_accuracy": rng.random(),
                "bytes_up": sum(n["bytes_up"] for n in nodes), "bytes_down": sum(n["bytes_down"] for n in nodes),
                "wall_s": 1.0, "num_clients": len(nodes), "metrics": {"bench": "ingest"}, "nodes": nodes}

    async def heartbeat(self, r: int, give_up_at: float) -> None:
        body = {"node_id": self.nodes[0], "kind": "serverapp" if self.serverapp else "peer", "run_id": self.run_id,
                "device_class": "edge-wifi", "info": {"round": r}}
        self._ok("heartbeat", *await self.post("/api/ingest/nodes", body, give_up_at))

    async def main(self, end: float, every_s: float, min_rounds: int = 0) -> None:
        """Register, then report a round every ``every_s`` until ``end``, and at least
        ``min_rounds`` rounds however long that takes (a test's count, not a loaded machine's)."""
        give_up_at = end + GRACE_S
        await asyncio.sleep(random.uniform(0, every_s))  # reporters join over the first interval
        body = {"run_id": self.run_id, "name": self.run_id, "status": "running",
                "config": {"strategy": "fedavg", "engine": "flower" if self.serverapp else "swarm", "rounds": 10**6}}
        if not self._ok("register", *await self.post("/api/ingest/runs", body, give_up_at)):
            return
        self.res.run_ids.append(self.run_id)
        r = 1
        while time.monotonic() < end or r <= min_rounds:
            give_up_at = max(give_up_at, time.monotonic() + GRACE_S)
            body = self.round_body(r)
            self.res.sent[(self.run_id, r)] = self.nodes
            if self._ok(f"round {r}", *await self.post(f"/api/ingest/runs/{self.run_id}/rounds", body, give_up_at)):
                self.res.acked[(self.run_id, r)] = self.nodes
            if r % 2 == 1 and time.monotonic() < end:
                await self.heartbeat(r, give_up_at)
            r += 1
            await asyncio.sleep(every_s * random.uniform(0.8, 1.2))


async def _reader(url: str, cookies: httpx.Cookies, res: LoadResult, end: float) -> None:
    """The dashboard's reads during the load: the runs list and one run's page API."""
    async with httpx.AsyncClient(base_url=url, cookies=cookies, timeout=60) as c:
        while time.monotonic() < end:
            paths = ["/api/runs"]
            if res.run_ids:
                paths.append(f"/api/runs/{random.choice(res.run_ids)}")
            for path in paths:
                key = "/api/runs/{id}" if path != "/api/runs" else path
                t0 = time.perf_counter()
                try:
                    status = (await c.get(path)).status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                res.reads_ms.setdefault(key, []).append((time.perf_counter() - t0) * 1e3)
                res.read_statuses[status] += 1
            await asyncio.sleep(READ_GAP_S)


async def run_load(url: str, tokens: list[str], cookies: httpx.Cookies, *, seconds: float,
                   round_every_s: float, min_rounds: int = 0) -> LoadResult:
    """Every token a reporter for ``seconds`` (and for at least ``min_rounds`` rounds each);
    what was sent, acknowledged and measured."""
    res = LoadResult()
    tag = f"{int(time.time()) % 100000:05d}"
    limits = httpx.Limits(max_connections=len(tokens) + 8, max_keepalive_connections=len(tokens) + 8)
    cpu0, t0 = time.process_time(), time.monotonic()
    end = t0 + seconds
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        reporters = [_Reporter(i, tok, client, res, tag) for i, tok in enumerate(tokens)]
        await asyncio.gather(_reader(url, cookies, res, end),
                             *(r.main(end, round_every_s, min_rounds) for r in reporters))
    res.wall_s = time.monotonic() - t0
    res.cpu_s = time.process_time() - cpu0
    return res
