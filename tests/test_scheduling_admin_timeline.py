"""The evaluation and shared-build pages of the admin show the job's record as a timeline."""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.core.vocab import JobKind
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    ClusterAttemptOpened,
    Prioritize,
    ReportKind,
    Resubmitted,
    Seat,
    WorkerReport,
)
from gradient.records.services import commit_control, record_append_facts
from gradient.scheduling.services.evaluations import evaluation_create, evaluation_request_cancel
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import (
    ClusterAttemptFactory,
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
    visible = re.sub(r"<details>.*?</details>", "", timeline, flags=re.S)
    words = re.sub(r"<a [^>]*>|</a>", "", visible)  # the names are links (issue 34, item 9)
    assert "claimed for builder-2, attempt 1" in words
    assert "builder-2 reported accepted" in words
    assert str(worker.id) not in words and str(row.id)[:8] not in words
    assert re.search(r'<time datetime="[^"]+" title="[^"]+ UTC">[^<]+ ago</time>', timeline)


def _timeline_of(client: Client, url: str) -> str:
    page = client.get(url).content.decode()
    return page[page.index('id="record-timeline"') :]


def test_the_timeline_links_the_workers_tries_builds_and_evaluations_it_names_to_their_pages(
    operator_client: Client,
) -> None:
    """Issue 34, item 9: a name on the timeline is a link to the named object's console page."""
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="abc", now=timezone.now()
    )
    successor = EvaluationFactory(repository="sim:diamond", commit="def0123456789")
    worker = WorkerFactory(name="builder-2")
    build = DerivationBuildFactory(drv_path="/nix/store/" + "a" * 32 + "-hello-2.12.drv")
    row = DispatchedJobFactory(kind=JobKind.EVAL, evaluation=evaluation, derivation_build=None, worker=worker)
    record_append_facts(
        job_key=evaluation.job_key,
        facts=[
            AssignmentClaimed(submission=1, assignment_id=row.id, worker=str(worker.id), attempt=1),
            AssignmentClosed(assignment_id=row.id, outcome=AssignmentOutcome.COMPLETED),
            Resubmitted(successor=successor.job_key),
        ],
        now=timezone.now(),
    )
    commit_control(
        job_key=evaluation.job_key,
        intent=Prioritize(target=f"build:{build.id}", reason="urgent"),
        actor="admin:root",
        now=timezone.now(),
    )
    timeline = _timeline_of(
        operator_client, reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    )

    def link(admin_name: str, pk: object, text: str) -> str:
        return f'<a href="{reverse(admin_name, args=[pk])}">{text}</a>'

    assert "claimed for " + link("admin:workers_worker_change", worker.id, "builder-2") in timeline
    assert (
        link("admin:scheduling_dispatchedjob_change", row.id, "the try on builder-2") + " closed" in timeline
    )
    assert (
        "restarted as " + link("admin:scheduling_evaluation_change", successor.id, "sim:diamond@def012345678")
        in timeline
    )
    assert (
        "prioritize requested for " + link("admin:scheduling_derivationbuild_change", build.id, "hello-2.12")
        in timeline
    )


def test_a_clusters_timeline_links_its_attempts_and_the_workers_of_their_seats(
    operator_client: Client,
) -> None:
    cluster = make_cluster([("server", queued_build(ProjectFactory()))])
    worker = WorkerFactory(name="node-a")
    attempt = ClusterAttemptFactory(cluster_job=cluster, number=1)
    record_append_facts(
        job_key=cluster.job_key,
        facts=[
            ClusterAttemptOpened(
                submission=1,
                cluster_attempt_id=attempt.id,
                attempt=1,
                seats=(Seat(role="server", index=0, worker=str(worker.id)),),
            )
        ],
        now=timezone.now(),
    )
    timeline = _timeline_of(operator_client, reverse("admin:clusters_clusterjob_change", args=[cluster.id]))
    attempt_url = reverse("admin:clusters_clusterattempt_change", args=[attempt.id])
    worker_url = reverse("admin:workers_worker_change", args=[worker.id])
    assert f'cluster attempt <a href="{attempt_url}">#1</a> (claim 1) opened' in timeline
    assert f'server[0] on <a href="{worker_url}">node-a</a>' in timeline


def test_a_name_on_the_timeline_is_escaped_and_an_unnamed_id_is_plain_text(operator_client: Client) -> None:
    evaluation, _ = evaluation_create(
        project=ProjectFactory(), repository="sim:diamond", commit="abc", now=timezone.now()
    )
    worker = WorkerFactory(name="<b>x</b>")
    gone = uuid.uuid4()
    record_append_facts(
        job_key=evaluation.job_key,
        facts=[
            AssignmentClaimed(submission=1, assignment_id=gone, worker=str(worker.id), attempt=1),
            AssignmentClosed(assignment_id=gone, outcome=AssignmentOutcome.ABANDONED),
        ],
        now=timezone.now(),
    )
    timeline = _timeline_of(
        operator_client, reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    )
    assert "&lt;b&gt;x&lt;/b&gt;</a>" in timeline and "<b>x</b>" not in timeline
    assert f"assignment {str(gone)[:8]} closed Abandoned" in timeline
