"""``--behind-proxy`` believes X-Forwarded-* only from ``--trusted-proxies`` (loopback by default),
checked on a real uvicorn server: a forwarded ``https`` scheme makes the login page's cookie
``Secure`` only when the sender (here 127.0.0.1) is a trusted proxy."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from dashboard_helpers import start_server
from fedswarm.cli import app as cli
from fedswarm.web.app import LOOPBACK, proxy_options


def _login_cookie_secure(server) -> bool:
    r = httpx.get(server.url + "/login", headers={"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"},
                  timeout=30)
    assert r.status_code == 200
    return "secure" in r.headers["set-cookie"].lower()


@pytest.mark.parametrize("args, trusted", [
    ([], False),  # not behind a proxy: headers ignored
    (["--behind-proxy"], True),  # the default trusted proxy is loopback, which is who sends here
    (["--behind-proxy", "--trusted-proxies", "10.0.0.5,192.168.0.0/16"], False),  # loopback not listed
    (["--behind-proxy", "--trusted-proxies", "127.0.0.0/8"], True),
])
def test_forwarded_headers_believed_only_from_trusted_proxies(tmp_path, args, trusted):
    server = start_server(tmp_path, fake=True, args=args)
    try:
        assert _login_cookie_secure(server) is trusted
    finally:
        server.stop()


def test_proxy_options_default_loopback_and_refuse_bad_addresses():
    assert proxy_options(False, "10.0.0.1") == {"proxy_headers": False}
    assert proxy_options(True) == {"proxy_headers": True, "forwarded_allow_ips": ",".join(LOOPBACK)}
    assert proxy_options(True, " 10.0.0.5 , fd00::/8")["forwarded_allow_ips"] == "10.0.0.5,fd00::/8"
    for bad in ("proxy.local", "10.0.0.300", "10.0.0.0/33", " , "):
        with pytest.raises(ValueError, match="trusted proxy|no trusted proxy"):
            proxy_options(True, bad)


def test_cli_refuses_a_bad_trusted_proxy_before_serving():
    r = CliRunner().invoke(cli, ["dashboard", "--behind-proxy", "--trusted-proxies", "proxy.local"])
    assert r.exit_code != 0 and "proxy.local" in r.output
