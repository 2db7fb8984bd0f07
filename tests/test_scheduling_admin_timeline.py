"""The evaluation and shared-build pages of the admin show the job's record as a timeline."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.core.vocab import JobKind
from gradient.records.schemas import AssignmentClaimed, ReportKind, WorkerReport
from gradient.records.services import record_append_facts
from gradient.scheduling.services.evaluations import evaluation_create, evaluation_request_cancel
from tests.factories import (
    DerivationBuildFactory,
    DispatchedJobFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
)

pytestmark = pytest.mark.django_db(transaction=True)  # the control hook runs once the intent committed


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def test_the_evaluation_page_shows_facts_and_the_operators_cancel_on_its_timeline(
    operator_client: Client,
) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="abc", now=timezone.now()
    )
    evaluation_request_cancel(evaluation_id=evaluation.id, actor="alice", now=timezone.now())
    page = operator_client.get(
        reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    ).content.decode()
    assert f"eval:{evaluation.id}" in page
    assert "status Queued: submitted" in page  # the fact, by the system
    assert "cancel requested" in page and "alice" in page  # the intent, by the operator


def test_a_job_made_outside_the_services_says_it_has_no_record(operator_client: Client) -> None:
    evaluation = EvaluationFactory(record=False)
    response = operator_client.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id]))
    assert response.status_code == 200
    assert "No record: this job was made outside the services" in response.content.decode()


def test_a_builds_page_says_builds_have_no_record_yet_not_that_something_went_wrong(
    operator_client: Client,
) -> None:
    """Issue 24, item 6: every build page read "no record (made outside the services)", as if an error."""
    build = DerivationBuildFactory()
    page = operator_client.get(reverse("admin:scheduling_derivationbuild_change", args=[build.id])).content
    text = page.decode()
    assert "Shared builds have no record of their own yet" in text
    assert "made outside the services" not in text


def test_the_timeline_names_workers_and_tries_and_shows_relative_times(operator_client: Client) -> None:
    """Issue 24, items 3 and 4: the timeline said "27fc759f-… reported accepted on 9a8bdaa3" (a worker id)
    and showed raw timestamps; it names the worker and the try, and says "… ago" with the exact time on
    hover."""
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="abc", now=timezone.now()
    )
    worker = WorkerFactory(name="builder-2")
    row = DispatchedJobFactory(kind=JobKind.EVAL, evaluation=evaluation, derivation_build=None, worker=worker)
    record_append_facts(
        job_key=evaluation.job_key,
        facts=[
            AssignmentClaimed(submission=1, assignment_id=row.id, worker=str(worker.id), attempt=1),
            WorkerReport(assignment_id=row.id, worker=str(worker.id), kind=ReportKind.ACCEPTED, summary=""),
        ],
        now=timezone.now(),
    )
    page = operator_client.get(
        reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    ).content.decode()
    timeline = page[page.index("Record (timeline)") :]
    assert "claimed for builder-2, attempt 1" in timeline
    assert "builder-2 reported accepted" in timeline
    visible = re.sub(r"<details>.*?</details>", "", timeline, flags=re.S)
    assert str(worker.id) not in visible and str(row.id)[:8] not in visible
    assert re.search(r'<time datetime="[^"]+" title="[^"]+ UTC">[^<]+ ago</time>', timeline)
