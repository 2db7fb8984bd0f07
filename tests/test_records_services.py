"""The record store on PostgreSQL: create once (idempotently), append facts in the caller's
transaction, commit only at the current revision, commit control intents with receipts, settle,
tombstone, list."""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from gradient.records.decisions.fold import Effect
from gradient.records.errors import (
    IdempotencyConflict,
    NotSettled,
    RecordExists,
    RecordTombstoned,
    RevisionConflict,
    UnknownRecord,
)
from gradient.records.models import JobRecord, RecordEntry
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    Cancel,
    Hold,
    JobKind,
    Outcome,
    OutcomeCommitted,
    ReportKind,
    RowStatus,
    StatusChanged,
    WorkerReport,
    decode_header,
    job_key_for,
)
from gradient.records.selectors import record_job, record_status, records_list
from gradient.records.services import (
    commit_control,
    plan_default,
    record_append_facts,
    record_append_facts_many,
    record_commit,
    record_create,
    record_settle,
    record_tombstone,
    register_control_hook,
    unregister_control_hook,
)
from gradient.scheduling.models import DispatchOutcome, EvaluationStatus
from gradient.scheduling.models import JobKind as DispatchKind
from tests.factories import DispatchedJobFactory, EvaluationFactory

pytestmark = pytest.mark.django_db

SPEC = {"project": "demo", "repository": "sim:chain?n=3", "commit": "a" * 40}


def _create(
    job_key: str | None = None, *, key: str | None = None, spec: dict[str, object] = SPEC, **kw: object
):  # type: ignore[no-untyped-def]
    job_key = job_key or job_key_for(JobKind.EVALUATION, uuid.uuid4())
    return record_create(
        job_key=job_key,
        spec=spec,
        plan=plan_default(kind=JobKind.EVALUATION),
        created_by=kw.pop("created_by", None),  # type: ignore[arg-type]
        idempotency_key=key,
        now=timezone.now(),
        **kw,  # type: ignore[arg-type]
    )


# --- Create -----------------------------------------------------------------------------------------------


def test_create_writes_the_header_once_with_the_plan_and_who_created_it() -> None:
    alice = User.objects.create_user("alice")
    record, created = _create(created_by=alice)
    header = decode_header(record.header)
    assert created and record.revision == 0 and record.created_by == alice
    assert header.created_by == "alice" and header.generation == 1 and header.supersedes is None
    assert header.plan.prepare_timeout_secs == 30 and header.plan.max_attempts == 10
    assert header.digest == record.digest and header.spec == SPEC
    with pytest.raises(RecordExists):
        _create(record.job_key)


def test_the_same_idempotency_key_and_spec_returns_the_existing_record() -> None:
    first, created = _create(key="k-1")
    again, created_again = _create(key="k-1", spec=dict(reversed(list(SPEC.items()))))
    assert created and not created_again and again.pk == first.pk
    assert JobRecord.objects.count() == 1


def test_the_same_idempotency_key_with_another_spec_is_a_conflict_that_writes_nothing() -> None:
    _create(key="k-2")
    with pytest.raises(IdempotencyConflict):
        _create(key="k-2", spec={**SPEC, "commit": "b" * 40})
    assert JobRecord.objects.count() == 1


def test_a_tombstoned_record_keeps_its_key_so_a_late_submit_cannot_recreate_the_job() -> None:
    record, _ = _create(key="k-3")
    record_append_facts(
        job_key=record.job_key, facts=[OutcomeCommitted(outcome=Outcome.SUCCEEDED)], now=timezone.now()
    )
    assert record_settle(job_key=record.job_key, now=timezone.now())
    record_tombstone(job_key=record.job_key, now=timezone.now())
    late, created = _create(key="k-3")
    assert not created and late.pk == record.pk and late.tombstoned_at is not None
    assert JobRecord.objects.count() == 1


def test_create_inside_the_callers_transaction_rolls_back_with_it() -> None:
    job_key = job_key_for(JobKind.EVALUATION, uuid.uuid4())
    with pytest.raises(RuntimeError), transaction.atomic():
        _create(job_key)
        raise RuntimeError("the evaluation row failed")
    assert not JobRecord.objects.filter(job_key=job_key).exists()


def test_a_resubmitted_job_records_its_lineage() -> None:
    first, _ = _create()
    second, _ = _create(supersedes=first.job_key)
    header = decode_header(second.header)
    assert (header.supersedes, header.generation) == (first.job_key, 2)
    with pytest.raises(UnknownRecord):
        _create(supersedes=job_key_for(JobKind.EVALUATION, uuid.uuid4()))


