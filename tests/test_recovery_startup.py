"""Startup recovery: what a crashed server left open goes back to the pool, in the design's order, and
nothing a live server holds is touched."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import psutil
import pytest
from django.utils import timezone

from gradient.records.services import record_check_one
from gradient.recovery.models import PassState, ServerBoot
from gradient.recovery.startup import dead_boot_ids, recover_interrupted_work
from gradient.runtime.passes import pass_lease_acquire
from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.workers.models import WorkerSession
from tests.factories import EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import ask, build, build_id_of, drv
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db


def _boot(alive: bool) -> ServerBoot:
    now = timezone.now()
    return ServerBoot.objects.create(
        hostname="elsewhere",
        pid=4242,
        started_at=now - timedelta(hours=1),
        last_heartbeat=now if alive else now - timedelta(minutes=5),
    )


def _on(worker, boot: ServerBoot) -> None:  # type: ignore[no-untyped-def]
    WorkerSession.objects.filter(worker=worker, closed_at__isnull=True).update(server_boot=boot.id)


def test_recovery_returns_the_work_of_a_dead_server_and_keeps_a_live_servers() -> None:
    project = ProjectFactory()
    dead, live = _boot(alive=False), _boot(alive=True)
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=building, derivations=[drv("base"), drv("mid", "base"), drv("other")], now=timezone.now()
    )
    evaluating = EvaluationFactory(project=project)
    w_dead = connected_worker([project], max_concurrent_builds=2)
    w_live = connected_worker([project])
    _on(w_dead, dead)
    _on(w_live, live)
    eval_job = ask(w_dead.id, "flake")
    assert eval_job is not None and eval_job.job_key == evaluating.job_key
    first = ask(w_dead.id)
    assert first is not None
    kept = ask(w_live.id)
    assert kept is not None
    # A build whose dependencies are not all done but that is Building (a drifted row) is unpromoted.
    mid = DerivationBuild.objects.get(drv_path__endswith="mid.drv")
    DerivationBuild.objects.filter(id=mid.id).update(status=BuildStatus.BUILDING)

    report = recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())

    assert report.dead_boots == 1 and report.sessions_closed == 1
    assert report.assignments_closed == 2 and report.evaluations_requeued == 1
    assert not DispatchedJob.objects.filter(worker=w_dead, finished_at__isnull=True).exists()
    assert DispatchedJob.objects.get(id=kept.assignment_id).finished_at is None
    evaluating.refresh_from_db()
    assert evaluating.status == EvaluationStatus.QUEUED
    lost_build = DerivationBuild.objects.get(id=build_id_of(first))
    assert lost_build.status == BuildStatus.QUEUED
    assert BuildAttempt.objects.get(dispatched_job_id=first.assignment_id).outcome == "Aborted"
    assert DerivationBuild.objects.get(id=build_id_of(kept)).status == BuildStatus.BUILDING
    mid.refresh_from_db()
    assert mid.status == BuildStatus.CREATED and report.builds_unpromoted == 1
    for evaluation in (building, evaluating):
        problems, _ = record_check_one(job_key=evaluation.job_key, now=timezone.now(), settle=False)
        assert problems == ()


def test_recovery_twice_changes_nothing_more() -> None:
    project = ProjectFactory()
    dead = _boot(alive=False)
    EvaluationFactory(project=project)
    worker = connected_worker([project])
    _on(worker, dead)
    assert ask(worker.id, "flake") is not None
    first = recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())
    second = recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())
    assert first.assignments_closed == 1
    assert (second.assignments_closed, second.evaluations_requeued, second.sessions_closed) == (0, 0, 0)


def test_the_work_then_completes_with_the_same_worker_reconnected() -> None:
    project = ProjectFactory()
    dead = _boot(alive=False)
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv("solo")], now=timezone.now())
    worker = connected_worker([project])
    _on(worker, dead)
    assert ask(worker.id) is not None
    recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())
    WorkerSession.objects.create(
        worker=worker,
        channel_name="again",
        server_boot=uuid.uuid4(),
        opened_at=timezone.now(),
        last_seen=timezone.now(),
    )
    again = ask(worker.id)
    assert again is not None
    build(worker.id, again)
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.COMPLETED


def _local_boot(pid: int, started_at: datetime) -> ServerBoot:
    """A boot on this host whose heartbeat is fresh: only its process can tell whether it is gone."""
    return ServerBoot.objects.create(
        hostname=socket.gethostname(), pid=pid, started_at=started_at, last_heartbeat=timezone.now()
    )


@contextlib.contextmanager
def _child() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_a_sigkilled_boot_on_this_host_is_dead_at_once_even_before_its_parent_reaps_it() -> None:
    with _child() as child:
        boot = _local_boot(child.pid, timezone.now())
        assert boot.id not in dead_boot_ids(current=uuid.uuid4(), now=timezone.now())
        child.send_signal(signal.SIGKILL)
        # Not reaped yet: a zombie still answers kill(pid, 0).
        wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, timeout=10)
        assert boot.id in dead_boot_ids(current=uuid.uuid4(), now=timezone.now())
        child.wait()
        assert boot.id in dead_boot_ids(current=uuid.uuid4(), now=timezone.now())


def test_a_boot_whose_pid_now_belongs_to_a_later_process_is_dead() -> None:
    with _child() as child:
        reused = _local_boot(child.pid, timezone.now() - timedelta(hours=2))
        mine = _local_boot(os.getpid(), timezone.now())  # a restarted container gets its old pid again
        dead = dead_boot_ids(current=uuid.uuid4(), now=timezone.now())
        assert reused.id in dead and mine.id in dead


def test_recovery_closes_the_sessions_of_a_killed_boot_on_this_host_but_not_of_a_running_one() -> None:
    project = ProjectFactory()
    with _child() as running, _child() as killed:
        live_boot = _local_boot(running.pid, timezone.now())
        dead_boot = _local_boot(killed.pid, timezone.now())
        w_live, w_dead = connected_worker([project]), connected_worker([project])
        _on(w_live, live_boot)
        _on(w_dead, dead_boot)
        killed.kill()
        killed.wait()
        report = recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())
    assert (report.dead_boots, report.sessions_closed) == (1, 1)
    assert WorkerSession.objects.get(worker=w_live).closed_at is None
    assert WorkerSession.objects.get(worker=w_dead).closed_at is not None
    assert ServerBoot.objects.get(id=live_boot.id).stopped_at is None


def test_a_pass_lease_held_by_a_killed_serve_is_freed_and_a_running_ones_is_kept() -> None:
    host = socket.gethostname()
    now = timezone.now()
    with _child() as running, _child() as killed:
        _local_boot(running.pid, now)
        _local_boot(killed.pid, now)
        # Each held a lease for a minute more, as the cluster-dispatch kick takes it inside serve.
        for name, pid in (("cluster-dispatch", killed.pid), ("assignment", running.pid)):
            assert pass_lease_acquire(name=name, holder=f"{host}:{pid}:abcd1234", lease_secs=60, now=now)
        killed.kill()
        killed.wait()
        report = recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())
    assert report.pass_leases_released == 1
    assert PassState.objects.get(name="cluster-dispatch").lease_holder == ""
    assert PassState.objects.get(name="assignment").lease_holder == f"{host}:{running.pid}:abcd1234"
    # Free, so the next runner takes it at once.
    assert pass_lease_acquire(name="cluster-dispatch", holder="next", lease_secs=60, now=timezone.now())


def test_a_waiting_pass_right_after_recovery_closed_an_evaluations_assignment_finds_it_requeued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The passes run on while a server recovers. Recovery requeues the evaluation in the transaction
    that closes its assignment, so a waiting pass never sees it Fetching on no worker (and parks it
    instead of it being requeued with its phase event)."""
    from gradient.scheduling.models import Evaluation
    from gradient.scheduling.services import lifecycle
    from gradient.scheduling.services.waiting import refresh_waiting_state

    project = ProjectFactory()
    dead = _boot(alive=False)
    evaluation = EvaluationFactory(project=project)
    worker = connected_worker([project])
    _on(worker, dead)
    assert ask(worker.id, "flake") is not None
    real_forget_sent = lifecycle.forget_sent

    def forget_sent_then_a_waiting_pass(job_key: str) -> None:
        real_forget_sent(job_key)
        refresh_waiting_state(now=timezone.now(), grace_secs=300, use_memo=False)

    monkeypatch.setattr(lifecycle, "forget_sent", forget_sent_then_a_waiting_pass)

    report = recover_interrupted_work(boot_id=uuid.uuid4(), now=timezone.now())

    assert report.evaluations_requeued == 1
    evaluation.refresh_from_db()
    # Queued by recovery, then parked by the pass: no worker is connected any more.
    assert evaluation.status == EvaluationStatus.WAITING
    assert evaluation.waiting_reason is not None and evaluation.waiting_reason["reason"] == "eval_workers"
    assert Evaluation.objects.filter(id=evaluation.id, lost_dispatches=0).exists()
    problems, _ = record_check_one(job_key=evaluation.job_key, now=timezone.now(), settle=False)
    assert problems == ()
