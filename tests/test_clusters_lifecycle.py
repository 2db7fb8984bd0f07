"""Creating a cluster of existing jobs (with its record), and aborting it: a control intent on the
cluster's record that the control hook carries out on the rows."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from gradient.clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterStatus,
)
from gradient.clusters.services.lifecycle import (
    ClusterInputError,
    MemberSpec,
    cluster_abort,
    cluster_create,
    cluster_request_abort,
)
from gradient.records.models import JobRecord
from gradient.records.schemas import Outcome
from gradient.records.selectors import record_job, record_read
from gradient.scheduling.models import (
    BuildAttempt,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    EvaluationBuild,
    EvaluationStatus,
)
from tests.clusters_helpers import (
    claim,
    cluster_only_build,
    make_cluster,
    queued_build,
    queued_evaluation,
    seat_worker,
    started,
)
from tests.factories import (
    DerivationBuildFactory,
    EvaluationFactory,
    ProjectFactory,
    WorkerFactory,
    connected_worker,
)
from tests.scheduling_helpers import ask

pytestmark = pytest.mark.django_db


def test_a_cluster_is_created_queued_with_members_indexed_per_role_and_its_record() -> None:
    project = ProjectFactory()
    a, b = queued_build(project), queued_build(project)
    evaluation = queued_evaluation(project)
    pinned = WorkerFactory()
    now = timezone.now()
    cluster = cluster_create(
        members=[
            MemberSpec(role="server", build_id=a.id, primary=True),
            MemberSpec(role="client", evaluation_id=evaluation.id, pin=pinned.name),
            MemberSpec(role="server", build_id=b.id),
        ],
        same_zone=True,
        retry_budget=3,
        now=now,
    )
    assert (cluster.status, cluster.same_zone, cluster.retry_budget, cluster.queued_at) == (
        ClusterStatus.QUEUED,
        True,
        3,
        now,
    )
    members = list(
        ClusterMember.objects.filter(cluster_job=cluster).values_list("role", "index", "primary", "pin")
    )
    assert sorted(members) == [
        ("client", 0, False, pinned.name),
        ("server", 0, True, None),
        ("server", 1, False, None),
    ]
    job = record_job(job_key=cluster.job_key, now=now)
    assert job.status.value == "Queued" and job.plan.retry_budget == 3
    _, view = record_read(job_key=cluster.job_key)
    assert [(m["role"], m["build"], m["evaluation"]) for m in view.header.spec["members"]] == [
        ("server", str(a.id), None),
        ("client", None, str(evaluation.id)),
        ("server", str(b.id), None),
    ]


def _refused(members: list[MemberSpec], **options: object) -> ClusterInputError:
    before = (ClusterJob.objects.count(), ClusterMember.objects.count(), JobRecord.objects.count())
    with pytest.raises(ClusterInputError) as refused:
        cluster_create(members=members, now=timezone.now(), **options)  # type: ignore[arg-type]
    assert (ClusterJob.objects.count(), ClusterMember.objects.count(), JobRecord.objects.count()) == before
    return refused.value


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no members", "at least one member"),
        ("both jobs", "exactly one job"),
        ("no job", "exactly one job"),
        ("unknown evaluation", "Unknown evaluation"),
        ("unknown build", "Unknown build"),
        ("named twice", "more than one member"),
        ("already in a cluster", "already a member of a cluster"),
        ("evaluation ended", "already ended"),
        ("evaluation evaluated", "cannot start again"),
        ("build ended", "already ended"),
        ("unknown pin", "Unknown worker"),
        ("empty role", "role"),
    ],
)
def test_bad_members_are_refused_with_a_clear_error_and_nothing_is_written(case: str, message: str) -> None:
    project = ProjectFactory()
    build = queued_build(project)
    evaluation = queued_evaluation(project)
    members = {
        "no members": [],
        "both jobs": [MemberSpec(role="r", evaluation_id=evaluation.id, build_id=build.id)],
        "no job": [MemberSpec(role="r")],
        "unknown evaluation": [MemberSpec(role="r", evaluation_id=uuid.uuid4())],
        "unknown build": [MemberSpec(role="r", build_id=uuid.uuid4())],
        "named twice": [MemberSpec(role="r", build_id=build.id), MemberSpec(role="s", build_id=build.id)],
        "already in a cluster": [MemberSpec(role="r", build_id=build.id)],
        "evaluation ended": [
            MemberSpec(
                role="r",
                evaluation_id=EvaluationFactory(
                    status=EvaluationStatus.ABORTED, finished_at=timezone.now()
                ).id,
            )
        ],
        "evaluation evaluated": [
            MemberSpec(role="r", evaluation_id=EvaluationFactory(status=EvaluationStatus.BUILDING).id)
        ],
        "build ended": [
            MemberSpec(role="r", build_id=DerivationBuildFactory(status=BuildStatus.COMPLETED).id)
        ],
        "unknown pin": [MemberSpec(role="r", build_id=build.id, pin="nobody")],
        "empty role": [MemberSpec(role="", build_id=build.id)],
    }[case]
    if case == "already in a cluster":
        make_cluster([("first", build)])
    error = _refused(members)
    assert message in str(error)


def test_an_evaluation_parked_before_its_evaluation_job_can_be_a_member_and_one_parked_building_cannot() -> (
    None
):
    waiting_for_eval = EvaluationFactory(
        status=EvaluationStatus.WAITING,
        waiting_reason={"reason": "eval_workers", "capability": "fetch", "connected_workers": 0},
    )
    cluster = cluster_create(
        members=[MemberSpec(role="peer", evaluation_id=waiting_for_eval.id)], now=timezone.now()
    )
    assert ClusterMember.objects.get(cluster_job=cluster).evaluation_id == waiting_for_eval.id
    waiting_for_workers = EvaluationFactory(
        status=EvaluationStatus.WAITING,
        waiting_reason={
            "reason": "workers",
            "unmet": [],
            "connected_workers": 0,
            "available_architectures": [],
        },
    )
    error = _refused([MemberSpec(role="peer", evaluation_id=waiting_for_workers.id)])
    assert "cannot start again" in str(error)


def test_a_negative_retry_budget_is_refused() -> None:
    error = _refused([MemberSpec(role="r", build_id=queued_build(ProjectFactory()).id)], retry_budget=-1)
    assert "retry_budget" in error.errors


# --- Abort ----------------------------------------------------------------------------------------------


def test_abort_is_a_control_intent_whose_hook_aborts_a_queued_cluster_and_its_member_jobs(  # type: ignore[no-untyped-def]
    django_capture_on_commit_callbacks,
) -> None:
    project = ProjectFactory()
    build, evaluation = cluster_only_build(), queued_evaluation(project)
    cluster = make_cluster([("a", build), ("b", evaluation)])
    with django_capture_on_commit_callbacks(execute=True):
        receipt = cluster_request_abort(cluster_id=cluster.id, actor="ops", now=timezone.now())
    assert receipt is not None and receipt.applied
    cluster.refresh_from_db(), build.refresh_from_db(), evaluation.refresh_from_db()
    assert (cluster.status, build.status, evaluation.status) == (
        ClusterStatus.ABORTED,
        BuildStatus.ABORTED,
        EvaluationStatus.ABORTED,
    )
    job = record_job(job_key=cluster.job_key, now=timezone.now())
    assert job.outcome is Outcome.CANCELLED and job.status.value == "Aborted"
    assert [c.intent for c in job.controls] == ["cancel"]


def test_aborting_a_started_attempt_aborts_the_running_members_and_closes_it_aborted(  # type: ignore[no-untyped-def]
    sent, django_capture_on_commit_callbacks
) -> None:
    project = ProjectFactory()
    a, b = cluster_only_build(), cluster_only_build()
    cluster = make_cluster([("a", a), ("b", b)])
    wa, wb = seat_worker(project), seat_worker(project)
    claimed = started(cluster, [wa, wb])
    with django_capture_on_commit_callbacks(execute=True):
        cluster_request_abort(cluster_id=cluster.id, actor="ops", now=timezone.now())
    assert sorted((w, m["type"]) for w, m in sent) == sorted(
        [(str(wa.id), "AbortJob"), (str(wb.id), "AbortJob")]
    )
    attempt = ClusterAttempt.objects.get(id=claimed.attempt_id)
    assert (attempt.outcome, attempt.verdict) == (AttemptOutcome.ABORTED, "Abort")
    assert set(DerivationBuild.objects.filter(id__in=[a.id, b.id]).values_list("status", flat=True)) == {
        BuildStatus.ABORTED
    }
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.ABORTED
    assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()


def test_aborting_a_preparing_attempt_sends_abort_cluster_and_closes_it_aborted(  # type: ignore[no-untyped-def]
    sent, django_capture_on_commit_callbacks
) -> None:
    project = ProjectFactory()
    build = cluster_only_build()
    cluster = make_cluster([("a", build)])
    worker = seat_worker(project)
    claimed = claim(cluster, [worker])
    with django_capture_on_commit_callbacks(execute=True):
        cluster_request_abort(cluster_id=cluster.id, actor="ops", now=timezone.now())
    assert [(w, m["type"]) for w, m in sent] == [(str(worker.id), "AbortCluster")]
    assert ClusterAttempt.objects.get(id=claimed.attempt_id).outcome == AttemptOutcome.ABORTED
    assert DerivationBuild.objects.get(id=build.id).status == BuildStatus.ABORTED


def test_aborting_a_cluster_that_already_ended_changes_nothing() -> None:
    project = ProjectFactory()
    cluster = make_cluster([("a", queued_build(project))])
    assert cluster_abort(cluster_id=cluster.id, reason="first", now=timezone.now()) is not None
    revision = record_job(job_key=cluster.job_key, now=timezone.now()).revision
    assert cluster_abort(cluster_id=cluster.id, reason="second", now=timezone.now()) is None
    assert record_job(job_key=cluster.job_key, now=timezone.now()).revision == revision


def test_aborting_a_cluster_spares_a_build_that_evaluations_outside_it_need_which_then_runs_as_a_single_job(  # type: ignore[no-untyped-def]
    sent, django_capture_on_commit_callbacks
) -> None:
    """As an evaluation's cancel spares a shared build another evaluation needs: the build goes back to the
    queue (its running try closes Aborted, unspent) and is handed out on its own, its cluster ended; a
    build nothing else needs ends Aborted. No evaluation is left waiting on an aborted build."""
    project = ProjectFactory()
    shared, lone = queued_build(project), cluster_only_build()
    outside = EvaluationBuild.objects.get(build=shared).evaluation
    cluster = make_cluster([("a", shared), ("b", lone)])
    wa, wb = seat_worker(project), seat_worker(project)
    started(cluster, [wa, wb])
    with django_capture_on_commit_callbacks(execute=True):
        cluster_request_abort(cluster_id=cluster.id, actor="ops", now=timezone.now())
    assert sorted(m["type"] for _, m in sent) == ["AbortJob", "AbortJob"]
    shared.refresh_from_db(), lone.refresh_from_db(), outside.refresh_from_db()
    assert (shared.status, lone.status) == (BuildStatus.QUEUED, BuildStatus.ABORTED)
    assert shared.attempts == 0 and outside.status == EvaluationStatus.BUILDING
    assert set(BuildAttempt.objects.filter(build=shared).values_list("outcome", flat=True)) == {"Aborted"}
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.ABORTED
    worker = connected_worker([project])
    assignment = ask(worker.id)
    assert assignment is not None and assignment.job_key == f"build:{shared.id}"
    assert DispatchedJob.objects.get(id=assignment.assignment_id).cluster_attempt_id is None


def test_aborting_a_queued_cluster_leaves_a_build_others_need_queued() -> None:
    project = ProjectFactory()
    shared = queued_build(project)
    cluster = make_cluster([("a", shared)])
    cluster_abort(cluster_id=cluster.id, reason="aborted by ops", now=timezone.now())
    assert DerivationBuild.objects.get(id=shared.id).status == BuildStatus.QUEUED
    assert ClusterJob.objects.get(id=cluster.id).status == ClusterStatus.ABORTED
