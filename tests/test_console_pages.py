"""What the console's pages say (issue 16), without a browser: an evaluation's progress, failed builds
and what happens next while it waits (REST too), why a build waits, readable values."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.console import between, drv_name, duration, with_relative_deadline
from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling.decisions.waiting import unbuildable_deadline, what_happens_next
from gradient.scheduling.models import EvaluationBuild
from tests.factories import DerivationBuildFactory, EvaluationFactory, WorkerFactory, WorkerSessionFactory

NO_ARM = {
    "reason": "workers",
    "unmet": [{"architecture": "aarch64-linux", "required_features": ["kvm"], "builds": 3}],
    "connected_workers": 1,
    "available_architectures": ["x86_64-linux"],
}
T0 = datetime(2026, 3, 1, 7, 8, tzinfo=UTC)


def test_what_happens_next_to_a_waiting_evaluation_in_words() -> None:
    deadline = unbuildable_deadline(
        reason=NO_ARM, waiting_since=T0, wait_for_workers=False, pool_stable_since=T0, grace_secs=300
    )
    assert deadline == T0 + timedelta(minutes=5)
    assert (
        what_happens_next(reason=NO_ARM, deadline=deadline, wait_for_workers=False)
        == "aborted at 07:13:00 UTC unless a worker for aarch64-linux (kvm) connects"
    )
    assert (
        unbuildable_deadline(
            reason=NO_ARM, waiting_since=T0, wait_for_workers=True, pool_stable_since=T0, grace_secs=300
        )
        is None
    )
    assert "never aborted" in what_happens_next(reason=NO_ARM, deadline=None, wait_for_workers=True)
    eval_workers = {"reason": "eval_workers", "capability": "fetch", "connected_workers": 0}
    assert what_happens_next(reason=eval_workers, deadline=None, wait_for_workers=False) == (
        "runs once a worker that can fetch connects"
    )
    assert what_happens_next(reason=None, deadline=None, wait_for_workers=False) == ""


def test_the_console_says_a_deadline_as_a_relative_time_kept_current_and_escapes_the_rest() -> None:
    """Issue 34, item 6: the console's "what happens next" says "aborted in 4 min 59 s unless ..." (a
    <time> the page keeps current, the exact time on hover), not a clock time; REST keeps the clock time.
    A project's name in it is escaped."""
    from django.utils import timezone

    deadline = timezone.now() + timedelta(minutes=5)
    reason = {"reason": "eval_workers", "project": "<b>x</b>", "connected_workers": 0}
    shown = str(
        with_relative_deadline(
            lambda at: what_happens_next(reason=reason, deadline=deadline, wait_for_workers=False, at=at)
        )
    )
    assert shown.startswith('aborted <time datetime="' + deadline.isoformat())
    assert ">in 4 min 59 s</time> unless a worker serving &lt;b&gt;x&lt;/b&gt; connects" in shown or (
        ">in 5 min 0 s</time> unless a worker serving &lt;b&gt;x&lt;/b&gt; connects" in shown
    )
    assert "UTC" not in shown.split("title=")[0]
    no_deadline = with_relative_deadline(
        lambda at: what_happens_next(reason=reason, deadline=None, wait_for_workers=False, at=at)
    )
    assert no_deadline == "runs once a worker serving <b>x</b> connects"  # the template escapes it


def test_readable_values() -> None:
    assert drv_name("/nix/store/" + "a" * 32 + "-hello-2.12.1.drv") == "hello-2.12.1"
    assert drv_name("not-a-store-path") == "not-a-store-path"
    assert [duration(s) for s in (0.25, 12.34, 185, 7800, 200000)] == [
        "250 ms",
        "12.3 s",
        "3 min 5 s",
        "2 h 10 min",
        "2 d 7 h",
    ]
    # an end a few microseconds before its start (two clocks, or two reads of one) is no time, not "-0 ms"
    assert between(T0, T0 - timedelta(microseconds=40)) == "0 ms"
    assert between(T0, T0 + timedelta(seconds=1.5)) == "1.5 s"


@pytest.fixture
def console() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


@pytest.mark.django_db
def test_a_waiting_evaluation_says_what_happens_next_and_its_progress(console: Client) -> None:
    evaluation = EvaluationFactory(
        status=EvaluationStatus.WAITING, waiting_reason=NO_ARM, waiting_since=timezone.now()
    )
    built = DerivationBuildFactory(status=BuildStatus.COMPLETED)
    arm = DerivationBuildFactory(system="aarch64-linux", required_features=["kvm"], status=BuildStatus.QUEUED)
    failed = DerivationBuildFactory(status=BuildStatus.FAILED_PERMANENT, last_error="exit code 2")
    for build in (built, arm, failed):
        EvaluationBuild.objects.create(evaluation=evaluation, build=build)
    page = console.get(reverse("admin:scheduling_evaluation_change", args=[evaluation.id])).content.decode()
    assert "unless a worker for aarch64-linux (kvm) connects" in page
    assert "1/3 built, 1 failed, 1 queued" in page and "exit code 2" in page

    staff = User.objects.create_user("ops", password="pw-ops-12345", is_staff=True)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=staff)[0].key}")
    body = api.get(f"/api/v1/evaluations/{evaluation.id}").json()
    assert "unless a worker for aarch64-linux (kvm) connects" in body["waiting_next"]
    assert body["progress"] == "1/3 built, 1 failed, 1 queued"
    assert [b["last_error"] for b in body["failed_builds"]] == ["exit code 2"]

    build_page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[arm.id])).content
    assert b"no connected worker can build aarch64-linux with kvm" in build_page
    worker = WorkerFactory(architectures=["aarch64-linux"], system_features=["kvm"])
    WorkerSessionFactory(worker=worker)
    build_page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[arm.id])).content
    assert b"1 connected worker can build it; 0 queued builds ahead of it" in build_page


