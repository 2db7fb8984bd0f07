"""REST tokens (issue 17, finding 5): stored hashed, expiring, listed and revoked over REST and in the
admin, and revoked when the user's password changes or the user is deactivated. The token route keeps
its shape, {token}."""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client, override_settings
from django.utils import timezone
from knox.models import AuthToken
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db(transaction=True)


def _login(username: str = "op", password: str = "pw-op-1") -> str:
    response = APIClient().post(
        "/api/v1/auth/token", {"username": username, "password": password}, format="json"
    )
    assert response.status_code == 200, response.content
    assert set(response.json()) == {"token"}
    return str(response.json()["token"])


def _client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def _works(token: str) -> bool:
    status = _client(token).get("/api/v1/projects").status_code
    assert status in (200, 401), status
    return status == 200


@pytest.fixture
def op() -> User:
    return User.objects.create_user("op", password="pw-op-1", is_staff=True)


def _every_text_in_the_database() -> str:
    """Every text column of every table that holds tokens, as one string."""
    with connection.cursor() as cursor:
        chunks = []
        for table in ("knox_authtoken", "authtoken_token"):
            cursor.execute(f"SELECT * FROM {table}")  # noqa: S608 (fixed names)
            chunks.extend(str(value) for row in cursor.fetchall() for value in row)
    return "\n".join(chunks)


def test_a_token_is_stored_hashed_and_expires_after_the_configured_days(op: User) -> None:
    with override_settings(GRADIENT_API_TOKEN_TTL_DAYS=7):
        token = _login()
    assert _works(token)
    assert token not in _every_text_in_the_database()
    [row] = AuthToken.objects.filter(user=op)
    assert row.expiry is not None
    assert timedelta(days=6, hours=23) < row.expiry - timezone.now() <= timedelta(days=7)
    AuthToken.objects.filter(pk=row.pk).update(expiry=timezone.now() - timedelta(seconds=1))
    assert not _works(token)


def test_each_login_is_a_token_of_its_own_listed_and_revoked_over_rest(op: User) -> None:
    first, second = _login(), _login()
    assert first != second
    listed = _client(first).get("/api/v1/auth/tokens").json()
    assert len(listed) == 2
    assert sorted(t["current"] for t in listed) == [False, True]
    assert all(set(t) == {"id", "created", "expiry", "current"} and t["expiry"] for t in listed)
    [other] = [t for t in listed if not t["current"]]
    assert second.startswith(other["id"])

    assert _client(first).delete(f"/api/v1/auth/tokens/{other['id']}").status_code == 204
    assert not _works(second) and _works(first)
    assert _client(first).delete(f"/api/v1/auth/tokens/{other['id']}").status_code == 404
    assert _client(first).post("/api/v1/auth/logout").status_code == 204
    assert not _works(first)


def test_one_user_cannot_see_or_revoke_anothers_tokens(op: User) -> None:
    User.objects.create_user("other", password="pw-other-1")
    mine, theirs = _login(), _login("other", "pw-other-1")
    assert [t["current"] for t in _client(theirs).get("/api/v1/auth/tokens").json()] == [True]
    key = mine[:15]
    assert _client(theirs).delete(f"/api/v1/auth/tokens/{key}").status_code == 404
    assert _works(mine)


def test_a_password_change_revokes_every_token_of_the_user(op: User) -> None:
    tokens = [_login(), _login()]
    op.set_password("pw-op-2")
    op.save()
    assert not any(_works(t) for t in tokens)
    assert _works(_login(password="pw-op-2"))


def test_deactivating_a_user_revokes_every_token(op: User) -> None:
    token = _login()
    op.is_active = False
    op.save()
    assert not AuthToken.objects.filter(user=op).exists()
    op.is_active = True
    op.save()
    assert not _works(token)


def test_saving_other_fields_keeps_the_tokens(op: User) -> None:
    token = _login()
    op.email = "op@example.com"
    op.save()
    assert _works(token)


def test_a_plain_drf_token_is_kept_hashed_only_and_still_works(op: User) -> None:
    key = Token.objects.create(user=op).key
    assert not Token.objects.exists()
    assert key not in _every_text_in_the_database()
    assert _works(key)


def test_the_migration_hashes_the_tokens_stored_before(op: User) -> None:
    Token.objects.bulk_create([Token(key="a" * 40, user=op)])  # no save signal: as stored before
    migration = importlib.import_module("gradient.migrations.0002_hash_rest_tokens")
    migration.hash_plain_tokens(apps, None)
    assert not Token.objects.exists()
    assert _works("a" * 40)
    assert "a" * 40 not in _every_text_in_the_database()


def test_staff_list_and_revoke_tokens_in_the_admin(op: User) -> None:
    token = _login()
    User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c")
    admin = Client()
    admin.force_login(User.objects.get(username="admin"))
    page = admin.get("/admin/knox/authtoken/")
    assert page.status_code == 200 and b"op" in page.content
    [row] = AuthToken.objects.filter(user=op)
    response = admin.post(
        "/admin/knox/authtoken/", {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"}
    )
    assert response.status_code == 302
    assert not _works(token)


def test_a_user_keeps_at_most_the_configured_number_of_tokens_the_newest(op: User) -> None:
    with override_settings(GRADIENT_API_TOKENS_PER_USER=3):
        tokens = [_login() for _ in range(5)]
    assert AuthToken.objects.filter(user=op).count() == 3
    assert [_works(t) for t in tokens] == [False, False, True, True, True]