# --- Append, commit ---------------------------------------------------------------------------------------


def test_appended_facts_take_the_next_revisions_in_order() -> None:
    record, _ = _create()
    a = uuid.uuid4()
    now = timezone.now()
    r1 = record_append_facts(
        job_key=record.job_key,
        facts=[AssignmentClaimed(submission=1, assignment_id=a, worker="w1", attempt=1)],
        now=now,
    )
    r3 = record_append_facts(
        job_key=record.job_key,
        facts=[
            StatusChanged(status=RowStatus.FETCHING),
            WorkerReport(assignment_id=a, worker="w1", kind=ReportKind.ACCEPTED),
        ],
        now=now,
    )
    assert (r1, r3) == (1, 3)
    assert list(RecordEntry.objects.filter(record=record).values_list("revision", "kind")) == [
        (1, "fact"),
        (2, "fact"),
        (3, "fact"),
    ]
    job = record_job(job_key=record.job_key, now=now)
    assert job.status is RowStatus.FETCHING and job.submissions[0].started_at is not None


def test_facts_appended_to_many_records_at_once_take_each_records_next_revisions() -> None:
    first, _ = _create()
    second, _ = _create()
    a = uuid.uuid4()
    now = timezone.now()
    record_append_facts(job_key=first.job_key, facts=[StatusChanged(status=RowStatus.FETCHING)], now=now)
    revisions = record_append_facts_many(
        facts={
            first.job_key: [WorkerReport(assignment_id=a, worker="w1", kind=ReportKind.ACCEPTED)],
            second.job_key: [
                StatusChanged(status=RowStatus.FETCHING),
                AssignmentClaimed(submission=1, assignment_id=a, worker="w1", attempt=1),
            ],
        },
        now=now,
    )
    assert revisions == {first.job_key: 2, second.job_key: 2}
    entries = RecordEntry.objects.filter(record=second).order_by("revision")
    assert [(e.revision, json.loads(e.body)["fact"]) for e in entries] == [
        (1, "status_changed"),
        (2, "assignment_claimed"),
    ]
    job = record_job(job_key=second.job_key, now=now)
    assert job.status is RowStatus.FETCHING and len(job.submissions) == 1


def test_a_set_append_naming_an_unknown_record_appends_nothing() -> None:
    record, _ = _create()
    with pytest.raises(UnknownRecord), transaction.atomic():
        record_append_facts_many(
            facts={
                record.job_key: [StatusChanged(status=RowStatus.FETCHING)],
                job_key_for(JobKind.EVALUATION, uuid.uuid4()): [StatusChanged(status=RowStatus.FETCHING)],
            },
            now=timezone.now(),
        )
    record.refresh_from_db()
    assert record.revision == 0 and not record.entries.exists()


def test_a_state_change_and_its_fact_roll_back_together() -> None:
    record, _ = _create()
    with pytest.raises(RuntimeError), transaction.atomic():
        record_append_facts(
            job_key=record.job_key, facts=[StatusChanged(status=RowStatus.FETCHING)], now=timezone.now()
        )
        raise RuntimeError("the row update failed")
    record.refresh_from_db()
    assert record.revision == 0 and not record.entries.exists()


def test_appending_a_control_intent_as_a_fact_or_to_an_unknown_record_is_refused() -> None:
    record, _ = _create()
    with pytest.raises(TypeError):
        record_append_facts(job_key=record.job_key, facts=[Cancel()], now=timezone.now())  # type: ignore[list-item]
    with pytest.raises(UnknownRecord):
        record_append_facts(
            job_key=job_key_for(JobKind.EVALUATION, uuid.uuid4()),
            facts=[StatusChanged(status=RowStatus.FETCHING)],
            now=timezone.now(),
        )


def test_a_commit_at_a_stale_revision_is_a_conflict_and_writes_nothing() -> None:
    record, _ = _create()
    now = timezone.now()
    assert (
        record_commit(job_key=record.job_key, expected_revision=0, entries=[Hold()], now=now, actor="op") == 1
    )
    with pytest.raises(RevisionConflict):
        record_commit(job_key=record.job_key, expected_revision=0, entries=[Cancel()], now=now, actor="op")
    record.refresh_from_db()
    assert record.revision == 1 and record.entries.count() == 1


