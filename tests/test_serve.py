"""The README's run command, end to end: a real `serve` process answers /healthz and serves the admin
login, on the embedded SQLite default and on PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.conf import settings

from tests.support.processes import base_env, http_get, manage, serve

pytestmark = pytest.mark.e2e


def _check_service(base_url: str) -> dict[str, object]:
    status, body = http_get(f"{base_url}/healthz")
    assert status == 200, body
    health = json.loads(body)
    status, body = http_get(f"{base_url}/admin/login/")
    assert status == 200
    assert b'name="username"' in body and b'name="password"' in body
    status, _ = http_get(f"{base_url}/static/admin/css/base.css")
    assert status == 200, "the admin's static files are served"
    return health


def test_serve_on_a_fresh_checkout_uses_the_embedded_sqlite_database(tmp_path: Path) -> None:
    database = tmp_path / "gradient.sqlite3"
    env = base_env(DATABASE_URL=f"sqlite:///{database}", REDIS_URL=None)
    manage(["migrate", "--noinput"], env)
    with serve(env, tmp_path) as server:
        health = _check_service(server.base_url)
        assert health == {
            "status": "ok",
            "database": "sqlite",
            "embedded": False,
            "channel_layer": "in-memory",
        }
        assert "periodic passes run in-process" in server.log()
    assert database.exists()


def test_serve_with_no_database_url_falls_back_to_var_gradient_sqlite3(tmp_path: Path) -> None:
    env = base_env(DATABASE_URL=None, REDIS_URL=None)
    manage(["migrate", "--noinput"], env)
    with serve(env, tmp_path) as server:
        health = _check_service(server.base_url)
    assert health["database"] == "sqlite" and health["embedded"] is True


@pytest.mark.django_db(transaction=True)
def test_serve_on_postgresql_with_redis(tmp_path: Path) -> None:
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("needs DATABASE_URL naming PostgreSQL")
    # The test database that pytest-django created is migrated already; serve it from a real process.
    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    env = base_env(DATABASE_URL=url, REDIS_URL=settings.REDIS_URL or None)
    with serve(env, tmp_path, extra_args=["--no-passes"]) as server:
        health = _check_service(server.base_url)
    assert health["database"] == "postgresql"
    assert health["channel_layer"] == ("redis" if settings.REDIS_URL else "in-memory")
