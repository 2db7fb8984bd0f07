"""The REST routes an operator reaches for first (issue 24, item 8; rest.md): every collection the
index lists answers a GET, the build and cluster lists (paged, filtered, only what the caller may read),
`Location` on every 201, `Authorization: Bearer` beside `Token`, and the build metric families."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from gradient.auth import issue_token
from gradient.clusters.models import ClusterJob
from gradient.core.vocab import BuildStatus, ClusterStatus, JobKind
from gradient.scheduling.models import EvaluationBuild
from tests.clusters_helpers import make_cluster, queued_build
from tests.factories import DerivationBuildFactory, DispatchedJobFactory, EvaluationFactory, ProjectFactory

pytestmark = pytest.mark.django_db


def client(user: User, scheme: str = "Token") -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"{scheme} {issue_token(user)}")
    return c


@pytest.fixture
def staff() -> User:
    return User.objects.create_user("ops", password="pw-ops-12345", is_staff=True)


def test_every_collection_the_index_lists_answers_a_get(staff: User) -> None:
    c = client(staff)
    routes = c.get("/api/v1/").json()["routes"]
    assert {"builds", "clusters", "users"} <= set(routes)
    for name, url in routes.items():
        response = c.get(url)
        assert response.status_code == 200, (name, response.status_code, response.content)


def test_a_bearer_token_is_as_good_as_a_token_and_a_401_still_names_the_token_scheme(staff: User) -> None:
    assert client(staff, "Bearer").get("/api/v1/evaluations").status_code == 200
    forged = APIClient()
    forged.credentials(HTTP_AUTHORIZATION="Bearer 00000000000000000000000000000000")
    assert forged.get("/api/v1/evaluations").status_code == 401
    refused = APIClient().get("/api/v1/evaluations")
    assert refused.status_code == 401 and refused["WWW-Authenticate"] == "Token"


def test_every_201_carries_the_location_of_what_it_created(staff: User) -> None:
    c = client(staff)
    project = c.post("/api/v1/projects", {"name": "loc"}, format="json")
    assert project.status_code == 201 and project["Location"] == f"/api/v1/projects/{project.json()['id']}"
    user = c.post(
        "/api/v1/users", {"username": "ci", "password": "pw-ci-12345", "projects": ["loc"]}, format="json"
    )
    assert user.status_code == 201 and user["Location"] == f"/api/v1/users/{user.json()['id']}"
    worker = c.post("/api/v1/workers", {"name": "w1", "projects": ["loc"]}, format="json")
    assert worker.status_code == 201 and worker["Location"] == f"/api/v1/workers/{worker.json()['id']}"
    body = {"project": "loc", "repository": "sim:diamond", "commit": "c1"}
    evaluation = c.post("/api/v1/evaluations", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert evaluation.status_code == 201
    assert evaluation["Location"] == f"/api/v1/evaluations/{evaluation.json()['id']}"
    repeat = c.post("/api/v1/evaluations", body, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    assert repeat.status_code == 200 and "Location" not in repeat
    build = queued_build(ProjectFactory(name="cl"))
    cluster = c.post("/api/v1/clusters", {"members": [{"build": str(build.id), "role": "a"}]}, format="json")
    assert cluster.status_code == 201 and cluster["Location"] == f"/api/v1/clusters/{cluster.json()['id']}"
    for response in (project, user, worker, evaluation, cluster):
        assert c.get(response["Location"]).status_code == 200, response["Location"]


def test_the_build_list_is_paged_newest_first_filtered_and_only_what_the_caller_may_read(staff: User) -> None:
    mine, theirs = ProjectFactory(name="mine"), ProjectFactory(name="theirs")
    member = User.objects.create_user("member", password="pw-member-1")
    mine.members.add(member)
    evaluation = EvaluationFactory(project=mine)
    now = timezone.now()
    old = DerivationBuildFactory(status=BuildStatus.COMPLETED)
    new = DerivationBuildFactory(status=BuildStatus.FAILED_PERMANENT)
    foreign = DerivationBuildFactory(status=BuildStatus.FAILED_PERMANENT)
    for build, age in ((old, 30), (new, 10), (foreign, 5)):
        type(build).objects.filter(id=build.id).update(created_at=now - timedelta(seconds=age))
    EvaluationBuild.objects.create(evaluation=evaluation, build=old)
    EvaluationBuild.objects.create(evaluation=evaluation, build=new)
    EvaluationBuild.objects.create(evaluation=EvaluationFactory(project=theirs), build=foreign)

    page = client(member).get("/api/v1/builds").json()
    assert page["count"] == 2 and page["next"] is None
    assert [b["id"] for b in page["results"]] == [str(new.id), str(old.id)]
    assert set(page["results"][0]) == {"id", "name", "drv_path", "system", "status", "created_at"}

    c = client(staff)
    assert c.get("/api/v1/builds").json()["count"] == 3
    failed = c.get("/api/v1/builds?status=FailedPermanent").json()
    assert {b["id"] for b in failed["results"]} == {str(new.id), str(foreign.id)}
    assert c.get(f"/api/v1/builds?evaluation={evaluation.id}").json()["count"] == 2
    assert c.get("/api/v1/builds?project=theirs").json()["results"][0]["id"] == str(foreign.id)
    first = c.get("/api/v1/builds?limit=1").json()
    assert first["count"] == 3 and len(first["results"]) == 1 and "offset=1" in first["next"]
    for bad in ("status=Nope", "evaluation=not-a-uuid", "limit=-1"):
        response = c.get(f"/api/v1/builds?{bad}")
        assert response.status_code == 400, bad


def test_the_cluster_list_is_paged_newest_first_filtered_and_only_what_the_caller_may_read(
    staff: User,
) -> None:
    mine, theirs = ProjectFactory(name="mine"), ProjectFactory(name="theirs")
    member = User.objects.create_user("member", password="pw-member-1")
    mine.members.add(member)
    a = make_cluster([("server", queued_build(mine))])
    b = make_cluster([("server", queued_build(theirs))])
    ClusterJob.objects.filter(id=a.id).update(created_at=timezone.now() - timedelta(minutes=1))
    ClusterJob.objects.filter(id=b.id).update(status=ClusterStatus.ABORTED)

    page = client(member).get("/api/v1/clusters").json()
    assert [c["id"] for c in page["results"]] == [str(a.id)]
    assert set(page["results"][0]) == {"id", "status", "same_zone", "attempts", "created_at"}
    c = client(staff)
    assert [x["id"] for x in c.get("/api/v1/clusters").json()["results"]] == [str(b.id), str(a.id)]
    assert [x["id"] for x in c.get("/api/v1/clusters?status=Aborted").json()["results"]] == [str(b.id)]
    assert c.get("/api/v1/clusters?status=Nope").status_code == 400


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_has_builds_by_status_build_durations_and_queue_waits() -> None:
    now = timezone.now()
    DerivationBuildFactory(status=BuildStatus.QUEUED)
    for seconds in (3, 90):  # two finished tries: 3 s and 90 s from claim to end
        DispatchedJobFactory(
            queued_at=now - timedelta(seconds=seconds + 2),
            dispatched_at=now - timedelta(seconds=seconds),
            finished_at=now,
            outcome="Succeeded",
        )
    DispatchedJobFactory(dispatched_at=now)  # still open, never queued: in neither histogram
    evaluation = EvaluationFactory()
    DispatchedJobFactory(
        kind=JobKind.EVAL,
        evaluation=evaluation,
        derivation_build=None,
        queued_at=now - timedelta(seconds=0.3),
        dispatched_at=now,
    )
    text = Client().get("/metrics").content.decode()
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds["gradient_builds"] == "gauge"
    assert kinds["gradient_build_duration_seconds"] == kinds["gradient_queue_wait_seconds"] == "histogram"
    got: dict[Any, float] = samples(text)
    assert got[("gradient_builds", (("status", "Queued"),))] >= 1
    assert ("gradient_builds", (("status", "FailedPermanent"),)) in got
    assert got[("gradient_build_duration_seconds_count", ())] == 2
    assert got[("gradient_build_duration_seconds_bucket", (("le", "5.0"),))] == 1
    assert got[("gradient_build_duration_seconds_bucket", (("le", "120.0"),))] == 2
    assert got[("gradient_build_duration_seconds_sum", ())] == pytest.approx(93, abs=0.5)
    assert got[("gradient_queue_wait_seconds_count", (("kind", "build"),))] == 2
    assert got[("gradient_queue_wait_seconds_bucket", (("kind", "build"), ("le", "1.0")))] == 0
    assert got[("gradient_queue_wait_seconds_bucket", (("kind", "build"), ("le", "5.0")))] == 2
    assert got[("gradient_queue_wait_seconds_bucket", (("kind", "flake"), ("le", "0.5")))] == 1


def test_a_build_without_a_log_is_a_204_for_a_page_that_follows_it_and_its_page_hides_the_whole_log_link(
    staff: User,
) -> None:
    """Issue 24, item 6: a build without a log linked "the whole log" to a JSON 404, and its page polled
    `/log?offset=0` into a 404 in the browser's console every second."""
    build = DerivationBuildFactory(status=BuildStatus.QUEUED)
    c = client(staff)
    assert c.get(f"/api/v1/builds/{build.id}/log").status_code == 404  # rest.md: unchanged
    followed = c.get(f"/api/v1/builds/{build.id}/log?missing=empty&offset=0")
    assert followed.status_code == 204 and followed["X-Log-Complete"] == "false"
    assert c.get(f"/api/v1/builds/{build.id}/log?missing=maybe").status_code == 400
    console = Client()
    console.force_login(staff)
    page = console.get(f"/admin/scheduling/derivationbuild/{build.id}/change/").content.decode()
    assert '<p id="build-log-whole-line" style="margin:.3em 0 0 0" hidden>' in page
    assert "missing=empty&offset=" in page
