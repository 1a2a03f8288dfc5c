"""What a dashboard instance is configured with."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fedswarm.store import to_url
from fedswarm.store.liveness import REPORT_TIMEOUT_S

__all__ = ["Settings"]


@dataclass
class Settings:
    """Dashboard settings; :func:`fedswarm.web.app.create_app` builds one from its arguments.

    ``runner`` is the command prefix that starts a run: ``RUNNER sim --db URL --run-id ID
    --config TOML`` (``python -m fedswarm`` by default; tests put a fake runner here).
    ``catalog_cmd`` prints the strategy/codec/task catalog as JSON.
    ``superlink`` names a SuperLink connection of the ``flwr`` CLI (its config file), or
    None when no Flower federation is attached.
    """

    db_url: str
    runs_dir: Path
    runner: list[str] = field(default_factory=lambda: [sys.executable, "-m", "fedswarm"])
    catalog_cmd: list[str] = field(
        default_factory=lambda: [sys.executable, "-m", "fedswarm", "strategies", "--json"])
    superlink: str | None = None
    flwr_cmd: list[str] = field(default_factory=lambda: ["flwr"])
    flwr_app_dir: Path | None = None
    admin_password: str | None = None
    secret_key: str | None = None
    # The key file that seals webhook secrets when no secret_key is given (fedswarm.web.secret_box;
    # None: $FEDSWARM_SECRET_KEY_FILE, else $XDG_CONFIG_HOME/fedswarm/secret.key).
    secret_key_file: Path | None = None
    session_hours: float = 12.0
    poll_interval_s: float = 0.3
    # Served over HTTPS (directly or behind a TLS-terminating proxy): cookies get ``Secure``
    # and pages send HSTS. Off by default; a request that arrives over https sets ``Secure``
    # on its cookies either way.
    https: bool = False
    # Trust X-Forwarded-For / X-Forwarded-Proto (the login throttle's client address and the
    # scheme) from the proxy in front; only set this when a proxy is really there.
    behind_proxy: bool = False
    # A run registered through ingest that reports nothing for this long shows as "lost"
    # (a reporter may ask for another timeout when it registers the run).
    report_timeout_s: float = REPORT_TIMEOUT_S
    # Ingest quotas per API token (see fedswarm.web.ratelimit).
    ingest_per_minute: int = 1200
    ingest_bytes_per_hour: int = 512_000_000
    nodes_per_token: int = 10_000
    token_days: float = 90.0  # default lifetime of a new API token
    # Webhooks (fedswarm.web.services.webhooks): how often the store is checked for events, the wait
    # before the first retry (doubled each time), attempts before giving up, and the
    # receiver's time to answer.
    webhook_poll_s: float = 2.0
    webhook_backoff_s: float = 5.0
    webhook_attempts: int = 6
    webhook_timeout_s: float = 10.0

    @classmethod
    def build(cls, db_url: str, runs_dir: str | Path | None = None, **kw: object) -> "Settings":
        url = to_url(db_url)
        if runs_dir is None:
            if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
                runs_dir = Path(url[len("sqlite:///"):]).parent / "fedswarm-runs"
            else:
                runs_dir = Path.cwd() / "fedswarm-runs"
        if kw.pop("secure_cookies", None):  # the older name of ``https``
            kw["https"] = True
        for key, env in (("admin_password", "FEDSWARM_ADMIN_PASSWORD"), ("secret_key", "FEDSWARM_SECRET_KEY"),
                         ("superlink", "FEDSWARM_SUPERLINK")):
            if kw.get(key) is None:
                kw[key] = os.environ.get(env) or None
        kw = {k: v for k, v in kw.items() if v is not None}
        return cls(db_url=url, runs_dir=Path(runs_dir), **kw)  # type: ignore[arg-type]
