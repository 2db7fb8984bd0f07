"""Drive the clusters services the way the dispatch pass and a worker session do, for service tests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import msgspec
from django.utils import timezone

from gradient.clusters.decisions.types import Placement, Seat, SlotKind
from gradient.clusters.models import ClusterJob, ClusterMember
from gradient.clusters.services.attempts import ClaimedAttempt, claim_cluster
from gradient.clusters.services.common import Push
from gradient.clusters.services.lifecycle import MemberSpec, cluster_create
from gradient.clusters.services.members import cluster_member_answer, cluster_member_report
from gradient.core.protocol import tag_of
from gradient.scheduling.models import (
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
    Project,
)
from gradient.scheduling.services.lifecycle import ReportOutcome
from gradient.workers.models import IdleSlot, Worker
from tests.factories import DerivationBuildFactory, EvaluationFactory, connected_worker
from tests.scheduling_helpers import wire


def queued_build(project: Project, **fields: Any) -> DerivationBuild:
    """A Queued shared build that an active evaluation of `project` needs."""
    build = DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now(), **fields)
    needing = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    EvaluationBuild.objects.create(evaluation=needing, build=build)
    return build


def cluster_only_build() -> DerivationBuild:
    """A Queued shared build that no evaluation outside its cluster needs: a cluster's verdict or abort
    may end it Aborted (one that other evaluations need is spared and requeued instead)."""
    return DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now())


def queued_evaluation(project: Project) -> Evaluation:
    return EvaluationFactory(project=project, status=EvaluationStatus.QUEUED)


def seat_worker(
    project: Project, *, zone: str | None = None, idle_for: Sequence[str] = ("build",), **fields: Any
) -> Worker:
    """A connected worker of `project` that holds fresh idle slots of the given kinds."""
    worker = connected_worker([project], zone=zone, **fields)
    for kind in idle_for:
        idle(worker, kind)
    return worker


def idle(worker: Worker, kind: str = "build", at: datetime | None = None) -> None:
    IdleSlot.objects.update_or_create(
        worker=worker, kind=kind, defaults={"recorded_at": at or timezone.now()}
    )


def make_cluster(jobs: Sequence[tuple[str, Evaluation | DerivationBuild]], **options: Any) -> ClusterJob:
    """A cluster through the service (with its record); `jobs` are (role, job), primary=role 'primary'."""
    members = [
        MemberSpec(
            role=role,
            evaluation_id=job.id if isinstance(job, Evaluation) else None,
            build_id=job.id if isinstance(job, DerivationBuild) else None,
            primary=role == "primary",
        )
        for role, job in jobs
    ]
    return cluster_create(members=members, now=timezone.now(), **options)


def placement_of(cluster: ClusterJob, workers: Sequence[Worker]) -> Placement:
    """Seat the members, in (role, index) order, on `workers` in order."""
    members = list(ClusterMember.objects.filter(cluster_job=cluster).order_by("role", "index"))
    seats = tuple(
        Seat(
            role=m.role,
            index=m.index,
            job_key=m.job_key,
            kind=SlotKind.EVAL if m.evaluation_id else SlotKind.BUILD,
            worker_id=str(w.id),
            zone=w.zone,
            endpoint=w.endpoint,
        )
        for m, w in zip(members, workers, strict=True)
    )
    return Placement(cluster_id=str(cluster.id), seats=seats, cost=0)


def claim(cluster: ClusterJob, workers: Sequence[Worker], now: datetime | None = None) -> ClaimedAttempt:
    claimed = claim_cluster(placement=placement_of(cluster, workers), now=now or timezone.now())
    assert claimed is not None
    return claimed


def answer(
    worker: Worker, assignment_id: uuid.UUID, accepted: bool = True, reason: str | None = None
) -> list[Push]:
    return cluster_member_answer(
        worker_id=worker.id, assignment_id=assignment_id, accepted=accepted, reason=reason, now=timezone.now()
    )


def started(cluster: ClusterJob, workers: Sequence[Worker]) -> ClaimedAttempt:
    """Claim the cluster on `workers` and have every seat accept: the attempt starts."""
    claimed = claim(cluster, workers)
    by_worker = {str(w.id): w for w in workers}
    for job_key, assignment_id in claimed.assignments.items():
        worker = next(by_worker[p[0]] for p in claimed.pushes if p[1].job_id == job_key)
        answer(worker, assignment_id)
    return claimed


def member_report(
    worker: Worker, claimed: ClaimedAttempt, job_key: str, type_: str, **fields: Any
) -> ReportOutcome:
    message = {"type": type_, "job_id": job_key, "assignment_id": str(claimed.assignments[job_key]), **fields}
    return cluster_member_report(worker_id=worker.id, message=wire(message), now=timezone.now())


def as_json(pushes: Sequence[Push]) -> list[tuple[str, Any]]:
    """The pushes with each message as its JSON object (what the worker receives)."""
    return [(w, msgspec.to_builtins(m)) for w, m in pushes]


def types(pushes: Sequence[Push]) -> list[str]:
    return [tag_of(type(m)) for _, m in pushes]


def record_problems(*job_keys: str) -> dict[str, tuple[str, ...]]:
    """The records check for these jobs: where a folded record disagrees with its rows (empty: none)."""
    from gradient.records.services import record_check_one

    out = {}
    for key in job_keys:
        problems, _ = record_check_one(job_key=key, now=timezone.now(), settle=False)
        if problems:
            out[key] = problems
    return out


def evaluated_builds(project: Project, url: str) -> list[DerivationBuild]:
    """An evaluation of the sim `url` that has been evaluated: Building, its shared builds (by drv path)
    all Queued."""
    import msgspec
    from django.db import transaction

    from gradient.scheduling import history
    from gradient.scheduling.services.evaluations import evaluation_create
    from gradient.scheduling.services.graph import ingest_eval_result
    from gradient.workers.executors.sim import graph_from_url

    now = timezone.now()
    with transaction.atomic():
        evaluation, _ = evaluation_create(project=project, repository=url, commit="1" * 40, now=now)
        assert history.evaluation_transition(
            evaluation_id=evaluation.id,
            to=EvaluationStatus.BUILDING,
            expect=[EvaluationStatus.QUEUED],
            reason="evaluated by the test",
            now=now,
        )
        graph = graph_from_url(url)
        derivations = [msgspec.to_builtins(d) for d in graph.discovered(list(graph.attrs()))]
        result = ingest_eval_result(evaluation=evaluation, derivations=derivations, now=now)
    builds = list(DerivationBuild.objects.filter(id__in=result.build_ids).order_by("drv_path"))
    assert {b.status for b in builds} == {BuildStatus.QUEUED}
    return builds
