"""Exports of a run's rounds and per-node rounds (CSV, JSON Lines): the API's download, the
CLI's `fedswarm runs export`, one writer behind both."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, Table
from typer.testing import CliRunner

from dashboard_helpers import bearer, make_token
from fedswarm import export
from fedswarm.cli import app as cli
from fedswarm.store import NodeRound, Round

ROUND_METRICS = [{"consensus_distance": 0.5, "nested": {"a": 1, "b": {"c": True}}},
                 {"consensus_distance": 0.25, "tags": [1, 2.5]},
                 {}]


def _seed(store) -> str:
    rid = store.create_run({"strategy": "fedavg", "rounds": 3}, name="export me", status="finished")
    for r, m in enumerate(ROUND_METRICS, start=1):
        store.add_round(rid, r, train_loss=float("nan") if r == 2 else 1.0 / r, test_accuracy=0.5 + r / 10,
                        bytes_up=100 * r, num_clients=2, metrics=m)
        store.add_node_rounds(rid, r, [
            {"node_id": "b", "bytes_up": 10 * r, "device_class": "gpu", "policy": {"local_steps": r}},
            {"node_id": "a", "bytes_up": 20 * r, "status": "failed" if r == 3 else "ok", "reason": 'say "no", then,'},
        ])
    other = store.create_run({"rounds": 1}, status="finished")  # rows of another run never leak in
    store.add_round(other, 1, metrics={"other_key": 1})
    return rid


def _csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_rounds_csv_flattens_metrics_in_place_and_keeps_every_value(admin):
    store = admin.app.state.ctx.store
    rid = _seed(store)
    r = admin.get(f"/api/runs/{rid}/rounds.csv")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    assert f'filename="run-{rid}-rounds.csv"' in r.headers["content-disposition"]
    head = next(csv.reader(io.StringIO(r.text)))
    # The fixed columns are the table's (less the surrogate id), metrics replaced in place by its keys.
    table_cols = [c.name for c in Round.__table__.columns if c.name != "id"]
    at = table_cols.index("metrics")
    keys = ["metrics.consensus_distance", "metrics.nested.a", "metrics.nested.b.c", "metrics.tags"]
    assert head == table_cols[:at] + keys + table_cols[at + 1:]
    rows = _csv(r.text)
    assert [row["round"] for row in rows] == ["1", "2", "3"]
    assert {row["run_id"] for row in rows} == {rid}
    assert rows[0]["metrics.nested.a"] == "1" and rows[0]["metrics.nested.b.c"] == "true"
    assert rows[0]["metrics.tags"] == "" and rows[1]["metrics.tags"] == "[1,2.5]"
    assert rows[1]["metrics.consensus_distance"] == "0.25" and rows[2]["metrics.consensus_distance"] == ""
    assert rows[1]["train_loss"] == ""  # NaN is written empty, as the JSON API writes null
    for row, orm in zip(rows, store.rounds(rid)):
        assert float(row["test_accuracy"]) == orm.test_accuracy and int(row["bytes_up"]) == orm.bytes_up
        assert row["created_at"] == orm.created_at.isoformat()
        if orm.train_loss is not None and not math.isnan(orm.train_loss):  # SQLite stores NaN as NULL
            assert float(row["train_loss"]) == orm.train_loss


def test_nodes_csv_and_jsonl_match_the_store(viewer):
    store = viewer.app.state.ctx.store
    rid = _seed(store)
    r = viewer.get(f"/api/runs/{rid}/nodes.csv")  # viewers may export
    assert r.status_code == 200, r.text
    rows = _csv(r.text)
    assert [(x["round"], x["node_id"]) for x in rows] == [(str(k), n) for k in (1, 2, 3) for n in ("a", "b")]
    assert rows[0]["reason"] == 'say "no", then,' and rows[0]["policy.local_steps"] == ""
    assert rows[1]["policy.local_steps"] == "1" and rows[5]["policy.local_steps"] == "3"
    assert "policy" not in rows[0]
    lines = viewer.get(f"/api/runs/{rid}/nodes.jsonl").text.splitlines()
    orm = sorted(store.node_rounds(rid), key=lambda n: (n.round, n.node_id))
    assert len(lines) == len(orm) == 6
    for line, n in zip(lines, orm):
        obj = json.loads(line)
        assert list(obj) == [c.name for c in NodeRound.__table__.columns if c.name != "id"]
        assert (obj["node_id"], obj["round"], obj["bytes_up"], obj["status"], obj["policy"]) == \
            (n.node_id, n.round, n.bytes_up, n.status, n.policy)
    rounds = [json.loads(x) for x in viewer.get(f"/api/runs/{rid}/rounds.jsonl").text.splitlines()]
    assert [x["metrics"] for x in rounds] == ROUND_METRICS
    assert rounds[1]["train_loss"] is None


def test_export_refusals(app, anon):
    rid = _seed(app.state.ctx.store)
    assert anon.get(f"/api/runs/{rid}/rounds.csv").status_code == 401
    reporter = make_token(app, "reporter")
    assert anon.get(f"/api/runs/{rid}/rounds.csv", headers=bearer(reporter)).status_code == 403
    r = anon.get("/api/runs/nope/rounds.csv", headers=bearer(make_token(app, "viewer")))
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        export.export(app.state.ctx.store, rid, "rounds", "xml")


def test_columns_follow_the_store(tmp_path, monkeypatch):
    """A column added to the rounds table (a number, a JSON column) is exported with no code
    change: the export reads its columns from the table."""
    from fedswarm.store import Store

    store = Store(str(tmp_path / "s.db"))
    rid = _seed(store)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE rounds ADD COLUMN later_loss FLOAT")
        conn.exec_driver_sql("ALTER TABLE rounds ADD COLUMN later_info JSON")
        conn.exec_driver_sql(
            "UPDATE rounds SET later_loss = round * 1.5, later_info = '{\"gpu_s\": 2}' WHERE round = 2")
    wider = Table("rounds", MetaData(), autoload_with=store.engine)
    monkeypatch.setitem(export.KINDS, "rounds", wider)
    rows = _csv(b"".join(export.export(store, rid, "rounds", "csv")).decode())
    assert list(rows[0])[-2:] == ["later_loss", "later_info.gpu_s"]
    assert [(x["later_loss"], x["later_info.gpu_s"]) for x in rows] == [("", ""), ("3.0", "2"), ("", "")]
    assert "`later_info.<key>`" in export.describe("rounds")


def test_streamed_in_chunks(tmp_path, monkeypatch):
    from fedswarm.store import Store

    store = Store(str(tmp_path / "s.db"))
    rid = _seed(store)
    monkeypatch.setattr(export, "CHUNK_ROWS", 2)
    chunks = list(export.export(store, rid, "nodes", "csv"))
    assert len(chunks) >= 3  # header+2 rows, 2 rows, 2 rows (and what is left)
    assert len(_csv(b"".join(chunks).decode())) == 6
    assert len(list(export.export(store, rid, "nodes", "jsonl"))) == 3


def test_cli_writes_the_same_bytes_as_the_api(admin, tmp_path):
    store = admin.app.state.ctx.store
    rid = _seed(store)
    runner = CliRunner()
    for args, url in ((["--format", "csv"], "rounds.csv"), (["--format", "jsonl"], "rounds.jsonl"),
                      (["--nodes"], "nodes.csv"), (["--nodes", "-f", "jsonl"], "nodes.jsonl")):
        out = tmp_path / url
        res = runner.invoke(cli, ["runs", "export", rid, "--db", store.url, "--out", str(out), *args])
        assert res.exit_code == 0, res.output
        assert out.read_bytes() == admin.get(f"/api/runs/{rid}/{url}").content
    res = runner.invoke(cli, ["runs", "export", rid, "--db", store.url])  # to standard output
    assert res.exit_code == 0 and res.stdout_bytes == admin.get(f"/api/runs/{rid}/rounds.csv").content
    res = runner.invoke(cli, ["runs", "export", "missing", "--db", store.url])
    assert res.exit_code == 2 and "no run 'missing'" in res.output
    res = runner.invoke(cli, ["runs", "export", rid, "--db", store.url, "--format", "xml"])
    assert res.exit_code == 2 and "unknown format 'xml'" in res.output
    res = runner.invoke(cli, ["runs", "--db", store.url, "--json"])  # `runs` alone lists, as before
    assert res.exit_code == 0, res.output
    assert rid in {r["run_id"] for r in json.loads(res.stdout)}


def test_run_page_links_the_downloads(app, admin):
    rid = _seed(app.state.ctx.store)
    page = admin.get(f"/runs/{rid}").text
    for f in ("rounds.csv", "rounds.jsonl", "nodes.csv"):
        assert f'href="/api/runs/{rid}/{f}"' in page
    with TestClient(app) as c:  # the documented columns are in the OpenAPI description
        doc = c.get("/openapi.json").json()["paths"]["/api/runs/{run_id}/rounds.csv"]["get"]["description"]
    assert "`metrics.<key>`" in doc and "`test_accuracy`" in doc
