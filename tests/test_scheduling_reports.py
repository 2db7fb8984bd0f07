"""Reports are fenced by assignment_id; failures follow their kind; declines requeue and re-offer."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    EvaluationStatus,
    SentCandidate,
)
from gradient.scheduling.services import graph
from gradient.scheduling.services.offers import promote_retries
from gradient.scheduling.services.reports import handle_report
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv, job_json, report, update, wire

pytestmark = pytest.mark.django_db


def _snapshot() -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    rows += list(
        DispatchedJob.objects.order_by("id").values_list(
            "id", "finished_at", "outcome", "phase", "last_report_at"
        )
    )
    rows += list(DerivationBuild.objects.order_by("id").values_list("id", "status", "attempts"))
    rows += list(BuildAttempt.objects.order_by("id").values_list("id", "outcome"))
    return rows


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv("base"), drv("top", "base")], now=timezone.now()
    )
    worker = connected_worker([project], max_concurrent_builds=2)
    other = connected_worker([project])
    return project, evaluation, worker, other


def test_a_report_with_a_stale_or_foreign_assignment_id_changes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, other = setup
    a = ask(worker.id)
    assert a is not None
    before = _snapshot()
    for bogus in (str(uuid.uuid4()), "not-a-uuid", "", "0" * 64):
        message = {"type": "JobCompleted", "job_id": a.job_key, "assignment_id": bogus, "elapsed_ms": 1}
        assert handle_report(worker_id=worker.id, message=wire(message), now=timezone.now()).accepted is False
    assert _snapshot() == before


def test_a_report_from_another_worker_changes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, other = setup
    a = ask(worker.id)
    assert a is not None
    before = _snapshot()
    assert report(other.id, a, "JobFailed", error="x", kind="permanent", elapsed_ms=1).accepted is False
    assert _snapshot() == before


def test_a_report_after_close_changes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    build(worker.id, a)
    before = _snapshot()
    assert report(worker.id, a, "JobFailed", error="late", kind="permanent", elapsed_ms=1).accepted is False
    assert update(worker.id, a, kind="building", build_id=build_id_of(a)).accepted is False
    assert _snapshot() == before


def test_a_report_for_another_job_under_a_valid_assignment_id_is_dropped(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    before = _snapshot()
    message = {
        "type": "JobCompleted",
        "job_id": f"build:{uuid.uuid4()}",
        "assignment_id": str(a.assignment_id),
        "elapsed_ms": 1,
    }
    assert handle_report(worker_id=worker.id, message=wire(message), now=timezone.now()).accepted is False
    assert _snapshot() == before


def test_a_transient_failure_retries_with_a_doubling_backoff_up_to_max_attempts(setup) -> None:  # type: ignore[no-untyped-def]
    _, evaluation, worker, _ = setup
    base = DerivationBuild.objects.get(drv_path__endswith="base.drv")
    delays = []
    for attempt in (1, 2):
        a = ask(worker.id)
        assert a is not None and a.job_key == base.job_key
        report(worker.id, a, "JobFailed", error="network", kind="transient", elapsed_ms=1)
        base.refresh_from_db()
        assert (base.status, base.attempts) == (BuildStatus.FAILED_TRANSIENT, attempt)
        delays.append((base.retry_at - timezone.now()).total_seconds())
        assert ask(worker.id) is None  # in backoff
        assert promote_retries(now=base.retry_at + timedelta(seconds=1)) == 1
    assert 25 < delays[0] <= 30 and 55 < delays[1] <= 60
    a = ask(worker.id)
    assert a is not None
    report(worker.id, a, "JobFailed", error="network", kind="transient", elapsed_ms=1)
    base.refresh_from_db()
    assert base.status == BuildStatus.FAILED_PERMANENT and base.attempts == 3
    top = DerivationBuild.objects.get(drv_path__endswith="top.drv")
    assert top.status == BuildStatus.DEPENDENCY_FAILED
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED


def test_a_permanent_failure_fails_the_dependents_and_the_evaluation(setup) -> None:  # type: ignore[no-untyped-def]
    _, evaluation, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    report(
        worker.id,
        a,
        "JobFailed",
        error="builder for base failed with exit code 1",
        kind="permanent",
        elapsed_ms=1,
    )
    statuses = dict(DerivationBuild.objects.values_list("drv_path", "status"))
    assert sorted(statuses.values()) == [BuildStatus.DEPENDENCY_FAILED, BuildStatus.FAILED_PERMANENT]
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED
    assert any("FailedPermanent" in e for e in evaluation.errors)
    assert DerivationBuild.objects.get(drv_path__endswith="base.drv").last_error.startswith(
        "builder for base"
    )


def test_a_timeout_is_a_lasting_failure(setup) -> None:  # type: ignore[no-untyped-def]
    _, evaluation, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    report(worker.id, a, "JobFailed", error="silent for 3600 s", kind="timeout", elapsed_ms=1)
    assert DerivationBuild.objects.get(drv_path__endswith="base.drv").status == BuildStatus.FAILED_TIMEOUT
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FAILED


def test_a_canceled_build_goes_back_to_queued_without_spending_an_attempt(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, other = setup
    a = ask(worker.id)
    assert a is not None
    report(worker.id, a, "JobFailed", error="worker stopping", kind="canceled", elapsed_ms=1)
    base = DerivationBuild.objects.get(drv_path__endswith="base.drv")
    assert (base.status, base.attempts) == (BuildStatus.QUEUED, 0)
    b = ask(other.id)
    assert b is not None and b.job_key == base.job_key


def test_a_declined_assignment_requeues_the_job_and_clears_its_sent_flag(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, other = setup
    a = ask(worker.id)
    assert a is not None
    SentCandidate.objects.create(worker=other, job_id=a.job_key)
    outcome = report(worker.id, a, "AssignJobResponse", accepted=False, reason="full")
    assert outcome.accepted
    row = DispatchedJob.objects.get(id=a.assignment_id)
    assert row.outcome == "Abandoned" and row.reason == "declined: full"
    base = DerivationBuild.objects.get(id=build_id_of(a))
    assert (base.status, base.attempts) == (BuildStatus.QUEUED, 0)
    assert not SentCandidate.objects.filter(job_id=a.job_key).exists()


def test_an_accepted_assignment_is_marked_accepted(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    report(worker.id, a, "AssignJobResponse", accepted=True, reason=None)
    assert DispatchedJob.objects.get(id=a.assignment_id).accepted_at is not None


def test_build_output_caches_the_outputs_and_queues_the_dependents(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    build(worker.id, a)
    statuses = {p.rsplit("-", 1)[1]: s for p, s in DerivationBuild.objects.values_list("drv_path", "status")}
    assert statuses == {"base.drv": BuildStatus.COMPLETED, "top.drv": BuildStatus.QUEUED}
    assert BuildAttempt.objects.get(dispatched_job_id=a.assignment_id).outcome == "Built"
    from gradient.scheduling.models import CachedPath

    assert CachedPath.objects.filter(
        path=job_json(a)["builds"][0]["outputs"][0]["path"], nar_size=4096
    ).exists()


def test_a_lost_build_goes_back_to_the_queue_having_spent_its_attempt(setup) -> None:  # type: ignore[no-untyped-def]
    from gradient.scheduling.services.lifecycle import assignment_return_to_pool

    _, _, worker, _ = setup
    a = ask(worker.id)
    assert a is not None
    row = DispatchedJob.objects.get(id=a.assignment_id)
    assert assignment_return_to_pool(row=row, reason="worker lost", lost=True, now=timezone.now())
    assert not assignment_return_to_pool(row=row, reason="again", lost=True, now=timezone.now())
    base = DerivationBuild.objects.get(id=build_id_of(a))
    assert (base.status, base.attempts) == (BuildStatus.QUEUED, 1)
    assert BuildAttempt.objects.get(dispatched_job_id=row.id).outcome == "Aborted"


def test_an_evaluation_fails_after_ten_lost_dispatches() -> None:
    from gradient.scheduling.services.lifecycle import assignment_return_to_pool

    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    for lost in range(1, 11):
        a = ask(worker.id, "flake")
        assert a is not None, lost
        row = DispatchedJob.objects.get(id=a.assignment_id)
        assignment_return_to_pool(row=row, reason="worker lost", lost=True, now=timezone.now())
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.lost_dispatches) == (EvaluationStatus.FAILED, 10)
    assert "10 evaluation dispatches were lost" in evaluation.errors[-1]


def _finish_two_builds_at_once(project, derivations):  # type: ignore[no-untyped-def]
    """Two workers' builds finish in two transactions at once: the first has finished its build but not
    committed when the second finishes its own, and commits only a moment later."""
    import threading
    import time

    from django.db import connection, transaction

    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=derivations, now=timezone.now())
    first, second = connected_worker([project]), connected_worker([project])
    a, b = ask(first.id), ask(second.id)
    assert a is not None and b is not None
    first_done, second_started = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def finish_first() -> None:
        try:
            with transaction.atomic():
                build(first.id, a)
                first_done.set()
                second_started.wait(10)
                time.sleep(0.3)  # the second is now inside its own transaction, or waiting on ours
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            first_done.set()
        finally:
            connection.close()

    def finish_second() -> None:
        try:
            first_done.wait(10)
            second_started.set()
            with transaction.atomic():
                build(second.id, b)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=finish_first), threading.Thread(target=finish_second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return evaluation


@pytest.mark.django_db(transaction=True)
def test_the_last_two_builds_finishing_at_once_complete_the_evaluation_without_a_pass() -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("needs concurrent connections")
    project = ProjectFactory()
    evaluation = _finish_two_builds_at_once(project, [drv("left"), drv("right")])
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_two_dependencies_finishing_at_once_queue_their_dependent_without_the_resync() -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("needs concurrent connections")
    project = ProjectFactory()
    evaluation = _finish_two_builds_at_once(project, [drv("left"), drv("right"), drv("top", "left", "right")])
    statuses = {p.rsplit("-", 1)[1]: s for p, s in DerivationBuild.objects.values_list("drv_path", "status")}
    assert statuses == {
        "left.drv": BuildStatus.COMPLETED,
        "right.drv": BuildStatus.COMPLETED,
        "top.drv": "Queued",
    }
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.BUILDING


def test_a_batch_with_a_jobs_whole_cycle_writes_its_assignment_once_and_drops_what_follows_the_close() -> (
    None
):
    from gradient.scheduling.services.reports import worker_reports

    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("x"), drv("y")], now=timezone.now())
    fast, slow = connected_worker([project]), connected_worker([project])
    a, b = ask(fast.id), ask(slow.id)
    assert a is not None and b is not None

    def message(x: object, type_: str, **fields: object) -> object:
        return wire({"type": type_, "job_id": x.job_key, "assignment_id": str(x.assignment_id), **fields})  # type: ignore[attr-defined]

    spec = job_json(a)["builds"][0]
    outputs = [{"name": o["name"], "path": o["path"], "nar_size": 1} for o in spec["outputs"]]
    now = timezone.now()
    results = worker_reports(
        batch=[
            (fast.id, message(a, "AssignJobResponse", accepted=True)),
            (slow.id, message(b, "AssignJobResponse", accepted=True)),
            (fast.id, message(a, "JobUpdate", update={"kind": "building", "build_id": spec["build_id"]})),
            (
                fast.id,
                message(
                    a,
                    "JobUpdate",
                    update={
                        "kind": "build_output",
                        "build_id": spec["build_id"],
                        "outputs": outputs,
                        "substituted": False,
                    },
                ),
            ),
            (fast.id, message(a, "JobCompleted", elapsed_ms=3)),
            (fast.id, message(a, "JobUpdate", update={"kind": "building", "build_id": spec["build_id"]})),
        ],
        now=now,
    )
    assert [getattr(r, "accepted", None) for r in results] == [True, True, True, True, True, False]
    done = DispatchedJob.objects.get(id=a.assignment_id)
    assert (done.accepted_at, done.phase, done.last_report_at, done.finished_at) == (
        now,
        "build_output",
        now,
        now,
    )
    assert done.outcome == "Completed" and done.reason == "completed"
    running = DispatchedJob.objects.get(id=b.assignment_id)
    assert (running.accepted_at, running.phase, running.last_report_at, running.finished_at) == (
        now,
        "",
        now,
        None,
    )
    assert DerivationBuild.objects.get(id=build_id_of(a)).status == BuildStatus.COMPLETED
    assert BuildAttempt.objects.get(dispatched_job_id=a.assignment_id).outcome == "Built"
    assert DerivationBuild.objects.get(id=build_id_of(b)).status == BuildStatus.BUILDING


@pytest.mark.django_db(transaction=True)
def test_an_evaluation_completes_with_its_last_build_even_when_each_witness_finishes_first() -> None:
    """finish_evaluations after successes remembers an unfinished build per evaluation (its witness);
    the witness finishing first each time still leaves the evaluation Building until the last one."""
    project = ProjectFactory()
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    now = timezone.now()
    graph.ingest_eval_result(
        evaluation=evaluation, derivations=[drv("w1"), drv("w2"), drv("w3", "w1"), drv("w4")], now=now
    )
    ids = set(
        DerivationBuild.objects.filter(evaluation_links__evaluation=evaluation).values_list("id", flat=True)
    )
    assert len(ids) == 4
    seen: list[uuid.UUID] = []
    while ids:
        finished = graph.finish_evaluations(evaluation_ids=[evaluation.id], now=now, after_successes=True)
        assert finished == []
        evaluation.refresh_from_db()
        assert evaluation.status == EvaluationStatus.BUILDING
        witness = graph._witnesses[evaluation.id]
        assert witness in ids  # an unfinished build the evaluation needs
        seen.append(witness)
        DerivationBuild.objects.filter(id=witness).update(status=BuildStatus.COMPLETED, finished_at=now)
        ids.discard(witness)
    # The waiting-for-a-dependency build was the first witness (the one likely to finish last).
    assert DerivationBuild.objects.get(id=seen[0]).drv_path.endswith("-w3.drv")
    [done] = graph.finish_evaluations(evaluation_ids=[evaluation.id], now=now, after_successes=True)
    assert done.status == EvaluationStatus.COMPLETED
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED
    assert evaluation.id not in graph._witnesses
