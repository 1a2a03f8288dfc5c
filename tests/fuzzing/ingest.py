"""Fuzz target of the dashboard's ingest API (``/api/ingest``), as a reporter token sends it.

An input is ``METHOD PATH``, a newline and the request body. Inputs start from a valid body
for each ingest operation (a node heartbeat, a run, a round with node rows, a status change,
a control marked applied), then change fields (awkward JSON values: 10^400, NaN, Infinity,
nested lists and objects, long strings, unknown keys), use odd path parameters, or send a
body that is not JSON at all (cut, bytes flipped, nested thousands deep, invalid UTF-8).
It complements ``tests/web/test_web_schemathesis.py`` (schema-driven, 8 cases an operation,
as an admin) with structure-aware mutations of valid reporter traffic.

Known refusals: 400 (a body FastAPI cannot parse), 401, 403, 404, 405, 409, 413, 422 and 429,
each with a JSON ``detail``. Never a 5xx. An accepted round must be stored (once).
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient
from hypothesis import strategies as st

from tests.fuzzing import Target
from tests.fuzzing.mutate import deep_json, dumps_loose, json_values, mutate_bytes, mutate_dict

__all__ = ["TARGETS"]

RUN = "fuzz-run"
KNOWN = {400, 401, 403, 404, 405, 409, 413, 422, 429}
_state: dict = {}


def _client() -> TestClient:
    """One dashboard over a temporary SQLite store per process, with a run-bound reporter token."""
    if "client" not in _state:
        from fedswarm.web.app import create_app

        tmp = Path(tempfile.mkdtemp(prefix="fedswarm-fuzz-ingest-"))
        atexit.register(shutil.rmtree, tmp, True)
        app = create_app(str(tmp / "store.db"), runs_dir=tmp / "runs", admin_password="admin-password-1",
                         secret_key_file=tmp / "secret.key",  # not the user's key file
                         runner=[sys.executable, "-c", "pass"], catalog_cmd=[sys.executable, "-c", "print('{}')"],
                         announce=lambda _: None, ingest_per_minute=10**9, ingest_bytes_per_hour=10**15)
        _, token = app.state.ctx.accounts.create_token("fuzz-reporter", "reporter", None, "test")
        client = TestClient(app, raise_server_exceptions=False)
        client.headers["Authorization"] = f"Bearer {token}"
        made = client.post("/api/ingest/runs", json={"run_id": RUN, "config": {"rounds": 3}})
        assert made.status_code == 201, made.text  # the token owns the run its rounds go to
        _state.update(client=client, store=app.state.ctx.store)
    return _state["client"]


def _round_body(r: int) -> dict:
    return {"round": r, "train_loss": 0.5, "test_loss": 0.6, "test_accuracy": 0.7, "bytes_up": 100,
            "bytes_down": 200, "wall_s": 1.5, "sim_time_s": 2.0, "num_clients": 2, "metrics": {"lr": 0.1},
            "nodes": [{"node_id": "n1", "bytes_up": 50, "bytes_down": 100, "num_examples": 10, "train_loss": 0.5,
                       "device_class": "edge", "status": "ok", "reason": None}]}


_OPS = {
    "node": ("POST", "/api/ingest/nodes", lambda r: {"node_id": f"node-{r % 50}", "kind": "peer", "run_id": RUN,
                                                      "device_class": "gpu", "status": "online",
                                                      "info": {"cpu": 4}, "rejected_updates": 0}),
    "run": ("POST", "/api/ingest/runs", lambda r: {"run_id": f"r-{r}", "name": "fuzz", "config": {"rounds": 3},
                                                    "status": "running", "lost_after_s": 60}),
    "round": ("POST", f"/api/ingest/runs/{RUN}/rounds", _round_body),
    "status": ("POST", f"/api/ingest/runs/{RUN}/status", lambda r: {"status": "running", "error": None}),
    "controls": ("GET", f"/api/ingest/runs/{RUN}/controls", lambda r: None),
    "applied": ("POST", f"/api/ingest/runs/{RUN}/controls/1/applied", lambda r: None),
}
_PATH_PARAMS = st.sampled_from([RUN, "no-such-run", "..", "a" * 40, "%00", "1e400", "x/y", "-1"])


@st.composite
def ingest_inputs(draw) -> bytes:
    op = draw(st.sampled_from(sorted(_OPS)))
    method, path, body_of = _OPS[op]
    body = body_of(draw(st.integers(0, 10**6)))
    if draw(st.integers(0, 5)) == 0:
        control = draw(st.sampled_from(["0", "2", "-5", "99999999999999999999", "x"]))
        path = path.replace(RUN, draw(_PATH_PARAMS)).replace("/1/", f"/{control}/")
    how = draw(st.sampled_from(["valid", "field", "field", "field", "nested", "raw", "deep"]))
    if how == "field" and isinstance(body, dict):
        body = draw(mutate_dict(body))
    elif how == "nested" and isinstance(body, dict) and body.get("nodes"):
        body["nodes"][0] = draw(mutate_dict(body["nodes"][0]))
    elif how == "nested" and isinstance(body, dict):
        body[draw(st.sampled_from(["info", "config", "metrics"]))] = draw(json_values)
    raw = b"" if body is None else dumps_loose(body)
    if how == "raw":
        raw = draw(mutate_bytes(raw))
    elif how == "deep":
        key = draw(st.sampled_from(["info", "config", "metrics", "round"]))
        raw = (f'{{"{key}":' + deep_json(draw(st.integers(500, 20_000))) + "}").encode()
    return f"{method} {path}\n".encode() + raw


def run_ingest(data: bytes) -> str:
    client = _client()
    head, _, body = data.partition(b"\n")
    method, _, path = head.decode("utf-8", "replace").partition(" ")
    if method not in ("GET", "POST") or not path.startswith("/api/ingest/"):
        return "refused:not_ingest"
    if not path.isprintable() or " " in path:  # no HTTP client sends it (httpx refuses it before sending)
        return "refused:not_http"
    r = client.request(method, path, content=body or None, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, f"{method} {path}: HTTP {r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        assert r.status_code in KNOWN, f"{method} {path}: unexpected HTTP {r.status_code}"
        assert isinstance(r.json().get("detail"), (str, list)), r.text[:300]
        return f"refused:{r.status_code}"
    if path.endswith("/rounds") and r.status_code == 201:
        sent = json.loads(body)
        rows = [x for x in _state["store"].rounds(RUN) if x.round == sent["round"]]
        assert len(rows) == 1, f"round {sent['round']} was accepted but not stored once"
    return "accepted"


TARGETS = [Target("ingest", ingest_inputs(), run_ingest, min_outcomes=4)]
