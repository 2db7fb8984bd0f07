"""The Idempotency-Key is its submitter's (issue 17, finding 11): another user's use of the same key is
neither a 409 (which would show that the key was used) nor is it taken from them."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.idempotency import scoped_key
from gradient.records.models import JobRecord
from gradient.scheduling.models import Evaluation
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db

BODY = {"project": "p", "repository": "sim:chain?n=1", "commit": "c0ffee"}


def _member(name: str) -> APIClient:
    user = User.objects.create_user(name, password=f"pw-{name}-1")
    ProjectFactory._meta.model.objects.get(name="p").members.add(user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def alice_and_bob() -> tuple[APIClient, APIClient]:
    ProjectFactory(name="p")
    return _member("alice"), _member("bob")


def _submit(client: APIClient, body: dict[str, str], key: str) -> tuple[int, dict[str, object]]:
    response = client.post("/api/v1/evaluations", body, format="json", HTTP_IDEMPOTENCY_KEY=key)
    return response.status_code, response.json()


def test_another_users_key_is_not_a_conflict_and_not_theirs(
    alice_and_bob: tuple[APIClient, APIClient],
) -> None:
    alice, bob = alice_and_bob
    status, first = _submit(alice, BODY, "release-1")
    assert status == 201
    # Bob's same key with another body: his own new submission, not a 409.
    status, bobs = _submit(bob, {**BODY, "commit": "beef"}, "release-1")
    assert status == 201 and bobs["id"] != first["id"]
    # Bob's same key with the same body is his, not Alice's evaluation.
    assert _submit(bob, {**BODY, "commit": "beef"}, "release-1") == (200, bobs)
    # Each still gets their own answers.
    assert _submit(alice, BODY, "release-1")[1]["id"] == first["id"]
    assert _submit(alice, {**BODY, "commit": "beef"}, "release-1")[0] == 409
    assert Evaluation.objects.count() == 2


def test_a_long_key_is_scoped_too(alice_and_bob: tuple[APIClient, APIClient]) -> None:
    alice, bob = alice_and_bob
    key = "k" * 255
    status, first = _submit(alice, BODY, key)
    assert status == 201
    assert _submit(alice, BODY, key)[1]["id"] == first["id"]
    assert _submit(bob, BODY, key)[0] == 201
    assert all(len(k) <= 255 for k in JobRecord.objects.values_list("idempotency_key", flat=True) if k)


def test_the_migration_scopes_the_keys_stored_before(alice_and_bob: tuple[APIClient, APIClient]) -> None:
    alice, _ = alice_and_bob
    status, first = _submit(alice, BODY, "old-key")
    record = JobRecord.objects.get(idempotency_key=scoped_key(User.objects.get(username="alice"), "old-key"))
    JobRecord.objects.filter(pk=record.pk).update(idempotency_key="old-key")  # as stored before
    importlib.import_module("gradient.migrations.0003_scope_idempotency_keys").scope_keys(apps, None)
    assert _submit(alice, BODY, "old-key") == (200, first)
