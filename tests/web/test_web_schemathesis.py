"""Property-based API test: schemathesis sends generated requests for every operation in the
OpenAPI schema (as an admin, so they reach the handlers, and anonymously) and no answer may
be a 5xx.

It uses schemathesis's documented pytest integration: a schema loaded at import time
(``schemathesis.openapi.from_asgi``) and ``@schema.parametrize()``. The app it loads is a real
dashboard over a real SQLite store in a temporary folder that the module fixture removes.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from dashboard_helpers import FAKE_CATALOG  # noqa: E402
from fedswarm.web.app import create_app  # noqa: E402

_TMP = Path(tempfile.mkdtemp(prefix="fedswarm-schemathesis-"))
atexit.register(shutil.rmtree, _TMP, True)  # every xdist worker imports this module
# Runs "start" a process that exits at once: generated configs may ask for a million rounds.
_APP = create_app(str(_TMP / "store.db"), runs_dir=_TMP / "runs", admin_password="admin-password-1",
                  catalog_cmd=FAKE_CATALOG, runner=[sys.executable, "-c", "pass"], announce=lambda _: None)
_, _TOKEN = _APP.state.ctx.accounts.create_token("schemathesis", "admin", None, "test")
_store = _APP.state.ctx.store
_store.create_run({"rounds": 3}, run_id="seeded-run", status="running")
_store.add_round("seeded-run", 1, train_loss=1.0, test_accuracy=0.5, bytes_up=10)

schema = schemathesis.openapi.from_asgi("/openapi.json", _APP)



def test_the_schema_covers_the_api():
    """Guards the test below against passing vacuously on an empty or broken schema."""
    paths = set(_APP.openapi()["paths"])
    assert {"/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/rounds"} <= paths
    assert len(list(schema.get_all_operations())) >= 10


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case):
    for headers in ({"Authorization": f"Bearer {_TOKEN}"}, {}):
        response = case.call(headers=headers)
        case.validate_response(response, checks=[not_a_server_error])
