"""Password guessing is bounded (issue 17, finding 4): the client address is the peer's unless the peer
is a trusted proxy, the counts live in the database (shared by every `serve`, kept across restarts), and
failed logins are limited per account and per address on the token route and the admin's login page."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.cache import cache
from django.test import Client, RequestFactory, override_settings
from rest_framework.test import APIClient

from gradient.models import RateCounter
from gradient.throttling import client_address, parse_rate
from tests.support.processes import database_env, http_json, serve

pytestmark = pytest.mark.django_db


def _token(client: APIClient, username: str, password: str, forwarded: str | None = None) -> int:
    """The status of a login: 401 for wrong credentials (issue 34), 429 once throttled."""
    extra = {"HTTP_X_FORWARDED_FOR": forwarded} if forwarded else {}
    return client.post(
        "/api/v1/auth/token", {"username": username, "password": password}, **extra
    ).status_code


@override_settings(GRADIENT_API_THROTTLE_ANON="2/minute", GRADIENT_LOGIN_THROTTLE_ACCOUNT="")
def test_a_forged_x_forwarded_for_does_not_give_a_client_a_new_count() -> None:
    codes = [_token(APIClient(), "x", "y", forwarded=f"10.0.0.{n}") for n in range(4)]
    assert codes == [401, 401, 429, 429]


@override_settings(
    GRADIENT_API_THROTTLE_ANON="2/minute",
    GRADIENT_LOGIN_THROTTLE_ACCOUNT="",
    GRADIENT_TRUSTED_PROXIES="127.0.0.0/8",
)
def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_count() -> None:
    codes = [_token(APIClient(), "x", "y", forwarded=f"10.0.0.{n % 2}") for n in range(4)]
    assert codes == [401, 401, 401, 401]
    assert _token(APIClient(), "x", "y", forwarded="10.0.0.0") == 429


@pytest.mark.parametrize(
    ("trusted", "remote", "forwarded", "expected"),
    [
        ("", "203.0.113.9", "1.2.3.4", "203.0.113.9"),
        ("10.0.0.1", "203.0.113.9", "1.2.3.4", "203.0.113.9"),  # the peer is no proxy of ours
        ("10.0.0.1", "10.0.0.1", "1.2.3.4", "1.2.3.4"),
        (
            "10.0.0.1",
            "10.0.0.1",
            "6.6.6.6, 1.2.3.4",
            "1.2.3.4",
        ),  # what the client wrote first is not believed
        ("10.0.0.0/24", "10.0.0.1", "6.6.6.6, 1.2.3.4, 10.0.0.7", "1.2.3.4"),
        ("10.0.0.0/24", "10.0.0.1", "", "10.0.0.1"),
        ("10.0.0.0/24, ::1", "::1", "2001:db8::1", "2001:db8::1"),
    ],
)
def test_the_client_address(trusted: str, remote: str, forwarded: str, expected: str) -> None:
    request = RequestFactory().get("/", REMOTE_ADDR=remote, HTTP_X_FORWARDED_FOR=forwarded)
    with override_settings(GRADIENT_TRUSTED_PROXIES=trusted):
        assert client_address(request) == expected


def test_rates_parse() -> None:
    assert parse_rate("20/minute") == (20, 60)
    assert parse_rate("10/15m") == (10, 900)
    assert parse_rate("5/h") == (5, 3600)
    assert parse_rate("") is None


@override_settings(GRADIENT_API_THROTTLE_ANON="2/minute", GRADIENT_LOGIN_THROTTLE_ACCOUNT="")
def test_the_count_is_kept_in_the_database_not_in_a_process() -> None:
    assert [_token(APIClient(), "x", "y") for _ in range(2)] == [401, 401]
    cache.clear()  # what a restart did to the local-memory count
    assert _token(APIClient(), "x", "y") == 429
    assert RateCounter.objects.filter(key__startswith="anon").get().hits == 3


@override_settings(GRADIENT_LOGIN_THROTTLE_ACCOUNT="3/15m", GRADIENT_LOGIN_THROTTLE_ADDRESS="")
def test_failed_token_logins_are_limited_per_account_even_with_the_right_password_then() -> None:
    User.objects.create_user("op", password="pw-op-1")
    assert [_token(APIClient(), "op", "wrong") for _ in range(3)] == [401, 401, 401]
    refused = APIClient().post("/api/v1/auth/token", {"username": "op", "password": "pw-op-1"})
    assert refused.status_code == 429 and "Retry-After" in refused
    # Another account is not held back.
    User.objects.create_user("other", password="pw-other-1")
    assert _token(APIClient(), "other", "pw-other-1") == 200


@override_settings(GRADIENT_LOGIN_THROTTLE_ACCOUNT="3/15m", GRADIENT_LOGIN_THROTTLE_ADDRESS="5/15m")
def test_the_admin_login_is_limited_per_account_and_per_address() -> None:
    User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c")
    client = Client()
    codes = [
        client.post("/admin/login/", {"username": "admin", "password": "no"}).status_code for _ in range(3)
    ]
    assert codes == [200, 200, 200]  # the form again, with its error
    refused = client.post("/admin/login/", {"username": "admin", "password": "pw-admin-1"})
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    # Other accounts from the same address: two more failures reach the address's limit.
    codes = [
        client.post("/admin/login/", {"username": f"u{n}", "password": "no"}).status_code for n in range(3)
    ]
    assert codes == [200, 200, 429]
    assert client.get("/admin/login/").status_code == 200  # the page itself is still shown


@override_settings(GRADIENT_LOGIN_THROTTLE_ACCOUNT="3/15m")
def test_a_successful_admin_login_is_not_counted() -> None:
    User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c")
    for _ in range(4):
        client = Client()
        assert (
            client.post("/admin/login/", {"username": "admin", "password": "pw-admin-1"}).status_code == 302
        )


@pytest.mark.django_db(transaction=True)
def test_two_serve_processes_share_one_count(tmp_path: Path) -> None:
    env = database_env(redis=False, GRADIENT_API_THROTTLE_ANON="3/minute", GRADIENT_LOGIN_THROTTLE_ACCOUNT="")
    with serve(env, tmp_path, ["--no-passes"]) as first, serve(env, tmp_path, ["--no-passes"]) as second:
        codes = [
            http_json("POST", f"{server.base_url}/api/v1/auth/token", {"username": "x", "password": "y"})[0]
            for server in (first, second, first, second)
        ]
    assert codes == [401, 401, 401, 429]
