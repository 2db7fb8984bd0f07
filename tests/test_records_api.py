"""GET /api/v1/evaluations/{id}/history, as ../shared/spec/rest.md says."""

from __future__ import annotations

import json
import uuid

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gradient.records.models import JobRecord
from gradient.records.schemas import (
    AssignmentClaimed,
    Cancel,
    JobKind,
    RowStatus,
    StatusChanged,
    decode_header,
)
from gradient.records.services import commit_control, plan_default, record_append_facts, record_create
from gradient.scheduling.models import Evaluation
from tests.factories import EvaluationFactory

pytestmark = pytest.mark.django_db


def _client(user: User | None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return client


def _evaluation_with_history(submitter: User | None = None) -> Evaluation:
    evaluation = EvaluationFactory(record=False)
    now = timezone.now()
    record_create(
        job_key=evaluation.job_key,
        spec={
            "project": evaluation.project.name,
            "repository": evaluation.repository,
            "commit": evaluation.commit,
        },
        plan=plan_default(kind=JobKind.EVALUATION),
        created_by=submitter,
        idempotency_key=None,
        now=now,
    )
    record_append_facts(
        job_key=evaluation.job_key,
        facts=[
            AssignmentClaimed(submission=1, assignment_id=uuid.uuid4(), worker="w1", attempt=1),
            StatusChanged(status=RowStatus.FETCHING),
        ],
        now=now,
    )
    commit_control(job_key=evaluation.job_key, intent=Cancel(reason="wrong commit"), actor="api:bob", now=now)
    return evaluation


def _url(evaluation_id: object) -> str:
    return f"/api/v1/evaluations/{evaluation_id}/history"


def test_a_member_of_the_project_reads_the_header_and_every_entry_in_order() -> None:
    bob = User.objects.create_user("bob")
    evaluation = _evaluation_with_history(bob)
    evaluation.project.members.add(bob)
    response = _client(bob).get(_url(evaluation.id))
    assert response.status_code == 200
    data = response.json()
    assert data["header"]["job_key"] == f"eval:{evaluation.id}"
    assert data["header"]["created_by"] == "bob" and data["header"]["plan"]["max_attempts"] == 10
    assert [(e["revision"], e["kind"], e["schema"]) for e in data["entries"]] == [
        (1, "fact", "gradient.fact.v1"),
        (2, "fact", "gradient.fact.v1"),
        (3, "control", "gradient.control.v1"),
    ]
    assert data["entries"][2]["body"] == {"intent": "cancel", "reason": "wrong commit"}
    assert data["entries"][1]["body"] == {"fact": "status_changed", "status": "Fetching", "reason": ""}
    assert all(set(e) >= {"revision", "schema", "kind", "body", "recorded_at"} for e in data["entries"])
    assert data["revision"] == 3 and data["settled"] is False


def test_the_header_in_the_response_is_the_header_as_written() -> None:
    staff = User.objects.create_user("root", is_staff=True)
    evaluation = _evaluation_with_history()
    header = _client(staff).get(_url(evaluation.id)).json()["header"]
    assert header == json.loads(JobRecord.objects.get(job_key=evaluation.job_key).header)
    assert (
        decode_header(JobRecord.objects.get(job_key=evaluation.job_key).header).spec["commit"]
        == evaluation.commit
    )


def test_without_a_token_the_answer_is_401() -> None:
    evaluation = _evaluation_with_history()
    assert _client(None).get(_url(evaluation.id)).status_code == 401
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert bad.get(_url(evaluation.id)).status_code == 401


def test_an_unknown_evaluation_is_404_as_json() -> None:
    staff = User.objects.create_user("root", is_staff=True)
    for missing in (uuid.uuid4(), "not-a-uuid"):
        response = _client(staff).get(_url(missing))
        assert response.status_code == 404 and "detail" in response.json()


def test_an_evaluation_without_a_record_is_404() -> None:
    staff = User.objects.create_user("root", is_staff=True)
    assert _client(staff).get(_url(EvaluationFactory(record=False).id)).status_code == 404


def test_a_user_outside_the_project_is_404_and_staff_reads_everything() -> None:
    evaluation = _evaluation_with_history()
    outsider = User.objects.create_user("eve")
    assert _client(outsider).get(_url(evaluation.id)).status_code == 404
    staff = User.objects.create_user("root", is_staff=True)
    assert _client(staff).get(_url(evaluation.id)).status_code == 200


def test_the_route_is_in_the_openapi_document() -> None:
    staff = User.objects.create_user("root", is_staff=True)
    client = _client(staff)
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    operation = paths["/api/v1/evaluations/{evaluation_id}/history"]["get"]
    assert operation["operationId"] == "evaluation_history"
    assert {"200", "401", "403", "404"} <= set(operation["responses"])
