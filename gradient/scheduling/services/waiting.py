"""The waiting pass (refresh_waiting_state), the graph-stuck heal and the unbuildable abort.

Runs at the end of every build assignment pass over every in-flight evaluation. A reason is written
only when its JSON changes; the reasons other hooks own (approval, no_cache, cache_storage_full) are
never touched.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, OuterRef, Q
from django.utils import timezone

from gradient.core.vocab import (
    BUILD_LASTING_FAILURE,
    BUILD_SUCCESS,
    EVALUATION_ACTIVE,
    BuildStatus,
    EvaluationStatus,
)
from gradient.recovery.models import ServerBoot
from gradient.runtime.instances import service_draining
from gradient.scheduling import history
from gradient.scheduling.decisions import scoring
from gradient.scheduling.decisions import waiting as w
from gradient.scheduling.models import (
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
)
from gradient.scheduling.services import drv_recovery, graph, tenants
from gradient.scheduling.services.evaluations import evaluation_cancel
from gradient.workers.models import Worker, WorkerSession

log = logging.getLogger("gradient.waiting")

_MEMO = w.AssessmentMemo()


@dataclass
class WaitingPassResult:
    assessed: int = 0
    parked: int = 0
    unparked: int = 0
    changed: int = 0
    finalized: int = 0
    healed: int = 0
    aborted: int = 0
    drv_recoveries: int = 0
    draining: bool = False
    reasons: dict[str, int] = field(default_factory=dict)


def current_pool(now: datetime | None = None) -> w.Pool:
    """The connected workers as the waiting pass sees them: under the resource-aware policy each with
    the ResourceSaturation signals of its fresh metrics (stale ones hold nothing back)."""
    now = now or timezone.now()
    sessions = (
        WorkerSession.objects.filter(closed_at__isnull=True, worker__active=True)
        .select_related("worker")
        .prefetch_related("worker__projects")
    )
    policy = str(getattr(settings, "GRADIENT_SCHEDULING_POLICY", scoring.RESOURCE_AWARE))
    resource_aware = scoring.policy_name(policy) == scoring.RESOURCE_AWARE
    return w.Pool(
        tuple(
            w.PoolWorker(
                can_fetch=s.worker.can_fetch,
                can_eval=s.worker.can_eval,
                can_build=s.worker.can_build,
                architectures=tuple(s.worker.architectures or ()),
                system_features=tuple(s.worker.system_features or ()),
                draining=s.draining,
                projects=frozenset(p.name for p in s.worker.projects.all()),
                saturation=_saturation(s.worker, now) if resource_aware else (),
            )
            for s in sessions
        )
    )


def _saturation(worker: Worker, now: datetime) -> tuple[str, ...]:
    if scoring.metrics_stale(worker.metrics_at, now):
        return ()
    return scoring.saturation_signals(
        scoring.WorkerView(
            cpu_usage_pct=worker.cpu_usage_pct,
            ram_free_mb=worker.ram_free_mb,
            ram_total_mb=worker.ram_total_mb,
            build_peak_ram_mb=worker.build_peak_ram_mb,
        )
    )


def _counters(evaluation_ids: list[uuid.UUID]) -> dict[uuid.UUID, w.Counters]:
    still_wanted = ~Q(build__status__in=[*BUILD_SUCCESS, *BUILD_LASTING_FAILURE, BuildStatus.ABORTED])
    rows = (
        EvaluationBuild.objects.filter(evaluation_id__in=evaluation_ids, blocks_evaluation=True)
        .values("evaluation_id")
        .annotate(
            named=Count("id"),
            active=Count("id", filter=still_wanted),
            building=Count("id", filter=Q(build__status=BuildStatus.BUILDING)),
            aborted=Count("id", filter=Q(build__status=BuildStatus.ABORTED)),
        )
    )
    out = {e: w.Counters(0, 0, 0) for e in evaluation_ids}
    for r in rows:
        out[r["evaluation_id"]] = w.Counters(r["named"], r["active"], r["building"], r["aborted"])
    return out


def _blocking(evaluation_id: uuid.UUID) -> list[w.BlockingBuild]:
    rows = list(
        EvaluationBuild.objects.filter(evaluation_id=evaluation_id, blocks_evaluation=True).values_list(
            "build_id", "build__status", "build__system", "build__required_features", "build__prioritized"
        )
    )
    # An aborted one is named in the reason (issue 34, item 9): its derivation's name, read only then.
    aborted = [b for b, status, *_ in rows if status == BuildStatus.ABORTED]
    names = {b.id: b.name for b in DerivationBuild.objects.filter(id__in=aborted).only("id", "drv_path")}
    # A shared build can be handed to a worker of any project whose active evaluation needs it.
    wanted_by: dict[uuid.UUID, set[str]] = defaultdict(set)
    for build_id, project in EvaluationBuild.objects.filter(
        build_id__in=[r[0] for r in rows], blocks_evaluation=True, evaluation__status__in=EVALUATION_ACTIVE
    ).values_list("build_id", "evaluation__project__name"):
        wanted_by[build_id].add(project)
    return [
        w.BlockingBuild(
            str(b),
            status,
            system,
            tuple(features or ()),
            tuple(sorted(wanted_by[b])),
            names.get(b, ""),
            prioritized,
        )
        for b, status, system, features, prioritized in rows
    ]


def pool_stable_since() -> datetime | None:
    """When the newest live server started: the unbuildable grace counts from there too."""
    boot = ServerBoot.objects.filter(stopped_at__isnull=True).order_by("-started_at").first()
    return boot.started_at if boot else None


def refresh_waiting_state(
    *, now: datetime, grace_secs: int, use_memo: bool = True, draining: bool | None = None
) -> WaitingPassResult:
    """The waiting pass. `draining` (default: whether the service is draining, from the server boots)
    parks every in-flight evaluation as `draining`; when a serving instance is back, the next pass
    assesses them again like any other."""
    result = WaitingPassResult()
    result.draining = service_draining(now=now) if draining is None else draining
    pool = current_pool(now)
    fingerprint = (result.draining, pool.fingerprint())
    stable_since = pool_stable_since() or now
    open_job = DispatchedJob.objects.filter(evaluation_id=OuterRef("pk"), finished_at__isnull=True)
    evaluations = list(
        Evaluation.objects.filter(status__in=EVALUATION_ACTIVE)
        .annotate(has_open_job=Exists(open_job))
        .select_related("project")
        .only("id", "kind", "status", "waiting_reason", "waiting_since", "wait_for_workers", "project__name")
    )
    counters = _counters([e.id for e in evaluations])
    for evaluation in evaluations:
        parked_for = (evaluation.waiting_reason or {}).get("reason")
        if parked_for in w.FOREIGN_REASONS:
            continue
        c = counters[evaluation.id]
        if parked_for == "draining":
            # Parked for this drain already: its `resume` stays as written. Once an instance serves
            # again it goes back where it was; the next pass assesses it from there.
            if not result.draining and _unpark_drained(evaluation.id, evaluation.waiting_reason, c, now):
                result.unparked += 1
            continue
        result.assessed += 1
        memo_key = f"{evaluation.id}:{c.key()}:{evaluation.status}:{evaluation.has_open_job}:{parked_for}"
        verdict = _MEMO.get(memo_key, fingerprint, now) if use_memo else None
        if verdict is None:
            blocking = _blocking(evaluation.id) if w.phase_from_counters(c) == w.Phase.ASSESS else None
            verdict = w.assess(
                status=evaluation.status,
                counters=c,
                has_open_job=evaluation.has_open_job,
                pool=pool,
                blocking=blocking,
                draining=result.draining,
                parked_for=parked_for,
                project=evaluation.project.name,
            )
            _MEMO.put(memo_key, fingerprint, verdict, now)
        _apply(evaluation, verdict, c, now, result)
        if verdict.name:
            result.reasons[verdict.name] = result.reasons.get(verdict.name, 0) + 1
        if w.unbuildable_due(
            reason=verdict.reason,
            waiting_since=evaluation.waiting_since,
            wait_for_workers=evaluation.wait_for_workers,
            pool_stable_since=stable_since,
            now=now,
            grace_secs=grace_secs,
        ):
            abort_unbuildable_evaluation(evaluation_id=evaluation.id, reason=verdict.reason or {}, now=now)
            result.aborted += 1
    stuck = list(
        Evaluation.objects.filter(
            status=EvaluationStatus.WAITING,
            waiting_reason__reason="graph_stuck",
            waiting_since__lte=now - timedelta(seconds=w.LOST_DRV_GRACE_SECS),
        ).only("id", "waiting_reason", "waiting_since")
    )
    if stuck and not result.draining:
        recovered = drv_recovery.recover_drv_stuck_evals(evaluations=stuck, closure_of=_closure, now=now)
        result.drv_recoveries = recovered.started + recovered.gave_up
    return result


def unpark_draining_evals(*, now: datetime) -> int:
    """At startup, after recovery (and whenever a serving instance is back): every evaluation parked for
    a drain goes back where it was: Building when its evaluation job had completed, else Queued."""
    parked = Evaluation.objects.filter(status=EvaluationStatus.WAITING, waiting_reason__reason="draining")
    reasons = dict(parked.values_list("id", "waiting_reason"))
    counters = _counters(list(reasons))
    return sum(_unpark_drained(e, reasons[e], counters[e], now) for e in reasons)


def _unpark_drained(
    evaluation_id: uuid.UUID, reason: dict[str, Any] | None, c: w.Counters, now: datetime
) -> bool:
    return history.evaluation_transition(
        evaluation_id=evaluation_id,
        to=w.unpark_status(reason, c.named),
        expect=[EvaluationStatus.WAITING],
        reason="no longer waiting (draining): the server is back",
        now=now,
        waiting_reason=None,
        waiting_since=None,
    )


def _apply(
    evaluation: Evaluation, verdict: w.Verdict, c: w.Counters, now: datetime, r: WaitingPassResult
) -> None:
    if verdict.finalize:
        if graph.finish_evaluations(evaluation_ids=[evaluation.id], now=now):
            r.finalized += 1
        return
    old = evaluation.waiting_reason
    if verdict.reason is None:
        if evaluation.status == EvaluationStatus.WAITING:
            # An eval_workers park is of an evaluation that still needs its evaluation job, even one with
            # builds from an earlier eval_result whose job never completed (requeued by startup recovery
            # or the watchdog): back to Queued, so it is evaluated again (and a cluster member stays its
            # cluster's). Only a Building park goes back to Building (w.unpark_status).
            target = w.unpark_status(old, c.named)
            if history.evaluation_transition(
                evaluation_id=evaluation.id,
                to=target,
                expect=[EvaluationStatus.WAITING],
                reason=f"no longer waiting ({(old or {}).get('reason', 'unknown')})",
                now=now,
                waiting_reason=None,
                waiting_since=None,
            ):
                r.unparked += 1
        elif old is not None:
            Evaluation.objects.filter(id=evaluation.id).update(waiting_reason=None, waiting_since=None)
        return
    if old == verdict.reason and evaluation.status == EvaluationStatus.WAITING:
        return  # unchanged: nothing is written
    if w.load_shift_only(old, verdict.reason) and evaluation.status == EvaluationStatus.WAITING:
        # The workers' load moved (which signals, how many): the words follow it, but the record
        # gets no fact per heartbeat's shift; the park itself is unchanged.
        Evaluation.objects.filter(id=evaluation.id, status=EvaluationStatus.WAITING).update(
            waiting_reason=verdict.reason
        )
        return
    kept = w.same_park(old, verdict.reason)
    since = evaluation.waiting_since if kept and evaluation.waiting_since else now
    expected = evaluation.status
    if history.evaluation_transition(
        evaluation_id=evaluation.id,
        to=EvaluationStatus.WAITING,
        expect=[expected],
        reason=w.describe(verdict.reason),
        now=now,
        waiting_reason=verdict.reason,
        waiting_since=since,
    ):
        evaluation.waiting_since = since
        r.changed += 1
        if expected != EvaluationStatus.WAITING:
            r.parked += 1
        if verdict.name == "graph_stuck" and old != verdict.reason:
            repair_build_graph(evaluation_id=evaluation.id, now=now)
            r.healed += 1


def abort_unbuildable_evaluation(
    *, evaluation_id: uuid.UUID, reason: dict[str, object], now: datetime
) -> None:
    warning = w.unbuildable_warning(reason)
    with transaction.atomic():
        evaluation = Evaluation.objects.select_for_update(no_key=True).get(id=evaluation_id)
        evaluation.warnings = [*evaluation.warnings, warning]
        evaluation.save(update_fields=["warnings"])
        evaluation_cancel(evaluation_id=evaluation_id, reason=warning, now=now)
    log.warning("evaluation %s %s", evaluation_id, warning)


def _closure(evaluation_id: uuid.UUID) -> set[uuid.UUID]:
    """Every shared build the evaluation needs, with their dependencies, transitively."""
    seen = set(EvaluationBuild.objects.filter(evaluation_id=evaluation_id).values_list("build_id", flat=True))
    frontier = set(seen)
    while frontier:
        deps = set(
            DerivationBuildDependency.objects.filter(build_id__in=frontier).values_list(
                "dependency_id", flat=True
            )
        )
        frontier = deps - seen
        seen |= frontier
    return seen


def repair_build_graph(*, evaluation_id: uuid.UUID, now: datetime) -> dict[str, int]:
    """The heal (RepairScope::Unstick), its five steps in order, in one transaction: the first failing
    step fails the whole repair."""
    with transaction.atomic():
        closure = list(_closure(evaluation_id))
        # 1. requeue_failed_closure: thaw retryable failures; deterministic failures stay as they are.
        thawed = DerivationBuild.objects.filter(id__in=closure, status=BuildStatus.FAILED_TRANSIENT).update(
            status=BuildStatus.CREATED, retry_at=None, updated_at=now
        )
        # ... and revive what was aborted while this active evaluation still needs it (by a cancel that
        # raced a new link, a cluster's settlement, whatever path): wanted again, as an ingest that
        # links an aborted build wants it again.
        revived = DerivationBuild.objects.filter(id__in=closure, status=BuildStatus.ABORTED).update(
            status=BuildStatus.CREATED, retry_at=None, finished_at=None, updated_at=now
        )
        # 2. repair_cached_shared_builds_for_eval: builds whose outputs are all cached are done.
        # Not one another project's active evaluation needs built: it would reopen it (services.tenants).
        project_id = Evaluation.objects.values_list("project_id", flat=True).get(id=evaluation_id)
        substitutable = tenants.substitutable(
            build_ids=closure, project_id=project_id, cached_for=graph.cached_for
        )
        substituted = len(
            graph.substitute_cached_builds(build_ids=substitutable, project_id=project_id, now=now)
        )
        # 3. repair_dependency_failed: builds needing a lasting failure fail.
        failed = graph.fail_dependents(build_ids=closure, now=now)
        # 4. adopt_pending_closure: name orphaned pending builds of the closure for this evaluation.
        linked = set(
            EvaluationBuild.objects.filter(evaluation_id=evaluation_id).values_list("build_id", flat=True)
        )
        orphans = DerivationBuild.objects.filter(
            id__in=[b for b in closure if b not in linked],
            status__in=[BuildStatus.CREATED, BuildStatus.QUEUED],
        ).values_list("id", flat=True)
        adopted = EvaluationBuild.objects.bulk_create(
            [EvaluationBuild(evaluation_id=evaluation_id, build_id=b) for b in orphans], ignore_conflicts=True
        )
        # 5. promote_closure: queue everything whose dependencies succeeded.
        queued = graph.queue_ready_builds(build_ids=closure, now=now)
    return {
        "thawed": thawed,
        "revived": revived,
        "substituted": substituted,
        "failed": failed,
        "adopted": len(adopted),
        "queued": queued,
    }


def reheal_pass(*, now: datetime) -> int:
    """Every 300 s: the heal again for every graph_stuck evaluation."""
    stuck = Evaluation.objects.filter(status=EvaluationStatus.WAITING, waiting_reason__reason="graph_stuck")
    count = 0
    for evaluation_id in stuck.values_list("id", flat=True):
        repair_build_graph(evaluation_id=evaluation_id, now=now)
        count += 1
    return count


def waiting_counts() -> dict[str, int]:
    """Waiting evaluations grouped by reason, for the overview."""
    counts: dict[str, int] = defaultdict(int)
    for reason in Evaluation.objects.filter(status=EvaluationStatus.WAITING).values_list(
        "waiting_reason", flat=True
    ):
        counts[(reason or {}).get("reason", "unknown")] += 1
    return dict(counts)
