"""What one part's decision (graph.decide_builds; decide_evaluation_graph for a whole result) does with
the builds it brought, whose held dependencies have already finished: a build that needs a lasting
failure fails with what needs it (DependencyFailed), a build whose dependencies all succeeded is queued
at once, one that waits on a pending or running dependency stays Created. On PostgreSQL one pick decides
the failures and the queueing (graph._FAILED_OR_READY); the outcome is what the two picks gave."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from gradient.scheduling.models import BuildStatus, DerivationBuild, EvaluationStatus
from gradient.scheduling.services import graph
from tests.factories import connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv, evaluating, report, update

pytestmark = pytest.mark.django_db(transaction=True)


def _part(worker: Any, a: Any, derivations: list[dict[str, Any]], **extra: Any) -> Any:
    return update(worker.id, a, kind="eval_result", derivations=derivations, warnings=[], errors=[], **extra)


def _statuses() -> dict[str, str]:
    return {
        p.rsplit("-", 1)[1].removesuffix(".drv"): s
        for p, s in DerivationBuild.objects.values_list("drv_path", "status")
    }


def _held_builds(project: Any) -> tuple[Any, Any]:
    """An earlier evaluation of `project` (a new one with None) whose `bad` failed for good, `good` was
    built, and `busy` is being built: (the project, its evaluating worker)."""
    first, worker, job = evaluating(project)
    assert _part(worker, job, [drv("bad"), drv("good"), drv("busy")]).accepted
    report(worker.id, job, "JobCompleted", elapsed_ms=5)
    by_name = {}
    for _ in range(3):  # a builder each (one slot each)
        builder = connected_worker([first.project])
        a = ask(builder.id)
        assert a is not None
        by_name[DerivationBuild.objects.get(id=build_id_of(a)).drv_path.rsplit("-", 1)[1]] = (builder, a)
    builder, a = by_name["good.drv"]
    build(builder.id, a)
    builder, a = by_name["bad.drv"]
    report(builder.id, a, "JobFailed", error="exit 1", kind="permanent", elapsed_ms=1)
    builder, a = by_name["busy.drv"]
    update(builder.id, a, kind="building", build_id=build_id_of(a))
    assert _statuses() == {"bad": "FailedPermanent", "good": "Completed", "busy": "Building"}
    first.refresh_from_db()
    assert first.status == EvaluationStatus.FAILED
    return first.project, worker


def test_a_part_fails_what_needs_a_lasting_failure_and_queues_what_needs_only_successes() -> None:
    project, _ = _held_builds(None)
    _, worker, job = evaluating(project)
    part = [
        drv("bad"),
        drv("good"),
        drv("busy"),
        drv("needsbad", "bad"),
        drv("needsboth", "bad", "good"),  # a failure and a success: fails, never queued
        drv("above", "needsbad"),  # needs what fails in this very part: fails with it
        drv("needsgood", "good"),  # every dependency succeeded: queued at once
        drv("needsbusy", "busy", "good"),  # waits on the running one
        drv("fresh"),
        drv("needsfresh", "fresh", "good"),  # waits on a new build of the part
    ]
    outcome = _part(worker, job, part, is_final=False)
    assert outcome.accepted
    assert "3 failed" in outcome.detail and "2 queued" in outcome.detail, outcome.detail
    assert _statuses() == {
        "bad": BuildStatus.FAILED_PERMANENT,
        "good": BuildStatus.COMPLETED,
        "busy": BuildStatus.BUILDING,
        "needsbad": BuildStatus.DEPENDENCY_FAILED,
        "needsboth": BuildStatus.DEPENDENCY_FAILED,
        "above": BuildStatus.DEPENDENCY_FAILED,
        "needsgood": BuildStatus.QUEUED,
        "needsbusy": BuildStatus.CREATED,
        "fresh": BuildStatus.QUEUED,
        "needsfresh": BuildStatus.CREATED,
    }


def test_a_whole_results_decision_gives_the_same() -> None:
    """decide_evaluation_graph over the evaluation's links (graph.ingest_eval_result, one whole result)."""
    project, _ = _held_builds(None)
    evaluation, _, _ = evaluating(project)
    result = graph.ingest_eval_result(
        evaluation=evaluation,
        derivations=[
            drv("bad"),
            drv("good"),
            drv("needsbad", "bad"),
            drv("busy"),
            drv("needsgood", "good"),
            drv("w", "busy"),
        ],
        now=timezone.now(),
    )
    assert (result.dependency_failed, result.queued) == (1, 1)
    statuses = _statuses()
    assert (statuses["needsbad"], statuses["needsgood"], statuses["w"]) == (
        BuildStatus.DEPENDENCY_FAILED,
        BuildStatus.QUEUED,
        BuildStatus.CREATED,
    )
