"""The assignment pass re-offers to every connected worker and brings builds out of backoff; the resync
pass queues whatever missed its kick."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

from gradient.runtime.outbox import worker_group
from gradient.scheduling.models import BuildStatus, DerivationBuild
from gradient.scheduling.services.passes import assignment_pass, build_resync_pass
from tests.factories import DerivationBuildFactory, EvaluationFactory, ProjectFactory, connected_worker


def _listen(worker_id) -> str:  # type: ignore[no-untyped-def]
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(worker_group(worker_id), channel)
    return channel


def _next(channel: str) -> dict | None:
    async def one() -> dict | None:
        try:
            return await asyncio.wait_for(get_channel_layer().receive(channel), 1.0)
        except TimeoutError:
            return None

    return async_to_sync(one)()


@pytest.mark.django_db(transaction=True)
def test_the_assignment_pass_pushes_each_connected_worker_its_offer_delta_once() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    stranger = connected_worker([ProjectFactory()])
    mine, theirs = _listen(worker.id), _listen(stranger.id)

    result = assignment_pass(now=timezone.now())

    assert (result.workers, result.offers) == (2, 1)
    pushed = _next(mine)
    assert pushed is not None and json.loads(pushed["frame"])["type"] == "JobOffer"
    assert [c["job_id"] for c in json.loads(pushed["frame"])["candidates"]] == [evaluation.job_key]
    assert _next(theirs) is None
    assert assignment_pass(now=timezone.now()).offers == 0  # a delta: nothing new


@pytest.mark.django_db
def test_the_assignment_pass_queues_builds_whose_backoff_has_passed() -> None:
    now = timezone.now()
    due = DerivationBuildFactory(status=BuildStatus.FAILED_TRANSIENT, retry_at=now - timedelta(seconds=1))
    later = DerivationBuildFactory(status=BuildStatus.FAILED_TRANSIENT, retry_at=now + timedelta(seconds=30))
    assert assignment_pass(now=now).promoted == 1
    assert DerivationBuild.objects.get(id=due.id).status == BuildStatus.QUEUED
    assert DerivationBuild.objects.get(id=later.id).status == BuildStatus.FAILED_TRANSIENT


@pytest.mark.django_db
def test_the_resync_pass_queues_created_builds_whose_dependencies_succeeded() -> None:
    done = DerivationBuildFactory(status=BuildStatus.COMPLETED)
    waiting = DerivationBuildFactory(status=BuildStatus.CREATED)
    blocked = DerivationBuildFactory(status=BuildStatus.CREATED)
    waiting.dependency_edges.create(dependency=done)
    blocked.dependency_edges.create(dependency=waiting)
    assert build_resync_pass(now=timezone.now()) == 1
    assert DerivationBuild.objects.get(id=waiting.id).status == BuildStatus.QUEUED
    assert DerivationBuild.objects.get(id=blocked.id).status == BuildStatus.CREATED
