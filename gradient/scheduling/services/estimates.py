"""The error of past start estimates (issue 33, "honest estimates"): the ETA pass writes down where a
waiting build stood when it first saw it in a wait (queue_position.build_queue), and, once the build is
handed out, when it really started. The overview shows p50/p90 of |actual - expected| over the last day;
GET /metrics a histogram of it (gradient_eta_error_seconds).

Why a pass and not the hand-out itself: the claim is the hot path (design/hot-path.md), and an estimate
is only honest if it was made before the outcome was known, which is all this needs. The pass estimates
up to GRADIENT_ETA_ESTIMATES_PER_PASS newly waiting builds each run (newest waits first) all at once
(queue_position.build_queues: one read of the order per shape of build, the slots, typical durations
and turnover once per shape, name and projects), and settles those that started in one statement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from gradient.core.vocab import BuildStatus, EvaluationStatus, JobKind
from gradient.scheduling import queue_position
from gradient.scheduling.decisions import eta
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation, StartEstimate

KEEP = timedelta(days=7)
"""How long settled (and unsettled) estimates are kept: the overview reads the last day."""


@dataclass(frozen=True, slots=True)
class EstimatePassResult:
    recorded: int
    settled: int
    dropped: int
    # The same for Queued evaluations (their first wait; see start_evaluation_estimates_record).
    evaluations_recorded: int = 0
    evaluations_settled: int = 0
    evaluations_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        """The pass's record: the builds' counts, and the evaluations' when it did anything for them."""
        counts = {"recorded": self.recorded, "settled": self.settled, "dropped": self.dropped}
        evaluations = {
            "evaluations_recorded": self.evaluations_recorded,
            "evaluations_settled": self.evaluations_settled,
            "evaluations_dropped": self.evaluations_dropped,
        }
        return {**counts, **evaluations} if any(evaluations.values()) else counts


def start_estimates_record(*, now: datetime, limit: int, clock: Callable[[], datetime] | None = None) -> int:
    """Estimate the start of up to `limit` Queued builds not yet estimated in their current wait, the
    latest waits first (an estimate made late in a wait says little). Returns how many were written.
    `clock`: the time of the estimates when the pass starts later than `now` (the pass's: the later of
    the two); without it they are made at `now`."""
    estimated = StartEstimate.objects.filter(build_id=OuterRef("pk"), waiting_since=OuterRef("queued_at"))
    builds = list(
        DerivationBuild.objects.filter(status=BuildStatus.QUEUED, queued_at__isnull=False)
        .exclude(Exists(estimated))
        .order_by("-queued_at")[:limit]
    )
    if not builds:
        return 0
    at = now if clock is None else max(now, clock())
    # All at once (one read of the order per shape, each input read once): the pass is cheap enough
    # not to slow the hand-outs it estimates, and every estimate is made at one moment.
    standings = queue_position.build_queues(builds, at)
    rows = []
    for build in builds:
        standing = standings.get(build.id)
        if standing is None:
            continue
        assert build.queued_at is not None
        rows.append(
            StartEstimate(
                build_id=build.id,
                waiting_since=build.queued_at,
                estimated_at=at,
                position=standing.position,
                expected_start=standing.expected_start,
                basis=standing.basis,
            )
        )
    StartEstimate.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)


def start_evaluation_estimates_record(
    *, now: datetime, limit: int, clock: Callable[[], datetime] | None = None
) -> int:
    """start_estimates_record for up to `limit` Queued evaluations in their first wait (from their
    creation to their first hand-out; a follow-up's wait after its fetch is not estimated), the latest
    first, each through queue_position.evaluation_queue (evaluations wait by the few, not by the
    thousand). Returns how many were written."""
    estimated = StartEstimate.objects.filter(
        evaluation_id=OuterRef("pk"), waiting_since=OuterRef("created_at")
    )
    evaluations = list(
        Evaluation.objects.filter(status=EvaluationStatus.QUEUED, followup_pending=False)
        .exclude(Exists(estimated))
        .order_by("-created_at")[:limit]
    )
    if not evaluations:
        return 0
    at = now if clock is None else max(now, clock())
    workers = queue_position.connected_workers()
    rows = []
    for evaluation in evaluations:
        standing = queue_position.evaluation_queue(evaluation, at, workers)
        if standing is None:
            continue
        rows.append(
            StartEstimate(
                evaluation_id=evaluation.id,
                waiting_since=evaluation.created_at,
                estimated_at=at,
                position=standing.position,
                expected_start=standing.expected_start,
                basis=standing.basis,
            )
        )
    StartEstimate.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)


_SETTLE = """
UPDATE start_estimate e
SET started_at = d.first, error_secs = abs(EXTRACT(EPOCH FROM (d.first - e.expected_start)))
FROM (
    SELECT e2.id, min(j.dispatched_at) AS first
    FROM start_estimate e2
    JOIN dispatched_job j ON j.derivation_build_id = e2.build_id AND j.dispatched_at >= e2.waiting_since
    WHERE e2.started_at IS NULL AND e2.expected_start IS NOT NULL
    GROUP BY e2.id
) d
WHERE e.id = d.id
"""


# The same for evaluations: their first hand-out (an evaluation job) since the wait began.
_SETTLE_EVALUATIONS = """
UPDATE start_estimate e
SET started_at = d.first, error_secs = abs(EXTRACT(EPOCH FROM (d.first - e.expected_start)))
FROM (
    SELECT e2.id, min(j.dispatched_at) AS first
    FROM start_estimate e2
    JOIN dispatched_job j ON j.evaluation_id = e2.evaluation_id AND j.kind = 'eval'
        AND j.dispatched_at >= e2.waiting_since
    WHERE e2.started_at IS NULL AND e2.expected_start IS NOT NULL AND e2.evaluation_id IS NOT NULL
    GROUP BY e2.id
) d
WHERE e.id = d.id
"""


