"""A worker that keeps answering `canceled` for one evaluation job (issue 34): evaluation jobs follow the
builds' rule (scheduling.services.failures.evaluation_cancel_decision over decide_build_failure and
GRADIENT_BUILD_FREE_CANCELS): past the free cancels in a row by one worker, each cancel is a failed
attempt, counted as a lost dispatch, and the evaluation fails after MAX_LOST_EVAL_DISPATCHES of them
instead of being requeued forever."""

from __future__ import annotations

import uuid

import pytest
from django.test import override_settings
from django.utils import timezone

from gradient.scheduling.decisions.failures import MAX_LOST_EVAL_DISPATCHES, BuildVerdict
from gradient.scheduling.models import DispatchedJob, Evaluation, EvaluationStatus
from gradient.scheduling.services.failures import evaluation_cancel_decision, worker_eval_cancels_in_a_row
from gradient.workers.models import Worker
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, report

pytestmark = pytest.mark.django_db


@pytest.fixture
def setup() -> tuple[Evaluation, Worker, Worker]:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    return evaluation, connected_worker([project]), connected_worker([project])


def _fail(worker: Worker, evaluation: Evaluation, kind: str = "canceled") -> str:
    """The worker takes the evaluation's job and ends it `kind`; the report's outcome in words."""
    a = ask(worker.id, "flake")
    assert a is not None and a.job_key == evaluation.job_key
    outcome = report(worker.id, a, "JobFailed", error="worker stopping", kind=kind)
    assert outcome.accepted
    return outcome.detail


def _state(evaluation: Evaluation) -> tuple[str, int]:
    evaluation.refresh_from_db()
    return evaluation.status, evaluation.lost_dispatches


def test_a_workers_cancels_of_an_evaluation_in_a_row_are_counted_from_its_assignments(
    setup: tuple[Evaluation, Worker, Worker],
) -> None:
    evaluation, stopping, other = setup
    for _ in range(2):
        _fail(stopping, evaluation)
    _fail(other, evaluation)  # another worker's cancel in between neither counts nor breaks the run
    _fail(stopping, evaluation)
    assert worker_eval_cancels_in_a_row(evaluation_id=evaluation.id, worker_id=stopping.id) == 3
    assert worker_eval_cancels_in_a_row(evaluation_id=evaluation.id, worker_id=other.id) == 1
    assert worker_eval_cancels_in_a_row(evaluation_id=evaluation.id, worker_id=uuid.uuid4()) == 0
    assert worker_eval_cancels_in_a_row(evaluation_id=evaluation.id, worker_id=None) == 0
    assert _state(evaluation) == (EvaluationStatus.QUEUED, 0)  # the free ones counted nothing


def test_a_job_that_ended_otherwise_starts_the_count_again(setup: tuple[Evaluation, Worker, Worker]) -> None:
    evaluation, stopping, _ = setup
    for _ in range(3):
        _fail(stopping, evaluation)
    _fail(stopping, evaluation, kind="transient")  # requeued as before, and the run is broken
    assert _state(evaluation) == (EvaluationStatus.QUEUED, 0)
    _fail(stopping, evaluation)
    assert worker_eval_cancels_in_a_row(evaluation_id=evaluation.id, worker_id=stopping.id) == 1
    assert _state(evaluation) == (EvaluationStatus.QUEUED, 0)


def test_past_the_free_cancels_each_cancel_is_a_lost_dispatch_and_the_evaluation_ends(
    setup: tuple[Evaluation, Worker, Worker],
) -> None:
    evaluation, stopping, _ = setup
    for _ in range(3):
        assert _fail(stopping, evaluation) == "canceled: requeued"
    assert _state(evaluation) == (EvaluationStatus.QUEUED, 0)
    for counted in range(1, MAX_LOST_EVAL_DISPATCHES):
        _fail(stopping, evaluation)
        assert _state(evaluation) == (EvaluationStatus.QUEUED, counted)
    assert _fail(stopping, evaluation) == "evaluation failed"
    assert _state(evaluation) == (EvaluationStatus.FAILED, MAX_LOST_EVAL_DISPATCHES)
    assert evaluation.errors[-1] == "canceled: worker stopping"
    assert ask(stopping.id, "flake") is None  # nothing left to hand out


def test_the_decision_is_the_builds_with_its_setting(setup: tuple[Evaluation, Worker, Worker]) -> None:
    evaluation, stopping, _ = setup
    for _ in range(3):
        _fail(stopping, evaluation)
    a = ask(stopping.id, "flake")
    assert a is not None
    row = DispatchedJob.objects.get(id=a.assignment_id)
    DispatchedJob.objects.filter(id=row.id).update(
        finished_at=timezone.now(), outcome="Failed", reason="canceled: worker stopping"
    )
    now = timezone.now()
    with override_settings(GRADIENT_BUILD_FREE_CANCELS=4):
        decision = evaluation_cancel_decision(evaluation=evaluation, row=row, kind="canceled", now=now)
        assert decision.verdict is BuildVerdict.REQUEUE and decision.refund_attempt
        assert _state(evaluation)[1] == 0
    decision = evaluation_cancel_decision(evaluation=evaluation, row=row, kind="canceled", now=now)
    assert decision.verdict is BuildVerdict.RETRY
    assert decision.reason.startswith("canceled 4 times in a row by one worker: counted as a failed attempt")
    assert evaluation.lost_dispatches == 1 and _state(evaluation)[1] == 1
    # A worker's `aborted` stays free, as it is for builds.
    decision = evaluation_cancel_decision(evaluation=evaluation, row=row, kind="aborted", now=now)
    assert decision.verdict is BuildVerdict.REQUEUE and _state(evaluation)[1] == 1
