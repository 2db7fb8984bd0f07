"""The sweeps touch only what nobody tracks."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.recovery.sweeps import abandoned_dispatch_sweep, evaluation_watchdog
from gradient.scheduling.models import DispatchedJob, Evaluation, EvaluationStatus
from gradient.workers.models import WorkerSession
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask

pytestmark = pytest.mark.django_db


def test_the_sweep_closes_old_assignments_of_gone_workers_and_keeps_connected_ones() -> None:
    project = ProjectFactory()
    gone_eval, kept_eval = EvaluationFactory(project=project), EvaluationFactory(project=project)
    gone, kept = connected_worker([project]), connected_worker([project])
    a, b = ask(gone.id, "flake"), ask(kept.id, "flake")
    assert a is not None and b is not None
    WorkerSession.objects.filter(worker=gone).update(closed_at=timezone.now())
    later = timezone.now() + timedelta(seconds=1801)
    assert abandoned_dispatch_sweep(now=timezone.now()) == 0  # too young
    assert abandoned_dispatch_sweep(now=later) == 1
    assert DispatchedJob.objects.get(id=a.assignment_id).outcome == "Abandoned"
    assert DispatchedJob.objects.get(id=b.assignment_id).finished_at is None
    assert Evaluation.objects.get(id=gone_eval.id).status == "Queued"
    assert Evaluation.objects.get(id=kept_eval.id).status != "Queued"


def test_the_watchdog_requeues_an_evaluation_shown_evaluating_on_no_worker() -> None:
    stale = EvaluationFactory(status=EvaluationStatus.EVALUATING_FLAKE)
    Evaluation.objects.filter(id=stale.id).update(updated_at=timezone.now() - timedelta(minutes=5))
    fresh = EvaluationFactory(status=EvaluationStatus.FETCHING)
    assert evaluation_watchdog(now=timezone.now()) == 1
    assert Evaluation.objects.get(id=stale.id).status == "Queued"
    assert Evaluation.objects.get(id=fresh.id).status == "Fetching"
