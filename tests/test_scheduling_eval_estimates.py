"""The error of evaluations' start estimates (issue 33, "honest estimates", for evaluations too): the ETA
pass writes down a Queued evaluation's expected start once in its first wait and settles it at its first
hand-out; the overview shows the last day's p50/p90 for evaluations beside the builds'."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.scheduling.models import DispatchedJob, Evaluation, StartEstimate
from gradient.scheduling.services import estimates
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, drv
from tests.test_metrics import samples
from tests.test_scheduling_queue_position import queued

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_evaluations_wait_is_estimated_once_and_settled_at_its_first_hand_out() -> None:
    project = ProjectFactory()
    worker = connected_worker([project])
    first = EvaluationFactory(project=project)
    second = EvaluationFactory(project=project)
    # A now ahead of the clock makes the figures exact (the estimates are made at the later of the two).
    now = timezone.now() + timedelta(minutes=10)
    result = estimates.start_estimate_pass(now=now)
    assert (result.evaluations_recorded, result.evaluations_settled, result.evaluations_dropped) == (2, 0, 0)
    assert result.recorded == 0  # no build waits
    rows = {e.evaluation_id: e for e in StartEstimate.objects.all()}
    assert rows[first.id].position == 1 and rows[first.id].expected_start == now  # its slot is free
    assert rows[first.id].waiting_since == first.created_at and rows[first.id].build_id is None
    # One ahead on the one free slot: half of the default evaluation time (300 s) after it.
    assert rows[second.id].position == 2 and rows[second.id].expected_start == now + timedelta(seconds=150)
    assert rows[second.id].basis == "default"
    assert estimates.start_estimate_pass(now=now).evaluations_recorded == 0  # each wait once

    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == first.job_key
    DispatchedJob.objects.filter(id=a.assignment_id).update(dispatched_at=now + timedelta(seconds=20))
    result = estimates.start_estimate_pass(now=now + timedelta(seconds=30))
    assert (result.evaluations_settled, result.evaluations_dropped) == (1, 0)
    settled = StartEstimate.objects.get(evaluation_id=first.id)
    assert settled.started_at == now + timedelta(seconds=20) and settled.error_secs == pytest.approx(20.0)
    assert StartEstimate.objects.get(evaluation_id=second.id).started_at is None

    # The second ends without a hand-out (cancelled): nothing to compare, dropped.
    Evaluation.objects.filter(id=second.id).update(status="Aborted")
    assert estimates.start_estimate_pass(now=now + timedelta(seconds=40)).evaluations_dropped == 1
    assert list(StartEstimate.objects.values_list("evaluation_id", flat=True)) == [first.id]

    errors = estimates.start_estimate_errors(now=now + timedelta(minutes=1), evaluations=True)
    assert (errors.count, errors.p50_secs, errors.p90_secs) == (1, pytest.approx(20.0), pytest.approx(20.0))
    assert estimates.start_estimate_errors(now=now + timedelta(minutes=1)).count == 0  # not a build's


def test_a_follow_ups_wait_is_not_estimated_and_the_builds_stay_apart() -> None:
    project = ProjectFactory()
    connected_worker([project])
    follow_up = EvaluationFactory(project=project)
    Evaluation.objects.filter(id=follow_up.id).update(followup_pending=True)
    _, (build,) = queued(project, drv("only"))
    result = estimates.start_estimate_pass(now=timezone.now())
    assert (result.recorded, result.evaluations_recorded) == (1, 0)
    assert StartEstimate.objects.get().build_id == build.id
    # The pass's record names the evaluations' counts only when it did anything for them.
    assert result.as_dict() == {"recorded": 1, "settled": 0, "dropped": 0}
    EvaluationFactory(project=project)
    assert estimates.start_estimate_pass(now=timezone.now()).as_dict() == {
        "recorded": 0,
        "settled": 0,
        "dropped": 0,
        "evaluations_recorded": 1,
        "evaluations_settled": 0,
        "evaluations_dropped": 0,
    }


def test_the_overview_shows_the_evaluations_estimate_errors_beside_the_builds() -> None:
    operator = Client()
    operator.force_login(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    snapshot = operator.get(reverse("console-overview-json")).json()
    assert snapshot["eval_estimate_errors"] == {"count": 0, "p50": "-", "p90": "-"}
    project = ProjectFactory()
    now = timezone.now()
    for error in (10.0, 20.0, 30.0):
        evaluation = EvaluationFactory(project=project, status="Completed")
        StartEstimate.objects.create(
            evaluation=evaluation,
            waiting_since=evaluation.created_at,
            estimated_at=now - timedelta(minutes=10),
            position=1,
            expected_start=now - timedelta(minutes=5),
            basis="project",
            started_at=now - timedelta(minutes=5) + timedelta(seconds=error),
            error_secs=error,
        )
    snapshot = operator.get(reverse("console-overview-json")).json()
    assert snapshot["eval_estimate_errors"] == {"count": 3, "p50": "20.0 s", "p90": "30.0 s"}
    assert snapshot["estimate_errors"]["count"] == 0  # the builds' stay apart
    html = operator.get(reverse("console-overview")).content.decode()
    assert 'id="ov-eta-eval-errors"' in html and "Evaluations' start estimates, last day" in html
    # gradient_eta_error_seconds stays the builds' (its help says so).
    scraped = samples(Client().get("/metrics").content.decode())
    assert scraped[("gradient_eta_error_seconds_count", ())] == 0