@pytest.mark.django_db
def test_a_cluster_attempts_seats_name_their_workers(console: Client) -> None:
    from tests.factories import ClusterAttemptFactory

    worker = WorkerFactory(name="builder-9")
    attempt = ClusterAttemptFactory(seats=[{"role": "server", "index": 0, "worker_id": str(worker.id)}])
    page = console.get(reverse("admin:clusters_clusterjob_change", args=[attempt.cluster_job_id])).content
    assert f"server[0] on {worker.id} (builder-9, no zone)".encode() in page


# --- Console details (issue 34, item 7) ---------------------------------------------------------------------


@pytest.mark.django_db
def test_history_leads_to_the_records_timeline_not_djangos_empty_history(console: Client) -> None:
    evaluation = EvaluationFactory()
    history = console.get(reverse("admin:scheduling_evaluation_history", args=[evaluation.id]))
    change = reverse("admin:scheduling_evaluation_change", args=[evaluation.id])
    assert (history.status_code, history["Location"]) == (302, f"{change}#record-timeline")
    assert 'id="record-timeline"' in console.get(change).content.decode()


@pytest.mark.django_db(transaction=True)
def test_a_deactivated_worker_offers_activate_behind_a_confirmation(console: Client) -> None:
    worker = WorkerFactory(active=False)
    page = console.get(reverse("admin:workers_worker_change", args=[worker.id])).content.decode()
    operate = reverse("admin:workers_worker_operate", args=[worker.id, "activate_workers"])
    assert operate in page, "the worker's page has an Activate button"
    asked = console.post(
        reverse("admin:workers_worker_changelist"),
        {"action": "activate_workers", "_selected_action": [str(worker.id)]},
    )
    assert "Yes, activate them" in asked.content.decode(), "the list's action asks first"
    worker.refresh_from_db()
    assert worker.active is False, "nothing changed before the confirmation"
    console.post(operate, {"confirmed": "yes"})
    worker.refresh_from_db()
    assert worker.active is True


@pytest.mark.django_db
def test_waits_for_workers_says_no_more_than_applies(console: Client) -> None:
    ended = EvaluationFactory(status=EvaluationStatus.ABORTED, wait_for_workers=False)
    running = EvaluationFactory(status=EvaluationStatus.BUILDING, wait_for_workers=False)
    ended_page = console.get(reverse("admin:scheduling_evaluation_change", args=[ended.id])).content.decode()
    assert "aborted after the grace" not in ended_page and "aborted if no connected worker" not in ended_page
    running_page = console.get(reverse("admin:scheduling_evaluation_change", args=[running.id])).content
    assert "aborted if no connected worker can build it for the grace" in running_page.decode()


@pytest.mark.django_db
def test_a_build_that_does_not_wait_has_no_empty_why_it_waits_row(console: Client) -> None:
    done = DerivationBuildFactory(status=BuildStatus.COMPLETED)
    page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[done.id])).content.decode()
    assert "field-why_it_waits" not in page


@pytest.mark.django_db
def test_the_403_page_is_gradients_and_points_members_to_my() -> None:
    client = Client()
    client.force_login(User.objects.create_user("ci", password="pw-ci-12345", is_staff=True))
    evaluation = EvaluationFactory()
    refused = client.get(reverse("admin:scheduling_evaluation_delete", args=[evaluation.id]))
    text = refused.content.decode()
    assert refused.status_code == 403 and "Django administration" not in text
    assert 'href="/my/"' in text


# --- Durations and times (issue 34, item 6) -----------------------------------------------------------------


@pytest.mark.django_db
def test_a_shared_builds_page_shows_waited_and_built_apart(console: Client) -> None:
    from gradient.scheduling.models import BuildAttempt

    build = DerivationBuildFactory(
        status=BuildStatus.COMPLETED, queued_at=T0, finished_at=T0 + timedelta(seconds=12.7)
    )
    BuildAttempt.objects.create(
        build=build,
        number=1,
        outcome="Succeeded",
        started_at=T0 + timedelta(seconds=11.7),
        finished_at=T0 + timedelta(seconds=12.7),
    )
    page = console.get(reverse("admin:scheduling_derivationbuild_change", args=[build.id])).content.decode()
    waited = page.split("field-waited", 1)[1].split("field-built", 1)[0]
    built = page.split("field-built", 1)[1][:600]
    assert "11.7 s" in waited and "1.0 s" in built, (waited, built)
    listed = console.get(reverse("admin:scheduling_derivationbuild_changelist")).content.decode()
    assert "12.7 s" not in listed, "no column adds the wait to the build"


@pytest.mark.django_db
def test_deactivated_at_sessions_and_job_records_use_the_one_relative_time_style(console: Client) -> None:
    from gradient.records.models import JobRecord

    worker = WorkerFactory(active=False, deactivated_at=timezone.now() - timedelta(minutes=3))
    WorkerSessionFactory(worker=worker, closed_at=timezone.now())
    page = console.get(reverse("admin:workers_worker_change", args=[worker.id])).content.decode()
    deactivated = page.split("field-deactivated", 1)[1][:600]
    assert "<time" in deactivated and "ago" in deactivated, deactivated
    sessions = console.get(reverse("admin:workers_workersession_changelist")).content.decode()
    assert sessions.count("<time datetime") >= 3, "opened, last seen and closed, relative"
    EvaluationFactory()  # a record of its own
    assert JobRecord.objects.exists()
    records = console.get(reverse("admin:records_jobrecord_changelist")).content.decode()
    assert "<time datetime" in records
