"""The admin's worker pages: registering a worker shows its token once; deactivating closes its
session."""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from gradient.workers.models import Worker, WorkerSession
from gradient.workers.tokens import token_matches

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("admin", "a@b.c", "pw"))
    return client


def _tokens_in(html: str) -> list[str]:
    return re.findall(r"\): (\S+) \. Copy it now", html)


def test_adding_a_worker_shows_its_token_once(operator: Client) -> None:
    assert operator.get("/admin/workers/worker/add/").status_code == 200

    response = operator.post(
        "/admin/workers/worker/add/",
        {
            "name": "builder",
            "max_concurrent_builds": 1,
            "architectures": "[]",
            "system_features": "[]",
            "sessions-TOTAL_FORMS": 0,
            "sessions-INITIAL_FORMS": 0,
        },
        follow=True,
    )

    assert response.status_code == 200
    worker = Worker.objects.get(name="builder")
    [token] = _tokens_in(response.content.decode())
    assert token_matches(token, worker.token_hash)
    again = operator.get(f"/admin/workers/worker/{worker.id}/change/").content.decode()
    assert token not in again and not _tokens_in(again)


def test_issuing_a_new_token_replaces_the_old_one(operator: Client) -> None:
    worker = Worker.objects.create(name="w", token_hash="old")
    response = operator.post(
        "/admin/workers/worker/",
        {"action": "issue_new_tokens", "_selected_action": [str(worker.id)]},
        follow=True,
    )
    [token] = _tokens_in(response.content.decode())
    worker.refresh_from_db()
    assert token_matches(token, worker.token_hash)


def test_the_deactivate_action_closes_the_open_session(operator: Client) -> None:
    now = timezone.now()
    worker = Worker.objects.create(name="w", token_hash="x")
    session = WorkerSession.objects.create(
        worker=worker, channel_name="c", server_boot=uuid.uuid4(), opened_at=now, last_seen=now
    )

    # behind a confirmation page now (issue 16): the second post confirms
    operator.post(
        "/admin/workers/worker/",
        {"action": "deactivate_workers", "_selected_action": [str(worker.id)], "confirmed": "yes"},
    )

    worker.refresh_from_db()
    session.refresh_from_db()
    assert not worker.active and session.closed_at is not None
