"""Lost `.drv` recovery (waiting-and-recovery.md, Graph-Stuck Heal).

A worker that cannot obtain a build's own `.drv` reports `JobFailed{inputs_unavailable}` naming it in
`missing_paths` (the nix executor does) or in its error. No
retry can help: the build goes back to Created with `drv_lost_at` set, attempt refunded, and is not
queued again while the mark stands. Its evaluations end up `graph_stuck`; after 120 s there,
recover_drv_stuck_evals starts one DrvRecovery evaluation of the same commit for each such build.
Evaluating the commit again instantiates the `.drv` again: its eval_result clears the mark on every
lost build it names, which then queue as usual, and the DrvRecovery evaluation completes. One that does
not name its build fails, and so does the build (and its dependents): the commit no longer produces it.
A build still lost after one recovery ran fails the same way, so nothing loops.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Exists, OuterRef

from gradient.core.protocol import DiscoveredDerivation
from gradient.core.vocab import (
    BUILD_SUCCESS,
    EVALUATION_ACTIVE,
    EVALUATION_TERMINAL,
    BuildStatus,
    EvaluationKind,
    EvaluationStatus,
)
from gradient.scheduling import history
from gradient.scheduling.decisions import waiting as w
from gradient.scheduling.models import DerivationBuild, DerivationBuildDependency, Evaluation
from gradient.scheduling.services import graph

log = logging.getLogger("gradient.drv_recovery")


def is_lost_drv_failure(
    *, kind: str, error: str, drv_path: str, missing_paths: Sequence[str] | None = None
) -> bool:
    """`inputs_unavailable` naming the build's own `.drv` (in `missing_paths`, or in the error text of a
    worker that sends none): the worker could not obtain it anywhere."""
    if kind != "inputs_unavailable" or not drv_path:
        return False
    if missing_paths:
        return drv_path in missing_paths
    return drv_path in error


def build_mark_drv_lost(*, build: DerivationBuild, error: str, now: datetime) -> None:
    """Back to Created with the mark, the attempt refunded (the build never ran). The caller holds the
    build's row lock."""
    build.status = BuildStatus.CREATED
    build.drv_lost_at = now
    build.queued_at = None
    build.retry_at = None
    build.attempts = max(0, build.attempts - 1)
    build.failure_kind = "inputs_unavailable"
    build.last_error = error[:10000]
    build.updated_at = now
    build.save()


def _closure_builds(closure: Sequence[uuid.UUID], project_id: uuid.UUID) -> list[w.ClosureBuild]:
    unfinished_dep = DerivationBuildDependency.objects.filter(build_id=OuterRef("pk")).exclude(
        dependency__status__in=BUILD_SUCCESS
    )
    rows = list(
        DerivationBuild.objects.filter(id__in=closure, status=BuildStatus.CREATED, drv_lost_at__isnull=False)
        .annotate(blocked=Exists(unfinished_dep))
        .values_list("id", "status", "outputs", "blocked")
    )
    paths = [o["path"] for _, _, outputs, _ in rows for o in outputs or []]
    cached = graph.cached_for(paths=paths, project_id=project_id)
    return [
        w.ClosureBuild(
            build_id=str(build_id),
            status=status,
            drv_lost=True,
            dependencies_done=not blocked,
            outputs_cached=bool(outputs) and all(o["path"] in cached for o in outputs),
        )
        for build_id, status, outputs, blocked in rows
    ]


@dataclass
class DrvRecoveryResult:
    started: int = 0
    gave_up: int = 0


def recover_drv_stuck_evals(
    *,
    evaluations: Sequence[Evaluation],
    closure_of: Callable[[uuid.UUID], Iterable[uuid.UUID]],
    now: datetime,
) -> DrvRecoveryResult:
    """For each graph_stuck evaluation past the grace: a DrvRecovery evaluation for each lost build that
    has none running, or the build's lasting failure when one already ran."""
    result = DrvRecoveryResult()
    for evaluation in evaluations:
        if not w.lost_drv_due(
            reason=evaluation.waiting_reason, waiting_since=evaluation.waiting_since, now=now
        ):
            continue
        targets = w.lost_drv_targets(_closure_builds(list(closure_of(evaluation.id)), evaluation.project_id))
        for build_id in targets:
            recoveries = Evaluation.objects.filter(
                kind=EvaluationKind.DRV_RECOVERY, recovery_of_id=uuid.UUID(build_id)
            )
            action = w.drv_recovery_action(
                active_recoveries=recoveries.filter(status__in=EVALUATION_ACTIVE).count(),
                finished_recoveries=recoveries.filter(status__in=EVALUATION_TERMINAL).count(),
            )
            if action == w.DrvRecoveryAction.START:
                trigger_drv_recovery(evaluation=evaluation, build_id=uuid.UUID(build_id), now=now)
                result.started += 1
            elif action == w.DrvRecoveryAction.GIVE_UP:
                build_fail_unrecoverable(
                    build_id=uuid.UUID(build_id),
                    error="its .drv is lost and a DrvRecovery evaluation did not bring it back",
                    now=now,
                )
                result.gave_up += 1
    return result


