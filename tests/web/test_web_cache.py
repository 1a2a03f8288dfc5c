"""The response cache and the cached-read fast path (``fedswarm.web.hot_reads.CachedReads``):
repeats skip the route but never the auth rules, the security headers, or a write's effect."""

from __future__ import annotations

import asyncio

from dashboard_helpers import bearer, make_token

from fedswarm.web.routers.api import runs as api_runs
from fedswarm.web.cache import Answer, ResponseCache


def _count_route_calls(monkeypatch) -> list[tuple]:
    """Record each time a cached read route runs (the fast path answers without it)."""
    calls: list[tuple] = []
    real = api_runs._cached

    async def counting(ctx, request, key, build):
        calls.append(key)
        return await real(ctx, request, key, build)

    monkeypatch.setattr(api_runs, "_cached", counting)
    return calls


def _seed(app, n: int = 3) -> list[str]:
    store = app.state.ctx.store
    ids = [store.create_run({"strategy": "fedavg", "rounds": 2}, name=f"r{i}", status="finished") for i in range(n)]
    for rid in ids:
        for r in (1, 2):
            store.add_round(rid, r, test_accuracy=0.5, bytes_up=10)
    return ids


def test_repeats_are_answered_without_the_route_with_the_same_body_and_headers(app, anon, monkeypatch):
    ids = _seed(app)
    calls = _count_route_calls(monkeypatch)
    auth = bearer(make_token(app, "viewer"))
    first = anon.get("/api/runs?limit=2", headers=auth)
    assert first.status_code == 200 and len(first.json()) == 2 and first.headers["x-total-count"] == "3"
    again = anon.get("/api/runs?limit=2", headers=auth)
    assert len(calls) == 1, calls  # the repeat did not reach the route
    assert again.content == first.content and again.headers["x-total-count"] == "3"
    for h in ("cache-control", "x-content-type-options", "x-frame-options", "content-type"):
        assert again.headers[h] == first.headers[h], h
    assert again.headers["cache-control"] == "no-store"
    anon.get("/api/runs?limit=3", headers=auth)  # another query string goes to the route
    assert len(calls) == 2
    rounds = anon.get(f"/api/runs/{ids[0]}/rounds", headers=auth)
    assert [r["round"] for r in rounds.json()] == [1, 2]
    assert anon.get(f"/api/runs/{ids[0]}/rounds", headers=auth).content == rounds.content
    assert len(calls) == 3


def test_fast_path_keeps_the_auth_rules(app, anon, monkeypatch):
    ids = _seed(app)
    row, viewer = app.state.ctx.accounts.create_token("viewer-test", "viewer", None, "test")
    reporter = make_token(app, "reporter")
    for path in ("/api/runs", f"/api/runs/{ids[0]}/rounds", f"/api/runs/{ids[0]}"):
        assert anon.get(path, headers=bearer(viewer)).status_code == 200  # now cached and aliased
        assert anon.get(path).status_code == 401, path
        assert anon.get(path, headers={"Authorization": "Basic " + viewer}).status_code == 401, path
        assert anon.get(path, headers=bearer(viewer + "x")).status_code == 401, path
        assert anon.get(path, headers=bearer(reporter)).status_code == 403, path
        assert anon.get(path, headers=bearer(reporter)).status_code == 403, path  # reporter now in the cache
        anon.cookies.set("fedswarm_session", "forged.value")
        assert anon.get(path).status_code == 401, path
        anon.cookies.clear()
    assert anon.get("/api/runs", headers=bearer(viewer)).status_code == 200
    app.state.ctx.accounts.revoke_token(row.id)
    assert anon.get("/api/runs", headers=bearer(viewer)).status_code == 401


def test_session_cookie_reader_is_served_and_sees_its_own_write_at_once(app, admin, monkeypatch):
    rid = app.state.ctx.store.create_run({"strategy": "fedavg", "rounds": 100}, name="live", status="running")
    calls = _count_route_calls(monkeypatch)
    before = admin.get(f"/api/runs/{rid}").json()
    assert admin.get(f"/api/runs/{rid}").json() == before and len(calls) == 1  # cookie reader, fast path
    assert admin.post(f"/api/runs/{rid}/pause").status_code == 200
    after = admin.get(f"/api/runs/{rid}").json()  # the write cleared the cache: no stale answer
    assert "pause" in after["pending"] and "pause" not in before["pending"]
    assert len(calls) == 2


def test_stale_entry_is_served_while_one_background_rebuild_runs(app):
    store = app.state.ctx.store
    rid = store.create_run({"strategy": "fedavg"}, name="x", status="running")
    cache = ResponseCache(store, ttl_s=60, mark_s=60, max_stale_s=60)
    built: list[int] = []

    def build() -> Answer:
        n = len(store.rounds(rid))
        built.append(n)
        return Answer(str(n).encode())

    assert cache.get(("k",), build).body == b"0"
    assert cache.lookup(("k",)) == (Answer(b"0"), False)
    store.add_round(rid, 1)
    cache._mark_at -= 61  # the mark is now too old to vouch for the entry

    async def serve_stale_then_refresh():
        value, refresh = cache.lookup(("k",))
        assert value == Answer(b"0") and refresh
        rebuild = cache.refresh_soon(("k",))
        assert rebuild is not None and cache.refresh_soon(("k",)) is None  # one rebuild at a time
        await asyncio.wait_for(rebuild, 30)

    asyncio.run(serve_stale_then_refresh())
    assert built == [0, 1] and cache.lookup(("k",)) == (Answer(b"1"), False)


def test_an_answer_built_across_a_clear_is_not_kept(app):
    store = app.state.ctx.store
    cache = ResponseCache(store)

    def build_racing_a_write() -> Answer:
        cache.clear()  # this process wrote while the answer was being built from older data
        return Answer(b"old")

    assert cache.get(("k",), build_racing_a_write).body == b"old"
    assert cache.lookup(("k",)) == (None, True)


def test_too_old_entry_is_not_served(app):
    cache = ResponseCache(app.state.ctx.store, max_stale_s=0.5)
    cache.get(("k",), lambda: Answer(b"a"))
    cache._mark_at -= 10
    entry = cache._entries[("k",)]
    cache._entries[("k",)] = entry.__class__(entry.expires, entry.mark, entry.built_at - 10, entry.value, entry.build)
    assert cache.lookup(("k",)) == (None, True)
