"""Cancelling an evaluation: Aborted at once, AbortJob to its running jobs after commit, shared builds
that another evaluation still needs keep running."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

from gradient.runtime.outbox import worker_group
from gradient.scheduling.models import BuildStatus, DerivationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.evaluations import evaluation_cancel, evaluation_create
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, drv


def _receive_all(channel: str) -> list[dict]:
    layer = get_channel_layer()
    out = []

    async def drain() -> None:
        import asyncio

        while True:
            try:
                out.append(await asyncio.wait_for(layer.receive(channel), 0.3))
            except TimeoutError:
                return

    async_to_sync(drain)()
    return out


def _listen(worker_id) -> str:  # type: ignore[no-untyped-def]
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(worker_group(worker_id), channel)
    return channel


@pytest.mark.django_db
def test_a_cached_store_path_repository_is_a_cached_source() -> None:
    project = ProjectFactory()
    e, created = evaluation_create(
        project=project, repository="/nix/store/abc-src", commit="x", now=timezone.now()
    )
    assert created and e.source_kind == "cached" and e.status == EvaluationStatus.QUEUED


@pytest.mark.django_db(transaction=True)
def test_cancel_aborts_the_evaluation_and_its_unshared_builds_and_sends_abort_job_after_commit() -> None:
    project = ProjectFactory()
    mine = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    theirs = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    now = timezone.now()
    graph.ingest_eval_result(evaluation=mine, derivations=[drv("shared"), drv("only-mine")], now=now)
    graph.ingest_eval_result(evaluation=theirs, derivations=[drv("shared")], now=now)
    w1 = connected_worker([project])
    w2 = connected_worker([project])
    a1, a2 = ask(w1.id), ask(w2.id)
    assert a1 is not None and a2 is not None
    running = {a1.job_key: (w1, a1), a2.job_key: (w2, a2)}
    channels = {w.id: _listen(w.id) for w in (w1, w2)}

    result = evaluation_cancel(evaluation_id=mine.id, reason="cancelled by operator", now=timezone.now())

    assert result.cancelled
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.status == EvaluationStatus.ABORTED and mine.finished_at is not None
    assert theirs.status == EvaluationStatus.BUILDING
    shared = DerivationBuild.objects.get(drv_path__endswith="-shared.drv")
    only = DerivationBuild.objects.get(drv_path__endswith="only-mine.drv")
    assert shared.status == BuildStatus.BUILDING
    assert only.status == BuildStatus.ABORTED
    worker, a = running[only.job_key]
    messages = _receive_all(channels[worker.id])
    assert [json.loads(m["frame"]) for m in messages] == [
        {
            "type": "AbortJob",
            "job_id": only.job_key,
            "assignment_id": str(a.assignment_id),
            "reason": "cancelled by operator",
        }
    ]
    other_worker = next(w for k, (w, _) in running.items() if k != only.job_key)
    assert _receive_all(channels[other_worker.id]) == []


@pytest.mark.django_db
def test_cancelling_a_finished_evaluation_changes_nothing() -> None:
    e = EvaluationFactory(status=EvaluationStatus.COMPLETED, finished_at=timezone.now())
    assert evaluation_cancel(evaluation_id=e.id, reason="late", now=timezone.now()).cancelled is False
    e.refresh_from_db()
    assert e.status == EvaluationStatus.COMPLETED
