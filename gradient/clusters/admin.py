"""Cluster jobs in the admin: the list, each cluster with its members and attempts (seats, outcome,
timing), read-only; abort, on a cluster's page and as an action of the list, after a confirmation page,
appends the abort intent to each cluster's record as the signed-in operator."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html_join
from django.utils.safestring import SafeString

from gradient.clusters.decisions.waiting_text import describe_cluster_waiting
from gradient.clusters.models import (
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterReservation,
    ClusterSeat,
    ClusterWorkerPenalty,
)
from gradient.clusters.selectors import needed_outside_its_cluster
from gradient.clusters.services.lifecycle import cluster_request_abort
from gradient.console import OperatedAdmin, Operation, ReadOnlyAdmin, ReadOnlyInline, drv_name, flag, when
from gradient.core.ids import parse_uuid
from gradient.core.vocab import BUILD_ABORTABLE, CLUSTER_TERMINAL, EVALUATION_ACTIVE
from gradient.records.admin import RecordTimelineMixin
from gradient.records.errors import RecordError
from gradient.workers.models import Worker


def _worker_name(names: dict[uuid.UUID, str], worker_id: object) -> str:
    parsed = parse_uuid(worker_id)
    return names.get(parsed, "unknown worker") if parsed is not None else "unknown worker"


def _duration(start, end) -> str:  # type: ignore[no-untyped-def]
    if start is None or end is None:
        return "-"
    return f"{(end - start).total_seconds():.1f} s"


SAME_ZONE = flag("same_zone", "same zone", yes="same zone", no="any zone")
PRIORITY = flag("priority", "priority", yes="prioritized", no="normal")


class ClusterMemberInline(ReadOnlyInline):
    model = ClusterMember
    fields = readonly_fields = ("role", "index", "evaluation", "derivation_build", "primary", "pin")


class ClusterAttemptInline(ReadOnlyInline):
    model = ClusterAttempt
    fields = readonly_fields = (  # type: ignore[assignment]
        "number",
        when("created_at"),
        when("started_at"),
        when("finished_at"),
        "prepare_time",
        "run_time",
        "outcome",
        "verdict",
        "reason",
        "seat_list",
    )
    show_change_link = True

    @admin.display(description="prepare")
    def prepare_time(self, obj: ClusterAttempt) -> str:
        return _duration(obj.created_at, obj.started_at or obj.finished_at)

    @admin.display(description="run")
    def run_time(self, obj: ClusterAttempt) -> str:
        return _duration(obj.started_at, obj.finished_at)

    @admin.display(description="seats")
    def seat_list(self, obj: ClusterAttempt) -> SafeString:
        names = dict(
            Worker.objects.filter(
                id__in=[s.get("worker_id") for s in obj.seats if s.get("worker_id")]
            ).values_list("id", "name")
        )
        return format_html_join(
            "",
            "<div>{}[{}] on {} ({}, {})</div>",
            (
                (
                    s.get("role"),
                    s.get("index"),
                    s.get("worker_id"),
                    _worker_name(names, s.get("worker_id")),
                    s.get("zone") or "no zone",
                )
                for s in obj.seats
            ),
        )


def _abort(cluster: ClusterJob, actor: str) -> str:
    receipt = cluster_request_abort(cluster_id=cluster.id, actor=actor, now=timezone.now())
    return receipt.message if receipt is not None else "aborted"


def _abort_consequences(cluster: ClusterJob) -> list[str]:
    """Which member jobs end Aborted and which shared builds are spared (needed outside the cluster)."""
    lines = []
    members = cluster.members.select_related("evaluation", "derivation_build").order_by("role", "index")
    for member in members:
        build = member.derivation_build
        if build is not None:
            name = f"{member.role}[{member.index}]: build {drv_name(build.drv_path)}"
            if build.status not in BUILD_ABORTABLE:
                lines.append(f"{name} has ended ({build.status}) and stays so")
            elif needed_outside_its_cluster(build.id):
                lines.append(
                    f"{name} is spared: evaluations outside this cluster need it, so it goes back to the "
                    "queue and is built on its own"
                )
            else:
                lines.append(f"{name} ends Aborted")
        elif member.evaluation is not None:
            evaluation = member.evaluation
            name = (
                f"{member.role}[{member.index}]: evaluation {evaluation.repository}@{evaluation.commit[:12]}"
            )
            if evaluation.status in EVALUATION_ACTIVE:
                lines.append(f"{name} is cancelled (its shared builds other evaluations need are spared)")
            else:
                lines.append(f"{name} has ended ({evaluation.status}) and stays so")
    return lines


ABORT = Operation(
    name="abort_clusters",
    label="Abort",
    description="Abort the selected cluster jobs",
    explain="Abort these cluster jobs? The abort is recorded on each cluster's record as a control intent; "
    "then the members' running jobs get AbortJob, an open attempt closes Aborted, and the cluster ends "
    "Aborted. A member build that evaluations outside the cluster still need is spared, as an "
    "evaluation's cancel spares it: it goes back to the queue and is built on its own; every other member "
    "job that has not ended ends Aborted. This cannot be undone.",
    applies=lambda c: c.status not in CLUSTER_TERMINAL,
    run=_abort,
    refused=(RecordError,),
    consequences=_abort_consequences,
)


@admin.register(ClusterJob)
class ClusterJobAdmin(RecordTimelineMixin, OperatedAdmin):
    list_display = [
        "title",
        "status",
        PRIORITY,
        SAME_ZONE,
        "attempts",
        "retry_budget",
        "prepare_failures",
        "waiting",
        when("created_at"),
    ]
    list_filter = ["status", "priority", "same_zone"]
    search_fields = ["id"]
    date_hierarchy = "created_at"
    # read-only: the record's plan and the rows must agree, so a cluster changes through its services
    fields = readonly_fields = (  # type: ignore[assignment]
        SAME_ZONE,
        PRIORITY,
        "retry_budget",
        "status",
        "attempts",
        "prepare_failures",
        when("retry_at", "retry"),
        "waiting_in_words",
        "waiting_reason",
        when("waiting_since", "waiting since"),
        when("queued_at"),
        "created_by",
        when("created_at"),
        when("finished_at"),
        "record_timeline",
    )
    inlines = [ClusterMemberInline, ClusterAttemptInline]
    operations = (ABORT,)
    actions = [ABORT.bulk()]

    list_display_links = ["title"]

    def get_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        """No empty rows: why it waits only while it has a waiting reason, the retry only once set."""
        fields = list(super().get_fields(request, obj))
        hidden = set()
        if obj is None or not obj.waiting_reason:
            hidden |= {"waiting_in_words", "waiting_reason", "waiting_since_when"}
        if obj is None or obj.retry_at is None:
            hidden.add("retry_at_when")
        return [f for f in fields if getattr(f, "__name__", f) not in hidden]

    @admin.display(description="cluster")
    def title(self, obj: ClusterJob) -> str:
        return obj.name

    @admin.display(description="why it waits")
    def waiting_in_words(self, obj: ClusterJob) -> str:
        return describe_cluster_waiting(obj.waiting_reason) or "-"

    @admin.display(description="waiting")
    def waiting(self, obj: ClusterJob) -> str:
        reason = obj.waiting_reason or {}
        return str(reason.get("code", "-"))


class ClusterSeatInline(ReadOnlyInline):
    model = ClusterSeat
    fields = readonly_fields = (
        "role",
        "index",
        "worker",
        "zone",
        "assignment",
        "accepted_at",
        "result",
        "failure_kind",
        "error",
        "reported_at",
        "settlement",
        "settled_at",
    )


@admin.register(ClusterAttempt)
class ClusterAttemptAdmin(ReadOnlyAdmin):
    list_display = [
        "cluster_job",
        "number",
        when("created_at"),
        when("started_at"),
        when("finished_at"),
        "outcome",
        "verdict",
    ]
    list_filter = ["outcome", "verdict"]
    raw_id_fields = ["cluster_job"]
    readonly_fields: ClassVar[Any] = [
        "cluster_job",
        "number",
        when("created_at"),
        when("prepare_deadline", "prepare deadline"),
        when("started_at"),
        when("finished_at"),
        "outcome",
        "verdict",
        "reason",
        "seats",
    ]
    inlines = [ClusterSeatInline]


@admin.register(ClusterReservation)
class ClusterReservationAdmin(ReadOnlyAdmin):
    list_display = ["cluster_job", when("created_at"), when("expires_at")]
    raw_id_fields = ["cluster_job"]


@admin.register(ClusterWorkerPenalty)
class ClusterWorkerPenaltyAdmin(ReadOnlyAdmin):
    list_display = ["worker", when("at", "at"), "reason"]
    raw_id_fields = ["worker"]
