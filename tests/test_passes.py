"""The periodic passes: declared once, installed into django-celery-beat with `expires` under their
interval, run under a lease so two runners never overlap, and the retention pass itself."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from gradient.celery import app
from gradient.clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterMember, ClusterStatus
from gradient.clusters.services import cluster_jobs_delete_expired
from gradient.passrunner import PassRunner
from gradient.recovery.models import PassState
from gradient.runtime.passes import pass_run
from gradient.schedule import PASSES, beat_schedule
from tests.factories import ClusterAttemptFactory, ClusterJobFactory, ClusterMemberFactory


def test_every_pass_has_a_registered_task_and_expires_under_its_interval() -> None:
    app.loader.import_default_modules()
    schedule = beat_schedule()
    assert set(schedule) == {p.name for p in PASSES if p.seconds() > 0}
    for name, entry in schedule.items():
        assert entry["task"] in app.tasks, name
        assert 0 < entry["options"]["expires"] < entry["schedule"]


@pytest.mark.django_db(transaction=True)  # the scheduler closes its connection, as in a beat process
def test_the_database_scheduler_installs_the_declared_passes_for_the_admin() -> None:
    app.conf.beat_schedule = beat_schedule()
    DatabaseScheduler(app=app, lazy=True).setup_schedule()
    installed = {t.name: t for t in PeriodicTask.objects.all()}
    for name, entry in beat_schedule().items():
        assert installed[name].task == entry["task"]
        assert installed[name].enabled
        # The scheduler keeps only expire_seconds: without it every run would be sent without expiry.
        assert 0 < installed[name].expires_ <= entry["schedule"]


@pytest.mark.django_db(transaction=True)
def test_a_paused_pass_stays_paused_when_beat_starts_again() -> None:
    app.conf.beat_schedule = beat_schedule()
    DatabaseScheduler(app=app, lazy=True).setup_schedule()
    PeriodicTask.objects.filter(name="assignment").update(enabled=False)
    DatabaseScheduler(app=app, lazy=True).setup_schedule()
    assert not PeriodicTask.objects.get(name="assignment").enabled
    assert PeriodicTask.objects.get(name="build-resync").enabled


def _finished_cluster(days_ago: float, status: str = ClusterStatus.COMPLETED) -> ClusterJob:
    finished = timezone.now() - timedelta(days=days_ago)
    cluster = ClusterJobFactory(status=status, finished_at=finished)
    ClusterMemberFactory(cluster_job=cluster)
    ClusterAttemptFactory(cluster_job=cluster, finished_at=finished, outcome=AttemptOutcome.SUCCEEDED)
    return cluster


@pytest.mark.django_db
def test_retention_deletes_finished_clusters_past_the_window_with_their_members_and_attempts() -> None:
    old = _finished_cluster(days_ago=100)
    recent = _finished_cluster(days_ago=10)
    active = ClusterJobFactory(status=ClusterStatus.RUNNING)
    ClusterAttemptFactory(cluster_job=active)
    stale_active = ClusterJobFactory(status=ClusterStatus.QUEUED)  # old but not finished

    deleted = cluster_jobs_delete_expired(now=timezone.now(), retention_days=90)

    assert deleted == 1
    remaining = set(ClusterJob.objects.values_list("id", flat=True))
    assert remaining == {recent.id, active.id, stale_active.id}
    assert not ClusterMember.objects.filter(cluster_job_id=old.id).exists()
    assert not ClusterAttempt.objects.filter(cluster_job_id=old.id).exists()


@pytest.mark.django_db
def test_retention_never_deletes_a_cluster_with_an_open_attempt() -> None:
    cluster = _finished_cluster(days_ago=100, status=ClusterStatus.FAILED)
    ClusterAttemptFactory(cluster_job=cluster, number=2)  # inconsistent on purpose: an open attempt
    assert cluster_jobs_delete_expired(now=timezone.now(), retention_days=90) == 0


@pytest.mark.django_db
def test_retention_works_in_batches() -> None:
    for _ in range(5):
        _finished_cluster(days_ago=200)
    assert cluster_jobs_delete_expired(now=timezone.now(), retention_days=90, batch_size=2) == 2
    assert ClusterJob.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_two_runners_of_the_same_pass_never_overlap() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs concurrent connections")
    running = 0
    overlaps = 0
    ran = 0
    lock = threading.Lock()

    def body() -> int:
        nonlocal running, overlaps, ran
        with lock:
            running += 1
            ran += 1
            overlaps += running > 1
        time.sleep(0.05)
        with lock:
            running -= 1
        return 1

    def runner() -> None:
        try:
            for _ in range(20):
                pass_run(name="test-pass", body=body)
        finally:
            connection.close()

    threads = [threading.Thread(target=runner) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == 0
    assert ran >= 1
    state = PassState.objects.get(name="test-pass")
    assert state.runs == ran
    assert state.lease_holder == "" and state.lease_expires_at is None


@pytest.mark.django_db
def test_a_failing_pass_releases_its_lease_and_keeps_the_error() -> None:
    def body() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        pass_run(name="failing-pass", body=body)
    state = PassState.objects.get(name="failing-pass")
    assert state.lease_expires_at is None
    assert "ValueError: boom" in state.last_error


@pytest.mark.django_db
def test_a_pass_whose_lease_is_held_does_not_run() -> None:
    PassState.objects.create(
        name="held-pass", lease_holder="elsewhere", lease_expires_at=timezone.now() + timedelta(minutes=5)
    )
    assert pass_run(name="held-pass", body=lambda: 1) is None
    assert PassState.objects.get(name="held-pass").runs == 0


@pytest.mark.django_db(transaction=True)
def test_the_in_process_runner_runs_the_retention_pass_through_its_task() -> None:
    _finished_cluster(days_ago=365)
    retention = next(p for p in PASSES if p.name == "cluster-retention")
    runner = PassRunner(passes=(retention,))
    app.loader.import_default_modules()
    runner.run_once(retention)
    assert ClusterJob.objects.count() == 0
    assert PassState.objects.get(name="cluster-retention").last_result == 1


@pytest.mark.django_db(transaction=True)
def test_the_in_process_runner_installs_the_passes_and_skips_one_paused_in_the_admin() -> None:
    retention = next(p for p in PASSES if p.name == "cluster-retention")
    resync = next(p for p in PASSES if p.name == "build-resync")
    PassRunner.install()
    assert {p.name for p in PASSES if p.seconds() > 0} <= set(
        PeriodicTask.objects.values_list("name", flat=True)
    )
    PeriodicTask.objects.filter(name="cluster-retention").update(enabled=False)
    _finished_cluster(days_ago=365)
    runner = PassRunner(passes=(retention, resync), tick=0.05)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not PassState.objects.filter(name="build-resync", runs__gte=1).exists():
            assert time.monotonic() < deadline, "the enabled pass never ran"
            time.sleep(0.1)
        assert ClusterJob.objects.count() == 1, "the paused pass did not run"
        assert not PassState.objects.filter(name="cluster-retention", runs__gte=1).exists()
        PeriodicTask.objects.filter(name="cluster-retention").update(enabled=True)
        runner.stop()
        runner = PassRunner(passes=(retention,), tick=0.05)
        runner.start()
        deadline = time.monotonic() + 20
        while ClusterJob.objects.exists():
            assert time.monotonic() < deadline, "the enabled-again pass never ran"
            time.sleep(0.1)
    finally:
        runner.stop()
