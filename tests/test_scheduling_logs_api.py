"""GET /api/v1/builds/{id}/log and the build's log_url and last_error (rest.md): the latest try's log,
?assignment= and ?offset= with X-Log-Offset and X-Log-Complete, 404 without a log, the build's read
permissions, 400 for bad parameters."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.scheduling.models import DerivationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.logs import build_log_append
from gradient.scheduling.services.offers import promote_retries
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build_id_of, drv, report, wire

pytestmark = pytest.mark.django_db


def client(user: User) -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return c


@pytest.fixture
def setup() -> dict[str, Any]:
    project = ProjectFactory(name="nixpkgs-ci")
    member = User.objects.create_user("member", password="pw-member-1")
    project.members.add(member)
    stranger = User.objects.create_user("stranger", password="pw-stranger-1")
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("hello")], now=timezone.now())
    worker = connected_worker([project])
    return {"member": member, "stranger": stranger, "worker": worker, "build": DerivationBuild.objects.get()}


def send(worker: Any, a: Any, offset: int, data: str) -> None:
    message = {
        "type": "BuildLog",
        "job_id": a.job_key,
        "assignment_id": str(a.assignment_id),
        "build_id": build_id_of(a),
        "offset": offset,
        "data": data,
    }
    build_log_append(worker_id=worker.id, message=wire(message), now=timezone.now())


def test_a_build_without_a_log_has_no_log_url_and_its_log_is_a_404(setup: dict[str, Any]) -> None:
    build = setup["build"]
    body = client(setup["member"]).get(f"/api/v1/builds/{build.id}").json()
    assert body["log_url"] is None and body["last_error"] == ""
    response = client(setup["member"]).get(f"/api/v1/builds/{build.id}/log")
    assert response.status_code == 404 and response.json()["detail"]
    assert client(setup["member"]).get(f"/api/v1/builds/{uuid.uuid4()}/log").status_code == 404
    assert client(setup["member"]).get("/api/v1/builds/not-a-uuid/log").status_code == 404


def test_a_failed_builds_log_and_error_are_on_the_build_and_earlier_tries_stay_readable(
    setup: dict[str, Any],
) -> None:
    worker, member, build = setup["worker"], setup["member"], setup["build"]
    first = ask(worker.id)
    assert first is not None
    send(worker, first, 0, "checking for gcc... no\n")
    report(worker.id, first, "JobFailed", error="builder failed: no compiler", kind="transient")
    promote_retries(now=timezone.now() + timedelta(hours=1))
    second = ask(worker.id)
    assert second is not None
    send(worker, second, 0, "checking for gcc... yes\n")

    body = client(member).get(f"/api/v1/builds/{build.id}").json()
    assert body["log_url"] == f"/api/v1/builds/{build.id}/log"
    assert body["last_error"] == "builder failed: no compiler"
    latest = client(member).get(body["log_url"])
    assert latest.status_code == 200
    assert latest["Content-Type"] == "text/plain; charset=utf-8"
    assert latest.content.decode() == "checking for gcc... yes\n"
    assert (latest["X-Log-Offset"], latest["X-Log-Complete"]) == ("0", "false")
    assert latest["X-Log-Assignment"] == str(second.assignment_id)
    earlier = client(member).get(f"{body['log_url']}?assignment={first.assignment_id}")
    assert earlier.content.decode() == "checking for gcc... no\n"
    assert earlier["X-Log-Complete"] == "true"
    tail = client(member).get(f"{body['log_url']}?offset=13")
    assert (tail.content.decode(), tail["X-Log-Offset"]) == ("gcc... yes\n", "13")
    beyond = client(member).get(f"{body['log_url']}?offset=1000")
    assert (beyond.status_code, beyond.content, beyond["X-Log-Offset"]) == (200, b"", "1000")
    unknown = client(member).get(f"{body['log_url']}?assignment={uuid.uuid4()}")
    assert unknown.status_code == 404


def test_a_text_only_client_gets_the_log_and_json_errors(setup: dict[str, Any]) -> None:
    worker, member, build = setup["worker"], setup["member"], setup["build"]
    a = ask(worker.id)
    send(worker, a, 0, "ok\n")
    response = client(member).get(f"/api/v1/builds/{build.id}/log", HTTP_ACCEPT="text/plain")
    assert (response.status_code, response.content) == (200, b"ok\n")
    bad = client(member).get(f"/api/v1/builds/{build.id}/log?offset=x", HTTP_ACCEPT="text/plain")
    assert bad.status_code == 400 and "offset" in bad.json()


@pytest.mark.parametrize(
    "query,field",
    [
        ("offset=-1", "offset"),
        ("offset=abc", "offset"),
        ("offset=1.5", "offset"),
        ("assignment=nope", "assignment"),
    ],
)
def test_bad_parameters_are_a_400_with_field_errors(setup: dict[str, Any], query: str, field: str) -> None:
    worker, member, build = setup["worker"], setup["member"], setup["build"]
    send(worker, ask(worker.id), 0, "x\n")
    response = client(member).get(f"/api/v1/builds/{build.id}/log?{query}")
    assert response.status_code == 400 and field in response.json()


def test_the_log_is_readable_by_whoever_may_read_the_build(setup: dict[str, Any]) -> None:
    worker, build = setup["worker"], setup["build"]
    send(worker, ask(worker.id), 0, "secret\n")
    assert client(setup["stranger"]).get(f"/api/v1/builds/{build.id}").status_code == 404
    assert client(setup["stranger"]).get(f"/api/v1/builds/{build.id}/log").status_code == 404
    assert APIClient().get(f"/api/v1/builds/{build.id}/log").status_code == 401
    staff = User.objects.create_user("staff", password="pw-staff-1", is_staff=True)
    assert client(staff).get(f"/api/v1/builds/{build.id}/log").status_code == 200