def test_the_database_refuses_a_second_entry_at_one_revision_and_an_entry_of_neither_kind() -> None:
    record, _ = _create()
    now = timezone.now()
    record_commit(job_key=record.job_key, expected_revision=0, entries=[Hold()], now=now)
    with pytest.raises(IntegrityError), transaction.atomic():
        RecordEntry.objects.create(
            record=record, revision=1, kind="fact", schema="gradient.fact.v1", body="{}", recorded_at=now
        )
    with pytest.raises(IntegrityError), transaction.atomic():
        RecordEntry.objects.create(
            record=record, revision=2, kind="control", schema="gradient.fact.v1", body="{}", recorded_at=now
        )


# --- Control intents --------------------------------------------------------------------------------------


def test_cancel_commits_and_its_receipt_says_the_job_is_cancelled() -> None:
    record, _ = _create()
    receipt = commit_control(
        job_key=record.job_key, intent=Cancel(reason="wrong commit"), actor="api:bob", now=timezone.now()
    )
    assert receipt.applied and receipt.effect is Effect.CANCELLED and receipt.outcome is Outcome.CANCELLED
    assert receipt.revision == 1 and receipt.folded
    assert RecordEntry.objects.get(record=record).actor == "api:bob"


def test_a_cancel_after_success_commits_and_its_receipt_says_the_outcome_stays_succeeded() -> None:
    record, _ = _create()
    record_append_facts(
        job_key=record.job_key, facts=[OutcomeCommitted(outcome=Outcome.SUCCEEDED)], now=timezone.now()
    )
    receipt = commit_control(job_key=record.job_key, intent=Cancel(), actor="op", now=timezone.now())
    assert not receipt.applied and receipt.effect is Effect.CANCEL_AFTER_OUTCOME
    assert receipt.outcome is Outcome.SUCCEEDED and "stays succeeded" in receipt.message
    assert record_job(job_key=record.job_key, now=timezone.now()).outcome is Outcome.SUCCEEDED


def test_a_record_with_facts_this_build_cannot_read_still_takes_a_cancel() -> None:
    record, _ = _create()
    now = timezone.now()
    # a newer build appended a fact with a schema this build does not know
    JobRecord.objects.filter(pk=record.pk).update(revision=1)
    RecordEntry.objects.create(
        record=record,
        revision=1,
        kind="fact",
        schema="gradient.fact.v2",
        body='{"fact":"teleported"}',
        recorded_at=now,
    )
    receipt = commit_control(job_key=record.job_key, intent=Cancel(), actor="op", now=now)
    assert receipt.revision == 2 and not receipt.folded and receipt.effect is None
    assert "could not fold" in receipt.message


def test_control_hooks_run_after_the_commit_with_the_receipt(django_capture_on_commit_callbacks) -> None:  # type: ignore[no-untyped-def]
    record, _ = _create()
    seen = []

    def hook(receipt: object) -> None:
        seen.append(receipt)

    register_control_hook(kind=JobKind.EVALUATION, hook=hook)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            receipt = commit_control(job_key=record.job_key, intent=Hold(), actor="op", now=timezone.now())
    finally:
        unregister_control_hook(kind=JobKind.EVALUATION, hook=hook)
    assert seen == [receipt]


def test_control_on_a_tombstoned_or_unknown_record_is_refused() -> None:
    with pytest.raises(UnknownRecord):
        commit_control(
            job_key=job_key_for(JobKind.CLUSTER, uuid.uuid4()),
            intent=Cancel(),
            actor="op",
            now=timezone.now(),
        )
    record, _ = _create()
    commit_control(job_key=record.job_key, intent=Cancel(), actor="op", now=timezone.now())
    record_settle(job_key=record.job_key, now=timezone.now())
    record_tombstone(job_key=record.job_key, now=timezone.now())
    with pytest.raises(RecordTombstoned):
        commit_control(job_key=record.job_key, intent=Cancel(), actor="op", now=timezone.now())


# --- Settle, tombstone, list ------------------------------------------------------------------------------


def _evaluation_with_record(status: str = EvaluationStatus.QUEUED):  # type: ignore[no-untyped-def]
    evaluation = EvaluationFactory(status=status, record=False)
    record, _ = _create(evaluation.job_key)
    return evaluation, record


