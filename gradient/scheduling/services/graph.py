"""The shared-build graph: ingesting an eval_result, queueing builds whose dependencies succeeded,
completing and failing builds, and finishing evaluations.

Every function here runs inside the caller's transaction; every status change is a conditional
UPDATE on the status it expects, so a stale caller changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from gradient.core.vocab import (
    BUILD_LASTING_FAILURE,
    BUILD_PENDING,
    BUILD_SUCCESS,
    BuildStatus,
    EvaluationStatus,
)
from gradient.scheduling import history
from gradient.scheduling.models import (
    CachedPath,
    DerivationBuild,
    DerivationBuildDependency,
    Evaluation,
    EvaluationBuild,
)


@dataclass
class IngestResult:
    builds: int = 0
    created: int = 0
    queued: int = 0
    substituted: int = 0
    dependency_failed: int = 0
    build_ids: list[uuid.UUID] = field(default_factory=list)


def cache_paths(*, paths: Iterable[tuple[str, int]]) -> None:
    rows = [CachedPath(path=p, nar_size=max(0, int(n))) for p, n in paths]
    if rows:
        CachedPath.objects.bulk_create(rows, ignore_conflicts=True)


def ingest_eval_result(
    *, evaluation: Evaluation, derivations: Sequence[dict[str, Any]], now: datetime
) -> IngestResult:
    """Create or reuse one shared build per derivation path, their dependency edges, the evaluation's
    links and the cached outputs; then queue what can start and fail what cannot."""
    result = IngestResult()
    by_path: dict[str, dict[str, Any]] = {}
    for d in derivations:
        by_path.setdefault(d["drv_path"], d)
    if not by_path:
        return result

    cache_paths(
        paths=(
            (o["path"], o.get("nar_size") or 0)
            for d in by_path.values()
            for o in d.get("cached_outputs") or []
        )
    )

    existing = set(DerivationBuild.objects.filter(drv_path__in=by_path).values_list("drv_path", flat=True))
    new_rows = [
        DerivationBuild(
            drv_path=path,
            system=d["system"],
            required_features=sorted(set(d.get("required_features") or [])),
            outputs=[{"name": o["name"], "path": o["path"]} for o in d.get("outputs") or []],
            prioritized=evaluation.priority,
        )
        for path, d in by_path.items()
        if path not in existing
    ]
    DerivationBuild.objects.bulk_create(new_rows, ignore_conflicts=True)
    ids = dict(DerivationBuild.objects.filter(drv_path__in=by_path).values_list("drv_path", "id"))
    result.builds = len(ids)
    result.created = len(new_rows)
    result.build_ids = list(ids.values())

    # A build aborted for an earlier evaluation nobody wanted any more is wanted again now.
    DerivationBuild.objects.filter(id__in=ids.values(), status=BuildStatus.ABORTED).update(
        status=BuildStatus.CREATED, retry_at=None, updated_at=now
    )

    edges = [
        DerivationBuildDependency(build_id=ids[path], dependency_id=ids[dep])
        for path, d in by_path.items()
        for dep in d.get("input_drvs") or []
        if dep in ids and dep != path
    ]
    DerivationBuildDependency.objects.bulk_create(edges, ignore_conflicts=True)

    links = [
        EvaluationBuild(
            evaluation=evaluation, build_id=ids[path], attr=d.get("attr"), named=d.get("attr") is not None
        )
        for path, d in by_path.items()
    ]
    EvaluationBuild.objects.bulk_create(links, ignore_conflicts=True)

    result.substituted = substitute_cached_builds(build_ids=result.build_ids, now=now)
    result.dependency_failed = fail_dependents(build_ids=result.build_ids, now=now)
    result.queued = queue_ready_builds(build_ids=result.build_ids, now=now)
    return result


def substitute_cached_builds(*, build_ids: Sequence[uuid.UUID], now: datetime) -> int:
    """A pending build whose every output is in the cache needs no build: it is Substituted."""
    done = 0
    pending = DerivationBuild.objects.filter(id__in=build_ids, status__in=BUILD_PENDING).only("id", "outputs")
    candidates = [b for b in pending if b.outputs]
    paths = {o["path"] for b in candidates for o in b.outputs}
    cached = set(CachedPath.objects.filter(path__in=paths).values_list("path", flat=True))
    for b in candidates:
        if all(o["path"] in cached for o in b.outputs):
            done += DerivationBuild.objects.filter(id=b.id, status__in=BUILD_PENDING).update(
                status=BuildStatus.SUBSTITUTED, finished_at=now, updated_at=now
            )
    return done


def queue_ready_builds(*, build_ids: Sequence[uuid.UUID] | None = None, now: datetime) -> int:
    """Created builds whose every dependency succeeded become Queued. With no ids, every Created build
    (the full resync)."""
    unfinished_dep = DerivationBuildDependency.objects.filter(build_id=OuterRef("pk")).exclude(
        dependency__status__in=BUILD_SUCCESS
    )
    # A build whose .drv is lost waits for its DrvRecovery evaluation (services.drv_recovery).
    qs = DerivationBuild.objects.filter(status=BuildStatus.CREATED, drv_lost_at__isnull=True)
    if build_ids is not None:
        qs = qs.filter(id__in=build_ids)
        # Lock the candidates first (in id order, so two callers never wait on each other in a cycle).
        # Two dependencies finishing at once in two transactions would otherwise each read the other
        # as unfinished and neither queue the build, leaving it to the 60 s resync; with the lock the
        # second waits for the first to commit and then reads both (READ COMMITTED: a fresh snapshot
        # per statement).
        _lock_ids(qs)
    ready = list(qs.exclude(Exists(unfinished_dep)).values_list("id", flat=True))
    if not ready:
        return 0
    return DerivationBuild.objects.filter(id__in=ready, status=BuildStatus.CREATED).update(
        status=BuildStatus.QUEUED, queued_at=now, updated_at=now
    )


def _lock_ids(qs: QuerySet[Any]) -> list[uuid.UUID]:
    """The ids of `qs`, each row locked (FOR NO KEY UPDATE) in id order for this transaction. Outside a
    transaction (autocommit: every statement commits on its own) there is nothing to hold a lock for."""
    if transaction.get_connection().in_atomic_block:
        qs = qs.select_for_update(no_key=True)
    return list(qs.order_by("id").values_list("id", flat=True))


def fail_dependents(*, build_ids: Sequence[uuid.UUID], now: datetime) -> int:
    """Pending builds needing a build with a lasting failure fail with DependencyFailed, transitively."""
    failed_dep = DerivationBuildDependency.objects.filter(
        build_id=OuterRef("pk"), dependency__status__in=BUILD_LASTING_FAILURE
    )
    total = 0
    frontier: set[uuid.UUID] = set(build_ids)
    while frontier:
        # Builds among the frontier and their dependents that now need a failed build.
        scope = set(frontier) | set(
            DerivationBuildDependency.objects.filter(dependency_id__in=frontier).values_list(
                "build_id", flat=True
            )
        )
        doomed = list(
            DerivationBuild.objects.filter(id__in=scope, status__in=BUILD_PENDING)
            .filter(Exists(failed_dep))
            .values_list("id", flat=True)
        )
        if not doomed:
            break
        total += DerivationBuild.objects.filter(id__in=doomed, status__in=BUILD_PENDING).update(
            status=BuildStatus.DEPENDENCY_FAILED,
            last_error="a dependency failed",
            finished_at=now,
            updated_at=now,
        )
        frontier = set(doomed)
    return total


def dependents_of(build_id: uuid.UUID) -> list[uuid.UUID]:
    return list(
        DerivationBuildDependency.objects.filter(dependency_id=build_id).values_list("build_id", flat=True)
    )


def evaluations_needing(build_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    return list(
        EvaluationBuild.objects.filter(build_id__in=list(build_ids), blocks_evaluation=True)
        .values_list("evaluation_id", flat=True)
        .distinct()
    )


MAX_REPORTED_FAILURES = 50


@dataclass(frozen=True)
class EvaluationFinish:
    evaluation_id: uuid.UUID
    status: str
    errors: tuple[str, ...] = ()


def finish_evaluations(*, evaluation_ids: Iterable[uuid.UUID], now: datetime) -> list[EvaluationFinish]:
    """check_evaluation_done: a Building (or Waiting while building) evaluation completes when everything
    it needs succeeded and fails on a lasting failure. Returns what changed. Two indexed EXISTS-style reads
    per evaluation, whatever its size: this runs after every finished build."""
    finished: list[EvaluationFinish] = []
    # Only an evaluation whose evaluation job completed: Building, or parked while building. One requeued
    # mid-evaluation (builds from an eval_result, no JobCompleted) is evaluated again first.
    parked_building = Q(waiting_reason__reason__in=["workers", "graph_stuck"]) | Q(
        waiting_reason__reason="draining", waiting_reason__resume="Building"
    )
    # Locked, in id order, for the same reason as in queue_ready_builds: the last two builds of an
    # evaluation finishing in two transactions at once would each see the other still Building, and
    # the evaluation would wait for the next waiting pass to complete.
    candidates = _lock_ids(
        Evaluation.objects.filter(
            Q(status=EvaluationStatus.BUILDING) | (Q(status=EvaluationStatus.WAITING) & parked_building),
            id__in=set(evaluation_ids),
        )
    )
    for evaluation_id in candidates:
        links = EvaluationBuild.objects.filter(evaluation_id=evaluation_id, blocks_evaluation=True)
        failed = list(
            links.filter(build__status__in=BUILD_LASTING_FAILURE).values_list(
                "build__drv_path", "build__status"
            )[:MAX_REPORTED_FAILURES]
        )
        if not failed and links.exclude(build__status__in=BUILD_SUCCESS).exists():
            continue  # still building
        verdict = EvaluationStatus.FAILED if failed else EvaluationStatus.COMPLETED
        errors = tuple(f"{path}: {status}" for path, status in failed)
        extra: dict[str, Any] = {}
        if errors:
            previous = (
                Evaluation.objects.filter(id=evaluation_id).values_list("errors", flat=True).first() or []
            )
            extra["errors"] = [*previous, *errors][:200]
        reason = "every needed build succeeded" if not errors else f"{len(errors)} builds failed lastingly"
        if history.evaluation_transition(
            evaluation_id=evaluation_id,
            to=verdict.value,
            expect=[EvaluationStatus.BUILDING, EvaluationStatus.WAITING],
            reason=reason,
            now=now,
            **extra,
        ):
            finished.append(EvaluationFinish(evaluation_id, verdict.value, errors))
    return finished
