"""``fedswarm bench swarm`` in miniature: every exchange path through a real peer process,
the Noise ratio with its handshake apart, and the warning that the reference itself was
unsteady."""

from __future__ import annotations


def test_the_exchange_bench_runs_every_path_and_reports_the_handshake_apart():
    """``fedswarm bench swarm --exchange-only`` in miniature (a 1 MB model, one rep): every
    path moves the model through a real peer process, and only the Noise paths have a
    handshake to set apart (so its ratio less the handshake is the larger)."""
    from fedswarm.bench.swarm_exchange import EXCHANGE_PATHS, exchange_rows

    rows = {r["path"]: r for r in exchange_rows(reps=1, d=250_000)}
    assert set(rows) == set(EXCHANGE_PATHS)
    for path, r in rows.items():
        assert r["payload_bytes"] == 1_000_000 and r["wire_bytes"] >= 1_000_000, path
        assert r["seconds"] > 0 and r["ratio_vs_raw"] > 0, path
    assert rows["raw"]["ratio_vs_raw"] == 1.0
    hs = [p for p, r in rows.items() if r["handshake_ms"] is not None]
    assert hs == ["encrypted", "pipelined"]
    assert all(rows[p]["ratio_vs_raw_handshake_apart"] > rows[p]["ratio_vs_raw"] for p in hs)
    assert all(r["ratio_vs_raw_handshake_apart"] is None for p, r in rows.items() if p not in hs)
    assert sum("[this machine's default]" in r["transport"] for r in rows.values()) == 1


def test_the_bench_warns_when_the_raw_reference_itself_is_unsteady():
    from fedswarm.bench.swarm import _p90, unsteady

    assert _p90([0.010] * 9 + [0.030]) == 0.010 and _p90([0.010, 0.030]) == 0.030
    steady = {"benchmark": "exchange", "path": "raw", "seconds": 0.010, "seconds_all": [0.009, 0.010, 0.011, 0.012]}
    assert unsteady([steady]) is None
    bimodal = dict(steady, seconds_all=[0.008, 0.009, 0.010, 0.025, 0.026])  # as seen on a shared VM
    assert "p90 0.026 s is over 1.5x its median 0.010 s" in unsteady([bimodal])
    assert unsteady([dict(bimodal, path="encrypted")]) is None  # only the reference's spread says so
