"""The `draining` waiting reason: parked during an instance drain, unparked at startup or once an
instance serves again; and what counts as the service draining."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.recovery.models import ServerBoot
from gradient.recovery.startup import run_startup_recovery
from gradient.runtime.instances import service_draining
from gradient.runtime.passes import server_boot_drain, server_boot_start, server_boot_stop
from gradient.scheduling.decisions import waiting as w
from gradient.scheduling.models import EvaluationStatus
from gradient.scheduling.services import graph
from gradient.scheduling.services.waiting import refresh_waiting_state, unpark_draining_evals
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import drv


def _boot(*, started_ago: float = 60, draining: bool = False, stopped: bool = False) -> ServerBoot:
    now = timezone.now()
    return ServerBoot.objects.create(
        hostname="elsewhere",
        pid=1,
        started_at=now - timedelta(seconds=started_ago),
        last_heartbeat=now,
        draining_since=now if draining else None,
        stopped_at=now if stopped else None,
    )


def test_draining_parks_everything_but_a_finished_evaluation() -> None:
    pool = w.Pool((w.PoolWorker(True, True, True, ("x86_64-linux",), ()),))
    building = w.Counters(named=2, active=1, building=1)
    assert w.assess(status="Building", counters=building, has_open_job=False, pool=pool, blocking=None) == (
        w.NOT_WAITING
    )
    verdict = w.assess(
        status="Building", counters=building, has_open_job=False, pool=pool, blocking=None, draining=True
    )
    assert verdict.reason == {"reason": "draining", "resume": "Building"}
    evaluating = w.assess(
        status="EvaluatingDerivation",
        counters=building,
        has_open_job=True,
        pool=pool,
        blocking=None,
        draining=True,
    )
    assert evaluating.reason == {"reason": "draining", "resume": "Queued"}, (
        "its evaluation job never completed"
    )
    parked = w.assess(
        status="Waiting",
        counters=building,
        has_open_job=False,
        pool=pool,
        blocking=None,
        draining=True,
        parked_for="workers",
    )
    assert parked.reason == {"reason": "draining", "resume": "Building"}
    done = w.Counters(named=2, active=0, building=0)
    assert w.assess(
        status="Building", counters=done, has_open_job=False, pool=pool, blocking=None, draining=True
    ).finalize
    assert w.unpark_status({"reason": "draining", "resume": "Queued"}, 3) == "Queued"
    assert w.unpark_status({"reason": "draining", "resume": "Building"}, 3) == "Building"
    assert w.unpark_status({"reason": "draining", "resume": "Building"}, 0) == "Queued"
    assert w.unpark_status({"reason": "eval_workers"}, 3) == "Queued"
    assert w.unpark_status({"reason": "workers"}, 3) == "Building"


@pytest.mark.django_db
def test_the_service_drains_only_when_no_live_instance_serves() -> None:
    now = timezone.now()
    assert service_draining(now=now) is False, "no instance ever started: nothing drains"
    a = _boot(started_ago=120)
    assert service_draining(now=now) is False
    server_boot_drain(boot_id=a.id, now=now)
    assert service_draining(now=now) is True, "the only instance is draining"
    b = _boot(started_ago=60)
    assert service_draining(now=now) is False, "another instance still serves"
    server_boot_stop(boot_id=b.id, now=now)
    assert service_draining(now=now) is True
    server_boot_stop(boot_id=a.id, now=now)
    # Both stopped: the latest to start (b) stopped without a drain, so this is no drain.
    assert service_draining(now=now) is False
    c = _boot(started_ago=1)
    server_boot_drain(boot_id=c.id, now=now)
    server_boot_stop(boot_id=c.id, now=now)
    # Stopped after its drain, nothing started since: still drained (a Celery-only pass keeps the park).
    assert service_draining(now=now) is True


@pytest.mark.django_db
def test_a_crashed_instance_is_not_a_drain() -> None:
    now = timezone.now()
    drained = _boot(started_ago=120, draining=True, stopped=True)
    assert service_draining(now=now) is True
    crashed = _boot(started_ago=10)
    ServerBoot.objects.filter(id=crashed.id).update(last_heartbeat=now - timedelta(minutes=5))
    assert service_draining(now=now) is False, "the latest instance crashed; it did not drain"
    assert drained.draining_since is not None


@pytest.mark.django_db
def test_the_pass_parks_every_in_flight_evaluation_during_a_drain_and_leaves_foreign_reasons() -> None:
    project = ProjectFactory()
    connected_worker([project])
    queued = EvaluationFactory(project=project)
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=building, derivations=[drv("app")], now=timezone.now())
    approval = EvaluationFactory(
        project=project, status=EvaluationStatus.WAITING, waiting_reason={"reason": "approval"}
    )
    boot = _boot()
    server_boot_drain(boot_id=boot.id, now=timezone.now())
    r = refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    assert r.draining and r.parked == 2
    for evaluation in (queued, building):
        evaluation.refresh_from_db()
        assert evaluation.status == "Waiting" and evaluation.waiting_reason["reason"] == "draining"
    approval.refresh_from_db()
    assert approval.waiting_reason == {"reason": "approval"}
    assert "draining" in w.describe({"reason": "draining"})


@pytest.mark.django_db
def test_startup_unparks_draining_evaluations_after_recovery() -> None:
    project = ProjectFactory()
    connected_worker([project])
    queued = EvaluationFactory(project=project)
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=building, derivations=[drv("app")], now=timezone.now())
    old = server_boot_start(now=timezone.now() - timedelta(minutes=5))
    server_boot_drain(boot_id=old.id, now=timezone.now())
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    server_boot_stop(boot_id=old.id, now=timezone.now())

    new = server_boot_start(now=timezone.now())
    report = run_startup_recovery(boot_id=new.id)
    assert report.draining_unparked == 2
    queued.refresh_from_db()
    building.refresh_from_db()
    assert (queued.status, queued.waiting_reason) == ("Queued", None)
    assert (building.status, building.waiting_reason) == ("Building", None)
    assert unpark_draining_evals(now=timezone.now()) == 0, "nothing left to unpark"


@pytest.mark.django_db
def test_the_pass_unparks_draining_evaluations_once_an_instance_serves_again() -> None:
    project = ProjectFactory()
    connected_worker([project])
    evaluation = EvaluationFactory(project=project)
    a = _boot(started_ago=120)
    server_boot_drain(boot_id=a.id, now=timezone.now())
    refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert evaluation.waiting_reason == {"reason": "draining", "resume": "Queued"}
    _boot(started_ago=1)  # another instance serves
    r = refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)
    evaluation.refresh_from_db()
    assert (r.draining, r.unparked, evaluation.status, evaluation.waiting_reason) == (
        False,
        1,
        "Queued",
        None,
    )
