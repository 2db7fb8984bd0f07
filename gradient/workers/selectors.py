"""Reads of the workers app: who a worker is allowed to work for, what it can be offered, and which
assignment a report belongs to."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db.models import Exists, OuterRef, Q, QuerySet

from gradient.scheduling.models import (
    BuildStatus,
    CachedPath,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
    FlakeSourceKind,
    Project,
    build_key,
    eval_key,
)
from gradient.workers.models import Worker, WorkerSession
from gradient.workers.protocol import BuildRequirement, JobCandidate, RequiredPath

BUILTIN_SYSTEM = "builtin"


def parse_uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        return None


def parse_job_key(job_id: str) -> tuple[str, uuid.UUID] | None:
    """`eval:<uuid>` or `build:<uuid>` as (kind, id); None for anything else."""
    kind, sep, rest = job_id.partition(":")
    if not sep or kind not in ("eval", "build"):
        return None
    parsed = parse_uuid(rest)
    return (kind, parsed) if parsed is not None else None


def worker_project_names(*, worker_id: uuid.UUID) -> list[str]:
    return list(Project.objects.filter(workers=worker_id).order_by("name").values_list("name", flat=True))


def workers_with_session_state() -> QuerySet[Worker]:
    """Every worker, annotated with `connected` (an open session) and `draining` (that session drains)."""
    open_sessions = WorkerSession.objects.filter(worker=OuterRef("pk"), closed_at__isnull=True)
    return Worker.objects.annotate(
        connected=Exists(open_sessions),
        draining=Exists(open_sessions.filter(draining=True)),
    ).prefetch_related("projects")


def dispatch_open_for_report(
    *, worker_id: uuid.UUID, job_id: str, assignment_id: str
) -> DispatchedJob | None:
    """The job's open assignment on this worker named by a report, or None: a report naming anything
    else (a stale or foreign assignment, another worker's, a garbage id) is dropped."""
    assignment = parse_uuid(assignment_id)
    if assignment is None:
        return None
    return DispatchedJob.objects.filter(
        id=assignment, job_id=job_id, worker_id=worker_id, finished_at__isnull=True
    ).first()


def workers_with_open_assignments(*, worker_ids: list[uuid.UUID]) -> set[uuid.UUID]:
    return set(
        DispatchedJob.objects.filter(worker_id__in=worker_ids, finished_at__isnull=True).values_list(
            "worker_id", flat=True
        )
    )


def build_matches_worker(*, system: str, required_features: list[str], worker: Worker) -> bool:
    """The design's capability rule: the worker's architectures contain the build's system (a
    `builtin` build skips that check) and its system features contain every required feature."""
    if system != BUILTIN_SYSTEM and system not in (worker.architectures or []):
        return False
    return set(required_features or []).issubset(set(worker.system_features or []))


def candidates_for_worker(*, worker_id: uuid.UUID, now: datetime) -> list[JobCandidate]:
    """What a worker may be offered: Queued evaluations of its projects, and Queued shared builds that
    an evaluation of its projects needs and that it can build; neither with an open assignment.

    A simple first version over the tables; the scheduler refines it (follow-ups, cluster members,
    backoff, the 5 s feed)."""
    worker = Worker.objects.filter(id=worker_id, active=True).first()
    if worker is None:
        return []
    projects = Project.objects.filter(workers=worker_id)
    candidates: list[JobCandidate] = []

    if worker.can_eval or worker.can_fetch:
        evaluations = list(
            Evaluation.objects.filter(status=EvaluationStatus.QUEUED, project__in=projects)
            .exclude(
                Exists(DispatchedJob.objects.filter(evaluation=OuterRef("pk"), finished_at__isnull=True))
            )
            .order_by("created_at")
            .values_list("id", "source_kind", "flake_source")
        )
        cached_sizes = _cached_sizes(
            [src for _, kind, src in evaluations if kind == FlakeSourceKind.CACHED and src]
        )
        for evaluation_id, source_kind, flake_source in evaluations:
            required = (
                [RequiredPath(path=flake_source, nar_size=cached_sizes.get(flake_source))]
                if source_kind == FlakeSourceKind.CACHED and flake_source
                else []
            )
            candidates.append(
                JobCandidate(
                    job_id=eval_key(evaluation_id),
                    kind="flake",
                    required_paths=required,
                    drv_paths=[],
                    output_paths=[],
                )
            )

    if worker.can_build:
        builds = [
            build
            for build in DerivationBuild.objects.filter(status=BuildStatus.QUEUED)
            .filter(Q(retry_at__isnull=True) | Q(retry_at__lte=now))
            .filter(
                Exists(EvaluationBuild.objects.filter(build=OuterRef("pk"), evaluation__project__in=projects))
            )
            .exclude(
                Exists(
                    DispatchedJob.objects.filter(derivation_build=OuterRef("pk"), finished_at__isnull=True)
                )
            )
            .order_by("queued_at", "created_at")
            if build_matches_worker(
                system=build.system, required_features=build.required_features, worker=worker
            )
        ]
        inputs = _input_paths([b.id for b in builds])
        cached_sizes = _cached_sizes([p for paths in inputs.values() for p in paths])
        for build in builds:
            candidates.append(
                JobCandidate(
                    job_id=build_key(build.id),
                    kind="build",
                    required_paths=[
                        RequiredPath(path=p, nar_size=cached_sizes.get(p)) for p in inputs.get(build.id, [])
                    ],
                    drv_paths=[build.drv_path],
                    output_paths=_output_paths(build.outputs),
                    requirement=BuildRequirement(
                        architecture=build.system, required_features=list(build.required_features or [])
                    ),
                )
            )
    return candidates


def _output_paths(outputs: object) -> list[str]:
    if not isinstance(outputs, list):
        return []
    return [o["path"] for o in outputs if isinstance(o, dict) and isinstance(o.get("path"), str)]


def _input_paths(build_ids: list[uuid.UUID]) -> dict[uuid.UUID, list[str]]:
    """The output paths of each build's dependencies: what a worker needs in its store to build it."""
    result: dict[uuid.UUID, list[str]] = {}
    edges = DerivationBuildDependency.objects.filter(build_id__in=build_ids).values_list(
        "build_id", "dependency__outputs"
    )
    for build_id, outputs in edges:
        result.setdefault(build_id, []).extend(_output_paths(outputs))
    return result


def _cached_sizes(paths: list[str]) -> dict[str, int]:
    if not paths:
        return {}
    return dict(CachedPath.objects.filter(path__in=set(paths)).values_list("path", "nar_size"))
