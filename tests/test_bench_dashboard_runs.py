"""The pieces of ``fedswarm bench dashboard-runs`` that decide what its table says: wrk's output
read right, another checkout's code really the one served, and the profile's split between the
event-loop thread and the rest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedswarm.bench.dashboard_load import parse_wrk
from fedswarm.bench.dashboard_runs import source_tree, summarize_profile

ROOT = Path(__file__).resolve().parents[1]

WRK = """Running 8s test @ http://127.0.0.1:18080/api/runs
  1 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    28.20ms   20.11ms 145.14ms   74.03%
    Req/Sec     1.57k   605.37     3.37k    74.03%
  Latency Distribution
     50%  850.00us
     75%   35.00ms
     90%   50.00ms
     99%    1.20s
  12558 requests in 8.05s, 621.10MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:   1559.45
Transfer/sec:     77.16MB
"""


def test_wrk_output_is_read_in_its_units_with_every_error_counted():
    got = parse_wrk(WRK)
    assert got["median_ms"] == pytest.approx(0.85) and got["p99_ms"] == pytest.approx(1200.0)
    assert got["rps"] == pytest.approx(1559.45) and got["requests"] == 12558
    assert got["errors"] == 2 + 1 + 4


def test_source_tree_serves_the_other_checkouts_code(tmp_path):
    other = tmp_path / "other"  # another checkout: its own copy of the package and of web/
    shutil.copytree(ROOT / "fedswarm", other / "fedswarm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "web", other / "web", ignore=shutil.ignore_patterns("__pycache__", "static", "templates"))
    shutil.copy(ROOT / "pyproject.toml", other / "pyproject.toml")
    tree = source_tree(other, tmp_path / "tree")
    code = "import fedswarm, fedswarm.web.middleware as m; print(fedswarm.__file__); print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    assert out.returncode == 0, out.stderr[-2000:]
    top, web = out.stdout.split()
    assert top == str(tree / "fedswarm" / "__init__.py")  # not the installed package's
    assert Path(web).resolve() == other / "web" / "middleware.py"  # nor the installed web/


def test_source_tree_refuses_a_directory_that_is_no_checkout(tmp_path):
    with pytest.raises(ValueError, match="not a fedswarm checkout"):
        source_tree(tmp_path, tmp_path / "tree")


RAW = "\n".join([
    "thread (1): MainThread;<module> (main.py:1);Runner.run (asyncio/runners.py:118);Server.run (uvicorn/server.py:6);"
    "Edge.__call__ (fedswarm/web/middleware.py:120);RequestResponseCycle.send (uvicorn/httptools_impl.py:480) 6",
    "thread (1): MainThread;<module> (main.py:1);Runner.run (asyncio/runners.py:118);Server.run (uvicorn/server.py:6);"
    "Edge.__call__ (fedswarm/web/middleware.py:121) 2",
    "thread (1): MainThread;Edge.__call__ (fedswarm/web/middleware.py:121);Logger.info (logging/__init__.py:9) 2",
    "thread (7): fedswarm-webhook-watcher;Thread._bootstrap (threading.py:1);Webhooks._watch (web/webhooks.py:5);"
    "stats_for (web/queries.py:8) 5",
])


def test_profile_splits_the_event_loop_thread_from_the_others():
    text = summarize_profile(RAW)
    assert text.startswith("event-loop thread: 10 busy samples")  # 6 + 2 + 2: a uvloop callback too
    loop, own, others = text.split("inclusive:\n")[1].split("own time")[0], text.split("own time")[1], \
        text.split("other threads")[1]
    assert "100.0%  Edge.__call__ (web/middleware.py)" in loop
    assert " 60.0%  RequestResponseCycle.send (uvicorn/httptools_impl.py)" in loop
    assert " 20.0%  Logger.info (logging/__init__.py)" in loop
    assert "Runner.run" not in loop and "<module>" not in loop  # the start-up chain is left out
    assert " 60.0%  RequestResponseCycle.send" in own and " 20.0%  Edge.__call__" in own
    assert "      5  fedswarm-webhook-watcher: stats_for (web/queries.py)" in others
    assert "webhook" not in text.split("other threads")[0]
