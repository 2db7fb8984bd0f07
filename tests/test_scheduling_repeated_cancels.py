"""A worker that keeps answering `canceled` for one build (issue 34, item 9): its tries are counted from
the build's attempt rows (scheduling.services.failures), and past GRADIENT_BUILD_FREE_CANCELS in a row
a cancel is a failed attempt, so such a worker cannot hold the build forever."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from gradient.core.vocab import BuildAttemptOutcome
from gradient.scheduling.decisions.failures import BuildVerdict
from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.scheduling.services.failures import build_failure_decision, worker_cancels_in_a_row
from gradient.scheduling.services.offers import promote_retries
from gradient.workers.models import Worker
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, drv, report

pytestmark = pytest.mark.django_db


@pytest.fixture
def workers() -> tuple[Worker, Worker]:
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("base")], now=timezone.now())
    return connected_worker([project]), connected_worker([project])


def _base() -> DerivationBuild:
    return DerivationBuild.objects.get(drv_path__endswith="base.drv")


def _cancel(worker: Worker) -> None:
    """The worker takes the build and answers `canceled`."""
    a = ask(worker.id)
    assert a is not None and a.job_key == _base().job_key
    assert report(worker.id, a, "JobFailed", error="worker stopping", kind="canceled").accepted


def _claim_and_close_canceled(worker: Worker) -> DispatchedJob:
    """A try claimed and closed `canceled`, as lifecycle.fail_build closes it before it decides."""
    a = ask(worker.id)
    assert a is not None
    BuildAttempt.objects.filter(dispatched_job_id=a.assignment_id).update(
        outcome=BuildAttemptOutcome.ABORTED, failure_kind="canceled", finished_at=timezone.now()
    )
    return DispatchedJob.objects.get(id=a.assignment_id)


def test_a_workers_cancels_in_a_row_are_counted_from_the_builds_tries(workers: tuple[Worker, Worker]) -> None:
    stopping, other = workers
    for _ in range(2):
        _cancel(stopping)
    _cancel(other)  # another worker's cancel in between neither counts nor breaks the run
    _cancel(stopping)
    base = _base()
    assert worker_cancels_in_a_row(build_id=base.id, worker_id=stopping.id) == 3
    assert worker_cancels_in_a_row(build_id=base.id, worker_id=other.id) == 1
    assert worker_cancels_in_a_row(build_id=base.id, worker_id=uuid.uuid4()) == 0
    assert worker_cancels_in_a_row(build_id=base.id, worker_id=None) == 0
    assert (base.status, base.attempts) == (BuildStatus.QUEUED, 0)  # the free ones spent nothing


def test_a_try_that_ended_otherwise_starts_the_count_again(workers: tuple[Worker, Worker]) -> None:
    stopping, _ = workers
    _cancel(stopping)
    a = ask(stopping.id)
    assert a is not None
    report(stopping.id, a, "JobFailed", error="network", kind="transient")
    promote_retries(now=timezone.now() + timezone.timedelta(minutes=5))
    _cancel(stopping)
    assert worker_cancels_in_a_row(build_id=_base().id, worker_id=stopping.id) == 1


def test_past_the_free_cancels_the_decision_is_a_failed_attempt(workers: tuple[Worker, Worker]) -> None:
    stopping, _ = workers
    for _ in range(3):
        _cancel(stopping)
    row = _claim_and_close_canceled(stopping)
    base = _base()
    now = timezone.now()
    decision = build_failure_decision(build=base, row=row, kind="canceled", now=now)
    assert decision.verdict is BuildVerdict.RETRY and not decision.refund_attempt
    assert decision.retry_at == now + timezone.timedelta(seconds=30)
    assert decision.reason.startswith("canceled 4 times in a row by one worker")
    with override_settings(GRADIENT_BUILD_FREE_CANCELS=4):
        decision = build_failure_decision(build=base, row=row, kind="canceled", now=now)
        assert decision.verdict is BuildVerdict.REQUEUE and decision.refund_attempt


def test_another_failure_kind_is_decided_as_before(workers: tuple[Worker, Worker]) -> None:
    stopping, _ = workers
    for _ in range(3):
        _cancel(stopping)
    row = _claim_and_close_canceled(stopping)  # four in a row
    decision = build_failure_decision(build=_base(), row=row, kind="permanent", now=timezone.now())
    assert decision.verdict is BuildVerdict.PERMANENT and decision.reason == "permanent failure"


def test_a_worker_that_keeps_canceling_a_build_spends_its_attempts_and_the_build_ends(
    workers: tuple[Worker, Worker],
) -> None:
    stopping, _ = workers
    for _ in range(3):
        _cancel(stopping)
    assert (_base().status, _base().attempts) == (BuildStatus.QUEUED, 0)
    later = timezone.now()
    for spent in (1, 2):
        _cancel(stopping)
        assert (_base().status, _base().attempts) == (BuildStatus.FAILED_TRANSIENT, spent)
        later += timezone.timedelta(minutes=10)
        promote_retries(now=later)
    _cancel(stopping)
    base = _base()
    assert (base.status, base.attempts, base.failure_kind) == (BuildStatus.FAILED_PERMANENT, 3, "canceled")


def test_only_a_cancel_reads_the_builds_tries(
    workers: tuple[Worker, Worker], django_assert_num_queries: Any
) -> None:
    stopping, _ = workers
    row = _claim_and_close_canceled(stopping)
    base = _base()
    with django_assert_num_queries(0):
        build_failure_decision(build=base, row=row, kind="transient", now=timezone.now())
    with django_assert_num_queries(1):
        build_failure_decision(build=base, row=row, kind="canceled", now=timezone.now())


def test_the_attempts_help_text_states_the_free_cancels_rule() -> None:
    """The model's word on attempts (the console and the admin show it) is the rule above, not
    'canceled ones spend none'."""
    help_text = str(DerivationBuild._meta.get_field("attempts").help_text)
    assert "spend none)" not in help_text
    assert "GRADIENT_BUILD_FREE_CANCELS times in a row" in help_text
