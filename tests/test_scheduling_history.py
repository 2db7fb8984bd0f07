"""Every transition of an evaluation appends its fact in the same transaction, so its record, folded,
agrees with the rows at every step (records_check finds nothing to report)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from gradient.records.schemas import Outcome
from gradient.records.selectors import record_job
from gradient.records.services import record_check_one
from gradient.scheduling.models import EvaluationStatus
from gradient.scheduling.services.evaluations import evaluation_cancel
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, diamond, evaluate, report

pytestmark = pytest.mark.django_db


def _problems(evaluation) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    problems, _ = record_check_one(job_key=evaluation.job_key, now=timezone.now(), settle=False)
    return problems


def test_a_whole_evaluation_leaves_a_record_that_agrees_with_its_rows_at_every_step() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project], max_concurrent_builds=4)
    a = ask(worker.id, "flake")
    assert a is not None
    assert _problems(evaluation) == ()
    evaluate(worker.id, a, diamond())
    assert _problems(evaluation) == ()
    while (b := ask(worker.id)) is not None:
        build(worker.id, b)
        assert _problems(evaluation) == ()
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert job.outcome is Outcome.SUCCEEDED
    assert [s.object.id for s in job.submissions] == [a.assignment_id]
    assert all(not s.open for s in job.submissions)


def test_a_requeued_evaluation_job_is_a_second_submission_on_the_record() -> None:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    first = ask(worker.id, "flake")
    assert first is not None
    report(worker.id, first, "JobFailed", error="flaky network", kind="transient", elapsed_ms=1)
    second = ask(worker.id, "flake")
    assert second is not None
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert [s.number for s in job.submissions] == [1, 2]
    assert [s.open for s in job.submissions] == [False, True]
    assert _problems(evaluation) == ()


def test_a_cancel_by_the_scheduler_commits_the_cancelled_outcome() -> None:
    evaluation = EvaluationFactory()
    evaluation_cancel(evaluation_id=evaluation.id, reason="unbuildable", now=timezone.now())
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert job.outcome is Outcome.CANCELLED
    assert _problems(evaluation) == ()


def test_an_evaluation_made_outside_the_services_gets_its_record_on_its_first_fact() -> None:
    evaluation = EvaluationFactory(record=False)
    project = evaluation.project
    worker = connected_worker([project])
    assert ask(worker.id, "flake") is not None
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert len(job.submissions) == 1 and job.created_by is None
