"""Property-based API test: schemathesis sends generated requests for every operation in the
OpenAPI schema (as an admin, so they reach the handlers) and no answer may be a 5xx."""

from __future__ import annotations

import sys

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from dashboard_helpers import FAKE_CATALOG  # noqa: E402
from fedswarm.web.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    db = tmp_path_factory.mktemp("schemathesis") / "store.db"
    # Runs "start" a process that exits at once: generated configs may ask for a million rounds.
    app = create_app(str(db), admin_password="admin-password-1", catalog_cmd=FAKE_CATALOG,
                     runner=[sys.executable, "-c", "pass"])
    _, token = app.state.ctx.accounts.create_token("schemathesis", "admin", None, "test")
    store = app.state.ctx.store
    store.create_run({"rounds": 3}, run_id="seeded-run", status="running")
    store.add_round("seeded-run", 1, train_loss=1.0, test_accuracy=0.5, bytes_up=10)
    return app, token


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(api):
    app, _ = api
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, api):
    _, token = api
    for headers in ({"Authorization": f"Bearer {token}"}, {}):
        response = case.call(headers=headers)
        case.validate_response(response, checks=[not_a_server_error])
