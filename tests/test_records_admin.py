"""The admin shows a record as a readable timeline and commits control intents as the operator."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gradient.records.models import JobRecord, RecordEntry
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    JobKind,
    Outcome,
    OutcomeCommitted,
    ReportKind,
    WorkerReport,
    job_key_for,
)
from gradient.records.services import plan_default, record_append_facts, record_create

pytestmark = pytest.mark.django_db

A1 = uuid.UUID("0badc0de-0000-4000-8000-000000000001")


@pytest.fixture
def operator_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def _record() -> JobRecord:
    job_key = job_key_for(JobKind.EVALUATION, uuid.uuid4())
    record, _ = record_create(
        job_key=job_key,
        spec={"commit": "c"},
        plan=plan_default(kind=JobKind.EVALUATION),
        created_by=None,
        idempotency_key=None,
        now=timezone.now(),
    )
    record_append_facts(
        job_key=job_key,
        facts=[
            AssignmentClaimed(submission=1, assignment_id=A1, worker="w1", attempt=1),
            WorkerReport(assignment_id=A1, worker="w1", kind=ReportKind.FAILED, summary="out of memory"),
        ],
        now=timezone.now(),
    )
    return record


def test_the_change_page_shows_the_entries_as_a_timeline_of_who_when_what(operator_client: Client) -> None:
    record = _record()
    page = operator_client.get(reverse("admin:records_jobrecord_change", args=[record.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "submission 1: claimed for w1, attempt 1" in html
    assert "w1 reported failed on 0badc0de: out of memory" in html
    assert "scheduler" in html and "Status (folded)" in html and "dispatched" in html


def test_an_admin_action_commits_a_cancel_as_the_signed_in_operator(operator_client: Client) -> None:
    record = _record()
    response = operator_client.post(
        reverse("admin:records_jobrecord_changelist"),
        {"action": "cancel", "_selected_action": [str(record.pk)]},
        follow=True,
    )
    assert response.status_code == 200
    entry = RecordEntry.objects.get(record=record, revision=3)
    assert (entry.kind, entry.actor) == ("control", "admin:root")
    assert "cancelled: it ends Aborted, and what it still runs is told to stop" in response.content.decode()
    page = operator_client.get(reverse("admin:records_jobrecord_change", args=[record.pk])).content.decode()
    assert "cancel requested: from the admin" in page and "cancelled" in page


def test_a_cancel_after_success_from_the_admin_says_the_outcome_stays(operator_client: Client) -> None:
    record = _record()
    record_append_facts(
        job_key=record.job_key,
        facts=[
            AssignmentClosed(assignment_id=A1, outcome=AssignmentOutcome.COMPLETED),
            OutcomeCommitted(outcome=Outcome.SUCCEEDED),
        ],
        now=timezone.now(),
    )
    response = operator_client.post(
        reverse("admin:records_jobrecord_changelist"),
        {"action": "cancel", "_selected_action": [str(record.pk)]},
        follow=True,
    )
    assert "the outcome stays succeeded" in response.content.decode()


def test_an_unreadable_entry_is_shown_as_such_not_hidden(operator_client: Client) -> None:
    record = _record()
    JobRecord.objects.filter(pk=record.pk).update(revision=3)
    RecordEntry.objects.create(
        record=record,
        revision=3,
        kind="fact",
        schema="gradient.fact.v2",
        body="{}",
        recorded_at=timezone.now(),
    )
    html = operator_client.get(reverse("admin:records_jobrecord_change", args=[record.pk])).content.decode()
    assert "unreadable gradient.fact.v2 entry" in html and "cannot be folded by this build" in html


def test_the_list_and_its_filters_load(operator_client: Client) -> None:
    _record()
    url = reverse("admin:records_jobrecord_changelist")
    assert operator_client.get(url).status_code == 200
    assert operator_client.get(url, {"settled__exact": "1"}).status_code == 200
