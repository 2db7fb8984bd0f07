"""The live overview of the console (/admin/overview/): queue depth, idle slots, clusters, why
evaluations wait, the reservation in force and the connected workers. The page polls the JSON
endpoint every few seconds, so it follows the scheduler without a reload. Staff only."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from gradient.clusters.decisions.matcher import IDLE_SLOT_TTL_SECS
from gradient.clusters.decisions.waiting_text import describe_cluster_waiting
from gradient.clusters.models import ClusterJob, ClusterReservation
from gradient.console import between, drv_name, duration, since
from gradient.core.vocab import (
    BUILD_LASTING_FAILURE,
    BuildStatus,
    ClusterStatus,
    DispatchOutcome,
    EvaluationStatus,
    JobKind,
)
from gradient.recovery.models import PassState
from gradient.scheduling import queue_position
from gradient.scheduling.decisions.waiting import describe
from gradient.scheduling.models import DerivationBuild, DispatchedJob, Evaluation
from gradient.scheduling.services.estimates import start_estimate_errors
from gradient.scheduling.services.waiting import waiting_counts
from gradient.workers.models import IdleSlot, WorkerSession

WAITING_CLUSTERS_SHOWN = 50


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at else None


def _waiting_evaluations() -> list[dict[str, Any]]:
    groups = []
    for name, count in sorted(waiting_counts().items(), key=lambda item: (-item[1], item[0])):
        sample = (
            Evaluation.objects.filter(status=EvaluationStatus.WAITING, waiting_reason__reason=name)
            .values_list("waiting_reason", flat=True)
            .first()
        )
        groups.append({"reason": name, "count": count, "example": describe(sample) if sample else ""})
    return groups


def _clusters() -> dict[str, Any]:
    counts = dict(
        ClusterJob.objects.filter(status__in=[ClusterStatus.QUEUED, ClusterStatus.RUNNING])
        .values_list("status")
        .annotate(n=Count("id"))
    )
    waiting = ClusterJob.objects.filter(status=ClusterStatus.QUEUED, waiting_reason__isnull=False).order_by(
        "-priority", "waiting_since"
    )
    return {
        "running": counts.get(ClusterStatus.RUNNING, 0),
        "queued": counts.get(ClusterStatus.QUEUED, 0),
        "waiting": [
            {
                "id": str(c.id),
                "name": c.name,
                "url": reverse("admin:clusters_clusterjob_change", args=[c.id]),
                "priority": c.priority,
                "code": str((c.waiting_reason or {}).get("code", "")),
                "reason": c.waiting_reason,
                "why": describe_cluster_waiting(c.waiting_reason),
                "waiting_since": _iso(c.waiting_since),
            }
            for c in waiting[:WAITING_CLUSTERS_SHOWN]
        ],
    }


def _reservation(now: datetime) -> dict[str, Any] | None:
    reservation = ClusterReservation.objects.filter(expires_at__gt=now).first()
    if reservation is None:
        return None
    return {
        "cluster": str(reservation.cluster_job_id),
        "name": reservation.cluster_job.name,
        "url": reverse("admin:clusters_clusterjob_change", args=[reservation.cluster_job_id]),
        "seats": reservation.seats,
        "created_at": _iso(reservation.created_at),
        "expires_at": _iso(reservation.expires_at),
    }


def _workers() -> list[dict[str, Any]]:
    sessions = (
        WorkerSession.objects.filter(closed_at__isnull=True, worker__active=True)
        .select_related("worker")
        .order_by("worker__name")
    )
    return [
        {
            "id": str(s.worker_id),
            "name": s.worker.name,
            "url": reverse("admin:workers_worker_change", args=[s.worker_id]),
            "draining": s.draining,
            "architectures": s.worker.architectures,
            "zone": s.worker.zone,
            "opened_at": _iso(s.opened_at),
            "last_seen": _iso(s.last_seen),
        }
        for s in sessions
    ]


RUNNING_SHOWN = 50
FAILURES_SHOWN = 10
CHART_BUCKETS = 12  # the last hour in 5-minute bars
CHART_BUCKET = timedelta(minutes=5)


def _job_link(row: DispatchedJob) -> tuple[str, str | None]:
    """A job's name and its page: a build by its derivation's name, an evaluation by its repository."""
    if row.derivation_build_id is not None and row.derivation_build is not None:
        url = reverse("admin:scheduling_derivationbuild_change", args=[row.derivation_build_id])
        return drv_name(row.derivation_build.drv_path), url
    if row.evaluation_id is not None and row.evaluation is not None:
        e = row.evaluation
        url = reverse("admin:scheduling_evaluation_change", args=[row.evaluation_id])
        return f"evaluation {e.repository}@{e.commit[:12]}", url
    return row.job_id, None


def _running(now: datetime) -> list[dict[str, Any]]:
    rows = (
        DispatchedJob.objects.filter(finished_at__isnull=True)
        .select_related("worker", "derivation_build", "evaluation")
        .order_by("dispatched_at")[:RUNNING_SHOWN]
    )
    running = []
    for row in rows:
        name, url = _job_link(row)
        running.append(
            {
                "job": name,
                "url": url,
                "kind": row.kind,
                "worker": row.worker.name,
                "worker_url": reverse("admin:workers_worker_change", args=[row.worker_id]),
                "since": _iso(row.dispatched_at),
                "for": since(row.dispatched_at, now),
                # Waited and running apart: queued to handed out, then handed out to now.
                "waited": between(row.queued_at, row.dispatched_at) if row.queued_at else "-",
                "member": row.cluster_attempt_id is not None,
            }
        )
    return running


HEAD_SHOWN = 5


def _queue_head(now: datetime) -> list[dict[str, Any]]:
    """The builds first in line (prioritized, then the longest waits): where each stands in the order
    of the workers that can run it (queue_position), and when it is expected to start. A few queries
    each, for HEAD_SHOWN of them."""
    builds = DerivationBuild.objects.filter(status=BuildStatus.QUEUED).order_by(
        "-prioritized", "queued_at", "id"
    )
    workers = queue_position.connected_workers()
    head = []
    for b in builds[:HEAD_SHOWN]:
        standing = queue_position.build_queue(b, now, workers)
        if standing is None:
            continue
        start = standing.expected_start
        head.append(
            {
                "name": drv_name(b.drv_path),
                "url": reverse("admin:scheduling_derivationbuild_change", args=[b.id]),
                "prioritized": b.prioritized,
                "position": standing.position,
                "ahead": standing.ahead,
                "slots": standing.slots,
                "busy": standing.busy,
                "expected_start": _iso(start),
                "starts": "unknown"
                if start is None
                else ("now" if start <= now else f"in {since(now, start)}"),
                "waited": since(b.queued_at, now),
            }
        )
    return head


def _estimate_errors(now: datetime, *, evaluations: bool = False) -> dict[str, Any]:
    """How far the start estimates of the builds (or evaluations) handed out over the last day were
    (services.estimates)."""
    errors = start_estimate_errors(now=now, evaluations=evaluations)
    return {
        "count": errors.count,
        "p50": duration(errors.p50_secs) if errors.p50_secs is not None else "-",
        "p90": duration(errors.p90_secs) if errors.p90_secs is not None else "-",
    }


def _oldest_wait(now: datetime) -> dict[str, str]:
    evaluation = (
        Evaluation.objects.filter(status=EvaluationStatus.QUEUED)
        .order_by("created_at")
        .values_list("created_at", flat=True)
    ).first()
    build = (
        DerivationBuild.objects.filter(status=BuildStatus.QUEUED, queued_at__isnull=False)
        .order_by("queued_at")
        .values_list("queued_at", flat=True)
        .first()
    )
    return {
        JobKind.EVAL.value: since(evaluation, now) if evaluation else "-",
        JobKind.BUILD.value: since(build, now) if build else "-",
    }


def _last_hour(now: datetime) -> dict[str, Any]:
    """Hand-outs and failed assignments per 5 minutes over the last hour, oldest first."""
    start = now - CHART_BUCKET * CHART_BUCKETS
    handed = [0] * CHART_BUCKETS
    failed = [0] * CHART_BUCKETS

    def slot(at: datetime) -> int:
        return min(CHART_BUCKETS - 1, max(0, int((at - start) / CHART_BUCKET)))

    for at in DispatchedJob.objects.filter(dispatched_at__gte=start).values_list("dispatched_at", flat=True):
        handed[slot(at)] += 1
    ended = DispatchedJob.objects.filter(finished_at__gte=start, outcome=DispatchOutcome.FAILED)
    for finished in ended.values_list("finished_at", flat=True):
        if finished is not None:
            failed[slot(finished)] += 1
    return {"bucket_minutes": int(CHART_BUCKET.total_seconds() // 60), "handed_out": handed, "failed": failed}


def _passes(now: datetime) -> list[dict[str, Any]]:
    return [
        {
            "name": p.name,
            "runs": p.runs,
            "last_run": _iso(p.last_started_at),
            "ago": f"{since(p.last_started_at, now)} ago" if p.last_started_at else "never",
            "duration": duration(p.last_duration_ms / 1000) if p.last_duration_ms is not None else "-",
            "error": (p.last_error.strip().splitlines() or [""])[-1][:300],
        }
        for p in PassState.objects.order_by("name")
    ]


def _recent_failures(now: datetime) -> list[dict[str, Any]]:
    builds = DerivationBuild.objects.filter(
        status__in=BUILD_LASTING_FAILURE, finished_at__isnull=False
    ).order_by("-finished_at")[:FAILURES_SHOWN]
    return [
        {
            "name": drv_name(b.drv_path),
            "url": reverse("admin:scheduling_derivationbuild_change", args=[b.id]),
            "status": b.status,
            "error": b.last_error.strip()[-300:],
            "ago": f"{since(b.finished_at, now)} ago",
        }
        for b in builds
    ]


def overview_snapshot(*, now: datetime) -> dict[str, Any]:
    """Everything the overview shows, as plain JSON-able data."""
    fresh = now - timedelta(seconds=IDLE_SLOT_TTL_SECS)
    idle = dict(
        IdleSlot.objects.filter(recorded_at__gte=fresh, worker__active=True)
        .values_list("kind")
        .annotate(n=Count("id"))
    )
    return {
        "at": now.isoformat(),
        "queued": {
            JobKind.EVAL.value: Evaluation.objects.filter(status=EvaluationStatus.QUEUED).count(),
            JobKind.BUILD.value: DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count(),
        },
        "idle_slots": {kind.value: idle.get(kind.value, 0) for kind in JobKind},
        "clusters": _clusters(),
        "waiting_evaluations": _waiting_evaluations(),
        "reservation": _reservation(now),
        "workers": _workers(),
        "running": _running(now),
        "oldest_wait": _oldest_wait(now),
        "queue_head": _queue_head(now),
        "estimate_errors": _estimate_errors(now),
        "eval_estimate_errors": _estimate_errors(now, evaluations=True),
        "last_hour": _last_hour(now),
        "passes": _passes(now),
        "recent_failures": _recent_failures(now),
    }


def overview_page(request: HttpRequest) -> HttpResponse:
    return TemplateResponse(
        request,
        "admin/overview.html",
        {
            **admin.site.each_context(request),
            "title": "Live overview",
            "snapshot": overview_snapshot(now=timezone.now()),
            "poll_ms": 2500,
        },
    )


def overview_json(request: HttpRequest) -> JsonResponse:
    return JsonResponse(overview_snapshot(now=timezone.now()))