def start_evaluation_estimates_settle() -> tuple[int, int]:
    """start_estimates_settle for the evaluations' estimates: fill in their first hand-out, drop those
    whose wait ended without one (failed, cancelled) or had no estimate. Returns (settled, dropped)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_SETTLE_EVALUATIONS)
            settled = cursor.rowcount
    else:  # the embedded mode: the same, row by row
        settled = 0
        for e in StartEstimate.objects.filter(
            evaluation__isnull=False, started_at__isnull=True, expected_start__isnull=False
        ):
            assert e.evaluation_id is not None
            first = (
                DispatchedJob.objects.filter(
                    evaluation_id=e.evaluation_id, kind=JobKind.EVAL, dispatched_at__gte=e.waiting_since
                )
                .order_by("dispatched_at")
                .values_list("dispatched_at", flat=True)
                .first()
            )
            if first is not None and e.expected_start is not None:
                e.started_at, e.error_secs = first, abs((first - e.expected_start).total_seconds())
                e.save(update_fields=["started_at", "error_secs"])
                settled += 1
    still_waiting = Evaluation.objects.filter(
        id=OuterRef("evaluation_id"), status=EvaluationStatus.QUEUED, created_at=OuterRef("waiting_since")
    )
    handed_out = DispatchedJob.objects.filter(
        evaluation_id=OuterRef("evaluation_id"),
        kind=JobKind.EVAL,
        dispatched_at__gte=OuterRef("waiting_since"),
    )
    ended = StartEstimate.objects.filter(evaluation__isnull=False, started_at__isnull=True).exclude(
        Exists(still_waiting)
    )
    dropped, _ = ended.filter(Q(expected_start__isnull=True) | ~Exists(handed_out)).delete()
    return settled, dropped


def start_estimates_settle(*, now: datetime) -> tuple[int, int]:
    """Fill in the start of the estimated builds handed out since; drop the estimates that can never be
    settled (the wait ended without a hand-out: substituted, failed, aborted; or nothing to compare) and
    those older than KEEP. Returns (settled, dropped)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_SETTLE)
            settled = cursor.rowcount
    else:  # the embedded mode: the same, row by row
        settled = 0
        for e in StartEstimate.objects.filter(
            build__isnull=False, started_at__isnull=True, expected_start__isnull=False
        ):
            assert e.build is not None
            first = (
                e.build.dispatches.filter(dispatched_at__gte=e.waiting_since)
                .order_by("dispatched_at")
                .values_list("dispatched_at", flat=True)
                .first()
            )
            if first is not None and e.expected_start is not None:
                e.started_at, e.error_secs = first, abs((first - e.expected_start).total_seconds())
                e.save(update_fields=["started_at", "error_secs"])
                settled += 1
    still_waiting = DerivationBuild.objects.filter(
        id=OuterRef("build_id"), status=BuildStatus.QUEUED, queued_at=OuterRef("waiting_since")
    )
    handed_out = DispatchedJob.objects.filter(
        derivation_build_id=OuterRef("build_id"), dispatched_at__gte=OuterRef("waiting_since")
    )
    # (One handed out between the two statements is settled by the next pass.)
    ended = StartEstimate.objects.filter(build__isnull=False, started_at__isnull=True).exclude(
        Exists(still_waiting)
    )
    dropped, _ = ended.filter(Q(expected_start__isnull=True) | ~Exists(handed_out)).delete()
    old, _ = StartEstimate.objects.filter(estimated_at__lt=now - KEEP).delete()
    return settled, dropped + old


def start_estimate_pass(*, now: datetime) -> EstimatePassResult:
    """The ETA pass: settle what started, then estimate the builds and evaluations newly waiting."""
    with transaction.atomic(durable=True):
        settled, dropped = start_estimates_settle(now=now)
        evaluations_settled, evaluations_dropped = start_evaluation_estimates_settle()
    limit = int(settings.GRADIENT_ETA_ESTIMATES_PER_PASS)
    recorded = start_estimates_record(now=now, limit=limit, clock=timezone.now)
    evaluations_recorded = start_evaluation_estimates_record(now=now, limit=limit, clock=timezone.now)
    return EstimatePassResult(
        recorded=recorded,
        settled=settled,
        dropped=dropped,
        evaluations_recorded=evaluations_recorded,
        evaluations_settled=evaluations_settled,
        evaluations_dropped=evaluations_dropped,
    )


@dataclass(frozen=True, slots=True)
class EstimateErrors:
    count: int
    p50_secs: float | None
    p90_secs: float | None


def start_estimate_errors(
    *, now: datetime, window: timedelta = timedelta(days=1), evaluations: bool = False
) -> EstimateErrors:
    """p50 and p90 of |actual - expected| start of the builds (or, with `evaluations`, of the
    evaluations) that started within `window`."""
    errors: list[float] = [
        e
        for e in StartEstimate.objects.filter(
            started_at__gte=now - window, error_secs__isnull=False, evaluation__isnull=not evaluations
        )
        .order_by("-started_at")
        .values_list("error_secs", flat=True)[:20_000]
        if e is not None
    ]
    return EstimateErrors(len(errors), eta.percentile(errors, 0.5), eta.percentile(errors, 0.9))
