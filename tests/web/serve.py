"""Serve the dashboard for tests in its own process (uvicorn on 127.0.0.1).

Usage: serve.py --db PATH --port N [--fake] [--poll S] [--behind-proxy [--trusted-proxies IPS]]
With --fake, runs are started by fake_runner.py and the catalog comes from fake_catalog.py;
without it, by the real ``python -m fedswarm`` (what the browser test uses).
"""

import argparse
import sys
from pathlib import Path

import uvicorn

from fedswarm.web.app import create_app, proxy_options

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--poll", type=float, default=0.3)
    ap.add_argument("--admin-password", default="admin-password-1")
    ap.add_argument("--report-timeout", type=float, default=None)
    ap.add_argument("--behind-proxy", action="store_true")
    ap.add_argument("--trusted-proxies", default=None)
    args = ap.parse_args()
    kw = {}
    if args.fake:
        kw = dict(runner=[sys.executable, str(HERE / "fake_runner.py")],
                  catalog_cmd=[sys.executable, str(HERE / "fake_catalog.py")])
    app = create_app(args.db, admin_password=args.admin_password, poll_interval_s=args.poll,
                     report_timeout_s=args.report_timeout, **kw)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=2,
                **proxy_options(args.behind_proxy, args.trusted_proxies))


if __name__ == "__main__":
    main()
