"""Webhook secrets at rest (fedswarm.web.secret_box): sealed in the store under a key kept outside
it, shown once, rotatable; clear-text rows of an older store are sealed when a dashboard starts;
a copy of the store without the key yields no secret, and a dashboard with another key sends
nothing rather than sign with the wrong one."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from dashboard_helpers import ADMIN_PW, bearer, login, make_token
from fedswarm.store import Store
from fedswarm.store.schema import Webhook, WebhookDelivery
from fedswarm.web.app import create_app
from fedswarm.web.secret_box import SecretKeyError, SecretUnavailable, load_box
from fedswarm.web.settings import Settings
from fedswarm.web.services.webhooks import Webhooks

ROOT = Path(__file__).resolve().parents[2]
SECRET = "a-test-secret-of-some-length"


def _raw_store_bytes(db: Path) -> bytes:
    """Every byte of the SQLite store as it lies on disk (the file and its write-ahead log)."""
    return b"".join(p.read_bytes() for p in (db, Path(f"{db}-wal")) if p.exists())


def _rows(store: Store) -> list[Webhook]:
    with store.session() as s:
        return list(s.scalars(select(Webhook).order_by(Webhook.id)))


@pytest.fixture
def keyed_app(tmp_path):
    """An app over tmp_path/store.db whose key file is tmp_path/keys/secret.key."""
    def make(**kw):
        return create_app(str(tmp_path / "store.db"), admin_password=ADMIN_PW,
                          secret_key_file=tmp_path / "keys" / "secret.key", **kw)
    return make


def _admin(app) -> TestClient:
    c = TestClient(app)
    c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
    return c


def test_the_store_holds_the_secret_only_sealed_and_it_is_shown_once(keyed_app, tmp_path):
    app = keyed_app()
    key_file = tmp_path / "keys" / "secret.key"
    assert key_file.stat().st_mode & 0o777 == 0o600  # made at first start
    with _admin(app) as c:
        made = c.post("/api/webhooks", json={"url": "http://127.0.0.1:9/h", "events": ["run.finished"],
                                             "secret": SECRET}).json()
        assert made["secret"] == SECRET
        assert "secret" not in c.get(f"/api/webhooks/{made['id']}").json()
        assert all("secret" not in h for h in c.get("/api/webhooks").json())
    (row,) = _rows(app.state.ctx.store)
    assert row.secret == "" and row.secret_sealed.startswith("fsk1:")
    assert SECRET.encode() not in _raw_store_bytes(tmp_path / "store.db")
    assert load_box(key_file=key_file).open(row.secret_sealed, row.id) == SECRET


def test_a_store_copied_without_the_key_yields_no_secret(keyed_app, tmp_path):
    app = keyed_app()
    with _admin(app) as c:
        hook = c.post("/api/webhooks", json={"url": "http://127.0.0.1:9/h", "events": ["run.finished"],
                                             "secret": SECRET}).json()
    app.state.ctx.store.close()
    copy = tmp_path / "elsewhere" / "store.db"
    copy.parent.mkdir()
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{tmp_path / 'store.db'}{suffix}").exists():
            shutil.copyfile(f"{tmp_path / 'store.db'}{suffix}", f"{copy}{suffix}")
    assert SECRET.encode() not in _raw_store_bytes(copy)
    other = load_box(key_file=tmp_path / "elsewhere" / "other.key")  # the copier's own key
    store = Store(copy)
    (row,) = _rows(store)
    with pytest.raises(SecretUnavailable, match="sealed under key"):
        other.open(row.secret_sealed, row.id)
    # A dashboard over the copy, with its own key: the delivery is not sent, and says why.
    with store.session() as s:
        s.add(WebhookDelivery(webhook_id=hook["id"], event="run.finished", event_key="k1", payload={"x": 1}))
    hooks = Webhooks(store, Settings.build(str(copy)), other)
    hooks.send_due()
    with store.session() as s:
        (d,) = s.scalars(select(WebhookDelivery))
        assert d.status == "failed" and d.last_error.startswith("not sent: webhook 1's secret was sealed under key")
    # The right key, even on another row's sealed value, does not open it either (bound to its row).
    right = load_box(key_file=tmp_path / "keys" / "secret.key")
    assert right.open(row.secret_sealed, row.id) == SECRET
    with pytest.raises(SecretUnavailable, match="does not open"):
        right.open(row.secret_sealed, row.id + 1)


def test_clear_text_secrets_of_an_older_store_are_sealed_at_start(tmp_path):
    db = tmp_path / "store.db"
    Store(db).close()
    con = sqlite3.connect(db)  # the webhooks table as fedswarm 0.1.0 made it, with a row in clear
    con.execute("ALTER TABLE webhooks DROP COLUMN secret_sealed")
    con.execute("INSERT INTO webhooks (url, secret, events, enabled, created_at) VALUES "
                "('http://127.0.0.1:9/h', ?, '[\"run.finished\"]', 1, '2026-01-01 00:00:00')", (SECRET,))
    con.commit()
    con.close()
    said: list[str] = []
    app = create_app(str(db), admin_password=ADMIN_PW, secret_key_file=tmp_path / "k", announce=said.append)
    (row,) = _rows(app.state.ctx.store)
    assert row.secret == "" and load_box(key_file=tmp_path / "k").open(row.secret_sealed, row.id) == SECRET
    assert any("sealed 1 webhook secret" in line for line in said), said
    app.state.ctx.store.close()
    assert SECRET.encode() not in _raw_store_bytes(db)  # not even in free space
    create_app(str(db), admin_password=ADMIN_PW, secret_key_file=tmp_path / "k", announce=said.append)
    assert sum("sealed" in line for line in said) == 1  # nothing left to seal the second time


def test_a_webhook_secret_is_rotated_by_the_api(keyed_app, tmp_path):
    app = keyed_app()
    with _admin(app) as c:
        hook = c.post("/api/webhooks", json={"url": "http://127.0.0.1:9/h", "events": ["run.finished"],
                                             "secret": SECRET}).json()
        new = c.post(f"/api/webhooks/{hook['id']}/secret")
        assert new.status_code == 200, new.text
        assert new.json()["secret"] != SECRET and len(new.json()["secret"]) >= 32
        chosen = c.post(f"/api/webhooks/{hook['id']}/secret", json={"secret": "another-secret-0123456"}).json()
        assert chosen["secret"] == "another-secret-0123456"
        assert c.post("/api/webhooks/999/secret").status_code == 404
        assert c.post(f"/api/webhooks/{hook['id']}/secret", json={"secret": "short"}).status_code == 422
    viewer = make_token(app, "viewer")
    with TestClient(app) as v:
        assert v.post(f"/api/webhooks/{hook['id']}/secret", headers=bearer(viewer)).status_code == 403
    (row,) = _rows(app.state.ctx.store)
    assert app.state.ctx.secrets.open(row.secret_sealed, row.id) == "another-secret-0123456"


def test_rekey_reseals_every_secret_under_the_new_key(keyed_app, tmp_path):
    app = keyed_app()
    with _admin(app) as c:
        for i in range(3):
            c.post("/api/webhooks", json={"url": f"http://127.0.0.1:9/{i}", "events": ["run.failed"],
                                          "secret": f"{SECRET}-{i}"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSWARM_")}
    env.update(PYTHONPATH=str(ROOT), FEDSWARM_SECRET_KEY_FILE=str(tmp_path / "keys" / "secret.key"))
    done = subprocess.run([sys.executable, "-m", "fedswarm", "rekey", "--db", str(tmp_path / "store.db"),
                           "--new-key-file", str(tmp_path / "new.key")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "re-sealed 3 webhook secret(s)" in done.stdout
    assert (tmp_path / "new.key").stat().st_mode & 0o777 == 0o600
    new, old = load_box(key_file=tmp_path / "new.key"), load_box(key_file=tmp_path / "keys" / "secret.key")
    rows = _rows(Store(tmp_path / "store.db"))
    assert [new.open(r.secret_sealed, r.id) for r in rows] == [f"{SECRET}-{i}" for i in range(3)]
    with pytest.raises(SecretUnavailable):
        old.open(rows[0].secret_sealed, rows[0].id)
    # With the old key gone from the store's rows, running it again from the old key changes nothing.
    again = subprocess.run([sys.executable, "-m", "fedswarm", "rekey", "--db", str(tmp_path / "store.db"),
                            "--new-key-file", str(tmp_path / "third.key")], capture_output=True, text=True,
                           timeout=120, env=env)
    assert again.returncode == 1 and "nothing changed" in again.stderr, again.stdout + again.stderr
    assert [new.open(r.secret_sealed, r.id) for r in _rows(Store(tmp_path / "store.db"))] == \
        [f"{SECRET}-{i}" for i in range(3)]


def test_a_key_file_others_can_read_or_a_short_key_is_refused(tmp_path):
    key = tmp_path / "secret.key"
    load_box(key_file=key)
    os.chmod(key, 0o644)
    with pytest.raises(SecretKeyError, match="readable by others"):
        load_box(key_file=key)
    with pytest.raises(SecretKeyError, match="at least 16"):
        load_box("short")
