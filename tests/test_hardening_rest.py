"""No 500 that nobody sees (issue 17, finding 3): a deeply nested JSON body on any JSON route (the
anonymous token route too) and a NUL in a query parameter are bad input (400); a value the database
refuses is a 400 as well; and every 500 is logged with its traceback."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.parsers import MAX_JSON_DEPTH
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db


def _staff() -> APIClient:
    client = APIClient()
    user = User.objects.create_user("op", password="pw-op-1", is_staff=True)
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 200_000])
def test_a_deeply_nested_body_on_the_anonymous_token_route_is_400(depth: int) -> None:
    response = APIClient().post("/api/v1/auth/token", _nested(depth), content_type="application/json")
    assert response.status_code == 400, response.content[:200]
    assert "nested" in response.json()["detail"]


@pytest.mark.parametrize(
    "path",
    ["/api/v1/projects", "/api/v1/evaluations", "/api/v1/clusters", "/api/v1/workers", "/api/v1/users"],
)
def test_a_deeply_nested_body_on_any_json_route_is_400(path: str) -> None:
    body = '{"name": ' + _nested(100_000) + "}"
    response = _staff().post(path, body, content_type="application/json")
    assert response.status_code == 400, response.content[:200]


def test_an_ordinary_nesting_still_parses() -> None:
    ProjectFactory(name="p")
    body = {"project": "p", "repository": "sim:chain?n=1", "commit": "c", "wildcards": ["a.b"]}
    assert _staff().post("/api/v1/evaluations", body, format="json").status_code == 201


@pytest.mark.parametrize(
    "query",
    ["project=a%00b", "status=Queued%00", "a%00=1", "project=%00"],
)
def test_a_nul_in_a_query_parameter_is_400(query: str) -> None:
    response = _staff().get(f"/api/v1/evaluations?{query}")
    assert response.status_code == 400
    assert "NUL" in response.json()["detail"]


def test_a_nul_in_a_query_parameter_outside_the_api_is_400_too() -> None:
    assert Client().get("/admin/login/?next=/admin/%00").status_code == 400


@pytest.fixture
def request_log() -> Iterator[io.StringIO]:
    """What the handlers the settings give Django's request logger print."""
    logger = logging.getLogger("django.request")
    assert logger.handlers, "django.request has no handler: a 500 would go unseen"
    out = io.StringIO()
    old = [h.setStream(out) if isinstance(h, logging.StreamHandler) else None for h in logger.handlers]
    yield out
    for handler, stream in zip(logger.handlers, old, strict=True):
        if isinstance(handler, logging.StreamHandler) and stream is not None:
            handler.setStream(stream)


def test_every_500_is_logged_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, request_log: io.StringIO
) -> None:
    from gradient.workers import api

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the projects list blew up")

    monkeypatch.setattr(api.ProjectsView, "get", boom)
    client = _staff()
    client.raise_request_exception = False
    response = client.get("/api/v1/projects")
    assert response.status_code == 500 and response.json() == {"detail": "Internal error; it was logged."}
    logged = request_log.getvalue()
    assert "Internal Server Error: /api/v1/projects" in logged
    assert "Traceback" in logged and "RuntimeError: the projects list blew up" in logged


def test_a_value_the_database_refuses_is_400_not_500(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import DataError

    from gradient.workers import api

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise DataError("value too long for type character varying(200)")

    monkeypatch.setattr(api.ProjectsView, "get", refused)
    response = _staff().get("/api/v1/projects")
    assert response.status_code == 400
    assert "cannot be stored" in response.json()["non_field_errors"][0]


# --- Anonymous requests cause no 500 (issue 36, finding 6) ------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        '{"username": "\\ud800", "password": "x"}',
        '{"username": "op", "password": "\\udfff"}',
        '{"\\ud800": "op", "password": "x"}',
    ],
)
def test_a_lone_surrogate_in_the_token_routes_body_is_400(body: str) -> None:
    response = APIClient().post("/api/v1/auth/token", body, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert "surrogate" in response.json()["detail"]


@pytest.mark.django_db(transaction=True)  # a real serve writes its boot: emptied afterwards
def test_on_a_real_serve_a_lone_surrogate_is_400_and_a_climbing_static_path_404_without_a_traceback(
    tmp_path: Any,
) -> None:
    import http.client

    from tests.support.processes import database_env, serve

    with serve(database_env(redis=False), tmp_path, ["--no-passes"]) as server:
        # The lone surrogate too, as a stranger sends it to the real server.
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        body = b'{"username": "\\ud800", "password": "x"}'
        conn.request("POST", "/api/v1/auth/token", body, {"Content-Type": "application/json"})
        token_status = conn.getresponse().status
        conn.close()
        answers = []
        for path in (
            "/static/admin/../../../../etc/passwd",
            "/static/admin/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
            "/static/../gradient/settings.py",
            "/static//etc/passwd",
            "/static/%2fetc%2fpasswd",
            "/static/admin/..%2f..%2f..%2f..%2fetc%2fpasswd",
            "/static/admin/..%5c..%5c..%5c..%5cetc%5cpasswd",
            "/static/%00/etc/passwd",
        ):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            conn.request("GET", path)  # sent as written: http.client does not normalise the path
            response = conn.getresponse()
            answers.append((path, response.status, b"root:" in response.read()))
            conn.close()
        log = server.log()
    assert token_status == 400
    assert all(status == 404 and not leaked for _, status, leaked in answers), answers
    assert "Traceback" not in log, log[log.find("Traceback") - 300 :][:3000]
