"""Where a waiting job stands, on the console (issue 33): a Queued build's and evaluation's position,
jobs ahead, slots and expected start with its range (or "unknown"), a Building evaluation's expected end,
waited apart from built or evaluated; the overview's first in line and the last day's estimate error."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.core.vocab import BuildAttemptOutcome, JobKind
from gradient.scheduling.models import BuildAttempt, DerivationBuild, DispatchedJob, Evaluation, StartEstimate
from tests.factories import DerivationBuildFactory, EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build_id_of, drv
from tests.test_scheduling_queue_position import queued

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(User.objects.create_user("op", password="pw-op-1", is_staff=True))
    return client


def page(client: Client, build: DerivationBuild) -> str:
    response = client.get(reverse("admin:scheduling_derivationbuild_change", args=[build.id]))
    assert response.status_code == 200
    return response.content.decode()


def tries(name: str, *secs: float) -> None:
    ended = timezone.now() - timedelta(hours=1)
    for i, s in enumerate(secs):
        earlier = DerivationBuildFactory(
            drv_path=f"/nix/store/{chr(ord('k') + i) * 32}-{name}.drv", status="Completed"
        )
        BuildAttempt.objects.create(
            build=earlier,
            number=1,
            outcome=BuildAttemptOutcome.BUILT,
            started_at=ended - timedelta(seconds=s),
            finished_at=ended,
        )


def test_a_queued_builds_page_says_where_it_stands_and_when_it_starts(operator: Client) -> None:
    project = ProjectFactory()
    worker = connected_worker([project])  # one slot
    _, (first, second, third) = queued(project, drv("first"), drv("second"), drv("third"))
    tries("third", 60.0, 100.0, 140.0)  # median 100 s, p10 60 s, p90 140 s
    a = ask(worker.id)
    assert a is not None and build_id_of(a) == str(first.id)

    text = page(operator, third)
    assert "Where it stands" in text
    assert "position 2 of the builds the same workers can run (1 ahead) · 1 of 1 slots busy" in text
    # One ahead on one busy slot: half of the running one, then one whole: 150 s (90 s to 210 s).
    assert "expected to start" in text and "in 2 min 30 s" in text
    assert "(between 1 min 30 s and 3 min 30 s from now)" in text
    assert "from past builds of this derivation" in text

    # The running one's page: no standing, its wait and its build apart.
    running = page(operator, first)
    assert "Where it stands" not in running
    assert "Waited" in running and "Built" in running


def test_unknown_without_history_or_without_a_worker(operator: Client, settings) -> None:  # type: ignore[no-untyped-def]
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 0
    project = ProjectFactory()
    connected_worker([project])
    _, (b,) = queued(project, drv("nohistory"))
    assert "start unknown (no history and no default duration)" in page(operator, b)
    _, (arm,) = queued(project, drv("armonly", system="aarch64-linux"))
    text = page(operator, arm)
    assert "no connected worker can run it now · start unknown (no worker can run it)" in text


def test_an_evaluations_page_stands_while_queued_and_says_when_it_ends_while_building(
    operator: Client, settings
) -> None:  # type: ignore[no-untyped-def]
    settings.GRADIENT_ETA_DEFAULT_BUILD_SECS = 60
    project = ProjectFactory()
    worker = connected_worker([project])
    first = EvaluationFactory(project=project)
    second = EvaluationFactory(project=project)

    def show(e: Evaluation) -> str:
        response = operator.get(reverse("admin:scheduling_evaluation_change", args=[e.id]))
        assert response.status_code == 200
        return response.content.decode()

    assert "position 2 of the evaluations of its project the same workers can run (1 ahead)" in show(second)
    assert "no history yet: the configured default duration" in show(second)
    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == first.job_key
    DispatchedJob.objects.filter(id=a.assignment_id).update(
        dispatched_at=first.created_at + timedelta(seconds=42)
    )
    text = show(first)
    assert "Where it stands" not in text
    assert "42.0 s" in text  # waited: from its creation to its hand-out

    building, _ = queued(project, drv("e1"), drv("e2"))
    text = show(building)
    assert "Expected to end" in text and "critical path" in text and "Where it stands" not in text


def test_the_overview_shows_the_first_in_line_and_the_last_days_estimate_error(operator: Client) -> None:
    project = ProjectFactory()
    worker = connected_worker([project])
    _, (first, second) = queued(project, drv("head1"), drv("head2"))
    tries("head2", 100.0)
    a = ask(worker.id)
    assert a is not None
    snapshot = operator.get(reverse("console-overview-json")).json()
    (head,) = snapshot["queue_head"]
    assert (head["name"], head["position"], head["ahead"], head["slots"], head["busy"]) == (
        "head2",
        1,
        0,
        1,
        1,
    )
    assert head["starts"] == "in 50.0 s"  # half of a typical build on the busy slot
    (running,) = snapshot["running"]
    assert running["waited"] != "-"  # queued to handed out, apart from its running time
    assert snapshot["estimate_errors"] == {"count": 0, "p50": "-", "p90": "-"}

    now = timezone.now()
    for i, error in enumerate((10.0, 20.0, 30.0, 40.0)):
        b = DerivationBuildFactory(
            drv_path=f"/nix/store/{chr(ord('p') + i) * 32}-done.drv", status="Completed"
        )
        StartEstimate.objects.create(
            build=b,
            waiting_since=now - timedelta(minutes=10),
            estimated_at=now - timedelta(minutes=10),
            position=1,
            expected_start=now - timedelta(minutes=5),
            basis="derivation",
            started_at=now - timedelta(minutes=5) + timedelta(seconds=error),
            error_secs=error,
        )
    snapshot = operator.get(reverse("console-overview-json")).json()
    assert snapshot["estimate_errors"] == {"count": 4, "p50": "20.0 s", "p90": "40.0 s"}
    html = operator.get(reverse("console-overview")).content.decode()
    assert 'id="ov-head"' in html and 'id="ov-eta-errors"' in html
    assert JobKind.BUILD.value in {r["kind"] for r in snapshot["running"]}


def test_why_it_waits_counts_the_builds_ahead_as_where_it_stands_does(operator: Client) -> None:
    project = ProjectFactory()
    # An older Queued build no worker of this one's kind takes (another system): ahead of it by age in
    # the whole queue, not in its workers' order.
    _, (arm, x86) = queued(project, drv("arm", system="aarch64-linux"), drv("x86"))
    connected_worker([project], architectures=["x86_64-linux"])
    text = page(operator, DerivationBuild.objects.get(id=x86.id))
    assert "1 connected worker can build it; 0 queued builds ahead of it" in text
    assert "1 queued build ahead of it" not in text
