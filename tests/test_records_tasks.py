"""The records pass and `check_records`: every unsettled record folded and compared with its rows;
disagreements reported, settleable records settled."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from gradient.clusters.models import AttemptOutcome as RowAttemptOutcome
from gradient.clusters.models import ClusterStatus
from gradient.records.models import JobRecord
from gradient.records.schemas import (
    AssignmentClaimed,
    AssignmentClosed,
    AssignmentOutcome,
    AttemptOutcome,
    Cancel,
    ClusterAttemptClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    JobKind,
    Outcome,
    OutcomeCommitted,
    RowStatus,
    StatusChanged,
)
from gradient.records.services import (
    commit_control,
    plan_default,
    record_append_facts,
    record_create,
    records_check,
)
from gradient.records.tasks import check_pass
from gradient.recovery.models import PassState
from gradient.scheduling.models import DispatchOutcome, EvaluationStatus
from gradient.scheduling.models import JobKind as DispatchKind
from tests.factories import ClusterAttemptFactory, ClusterJobFactory, DispatchedJobFactory, EvaluationFactory

pytestmark = pytest.mark.django_db


def _create(job_key: str, kind: JobKind = JobKind.EVALUATION) -> None:
    record_create(
        job_key=job_key,
        spec={"key": job_key},
        plan=plan_default(kind=kind),
        created_by=None,
        idempotency_key=None,
        now=timezone.now(),
    )


def _completed_without_an_outcome() -> str:
    evaluation = EvaluationFactory(
        status=EvaluationStatus.COMPLETED, finished_at=timezone.now(), record=False
    )
    _create(evaluation.job_key)
    return evaluation.job_key


def _open_assignment_never_recorded() -> str:
    evaluation = EvaluationFactory(status=EvaluationStatus.FETCHING, record=False)
    _create(evaluation.job_key)
    DispatchedJobFactory(
        kind=DispatchKind.EVAL, evaluation=evaluation, derivation_build=None, job_id=evaluation.job_key
    )
    return evaluation.job_key


def _cancelled_and_cleaned_up() -> str:
    evaluation = EvaluationFactory(status=EvaluationStatus.ABORTED, finished_at=timezone.now(), record=False)
    _create(evaluation.job_key)
    assignment = DispatchedJobFactory(
        kind=DispatchKind.EVAL,
        evaluation=evaluation,
        derivation_build=None,
        job_id=evaluation.job_key,
        finished_at=timezone.now(),
        outcome=DispatchOutcome.ABANDONED,
    )
    now = timezone.now()
    record_append_facts(
        job_key=evaluation.job_key,
        facts=[
            AssignmentClaimed(
                submission=1, assignment_id=assignment.id, worker=assignment.worker.name, attempt=1
            )
        ],
        now=now,
    )
    commit_control(job_key=evaluation.job_key, intent=Cancel(), actor="op", now=now)
    record_append_facts(
        job_key=evaluation.job_key,
        facts=[
            AssignmentClosed(assignment_id=assignment.id, outcome=AssignmentOutcome.ABANDONED),
            StatusChanged(status=RowStatus.ABORTED),
        ],
        now=now,
    )
    return evaluation.job_key


def _completed_cluster() -> str:
    now = timezone.now()
    cluster = ClusterJobFactory(status=ClusterStatus.COMPLETED, finished_at=now)
    attempt = ClusterAttemptFactory(
        cluster_job=cluster,
        created_at=now,
        started_at=now,
        finished_at=now,
        outcome=RowAttemptOutcome.SUCCEEDED,
    )
    _create(cluster.job_key, JobKind.CLUSTER)
    record_append_facts(
        job_key=cluster.job_key,
        facts=[
            ClusterAttemptOpened(submission=1, cluster_attempt_id=attempt.id, attempt=1),
            ClusterAttemptStarted(cluster_attempt_id=attempt.id),
            ClusterAttemptClosed(cluster_attempt_id=attempt.id, outcome=AttemptOutcome.SUCCEEDED),
            OutcomeCommitted(outcome=Outcome.SUCCEEDED),
        ],
        now=now,
    )
    return cluster.job_key


def test_the_pass_reports_jobs_whose_rows_disagree_and_settles_those_that_are_done() -> None:
    completed = _completed_without_an_outcome()
    foreign = _open_assignment_never_recorded()
    cancelled = _cancelled_and_cleaned_up()
    cluster = _completed_cluster()
    report = records_check(now=timezone.now(), settle=True, batch_size=2)  # several batches
    assert report.checked == 4 and report.settled == 2
    problems = {p.job_key: p.problems for p in report.problems}
    assert set(problems) == {completed, foreign}
    assert problems[completed] == ("the row is Completed but the record has no outcome",)
    assert any("never named it" in line for line in problems[foreign])
    assert set(JobRecord.objects.filter(settled=True).values_list("job_key", flat=True)) == {
        cancelled,
        cluster,
    }
    # settled records are not checked again
    assert records_check(now=timezone.now(), settle=True).checked == 2


def test_the_periodic_task_runs_the_pass_under_its_lease() -> None:
    _cancelled_and_cleaned_up()
    _completed_without_an_outcome()
    summary = check_pass()
    assert summary == {"checked": 2, "settled": 1, "disagreeing": 1, "jobs": [summary["jobs"][0]]}
    state = PassState.objects.get(name="records-check")
    assert state.runs == 1 and state.last_result == summary


def test_check_records_prints_each_disagreement_and_fails() -> None:
    completed = _completed_without_an_outcome()
    cancelled = _cancelled_and_cleaned_up()
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("check_records", stdout=out)
    text = out.getvalue()
    assert f"{completed}:" in text and "the row is Completed but the record has no outcome" in text
    assert cancelled not in text and "checked 2 records, settled 0, 1 disagree" in text


def test_check_records_settles_when_asked_and_passes_when_everything_agrees() -> None:
    cancelled = _cancelled_and_cleaned_up()
    out = io.StringIO()
    call_command("check_records", "--settle", stdout=out)
    assert "checked 1 records, settled 1, 0 disagree" in out.getvalue()
    assert JobRecord.objects.get(job_key=cancelled).settled


def test_check_records_can_check_one_job() -> None:
    completed = _completed_without_an_outcome()
    _cancelled_and_cleaned_up()
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("check_records", "--job", completed, stdout=out)
    assert "checked 1 records" in out.getvalue()
    with pytest.raises(CommandError, match="no record"):
        call_command(
            "check_records", "--job", "eval:00000000-0000-4000-8000-000000000000", stdout=io.StringIO()
        )
