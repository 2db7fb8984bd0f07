"""Cluster jobs in the admin: the list, each cluster with its members and attempts (seats, outcome,
timing), and an abort action that, after a confirmation page, appends the abort intent to each selected
cluster's record as the signed-in operator."""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
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
from gradient.clusters.services.lifecycle import cluster_request_abort
from gradient.core.vocab import CLUSTER_TERMINAL
from gradient.records.admin import RecordTimelineMixin
from gradient.records.errors import RecordError


def _duration(start, end) -> str:  # type: ignore[no-untyped-def]
    if start is None or end is None:
        return "-"
    return f"{(end - start).total_seconds():.1f} s"


class ClusterMemberInline(admin.TabularInline):
    model = ClusterMember
    fields = readonly_fields = ("role", "index", "evaluation", "derivation_build", "primary", "pin")
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


class ClusterAttemptInline(admin.TabularInline):
    model = ClusterAttempt
    fields = readonly_fields = (
        "number",
        "created_at",
        "started_at",
        "finished_at",
        "prepare_time",
        "run_time",
        "outcome",
        "verdict",
        "reason",
        "seat_list",
    )
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False

    @admin.display(description="prepare")
    def prepare_time(self, obj: ClusterAttempt) -> str:
        return _duration(obj.created_at, obj.started_at or obj.finished_at)

    @admin.display(description="run")
    def run_time(self, obj: ClusterAttempt) -> str:
        return _duration(obj.started_at, obj.finished_at)

    @admin.display(description="seats")
    def seat_list(self, obj: ClusterAttempt) -> SafeString:
        return format_html_join(
            "",
            "<div>{}[{}] on {} ({})</div>",
            (
                (s.get("role"), s.get("index"), s.get("worker_id"), s.get("zone") or "no zone")
                for s in obj.seats
            ),
        )


@admin.action(description="Abort the selected cluster jobs", permissions=["change"])
def abort_clusters(
    modeladmin: ClusterJobAdmin, request: HttpRequest, queryset: QuerySet[ClusterJob]
) -> TemplateResponse | None:
    active = queryset.exclude(status__in=CLUSTER_TERMINAL)
    if request.POST.get("confirmed") != "yes":
        return TemplateResponse(
            request,
            "admin/clusters/clusterjob/abort_confirmation.html",
            {
                **modeladmin.admin_site.each_context(request),
                "title": "Abort cluster jobs",
                "opts": modeladmin.model._meta,
                "clusters": list(active),
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            },
        )
    actor = f"admin:{request.user.get_username()}"
    for cluster in active:
        try:
            receipt = cluster_request_abort(cluster_id=cluster.id, actor=actor, now=timezone.now())
        except RecordError as exc:
            modeladmin.message_user(request, f"{cluster.id}: {exc}", messages.ERROR)
            continue
        text = receipt.message if receipt is not None else "aborted"
        modeladmin.message_user(request, f"{cluster.id}: {text}", messages.SUCCESS)
    return None


@admin.register(ClusterJob)
class ClusterJobAdmin(RecordTimelineMixin, admin.ModelAdmin):
    list_display = [
        "id",
        "status",
        "priority",
        "same_zone",
        "attempts",
        "retry_budget",
        "prepare_failures",
        "waiting",
        "created_at",
    ]
    list_filter = ["status", "priority", "same_zone"]
    search_fields = ["id"]
    date_hierarchy = "created_at"
    # read-only: the record's plan and the rows must agree, so a cluster changes through its services
    fields = readonly_fields = (
        "same_zone",
        "priority",
        "retry_budget",
        "status",
        "attempts",
        "prepare_failures",
        "retry_at",
        "waiting_in_words",
        "waiting_reason",
        "waiting_since",
        "queued_at",
        "created_by",
        "created_at",
        "finished_at",
        "record_timeline",
    )
    inlines = [ClusterMemberInline, ClusterAttemptInline]
    actions = [abort_clusters]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # created with their record through the REST API

    @admin.display(description="why it waits")
    def waiting_in_words(self, obj: ClusterJob) -> str:
        return describe_cluster_waiting(obj.waiting_reason) or "-"

    @admin.display(description="waiting")
    def waiting(self, obj: ClusterJob) -> str:
        reason = obj.waiting_reason or {}
        return str(reason.get("code", "-"))


class ClusterSeatInline(admin.TabularInline):
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
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(ClusterAttempt)
class ClusterAttemptAdmin(admin.ModelAdmin):
    list_display = ["cluster_job", "number", "created_at", "started_at", "finished_at", "outcome", "verdict"]
    list_filter = ["outcome", "verdict"]
    raw_id_fields = ["cluster_job"]
    readonly_fields = [
        "cluster_job",
        "number",
        "created_at",
        "prepare_deadline",
        "started_at",
        "finished_at",
        "outcome",
        "verdict",
        "reason",
        "seats",
    ]
    inlines = [ClusterSeatInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(ClusterReservation)
class ClusterReservationAdmin(admin.ModelAdmin):
    list_display = ["cluster_job", "created_at", "expires_at"]
    raw_id_fields = ["cluster_job"]


@admin.register(ClusterWorkerPenalty)
class ClusterWorkerPenaltyAdmin(admin.ModelAdmin):
    list_display = ["worker", "at", "reason"]
    raw_id_fields = ["worker"]