def test_a_job_settles_only_once_its_assignment_closed_and_then_carries_the_labels() -> None:
    evaluation, record = _evaluation_with_record()
    assignment = DispatchedJobFactory(kind=DispatchKind.EVAL, evaluation=evaluation, derivation_build=None)
    now = timezone.now()
    record_append_facts(
        job_key=record.job_key,
        facts=[
            AssignmentClaimed(
                submission=1, assignment_id=assignment.id, worker=assignment.worker.name, attempt=1
            )
        ],
        now=now,
    )
    commit_control(job_key=record.job_key, intent=Cancel(), actor="op", now=now)
    assert not record_settle(job_key=record.job_key, now=now)  # the assignment is still open
    with transaction.atomic():
        type(assignment).objects.filter(pk=assignment.pk).update(
            finished_at=now, outcome=DispatchOutcome.ABANDONED
        )
        type(evaluation).objects.filter(pk=evaluation.pk).update(
            status=EvaluationStatus.ABORTED, finished_at=now
        )
        record_append_facts(
            job_key=record.job_key,
            facts=[AssignmentClosed(assignment_id=assignment.id, outcome=AssignmentOutcome.ABANDONED)],
            now=now,
        )
    assert record_settle(job_key=record.job_key, now=now)
    record.refresh_from_db()
    assert record.settled and record.settled_at == now
    assert record_job(job_key=record.job_key, now=now).settled
    assert not record_settle(job_key=record.job_key, now=now)  # once


def test_only_a_settled_record_can_be_tombstoned_and_its_entries_go() -> None:
    record, _ = _create()
    with pytest.raises(NotSettled):
        record_tombstone(job_key=record.job_key, now=timezone.now())
    commit_control(job_key=record.job_key, intent=Cancel(), actor="op", now=timezone.now())
    record_settle(job_key=record.job_key, now=timezone.now())
    tombstoned = record_tombstone(job_key=record.job_key, now=timezone.now())
    assert tombstoned.tombstoned_at is not None and not tombstoned.entries.exists()
    assert (
        record_tombstone(job_key=record.job_key, now=timezone.now()).tombstoned_at == tombstoned.tombstoned_at
    )


def test_records_are_listed_by_their_settled_labels() -> None:
    settled, _ = _create()
    commit_control(job_key=settled.job_key, intent=Cancel(), actor="op", now=timezone.now())
    record_settle(job_key=settled.job_key, now=timezone.now())
    active, _ = _create()
    cluster, _ = record_create(
        job_key=job_key_for(JobKind.CLUSTER, uuid.uuid4()),
        spec={"members": []},
        plan=plan_default(kind=JobKind.CLUSTER, retry_budget=3),
        created_by=None,
        idempotency_key=None,
        now=timezone.now() + timedelta(seconds=1),
    )
    assert list(records_list(settled=True)) == [settled]
    assert list(records_list(settled=False)) == [active, cluster]
    assert list(records_list(settled=False, kind=JobKind.CLUSTER)) == [cluster]
    assert decode_header(cluster.header).plan.max_attempts == 3


def test_the_status_of_a_record_reads_its_rows() -> None:
    evaluation, record = _evaluation_with_record(EvaluationStatus.FETCHING)
    status = record_status(job_key=record.job_key, now=timezone.now())
    assert status.row_status is RowStatus.FETCHING and status.outcome is Outcome.NONE


@pytest.mark.django_db(transaction=True)
def test_the_check_reads_the_record_and_the_rows_at_one_point_while_a_transition_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A status change and its fact commit together, holding the record row. The check takes the same
    lock, so a transition committing while the check runs is seen whole or not at all."""
    import threading

    from django.db import connection

    from gradient.records import services
    from gradient.scheduling import history

    if connection.vendor != "postgresql":
        pytest.skip("needs concurrent connections")
    evaluation = EvaluationFactory()
    assert history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.BUILDING,
        expect=[EvaluationStatus.QUEUED],
        reason="evaluated",
        now=timezone.now(),
    )
    committed = threading.Event()
    go = threading.Event()

    def transition() -> None:
        try:
            with transaction.atomic():
                assert history.evaluation_transition(
                    evaluation_id=evaluation.id,
                    to=EvaluationStatus.WAITING,
                    expect=[EvaluationStatus.BUILDING],
                    reason="parked",
                    now=timezone.now(),
                )
                go.wait(timeout=1.0)  # commit once the check is between its two reads (or after 1 s)
            committed.set()
        finally:
            connection.close()

    real_discovery = services.record_discovery

    def discovery_after_the_commit(**kwargs):  # type: ignore[no-untyped-def]
        go.set()
        committed.wait(timeout=5)
        return real_discovery(**kwargs)

    monkeypatch.setattr(services, "record_discovery", discovery_after_the_commit)
    writer = threading.Thread(target=transition)
    writer.start()
    time.sleep(0.2)  # the writer holds its uncommitted change and the record row
    problems, _ = services.record_check_one(job_key=evaluation.job_key, now=timezone.now(), settle=False)
    writer.join()
    assert committed.is_set()
    assert problems == ()
