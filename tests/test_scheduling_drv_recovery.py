"""Lost `.drv` recovery: a build whose `.drv` no worker can obtain waits, its evaluation goes
graph_stuck, and after 120 s a DrvRecovery evaluation of the same commit brings the `.drv` back (or the
build fails for good)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.scheduling.decisions import waiting as w
from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationKind,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.scheduling.services.waiting import refresh_waiting_state
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, drv, evaluate, job_json, report

DEP, APP = drv("dep"), drv("app", "dep", attr="packages.x86_64-linux.app")


def test_only_a_lost_ready_uncached_build_is_a_target() -> None:
    def b(i: str, **kw: object) -> w.ClosureBuild:
        fields: dict[str, object] = {
            "status": "Created",
            "drv_lost": True,
            "dependencies_done": True,
            "outputs_cached": False,
        }
        fields.update(kw)
        return w.ClosureBuild(build_id=i, **fields)  # type: ignore[arg-type]

    closure = [
        b("lost"),
        b("queued", status="Queued"),
        b("not-lost", drv_lost=False),
        b("deps-pending", dependencies_done=False),
        b("cached", outputs_cached=True),
    ]
    assert w.lost_drv_targets(closure) == ["lost"]
    now = timezone.now()
    stuck = {"reason": "graph_stuck", "pending_shared_builds": 1}
    assert not w.lost_drv_due(reason=stuck, waiting_since=now - timedelta(seconds=119), now=now)
    assert w.lost_drv_due(reason=stuck, waiting_since=now - timedelta(seconds=120), now=now)
    assert not w.lost_drv_due(reason={"reason": "workers"}, waiting_since=now - timedelta(hours=1), now=now)
    assert w.drv_recovery_action(active_recoveries=1, finished_recoveries=1) == w.DrvRecoveryAction.WAIT
    assert w.drv_recovery_action(active_recoveries=0, finished_recoveries=1) == w.DrvRecoveryAction.GIVE_UP
    assert w.drv_recovery_action(active_recoveries=0, finished_recoveries=0) == w.DrvRecoveryAction.START


def _lose_app_drv():  # type: ignore[no-untyped-def]
    """An evaluation whose `dep` is built and whose `app` failed because its .drv is gone."""
    project = ProjectFactory()
    worker = connected_worker([project])
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING, commit="c0ffee")
    graph.ingest_eval_result(evaluation=evaluation, derivations=[DEP, APP], now=timezone.now())
    a = ask(worker.id)
    assert a is not None
    build(worker.id, a)
    a = ask(worker.id)
    assert a is not None and job_json(a)["builds"][0]["drv_path"] == APP["drv_path"]
    outcome = report(
        worker.id,
        a,
        "JobFailed",
        kind="inputs_unavailable",
        error=f"error: path '{APP['drv_path']}' is not valid and no substituter has it",
    )
    assert outcome.accepted and "its .drv is lost" in outcome.detail
    return project, worker, evaluation


@pytest.mark.django_db
def test_a_lost_drv_is_recovered_by_a_drv_recovery_evaluation_and_the_work_completes() -> None:
    project, worker, evaluation = _lose_app_drv()
    app = DerivationBuild.objects.get(drv_path=APP["drv_path"])
    assert (app.status, app.attempts, app.drv_lost_at is not None) == (BuildStatus.CREATED, 0, True)
    assert ask(worker.id) is None, "a build whose .drv is lost is not handed out"

    now = timezone.now()
    r = refresh_waiting_state(now=now, grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_reason == {"reason": "graph_stuck", "pending_shared_builds": 1}
    assert r.healed == 1 and r.drv_recoveries == 0, "the heal cannot queue it, and the grace has not passed"
    app.refresh_from_db()
    assert app.status == BuildStatus.CREATED

    later = now + timedelta(seconds=121)
    r = refresh_waiting_state(now=later, grace_secs=300, use_memo=False)
    assert r.drv_recoveries == 1
    recovery = Evaluation.objects.get(kind=EvaluationKind.DRV_RECOVERY)
    assert (recovery.recovery_of_id, recovery.commit, recovery.status) == (app.id, "c0ffee", "Queued")
    r = refresh_waiting_state(now=later + timedelta(seconds=5), grace_secs=300, use_memo=False)
    assert Evaluation.objects.filter(kind=EvaluationKind.DRV_RECOVERY).count() == 1, "one at a time"

    job = ask(worker.id, "flake")
    assert job is not None and job.job_key == f"eval:{recovery.id}"
    evaluate(worker.id, job, [DEP, APP])
    recovery.refresh_from_db()
    app.refresh_from_db()
    assert recovery.status == EvaluationStatus.COMPLETED
    assert (app.status, app.drv_lost_at) == (BuildStatus.QUEUED, None)
    assert not recovery.build_links.exists(), "a DrvRecovery evaluation names no builds of its own"

    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (evaluation.status, evaluation.waiting_reason) == ("Building", None)
    a = ask(worker.id)
    assert a is not None
    build(worker.id, a)
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED


@pytest.mark.django_db
def test_a_recovery_that_does_not_produce_the_drv_fails_it_and_the_build() -> None:
    project, worker, evaluation = _lose_app_drv()
    now = timezone.now()
    refresh_waiting_state(now=now, grace_secs=300, use_memo=False)
    refresh_waiting_state(now=now + timedelta(seconds=121), grace_secs=300, use_memo=False)
    recovery = Evaluation.objects.get(kind=EvaluationKind.DRV_RECOVERY)
    job = ask(worker.id, "flake")
    assert job is not None
    evaluate(worker.id, job, [DEP])  # the commit no longer produces app's .drv
    recovery.refresh_from_db()
    app = DerivationBuild.objects.get(drv_path=APP["drv_path"])
    evaluation.refresh_from_db()
    assert recovery.status == EvaluationStatus.FAILED
    assert "did not produce the lost .drv" in recovery.errors[-1]
    assert app.status == BuildStatus.FAILED_PERMANENT and "its .drv is lost" in app.last_error
    assert evaluation.status == EvaluationStatus.FAILED


@pytest.mark.django_db
def test_a_build_still_lost_after_a_recovery_ran_fails_instead_of_looping() -> None:
    project, worker, evaluation = _lose_app_drv()
    app = DerivationBuild.objects.get(drv_path=APP["drv_path"])
    EvaluationFactory(
        project=project,
        kind=EvaluationKind.DRV_RECOVERY,
        recovery_of=app,
        status=EvaluationStatus.COMPLETED,
        finished_at=timezone.now(),
    )
    now = timezone.now()
    refresh_waiting_state(now=now, grace_secs=300, use_memo=False)
    r = refresh_waiting_state(now=now + timedelta(seconds=121), grace_secs=300, use_memo=False)
    assert r.drv_recoveries == 1
    assert Evaluation.objects.filter(kind=EvaluationKind.DRV_RECOVERY).count() == 1, "no second recovery"
    app.refresh_from_db()
    evaluation.refresh_from_db()
    assert app.status == BuildStatus.FAILED_PERMANENT
    assert evaluation.status == EvaluationStatus.FAILED


@pytest.mark.django_db
def test_inputs_unavailable_for_another_path_is_an_ordinary_retry() -> None:
    project = ProjectFactory()
    worker = connected_worker([project])
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("solo")], now=timezone.now())
    a = ask(worker.id)
    assert a is not None
    report(
        worker.id,
        a,
        "JobFailed",
        kind="inputs_unavailable",
        error="cannot fetch an input",
        missing_paths=["/nix/store/xyz-src"],
    )
    solo = DerivationBuild.objects.get()
    assert (solo.status, solo.drv_lost_at, solo.attempts) == (BuildStatus.FAILED_TRANSIENT, None, 1)


@pytest.mark.django_db
def test_missing_paths_naming_the_drv_mark_it_lost() -> None:
    project = ProjectFactory()
    worker = connected_worker([project])
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("solo")], now=timezone.now())
    a = ask(worker.id)
    assert a is not None
    path = job_json(a)["builds"][0]["drv_path"]
    report(
        worker.id, a, "JobFailed", kind="inputs_unavailable", error="not in the store", missing_paths=[path]
    )
    solo = DerivationBuild.objects.get()
    assert (solo.status, solo.drv_lost_at is not None, solo.attempts) == (BuildStatus.CREATED, True, 0)
