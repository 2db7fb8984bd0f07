"""The cluster-dispatch pass (cluster-jobs.md, Placement and Aging Reservations): expire overdue prepares
first, place every cluster able to start, claim each placement, reserve for aged clusters, record why a
cluster waits. One test per clause, on PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.clusters.decisions.types import WaitingCode, WaitingReason
from gradient.clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterReservation,
    ClusterSeat,
    ClusterStatus,
)
from gradient.clusters.selectors import worker_reserved_for
from gradient.clusters.services.dispatch import (
    cluster_dispatch_kick,
    cluster_dispatch_pass,
    write_waiting_reasons,
)
from gradient.clusters.services.lifecycle import cluster_abort
from gradient.recovery.models import PassState
from gradient.scheduling.models import BuildStatus, CandidateScore, DerivationBuild, DispatchedJob
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from tests.clusters_helpers import claim, idle, make_cluster, queued_build, seat_worker
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def project():  # type: ignore[no-untyped-def]
    return ProjectFactory()


def _seats(cluster: ClusterJob) -> dict[str, str]:
    attempt = ClusterAttempt.objects.get(cluster_job=cluster, finished_at__isnull=True)
    return {f"{s.role}[{s.index}]": s.worker.name for s in ClusterSeat.objects.filter(attempt=attempt)}


def _score(worker: Worker, build: DerivationBuild, missing: int) -> None:
    CandidateScore.objects.create(
        worker=worker,
        job_id=build.job_key,
        missing_count=1,
        missing_nar_size=missing,
        updated_at=timezone.now(),
    )


def test_a_cluster_with_a_full_placement_is_claimed_and_every_seat_gets_assign_job(  # type: ignore[no-untyped-def]
    project, sent, django_capture_on_commit_callbacks
) -> None:
    builds = [queued_build(project), queued_build(project)]
    cluster = make_cluster([("node", b) for b in builds])
    workers = [seat_worker(project), seat_worker(project)]
    with django_capture_on_commit_callbacks(execute=True):
        result = cluster_dispatch_pass(now=timezone.now())
    assert (result.placed, result.claims_lost) == (1, 0)
    assert sorted(_seats(cluster).values()) == sorted(w.name for w in workers)
    assert sorted((w, m["type"], m["cluster"]["role"]) for w, m in sent) == sorted(
        (str(w.id), "AssignJob", "node") for w in workers
    )
    assert ClusterJob.objects.get(id=cluster.id).waiting_reason is None


def test_the_pass_expires_overdue_prepares_before_it_places_anything(project) -> None:  # type: ignore[no-untyped-def]
    build = queued_build(project)
    cluster = make_cluster([("node", build)])
    worker = seat_worker(project)
    long_ago = timezone.now() - timedelta(minutes=5)
    claimed = claim(cluster, [worker], now=long_ago)
    idle(worker)
    result = cluster_dispatch_pass(now=timezone.now())
    assert result.expired == 1
    assert ClusterAttempt.objects.get(id=claimed.attempt_id).outcome == AttemptOutcome.PREPARE_FAILED
    assert result.placed == 0  # the cluster now backs off
    assert ClusterJob.objects.get(id=cluster.id).waiting_reason["code"] == "backoff"


def test_a_cluster_without_a_full_placement_waits_and_its_reason_is_written_only_when_it_changes(
    project,
) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster([("node", queued_build(project)), ("node", queued_build(project))])
    seat_worker(project)
    result = cluster_dispatch_pass(now=timezone.now())
    assert (result.placed, result.waiting, result.reasons_written) == (0, 1, 1)
    cluster.refresh_from_db()
    assert cluster.waiting_reason == {"code": "too_few_workers", "seatable_workers": 1, "needed": 2}
    since, updated = cluster.waiting_since, cluster.updated_at
    assert cluster_dispatch_pass(now=timezone.now()).reasons_written == 0
    cluster.refresh_from_db()
    assert (cluster.waiting_since, cluster.updated_at) == (since, updated)


def test_a_member_without_a_capable_or_authorized_idle_worker_has_no_seat(project) -> None:  # type: ignore[no-untyped-def]
    arm = queued_build(project, system="aarch64-linux")
    cluster = make_cluster([("node", arm)])
    seat_worker(ProjectFactory())  # idle and capable, but not authorized for the project
    cluster_dispatch_pass(now=timezone.now())
    cluster.refresh_from_db()
    assert cluster.waiting_reason == {
        "code": "no_seat",
        "members": [{"role": "node", "index": 0, "reason": "no_capable_worker"}],
    }
    seat_worker(ProjectFactory(), architectures=["aarch64-linux"])
    cluster_dispatch_pass(now=timezone.now())
    cluster.refresh_from_db()
    assert cluster.waiting_reason["members"][0]["reason"] == "no_project_access"


def test_draining_workers_and_idle_slots_older_than_25_seconds_are_no_capacity(project) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster([("node", queued_build(project))])
    stale = seat_worker(project)
    idle(stale, at=timezone.now() - timedelta(seconds=26))
    draining = seat_worker(project)
    WorkerSession.objects.filter(worker=draining).update(draining=True)
    assert cluster_dispatch_pass(now=timezone.now()).placed == 0
    cluster.refresh_from_db()
    assert cluster.waiting_reason["members"][0]["reason"] == "no_idle_slot"


def test_a_pinned_member_sits_on_the_worker_it_names(project) -> None:  # type: ignore[no-untyped-def]
    from gradient.clusters.services.lifecycle import MemberSpec, cluster_create

    a, b = seat_worker(project), seat_worker(project)
    build = queued_build(project)
    _score(a, build, 0)  # a would be cheaper, but the pin says b
    cluster = cluster_create(
        members=[MemberSpec(role="node", build_id=build.id, pin=b.name)], now=timezone.now()
    )
    cluster_dispatch_pass(now=timezone.now())
    assert _seats(cluster) == {"node[0]": b.name}


def test_same_zone_seats_every_member_in_the_zone_with_the_lowest_missing_nar_size(project) -> None:  # type: ignore[no-untyped-def]
    builds = [queued_build(project), queued_build(project)]
    cluster = make_cluster([("node", b) for b in builds], same_zone=True)
    a1, a2 = seat_worker(project, zone="a"), seat_worker(project, zone="a")
    b1, b2 = seat_worker(project, zone="b"), seat_worker(project, zone="b")
    for worker, missing in ((a1, 900), (a2, 900), (b1, 100), (b2, 100)):
        for build in builds:
            _score(worker, build, missing)
    cluster_dispatch_pass(now=timezone.now())
    assert sorted(_seats(cluster).values()) == sorted([b1.name, b2.name])


def test_a_worker_seated_for_one_cluster_is_not_offered_to_the_next_and_priority_goes_first(project) -> None:  # type: ignore[no-untyped-def]
    older = make_cluster([("node", queued_build(project))])
    prioritized = make_cluster([("node", queued_build(project))], priority=True)
    worker = seat_worker(project)
    result = cluster_dispatch_pass(now=timezone.now())
    assert (result.placed, result.waiting) == (1, 1)
    assert _seats(prioritized) == {"node[0]": worker.name}
    older.refresh_from_db()
    assert older.waiting_reason["code"] == "no_seat"


def test_a_member_that_can_no_longer_start_holds_its_cluster_back(project) -> None:  # type: ignore[no-untyped-def]
    blocked = queued_build(project)
    cluster = make_cluster([("a", queued_build(project)), ("b", blocked)])
    DerivationBuild.objects.filter(id=blocked.id).update(status=BuildStatus.CREATED)
    seat_worker(project), seat_worker(project)
    assert cluster_dispatch_pass(now=timezone.now()).placed == 0
    cluster.refresh_from_db()
    assert cluster.waiting_reason == {"code": "member_cannot_start", "blocked": [{"role": "b", "index": 0}]}


def test_a_cluster_backing_off_waits_until_its_retry_at(project) -> None:  # type: ignore[no-untyped-def]
    now = timezone.now()
    cluster = make_cluster([("node", queued_build(project))])
    ClusterJob.objects.filter(id=cluster.id).update(retry_at=now + timedelta(seconds=30), prepare_failures=1)
    seat_worker(project)
    assert cluster_dispatch_pass(now=now).placed == 0
    assert ClusterJob.objects.get(id=cluster.id).waiting_reason["code"] == "backoff"
    assert cluster_dispatch_pass(now=now + timedelta(seconds=10)).placed == 0
    IdleSlot.objects.update(recorded_at=now + timedelta(seconds=31))
    assert cluster_dispatch_pass(now=now + timedelta(seconds=31)).placed == 1


def test_a_member_open_as_a_single_job_holds_its_cluster_back_and_nothing_is_written(project) -> None:  # type: ignore[no-untyped-def]
    from gradient.scheduling.services.claims import ClaimRequest, claim_assignment

    build = queued_build(project)
    cluster = make_cluster([("node", build)])
    seat_worker(project)
    other = seat_worker(project)
    claim_assignment(
        request=ClaimRequest(kind="build", job_key=build.job_key, worker_id=other.id, build_id=build.id),
        now=timezone.now(),
    )
    result = cluster_dispatch_pass(now=timezone.now())
    assert (result.placed, ClusterAttempt.objects.count(), DispatchedJob.objects.count()) == (0, 0, 1)
    assert ClusterJob.objects.get(id=cluster.id).waiting_reason["code"] == "member_cannot_start"


# --- Aging reservations ---------------------------------------------------------------------------------


def _aged(project, members: int = 2, ago: float = 601) -> ClusterJob:  # type: ignore[no-untyped-def]
    cluster = make_cluster([("node", queued_build(project)) for _ in range(members)])
    ClusterJob.objects.filter(id=cluster.id).update(queued_at=timezone.now() - timedelta(seconds=ago))
    return cluster


def test_an_aged_cluster_reserves_a_placement_over_busy_workers_and_blocks_their_kind(project) -> None:  # type: ignore[no-untyped-def]
    cluster = _aged(project)
    a = seat_worker(project, idle_for=())
    b = seat_worker(project, idle_for=())
    result = cluster_dispatch_pass(now=timezone.now())
    assert result.reserved == 1
    reservation = ClusterReservation.objects.get()
    assert reservation.cluster_job_id == cluster.id
    assert sorted(s["worker_id"] for s in reservation.seats) == sorted([str(a.id), str(b.id)])
    assert worker_reserved_for(a.id, "build") and not worker_reserved_for(a.id, "flake")
    cluster_dispatch_pass(now=timezone.now())
    cluster.refresh_from_db()
    assert cluster.waiting_reason["code"] == "reserved"


def test_a_cluster_that_has_not_aged_does_not_reserve(project) -> None:  # type: ignore[no-untyped-def]
    _aged(project, ago=100)
    seat_worker(project, idle_for=()), seat_worker(project, idle_for=())
    assert cluster_dispatch_pass(now=timezone.now()).reserved == 0


def test_a_reservation_commits_like_a_placement_once_every_seat_is_idle(project) -> None:  # type: ignore[no-untyped-def]
    cluster = _aged(project)
    a, b = seat_worker(project, idle_for=()), seat_worker(project, idle_for=())
    cluster_dispatch_pass(now=timezone.now())
    idle(a)
    assert cluster_dispatch_pass(now=timezone.now()).committed == 0  # one seat is still busy
    idle(b)
    result = cluster_dispatch_pass(now=timezone.now())
    assert result.committed == 1
    assert not ClusterReservation.objects.exists()
    assert sorted(_seats(cluster).values()) == sorted([a.name, b.name])


def test_only_one_cluster_holds_a_reservation_and_others_plan_over_unreserved_workers(project) -> None:  # type: ignore[no-untyped-def]
    first = _aged(project, members=1, ago=900)
    second = _aged(project, members=1, ago=700)
    reserved = seat_worker(project, idle_for=())
    cluster_dispatch_pass(now=timezone.now())
    assert list(ClusterReservation.objects.values_list("cluster_job_id", flat=True)) == [first.id]
    idle(reserved, "eval")  # idle for another kind only: the reserved build seat stays hidden
    other = seat_worker(project)
    cluster_dispatch_pass(now=timezone.now())
    assert _seats(second) == {"node[0]": other.name}
    assert ClusterReservation.objects.count() == 1


def test_a_reservation_is_released_after_its_timeout(project) -> None:  # type: ignore[no-untyped-def]
    _aged(project)
    seat_worker(project, idle_for=()), seat_worker(project, idle_for=())
    now = timezone.now()
    cluster_dispatch_pass(now=now)
    result = cluster_dispatch_pass(now=now + timedelta(seconds=1801))
    assert result.release_reasons[:1] == ["timeout"]


def test_a_reservation_is_released_when_a_seat_disconnects(project) -> None:  # type: ignore[no-untyped-def]
    _aged(project)
    a = seat_worker(project, idle_for=())
    seat_worker(project, idle_for=())
    cluster_dispatch_pass(now=timezone.now())
    WorkerSession.objects.filter(worker=a).update(closed_at=timezone.now())
    assert cluster_dispatch_pass(now=timezone.now()).release_reasons == ["seat_disconnected"]
    assert not ClusterReservation.objects.exists()


def test_a_reservation_is_released_when_the_cluster_leaves_the_queue(project) -> None:  # type: ignore[no-untyped-def]
    cluster = _aged(project)
    seat_worker(project, idle_for=()), seat_worker(project, idle_for=())
    cluster_dispatch_pass(now=timezone.now())
    ClusterJob.objects.filter(id=cluster.id).update(status="Running")
    assert cluster_dispatch_pass(now=timezone.now()).release_reasons == ["left_queue"]
    cluster_abort(cluster_id=cluster.id, reason="gone", now=timezone.now())
    assert not ClusterReservation.objects.exists()


def test_the_kick_runs_the_pass_at_once_unless_another_runner_holds_its_lease(project) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster([("node", queued_build(project))])
    seat_worker(project)
    PassState.objects.create(
        name="cluster-dispatch",
        lease_holder="elsewhere",
        lease_expires_at=timezone.now() + timedelta(minutes=1),
    )
    assert cluster_dispatch_kick(timezone.now()) is None
    PassState.objects.filter(name="cluster-dispatch").update(lease_holder="", lease_expires_at=None)
    result = cluster_dispatch_kick(timezone.now())
    assert result is not None and result["placed"] == 1
    assert ClusterAttempt.objects.filter(cluster_job=cluster).exists()


def test_the_waiting_reasons_of_a_pass_are_written_where_they_changed_keeping_when_waiting_began(
    project,
) -> None:  # type: ignore[no-untyped-def]
    waiting, changed, running = (make_cluster([("node", queued_build(project))]) for _ in range(3))
    earlier = timezone.now() - timedelta(minutes=5)
    same = WaitingReason(WaitingCode.TOO_FEW_WORKERS, seatable_workers=0, needed=1)
    ClusterJob.objects.filter(id__in=[changed.id, running.id]).update(
        waiting_reason=same.as_json(), waiting_since=earlier
    )
    ClusterJob.objects.filter(id=running.id).update(status=ClusterStatus.RUNNING)
    now = timezone.now()
    other = WaitingReason(WaitingCode.TOO_FEW_WORKERS, seatable_workers=1, needed=2)
    written = write_waiting_reasons(
        reasons={str(waiting.id): same, str(changed.id): other, str(running.id): other}, now=now
    )
    assert written == 2
    rows = {c.id: c for c in ClusterJob.objects.all()}
    assert (rows[waiting.id].waiting_reason, rows[waiting.id].waiting_since) == (same.as_json(), now)
    assert (rows[changed.id].waiting_reason, rows[changed.id].waiting_since) == (other.as_json(), earlier)
    assert rows[running.id].waiting_reason == same.as_json()  # not Queued: left as it was
    assert write_waiting_reasons(reasons={str(changed.id): other}, now=timezone.now()) == 0
