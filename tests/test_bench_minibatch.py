"""``fedswarm bench minibatch`` at a toy size: its cell runs a batched round with the plan timed
inside it, and the section writes its JSON and PNG with a row per checkout."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from fedswarm.bench import minibatch


@pytest.mark.slow  # a fresh interpreter running a batched round (a few seconds quiet; 110 s at load 40)
def test_bench_writes_the_round_and_the_plans_share(tmp_path, monkeypatch):
    monkeypatch.setattr(minibatch, "SHAPE", dict(clients=60, examples=8, batch_size=4, steps=2, rounds=3))
    monkeypatch.delenv(minibatch.BEFORE_ENV, raising=False)
    rows = minibatch.run(tmp_path, quick=True, console=Console(file=open(tmp_path / "out.txt", "w")))
    assert [r["row"] for r in rows] == ["now"]
    (now,) = rows
    assert now["status"] == "finished" and now["clients"] == 12, now
    (cell,) = now["runs"]
    assert len(cell["round_cpu"]) == 3 and len(cell["plan_cpu"]) == 3  # one draw per round, timed inside it
    assert 0 < now["plan_share"] < 1 and now["client_rounds_per_s"] > 0
    saved = json.loads((tmp_path / "minibatch.json").read_text())
    assert saved["rows"][0]["cpu_s_per_round"] == now["cpu_s_per_round"]
    assert (tmp_path / "minibatch.png").stat().st_size > 0