def trigger_drv_recovery(*, evaluation: Evaluation, build_id: uuid.UUID, now: datetime) -> Evaluation:
    """A DrvRecovery evaluation of the stuck evaluation's commit, for one lost build."""
    # evaluations imports reports, which imports this module: import at call time.
    from gradient.scheduling.services.evaluations import evaluation_create

    source = Evaluation.objects.select_related("project").get(id=evaluation.id)
    recovery, _ = evaluation_create(
        project=source.project,
        repository=source.repository,
        commit=source.commit,
        wildcards=list(source.wildcards or []),
        wait_for_workers=source.wait_for_workers,
        priority=True,  # it unblocks waiting work
        kind=EvaluationKind.DRV_RECOVERY,
        recovery_of_id=build_id,
        now=now,
    )
    log.warning(
        "evaluation %s stuck on build %s whose .drv is lost: DrvRecovery evaluation %s",
        evaluation.id,
        build_id,
        recovery.id,
    )
    return recovery


def build_fail_unrecoverable(*, build_id: uuid.UUID, error: str, now: datetime) -> bool:
    """The build's lasting failure, its dependents' DependencyFailed, and the evaluations that finish."""
    with transaction.atomic():
        changed = DerivationBuild.objects.filter(id=build_id, status=BuildStatus.CREATED).update(
            status=BuildStatus.FAILED_PERMANENT,
            failure_kind="inputs_unavailable",
            last_error=error,
            finished_at=now,
            updated_at=now,
        )
        if changed:
            graph.fail_dependents(build_ids=[build_id], now=now)
            graph.finish_evaluations(evaluation_ids=graph.evaluations_needing([build_id]), now=now)
    return bool(changed)


def drv_recovery_ingest(
    *, evaluation: Evaluation, derivations: Sequence[DiscoveredDerivation], now: datetime
) -> int:
    """A DrvRecovery evaluation's eval_result: every lost build it names has its `.drv` again. Returns how
    many marks were cleared; those builds queue if their dependencies are done."""
    paths = {d.drv_path for d in derivations}
    found = list(
        DerivationBuild.objects.filter(drv_path__in=paths, drv_lost_at__isnull=False).values_list(
            "id", flat=True
        )
    )
    if not found:
        return 0
    cleared = DerivationBuild.objects.filter(id__in=found).update(drv_lost_at=None, updated_at=now)
    graph.queue_ready_builds(build_ids=found, now=now)
    return cleared


def drv_recovery_finish(*, evaluation: Evaluation, now: datetime) -> str:
    """The DrvRecovery evaluation's job completed: Completed when its build has its `.drv` again, else
    Failed with the build (the commit no longer produces that derivation)."""
    target = evaluation.recovery_of_id
    still_lost = (
        target is not None and DerivationBuild.objects.filter(id=target, drv_lost_at__isnull=False).exists()
    )
    if evaluation.errors or still_lost:
        error = (
            f"the evaluation did not produce the lost .drv of build {target}"
            if still_lost
            else "the recovery evaluation failed"
        )
        history.evaluation_transition(
            evaluation_id=evaluation.id,
            to=EvaluationStatus.FAILED,
            expect=None,
            reason=error,
            now=now,
            errors=[*evaluation.errors, error],
        )
        if target is not None and still_lost:
            build_fail_unrecoverable(build_id=target, error=f"its .drv is lost: {error}", now=now)
        return "drv recovery failed"
    history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.COMPLETED,
        expect=None,
        reason=f"the .drv of build {target} is available again",
        now=now,
        followup_pending=False,
    )
    return "drv recovered"
