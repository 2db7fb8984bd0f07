"""Credentials that are odd, from outside (issue 25, findings 5 and 6): an `Authorization` header whose
bytes are no UTF-8 is an invalid token (401) on every route of a real `serve`, with no traceback in its
log; and the per-account login lock holds for every spelling of the name that signs in to the account
(spaces, a tab, U+3000 around it, full-width letters on the admin's login page)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from rest_framework.test import APIClient

from gradient.throttling import login_name
from tests.support.processes import database_env, serve

pytestmark = pytest.mark.django_db

ROUTES = [
    "/api/v1/",
    "/api/v1/projects",
    "/api/v1/evaluations",
    "/api/v1/clusters",
    "/api/v1/workers",
    "/api/v1/auth/tokens",
    "/api/schema/",
]


def _raw_get(port: int, path: str, authorization: bytes) -> tuple[int, bytes]:
    """GET `path` with the header's bytes as they are (urllib would refuse to send them)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Authorization: " + authorization + b"\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, answer


@pytest.mark.django_db(transaction=True)
def test_an_undecodable_token_is_401_on_every_route_with_no_traceback(tmp_path: Path) -> None:
    env = database_env(redis=False, GRADIENT_API_THROTTLE_ANON="")
    with serve(env, tmp_path, ["--no-passes"]) as server:
        for credential in (b"Token \xe9", b"Token \xff\xfe" + b"a" * 62, b"Token \xc3("):
            for path in ROUTES:
                status, answer = _raw_get(server.port, path, credential)
                assert status == 401, (credential, path, answer[:300])
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[log.find("Traceback") - 200 :][:3000]


def test_a_decodable_wrong_token_is_still_401_and_a_right_one_works() -> None:
    assert APIClient(HTTP_AUTHORIZATION="Token " + "ab" * 32).get("/api/v1/projects").status_code == 401
    user = User.objects.create_user("op", password="pw-op-1", is_staff=True)
    from gradient.auth import issue_token

    client = APIClient(HTTP_AUTHORIZATION=f"Token {issue_token(user)}")
    assert client.get("/api/v1/projects").status_code == 200


def _token(username: str, password: str) -> int:
    return APIClient().post("/api/v1/auth/token", {"username": username, "password": password}).status_code


SPELLINGS = [" alice", "alice\t", "\u3000alice", "alice ", "\talice\u3000"]


@override_settings(GRADIENT_LOGIN_THROTTLE_ACCOUNT="3/15m", GRADIENT_LOGIN_THROTTLE_ADDRESS="")
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_locked_account_stays_locked_on_the_token_route_however_the_name_is_spaced(spelling: str) -> None:
    User.objects.create_user("alice", password="pw-alice-1")
    assert _token(spelling, "pw-alice-1") == 200  # the route itself reads these as alice
    assert [_token("alice", "wrong") for _ in range(3)] == [401, 401, 401]  # a wrong password is 401
    assert _token(spelling, "pw-alice-1") == 429
    assert _token("alice", "pw-alice-1") == 429


@override_settings(GRADIENT_LOGIN_THROTTLE_ACCOUNT="3/15m", GRADIENT_LOGIN_THROTTLE_ADDRESS="")
@pytest.mark.parametrize("spelling", [*SPELLINGS, "ａｌｉｃｅ", "\u3000ａｌｉｃｅ "])
def test_a_locked_account_stays_locked_on_the_admin_login_full_width_too(spelling: str) -> None:
    User.objects.create_superuser("alice", password="pw-alice-1", email="a@b.c")
    assert Client().post("/admin/login/", {"username": spelling, "password": "pw-alice-1"}).status_code == 302
    for _ in range(3):
        assert Client().post("/admin/login/", {"username": "alice", "password": "no"}).status_code == 200
    refused = Client().post("/admin/login/", {"username": spelling, "password": "pw-alice-1"})
    assert refused.status_code == 429


@override_settings(GRADIENT_LOGIN_THROTTLE_ACCOUNT="3/15m", GRADIENT_LOGIN_THROTTLE_ADDRESS="")
def test_failures_under_another_spelling_count_for_the_same_account() -> None:
    User.objects.create_superuser("alice", password="pw-alice-1", email="a@b.c")
    for spelling in ("ａｌｉｃｅ", " alice", "alice\t"):
        assert Client().post("/admin/login/", {"username": spelling, "password": "no"}).status_code == 200
    assert _token("alice", "pw-alice-1") == 429
    # Another account is another count; case is the user model's (exact), so `Alice` is another name.
    User.objects.create_user("Alice", password="pw-Alice-1")
    assert _token("Alice", "pw-Alice-1") == 200


def test_the_login_name() -> None:
    assert login_name(" alice\t") == login_name("\u3000ａｌｉｃｅ") == "alice"
    assert login_name("Alice") == "Alice"
    assert login_name("") == ""
