"""A worker's session goes with its credentials (issue 17, findings 10 and 7): a new token closes the
session opened with the old one (4401) and the old token is refused from then on; a deleted worker's
socket is closed (4403) instead of staying open and deaf."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.test import Client

from gradient.scheduling.models import DispatchedJob
from gradient.workers.models import Worker, WorkerSession
from gradient.workers.services import worker_token_reset
from tests.factories import DispatchedJobFactory
from tests.support.proto import expect_close, expect_refusal, finish, handshake, init_connection, open_socket

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_new_token_closes_the_session_opened_with_the_old_one(make_worker: Any) -> None:
    worker, old = await database_sync_to_async(make_worker)()
    comm, _ = await handshake(str(worker.id), old)
    assignment = await database_sync_to_async(lambda: DispatchedJobFactory(worker=worker))()

    new = await database_sync_to_async(worker_token_reset)(worker_id=worker.id)

    assert new is not None and new != old
    assert await expect_close(comm) == 4401
    await finish(comm)
    session = await WorkerSession.objects.aget(worker=worker)
    assert session.closed_at is not None and session.close_reason == "token rotated"
    assert (await DispatchedJob.objects.aget(id=assignment.id)).finished_at is not None  # back to the pool
    again = await open_socket()
    await again.send_json_to(init_connection(str(worker.id), old))
    reject, code = await expect_refusal(again, "Reject")
    assert (reject["code"], code) == (401, 4401)
    await finish(again)
    fresh, _ = await handshake(str(worker.id), new)
    await finish(fresh)


async def test_the_admins_issue_new_tokens_closes_the_session_too(make_worker: Any) -> None:
    worker, old = await database_sync_to_async(make_worker)()
    comm, _ = await handshake(str(worker.id), old)

    def issue() -> int:
        User.objects.create_superuser("admin", password="pw-admin-1", email="a@b.c")
        client = Client()
        client.force_login(User.objects.get(username="admin"))
        return client.post(
            "/admin/workers/worker/", {"action": "issue_new_tokens", "_selected_action": [str(worker.id)]}
        ).status_code

    assert await database_sync_to_async(issue)() == 302
    assert await expect_close(comm) == 4401
    await finish(comm)


async def test_deleting_a_connected_worker_closes_its_socket(make_worker: Any) -> None:
    worker, token = await database_sync_to_async(make_worker)()
    comm, _ = await handshake(str(worker.id), token)

    await database_sync_to_async(lambda: Worker.objects.get(id=worker.id).delete())()

    assert await expect_close(comm) == 4403
    await finish(comm)
    assert not await WorkerSession.objects.filter(worker_id=worker.id).aexists()
