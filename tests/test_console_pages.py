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

from gradient.console import drv_name, duration
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
