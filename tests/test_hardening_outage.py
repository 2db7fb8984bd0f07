"""REST, /metrics and the console while the database does not answer (issue 25, finding 10): a real
`serve` on the test's own PostgreSQL, which is stopped: every route answers 503 with `Retry-After`
(not a 500), says nothing of the database's address, logs a few WARNING lines (not a traceback per
request), and answers as before once the database is back."""

from __future__ import annotations

import http.cookiejar
import re
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from django.db import OperationalError
from django.test import Client

from tests.support.postgres import operator_service_on_own_postgres

pytestmark = pytest.mark.django_db(transaction=True)


def _request(
    opener: urllib.request.OpenerDirector, method: str, url: str, token: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    if "/admin/" not in url:  # the console's session cookie only where the console is asked
        opener = urllib.request.build_opener()
    request = urllib.request.Request(url, method=method)  # noqa: S310 (loopback only)
    if token:
        request.add_header("Authorization", f"Token {token}")
    if method == "POST":
        request.add_header("Content-Type", "application/json")
        request.data = b'{"username": "operator", "password": "operator-pw"}'
    try:
        with opener.open(request, timeout=15) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _admin_session(base_url: str) -> urllib.request.OpenerDirector:
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{base_url}/admin/login/", timeout=10).read().decode()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert csrf is not None
    body = urllib.parse.urlencode(
        {"csrfmiddlewaretoken": csrf.group(1), "username": "operator", "password": "operator-pw"}
    ).encode()
    request = urllib.request.Request(f"{base_url}/admin/login/?next=/admin/", data=body)  # noqa: S310
    request.add_header("Referer", f"{base_url}/admin/login/")
    assert opener.open(request, timeout=10).status == 200
    assert any(cookie.name == "sessionid" for cookie in jar)
    return opener


ROUTES = [
    ("GET", "/api/v1/projects", True),
    ("GET", "/api/v1/evaluations", True),
    ("GET", "/api/v1/workers", True),
    ("GET", "/api/v1/", True),
    ("POST", "/api/v1/auth/token", False),
    ("GET", "/metrics", False),
    ("GET", "/admin/", False),
    ("GET", "/admin/scheduling/evaluation/", False),
    ("GET", "/admin/overview.json", False),
    ("GET", "/healthz", False),
]


def test_every_route_is_503_with_retry_after_while_the_database_is_away(tmp_path: Path) -> None:
    with operator_service_on_own_postgres(
        tmp_path, serve_args=["--no-passes"], GRADIENT_API_THROTTLE_ANON="", GRADIENT_API_THROTTLE_USER=""
    ) as service:
        pg, server, token = service.pg, service.server, service.token
        opener = _admin_session(server.base_url)
        for method, path, with_token in ROUTES:
            status, _headers, _body = _request(
                opener, method, server.base_url + path, token if with_token else None
            )
            assert status == 200, (path, status)

        pg.stop("fast")
        try:
            for _round in range(3):
                for method, path, with_token in ROUTES:
                    status, headers, answer = _request(
                        opener, method, server.base_url + path, token if with_token else None
                    )
                    assert status == 503, (path, status, answer[:300])
                    assert int(headers["retry-after"]) > 0, (path, headers)
                    assert str(pg.port) not in answer.decode(), (path, answer)
        finally:
            pg.start()
        for method, path, with_token in ROUTES:
            status, _headers, _body = _request(
                opener, method, server.base_url + path, token if with_token else None
            )
            assert status == 200, (path, status)
        log = server.log()
    assert "Internal Server Error" not in log and "django.request" not in log, log[-3000:]
    assert 1 <= log.count("the database does not answer:") <= 3 * len(ROUTES) // 2, log[-3000:]


def test_a_view_whose_database_is_away_is_503_in_the_test_client(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: object, *args: object) -> None:
        raise OperationalError('connection to server at "10.1.2.3", port 5432 failed: Connection refused')

    monkeypatch.setattr("django.db.backends.utils.CursorWrapper.execute", refused)
    response = Client().post("/api/v1/auth/token", {"username": "x", "password": "y"})
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert "10.1.2.3" not in response.content.decode()
