"""/healthz says unhealthy for what the service needs (issue 17, finding 8): 503 when the database or the
Redis of the channel layer does not answer (the test's own Redis, stopped), and its body never names a
host or a port."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.db import OperationalError
from django.test import Client, override_settings

from gradient import health
from tests.support.faults import own_redis
from tests.support.processes import database_env, http_get, serve

pytestmark = pytest.mark.django_db


def test_healthy_is_200() -> None:
    response = Client().get("/healthz")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_a_database_that_does_not_answer_is_503_without_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: object, *args: object) -> None:
        raise OperationalError('connection to server at "10.1.2.3", port 5432 failed: Connection refused')

    monkeypatch.setattr("django.db.backends.utils.CursorWrapper.execute", refused)
    response = Client().get("/healthz")
    assert response.status_code == 503
    assert response.json()["database"] == "unavailable"
    assert "10.1.2.3" not in response.content.decode() and "5432" not in response.content.decode()


def test_a_redis_that_does_not_answer_is_503_without_its_address() -> None:
    health._redis.cache_clear()
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        response = Client().get("/healthz")
    health._redis.cache_clear()
    assert response.status_code == 503
    assert response.json()["channel_layer"] == "unavailable"
    assert "127.0.0.1" not in response.content.decode()


@pytest.mark.django_db(transaction=True)
def test_serve_says_unhealthy_while_its_redis_is_down_and_healthy_again_after(tmp_path: Path) -> None:
    with own_redis(tmp_path) as redis_server:
        env = database_env(REDIS_URL=redis_server.url)
        with serve(env, tmp_path, ["--no-passes"]) as server:
            redis_server.stop()
            status, body = http_get(f"{server.base_url}/healthz")
            assert status == 503, body
            assert json.loads(body)["channel_layer"] == "unavailable"
            assert str(redis_server.port) not in body.decode()
            redis_server.start()
            assert http_get(f"{server.base_url}/healthz")[0] == 200
