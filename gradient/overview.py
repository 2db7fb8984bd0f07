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
from gradient.core.vocab import BuildStatus, ClusterStatus, EvaluationStatus, JobKind
from gradient.scheduling.decisions.waiting import describe
from gradient.scheduling.models import DerivationBuild, Evaluation
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
