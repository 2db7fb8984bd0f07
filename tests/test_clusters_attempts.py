"""claim_cluster, start_cluster_attempt and close_cluster_attempt (cluster-jobs.md, Claim, Close, Prepare
and Start), one test per clause, on PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from gradient.clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterSeat,
    ClusterStatus,
)
from gradient.clusters.services.attempts import (
    claim_cluster,
    claim_clusters,
    close_cluster_attempt,
    expire_overdue_prepares,
    start_cluster_attempt,
)
from gradient.records.selectors import record_job
from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    Evaluation,
    EvaluationStatus,
    JobKind,
)
from gradient.scheduling.services.claims import ClaimRequest, claim_assignment
from gradient.workers.models import IdleSlot, WorkerSession
from tests.clusters_helpers import (
    as_json,
    claim,
    idle,
    make_cluster,
    placement_of,
    queued_build,
    queued_evaluation,
    seat_worker,
    types,
)
from tests.factories import ProjectFactory, connected_worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def two():  # type: ignore[no-untyped-def]
    """A cluster of a build (primary) and an evaluation, and two idle workers able to seat them."""
    project = ProjectFactory()
    build = queued_build(project)
    evaluation = queued_evaluation(project)
    cluster = make_cluster([("primary", build), ("server", evaluation)])
    a = seat_worker(project, idle_for=("build",))
    b = seat_worker(project, idle_for=("eval",))
    return cluster, build, evaluation, a, b


def _written() -> tuple[int, int, int, int]:
    return (
        ClusterAttempt.objects.count(),
        DispatchedJob.objects.count(),
        ClusterSeat.objects.count(),
        BuildAttempt.objects.count(),
    )


def test_a_won_claim_writes_the_attempt_and_every_member_row_with_its_seat(two) -> None:  # type: ignore[no-untyped-def]
    cluster, build, evaluation, a, b = two
    claimed = claim(cluster, [a, b])
    attempt = ClusterAttempt.objects.get(id=claimed.attempt_id)
    assert (attempt.number, attempt.finished_at, attempt.started_at) == (1, None, None)
    rows = DispatchedJob.objects.filter(cluster_attempt=attempt)
    assert {(r.job_id, r.worker_id, r.finished_at) for r in rows} == {
        (build.job_key, a.id, None),
        (evaluation.job_key, b.id, None),
    }
    assert set(claimed.assignments.values()) == {r.id for r in rows}
    assert sorted(ClusterSeat.objects.filter(attempt=attempt).values_list("role", "worker_id")) == sorted(
        [("primary", a.id), ("server", b.id)]
    )
    assert sorted((s["role"], s["worker_id"]) for s in attempt.seats) == [
        ("primary", str(a.id)),
        ("server", str(b.id)),
    ]
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.QUEUED  # Running only once started


def test_a_won_claim_pushes_assign_job_with_the_cluster_membership_to_every_seat(two) -> None:  # type: ignore[no-untyped-def]
    cluster, build, evaluation, a, b = two
    claimed = claim(cluster, [a, b])
    assert types(claimed.pushes) == ["AssignJob", "AssignJob"]
    hold = settings.GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS + 10
    by_worker = {w: m for w, m in as_json(claimed.pushes)}
    build_msg, eval_msg = by_worker[str(a.id)], by_worker[str(b.id)]
    assert build_msg["job_id"] == build.job_key and build_msg["job"]["kind"] == "build"
    assert build_msg["assignment_id"] == str(claimed.assignments[build.job_key])
    assert build_msg["cluster"] == {
        "attempt": str(claimed.attempt_id),
        "role": "primary",
        "index": 0,
        "hold_secs": hold,
    }
    assert eval_msg["cluster"] == {
        "attempt": str(claimed.attempt_id),
        "role": "server",
        "index": 0,
        "hold_secs": hold,
    }


def test_a_build_member_goes_building_with_a_build_attempt(two) -> None:  # type: ignore[no-untyped-def]
    cluster, build, _, a, b = two
    claimed = claim(cluster, [a, b])
    build.refresh_from_db()
    assert (build.status, build.attempts) == (BuildStatus.BUILDING, 1)
    attempt = BuildAttempt.objects.get(build=build)
    assert (attempt.dispatched_job_id, attempt.worker_id, attempt.number) == (
        claimed.assignments[build.job_key],
        a.id,
        1,
    )


def test_an_evaluation_member_transitions_with_its_record_facts_naming_the_attempt(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, evaluation, a, b = two
    claimed = claim(cluster, [a, b])
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.FETCHING
    job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert job.status.value == "Fetching"
    assert job.current is not None and job.current.cluster_attempt_id == claimed.attempt_id


def test_member_evaluations_are_never_split_even_with_an_idle_eval_only_worker(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, evaluation, a, b = two
    connected_worker(can_fetch=False, can_eval=True, can_build=False)  # would make single assignment split
    claimed = claim(cluster, [a, b])
    row = DispatchedJob.objects.get(id=claimed.assignments[evaluation.job_key])
    assert row.job["steps"] == ["FetchFlake", "EvaluateFlake", "EvaluateDerivations"]


def test_the_cluster_record_names_the_attempt_with_its_seats_and_the_hold_deadline(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    now = timezone.now()
    claimed = claim(cluster, [a, b], now=now)
    job = record_job(job_key=cluster.job_key, now=now)
    assert job.current is not None and job.current.object.id == claimed.attempt_id
    assert {(s.role, s.worker) for s in job.current.seats} == {("primary", a.name), ("server", b.name)}
    (deadline,) = job.deadlines
    assert deadline.call.value == "hold"
    assert deadline.deadline == now + timedelta(
        seconds=settings.GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS
    )


def test_a_claim_of_a_cluster_that_is_not_queued_writes_nothing(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    for status in (ClusterStatus.RUNNING, ClusterStatus.ABORTED):
        ClusterJob.objects.filter(id=cluster.id).update(status=status)
        assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
        assert _written() == (0, 0, 0, 0)


def test_a_claim_of_a_cluster_with_an_open_attempt_inserts_nothing(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    claim(cluster, [a, b])
    before = _written()
    idle(a, "build"), idle(b, "eval")
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    assert _written() == before


def test_a_member_open_as_a_single_job_loses_the_claim_and_the_whole_attempt_rolls_back(two) -> None:  # type: ignore[no-untyped-def]
    cluster, build, evaluation, a, b = two
    other = connected_worker()
    single = ClaimRequest(
        kind=JobKind.EVAL, job_key=evaluation.job_key, worker_id=other.id, evaluation_id=evaluation.id
    )
    assert claim_assignment(request=single, now=timezone.now()) is not None
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    assert ClusterAttempt.objects.count() == 0 and ClusterSeat.objects.count() == 0
    assert list(DispatchedJob.objects.values_list("job_id", "cluster_attempt_id")) == [
        (evaluation.job_key, None)
    ]
    build.refresh_from_db()
    assert (build.status, build.attempts) == (
        BuildStatus.QUEUED,
        0,
    )  # the build member's claim rolled back too
    assert IdleSlot.objects.filter(worker=a).exists()  # and so did its idle slot


def test_a_member_whose_start_condition_no_longer_holds_loses_the_claim(two) -> None:  # type: ignore[no-untyped-def]
    cluster, build, _, a, b = two
    DerivationBuild.objects.filter(id=build.id).update(status=BuildStatus.CREATED)
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    assert _written() == (0, 0, 0, 0)


def test_a_seat_whose_worker_went_busy_since_the_snapshot_is_refused(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, evaluation, a, b = two
    IdleSlot.objects.filter(worker=b).delete()  # an assignment (or a full worker) cleared its slot
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    assert _written() == (0, 0, 0, 0)
    assert Evaluation.objects.get(id=evaluation.id).status == EvaluationStatus.QUEUED


def test_a_seat_whose_idle_slot_is_stale_or_whose_worker_drains_is_refused(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    idle(b, "eval", at=timezone.now() - timedelta(seconds=26))
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    idle(b, "eval")
    WorkerSession.objects.filter(worker=a).update(draining=True)
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    assert _written() == (0, 0, 0, 0)


def test_a_fresh_build_slot_of_a_worker_whose_build_slots_are_all_taken_is_stale(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    project = cluster.members.first().derivation_build.evaluation_links.first().evaluation.project
    running = queued_build(project)
    DispatchedJob.objects.create(
        kind="build", job_id=running.job_key, derivation_build=running, worker=a, dispatched_at=timezone.now()
    )
    assert a.max_concurrent_builds == 1
    assert claim_cluster(placement=placement_of(cluster, [a, b]), now=timezone.now()) is None
    assert ClusterAttempt.objects.count() == 0
    assert DispatchedJob.objects.count() == 1, "only the worker's own running build"


def test_a_won_claim_takes_the_idle_slots_of_its_seats(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    claim(cluster, [a, b])
    assert not IdleSlot.objects.filter(worker__in=[a, b]).exists()


def test_a_placement_that_does_not_seat_every_member_on_its_own_worker_is_refused(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, _ = two
    placement = placement_of(cluster, [a, a])
    with pytest.raises(ValueError):
        claim_cluster(placement=placement, now=timezone.now())
    assert _written() == (0, 0, 0, 0)


def test_start_marks_the_attempt_started_and_the_cluster_running_once(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    claimed = claim(cluster, [a, b])
    ClusterJob.objects.filter(id=cluster.id).update(prepare_failures=3)
    assert start_cluster_attempt(attempt_id=claimed.attempt_id, now=timezone.now()) is True
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts, cluster.prepare_failures) == (ClusterStatus.RUNNING, 1, 0)
    assert ClusterAttempt.objects.get(id=claimed.attempt_id).started_at is not None
    assert start_cluster_attempt(attempt_id=claimed.attempt_id, now=timezone.now()) is False
    assert ClusterJob.objects.get(id=cluster.id).attempts == 1
    assert record_job(job_key=cluster.job_key, now=timezone.now()).status.value == "Running"


def test_close_closes_an_open_attempt_and_abandons_every_open_member_row(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, evaluation, a, b = two
    claimed = claim(cluster, [a, b])
    assert close_cluster_attempt(
        attempt_id=claimed.attempt_id,
        outcome=AttemptOutcome.PREPARE_FAILED,
        reason="test",
        now=timezone.now(),
    )
    attempt = ClusterAttempt.objects.get(id=claimed.attempt_id)
    assert attempt.outcome == AttemptOutcome.PREPARE_FAILED and attempt.finished_at is not None
    assert set(DispatchedJob.objects.filter(cluster_attempt=attempt).values_list("outcome", flat=True)) == {
        DispatchOutcome.ABANDONED
    }
    job = record_job(job_key=cluster.job_key, now=timezone.now())
    assert job.current is not None and job.current.close_outcome == "PrepareFailed"
    eval_job = record_job(job_key=evaluation.job_key, now=timezone.now())
    assert eval_job.current is not None and eval_job.current.close_outcome == "Abandoned"


def test_a_second_close_returns_false_and_touches_nothing(two) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    claimed = claim(cluster, [a, b])
    now = timezone.now()
    assert close_cluster_attempt(
        attempt_id=claimed.attempt_id, outcome=AttemptOutcome.FAILED, reason="first", now=now
    )
    before = list(ClusterAttempt.objects.values_list("finished_at", "outcome", "reason"))
    rows = list(DispatchedJob.objects.values_list("id", "finished_at", "outcome", "reason"))
    revision = record_job(job_key=cluster.job_key, now=now).revision
    later = now + timedelta(seconds=5)
    assert not close_cluster_attempt(
        attempt_id=claimed.attempt_id, outcome=AttemptOutcome.PREPARE_FAILED, reason="second", now=later
    )
    assert list(ClusterAttempt.objects.values_list("finished_at", "outcome", "reason")) == before
    assert list(DispatchedJob.objects.values_list("id", "finished_at", "outcome", "reason")) == rows
    assert record_job(job_key=cluster.job_key, now=later).revision == revision


def test_an_overdue_prepare_closes_prepare_failed_with_abort_cluster_and_members_requeued(two) -> None:  # type: ignore[no-untyped-def]
    cluster, build, evaluation, a, b = two
    now = timezone.now()
    claimed = claim(cluster, [a, b], now=now)
    assert expire_overdue_prepares(now=now + timedelta(seconds=5)) == 0  # not yet
    later = now + timedelta(seconds=settings.GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS + 1)
    assert expire_overdue_prepares(now=later) == 1
    attempt = ClusterAttempt.objects.get(id=claimed.attempt_id)
    assert attempt.outcome == AttemptOutcome.PREPARE_FAILED and "timed out" in attempt.reason
    build.refresh_from_db(), evaluation.refresh_from_db()
    assert (build.status, build.attempts, evaluation.status) == (
        BuildStatus.QUEUED,
        0,
        EvaluationStatus.QUEUED,
    )
    cluster.refresh_from_db()
    assert (cluster.status, cluster.attempts, cluster.prepare_failures) == (ClusterStatus.QUEUED, 0, 1)
    assert cluster.retry_at is not None and cluster.retry_at >= later + timedelta(seconds=30)
    assert cluster.waiting_reason is not None and cluster.waiting_reason["code"] == "backoff"


def test_assign_job_leaves_only_once_the_claim_committed(
    two, sent, django_capture_on_commit_callbacks
) -> None:  # type: ignore[no-untyped-def]
    cluster, _, _, a, b = two
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        claimed = claim(cluster, [a, b])
    assert sent == []
    for callback in callbacks:
        callback()
    assert sorted(sent, key=lambda p: p[0]) == sorted(as_json(claimed.pushes), key=lambda p: p[0])
    assert {m["type"] for _, m in sent} == {"AssignJob"}


# --- A pass's claims as one set (claim_clusters) -----------------------------------------------------------


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    """Two clusters of a build and an evaluation each, and four idle workers seating them."""
    project = ProjectFactory()
    out = []
    for _ in range(2):
        build, evaluation = queued_build(project), queued_evaluation(project)
        cluster = make_cluster([("primary", build), ("server", evaluation)])
        workers = [seat_worker(project, idle_for=("build",)), seat_worker(project, idle_for=("eval",))]
        out.append((cluster, build, evaluation, workers))
    return out


def _claimed_rows(cluster) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    """What a cluster's claim wrote: its attempts, its members' assignment rows, its seats."""
    return (
        ClusterAttempt.objects.filter(cluster_job=cluster).count(),
        DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster).count(),
        ClusterSeat.objects.filter(attempt__cluster_job=cluster).count(),
    )


def test_a_set_whose_one_cluster_lost_a_build_member_claims_the_other_and_nothing_of_the_first(pair) -> None:  # type: ignore[no-untyped-def]
    (x, x_build, x_eval, x_workers), (y, y_build, y_eval, y_workers) = pair
    placements = [placement_of(x, x_workers), placement_of(y, y_workers)]
    # Between the plan and the claim, x's build is claimed as a single job by another worker.
    other = connected_worker()
    single = ClaimRequest(
        kind=JobKind.BUILD, job_key=x_build.job_key, worker_id=other.id, build_id=x_build.id
    )
    assert claim_assignment(request=single, now=timezone.now()) is not None
    claimed = claim_clusters(placements=placements, now=timezone.now())
    assert claimed[str(x.id)] is None and claimed[str(y.id)] is not None
    assert _claimed_rows(x) == (0, 0, 0)
    assert _claimed_rows(y) == (1, 2, 2)
    # Nothing of x: its evaluation member was not started, its seats kept their idle slots.
    assert Evaluation.objects.get(id=x_eval.id).status == EvaluationStatus.QUEUED
    assert DerivationBuild.objects.get(id=x_build.id).attempts == 0
    assert IdleSlot.objects.filter(worker__in=x_workers).count() == 2
    assert not IdleSlot.objects.filter(worker__in=y_workers).exists()
    assert Evaluation.objects.get(id=y_eval.id).status == EvaluationStatus.FETCHING
    assert DerivationBuild.objects.get(id=y_build.id).status == BuildStatus.BUILDING
    assert list(DispatchedJob.objects.filter(job_id=x_build.job_key).values_list("worker_id", flat=True)) == [
        other.id
    ]


def test_a_set_whose_one_evaluation_member_cannot_start_takes_back_its_claim_row(pair) -> None:  # type: ignore[no-untyped-def]
    (x, _, x_eval, x_workers), (y, _, _, y_workers) = pair
    # Not terminal (its claim row goes in) but no longer Queued (its start is refused).
    Evaluation.objects.filter(id=x_eval.id).update(status=EvaluationStatus.FETCHING)
    claimed = claim_clusters(
        placements=[placement_of(x, x_workers), placement_of(y, y_workers)], now=timezone.now()
    )
    assert claimed[str(x.id)] is None and claimed[str(y.id)] is not None
    assert _claimed_rows(x) == (0, 0, 0)
    assert not DispatchedJob.objects.filter(job_id=x_eval.job_key).exists()
    assert _claimed_rows(y) == (1, 2, 2)


def test_two_clusters_of_one_set_competing_for_a_seat_claim_as_one_after_the_other_would(pair) -> None:  # type: ignore[no-untyped-def]
    (x, _, _, x_workers), (y, y_build, _, y_workers) = pair
    # y's build member on x's build worker: whichever comes first takes the seat's one idle slot.
    contested = [x_workers[0], y_workers[1]]
    claimed = claim_clusters(
        placements=[placement_of(x, x_workers), placement_of(y, contested)], now=timezone.now()
    )
    assert claimed[str(x.id)] is not None and claimed[str(y.id)] is None
    assert _claimed_rows(y) == (0, 0, 0)
    assert DerivationBuild.objects.get(id=y_build.id).status == BuildStatus.QUEUED
    assert IdleSlot.objects.filter(worker=y_workers[1]).exists()  # y's other seat kept its slot
    assert list(DispatchedJob.objects.filter(worker=x_workers[0]).values_list("job_id", flat=True)) == [
        x.members.get(role="primary").job_key
    ]


def test_a_seat_contested_in_a_set_goes_to_the_later_cluster_when_the_earlier_lost(pair) -> None:  # type: ignore[no-untyped-def]
    (x, x_build, _, x_workers), (y, _, _, y_workers) = pair
    DerivationBuild.objects.filter(id=x_build.id).update(status=BuildStatus.CREATED)  # x cannot start
    contested = [x_workers[0], y_workers[1]]
    claimed = claim_clusters(
        placements=[placement_of(x, x_workers), placement_of(y, contested)], now=timezone.now()
    )
    assert claimed[str(x.id)] is None and claimed[str(y.id)] is not None
    assert _claimed_rows(x) == (0, 0, 0) and _claimed_rows(y) == (1, 2, 2)
    assert ClusterSeat.objects.get(attempt__cluster_job=y, role="primary").worker_id == x_workers[0].id


def test_a_set_writes_each_won_clusters_record_and_its_members_records(pair) -> None:  # type: ignore[no-untyped-def]
    (x, _, x_eval, x_workers), (y, _, y_eval, y_workers) = pair
    now = timezone.now()
    claimed = claim_clusters(placements=[placement_of(x, x_workers), placement_of(y, y_workers)], now=now)
    for cluster, evaluation in ((x, x_eval), (y, y_eval)):
        attempt = claimed[str(cluster.id)]
        assert attempt is not None
        job = record_job(job_key=cluster.job_key, now=now)
        assert job.current is not None and job.current.object.id == attempt.attempt_id
        member = record_job(job_key=evaluation.job_key, now=now)
        assert member.status.value == "Fetching"
        assert member.current is not None and member.current.cluster_attempt_id == attempt.attempt_id
