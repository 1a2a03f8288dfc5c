"""/openapi.json as a client sees it: a valid OpenAPI document (openapi-spec-validator) that
declares how to authenticate, and a client generated from it (openapi-python-client, at test
time) that lists runs with a viewer token against a real dashboard process on loopback."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import typing

import httpx
import pytest
from openapi_spec_validator import validate

from dashboard_helpers import start_server
from fedswarm.store import Store
from fedswarm.web.services.accounts import Accounts

SAFE = {"get", "head", "options"}


def _client_types(fn) -> set[str]:
    """The class names a generated function's ``client`` parameter accepts."""
    ann = inspect.signature(fn).parameters["client"].annotation
    if isinstance(ann, str):
        return {a.strip() for a in ann.split("|")}
    return {a.__name__ for a in (typing.get_args(ann) or (ann,))}


@pytest.fixture
def served(tmp_path):
    server = start_server(tmp_path, fake=True, poll=0.1)
    yield server
    server.stop()


def test_the_document_is_valid_and_says_how_each_operation_authenticates(app, anon):
    doc = anon.get("/openapi.json").json()
    validate(doc)  # raises on an invalid document
    schemes = doc["components"]["securitySchemes"]
    assert schemes["bearerToken"] == {**schemes["bearerToken"], "type": "http", "scheme": "bearer"}
    assert (schemes["sessionCookie"]["in"], schemes["sessionCookie"]["name"]) == ("cookie", "fedswarm_session")
    assert (schemes["csrfHeader"]["in"], schemes["csrfHeader"]["name"]) == ("header", "X-CSRF-Token")
    ops = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    assert "security" not in ops[("get", "/api/health")]
    for (method, path), op in ops.items():
        if path == "/api/health":
            continue
        got = op.get("security")
        if path.startswith("/api/ingest/"):
            assert got == [{"bearerToken": []}], (method, path)
        elif method in SAFE:
            assert got == [{"bearerToken": []}, {"sessionCookie": []}], (method, path)
        else:
            assert got == [{"bearerToken": []}, {"sessionCookie": [], "csrfHeader": []}], (method, path)


def test_what_the_document_declares_is_what_the_server_asks(app, anon):
    """Every operation that declares security answers 401 to a request without credentials; the
    one that declares none does not."""
    doc = anon.get("/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            url = path.replace("{run_id}", "r1").replace("{node_id}", "n1").replace("{control_id}", "1") \
                      .replace("{webhook_id}", "1").replace("{token_id}", "1")
            code = anon.request(method.upper(), url).status_code
            assert (code == 401) == ("security" in op), (method, path, code)


def test_a_generated_client_lists_runs_with_a_viewer_token(served, tmp_path):
    store = Store(served.db)
    ids = [store.create_run({"strategy": "fedavg", "rounds": 2}, name=f"gen-{i}") for i in range(3)]
    _, viewer = Accounts(store).create_token("generated-client", "viewer", None, "test")
    _, reporter = Accounts(store).create_token("generated-reporter", "reporter", None, "test")
    store.close()
    (tmp_path / "openapi.json").write_bytes(httpx.get(served.url + "/openapi.json", timeout=10).content)
    (tmp_path / "gen.yaml").write_text("package_name_override: fedswarm_api_client\npost_hooks: []\n")
    out = tmp_path / "gen" / "fedswarm_api_client"
    done = subprocess.run([sys.executable, "-m", "openapi_python_client", "generate", "--path",
                           str(tmp_path / "openapi.json"), "--meta", "none", "--output-path", str(out),
                           "--config", str(tmp_path / "gen.yaml")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and (out / "client.py").exists(), done.stdout[-2000:] + done.stderr[-2000:]
    sys.path.insert(0, str(out.parent))
    try:
        client_mod = importlib.import_module("fedswarm_api_client")
        list_runs = importlib.import_module("fedswarm_api_client.api.runs.list_runs_api_runs_get")
        health = importlib.import_module("fedswarm_api_client.api.meta.health_api_health_get")
        # The generator read the security schemes: listing runs takes an authenticated client only.
        assert _client_types(list_runs.sync) == {"AuthenticatedClient"}
        assert _client_types(health.sync) == {"AuthenticatedClient", "Client"}
        runs = list_runs.sync(client=client_mod.AuthenticatedClient(base_url=served.url, token=viewer))
        assert isinstance(runs, list), runs
        assert sorted(r.id for r in runs) == sorted(ids)
        assert {r.name for r in runs} == {"gen-0", "gen-1", "gen-2"}
        refused = list_runs.sync_detailed(client=client_mod.AuthenticatedClient(base_url=served.url,
                                                                                token="fs_not-a-token"))
        assert refused.status_code == 401
        wrong_role = list_runs.sync(client=client_mod.AuthenticatedClient(base_url=served.url, token=reporter))
        assert "reporter token" in wrong_role.detail  # a Message, as the document says a 403 is
    finally:
        sys.path.remove(str(out.parent))
        for name in [m for m in sys.modules if m == "fedswarm_api_client" or m.startswith("fedswarm_api_client.")]:
            del sys.modules[name]
