from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from gradient.core.vocab import EVALUATION_ACTIVE
from gradient.records.admin import RecordTimelineMixin
from gradient.scheduling.admin_logs import BuildLogMixin, FailedBuildLogsMixin
from gradient.scheduling.admin_waiting import WaitingReasonFilter, waiting_for
from gradient.scheduling.models import (
    BuildAttempt,
    CachedPath,
    CandidateScore,
    DerivationBuild,
    DerivationBuildDependency,
    DispatchedJob,
    Evaluation,
    EvaluationBuild,
    Project,
    SentCandidate,
)
from gradient.scheduling.services.evaluations import evaluation_request_cancel


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at"]
    search_fields = ["name"]
    filter_horizontal = ["members"]


class EvaluationBuildInline(admin.TabularInline):
    model = EvaluationBuild
    fields = ["build", "attr", "named", "blocks_evaluation"]
    raw_id_fields = ["build"]
    extra = 0


@admin.register(Evaluation)
class EvaluationAdmin(FailedBuildLogsMixin, RecordTimelineMixin, admin.ModelAdmin):
    list_display = ["id", "project", "status", waiting_for, "kind", "repository", "commit", "created_at"]
    list_filter = ["status", WaitingReasonFilter, "kind", "project"]
    search_fields = ["id", "repository", "commit"]
    date_hierarchy = "created_at"
    raw_id_fields = ["recovery_of", "created_by"]
    inlines = [EvaluationBuildInline]
    actions = ["cancel_evaluations"]
    readonly_fields = [waiting_for, "failed_build_logs", "record_timeline"]  # type: ignore[list-item]  # Django takes a callable

    @admin.action(description="Cancel the selected evaluations (a cancel intent on each record)")
    def cancel_evaluations(self, request: HttpRequest, queryset: QuerySet[Evaluation]) -> None:
        if not request.user.is_staff:
            raise PermissionDenied
        cancelled = 0
        for evaluation in queryset.filter(status__in=EVALUATION_ACTIVE):
            evaluation_request_cancel(
                evaluation_id=evaluation.id, actor=request.user.get_username(), now=timezone.now()
            )
            cancelled += 1
        self.message_user(request, f"Cancelled {cancelled} evaluations; finished ones were left as they are.")


class DependencyInline(admin.TabularInline):
    model = DerivationBuildDependency
    fk_name = "build"
    raw_id_fields = ["dependency"]
    extra = 0
    verbose_name = "dependency"


@admin.register(DerivationBuild)
class DerivationBuildAdmin(BuildLogMixin, RecordTimelineMixin, admin.ModelAdmin):
    list_display = ["drv_path", "system", "status", "drv_lost", "attempts", "queued_at", "finished_at"]
    list_filter = ["status", "system", ("drv_lost_at", admin.EmptyFieldListFilter)]
    search_fields = ["id", "drv_path"]
    inlines = [DependencyInline]
    readonly_fields = ["build_log", "record_timeline"]

    @admin.display(boolean=True, description=".drv lost", ordering="drv_lost_at")
    def drv_lost(self, obj: DerivationBuild) -> bool:
        return obj.drv_lost_at is not None


@admin.register(DispatchedJob)
class DispatchedJobAdmin(admin.ModelAdmin):
    list_display = ["id", "job_id", "kind", "worker", "score", "dispatched_at", "finished_at", "outcome"]
    list_filter = ["kind", "outcome"]
    search_fields = ["id", "job_id"]
    raw_id_fields = ["evaluation", "derivation_build", "worker", "cluster_attempt"]


@admin.register(BuildAttempt)
class BuildAttemptAdmin(admin.ModelAdmin):
    list_display = ["build", "number", "worker", "outcome", "failure_kind", "started_at", "finished_at"]
    list_filter = ["outcome", "failure_kind"]
    raw_id_fields = ["build", "dispatched_job", "worker"]


@admin.register(CachedPath)
class CachedPathAdmin(admin.ModelAdmin):
    list_display = ["path", "nar_size", "created_at"]
    search_fields = ["path"]


@admin.register(SentCandidate)
class SentCandidateAdmin(admin.ModelAdmin):
    list_display = ["worker", "job_id"]
    search_fields = ["job_id"]


@admin.register(CandidateScore)
class CandidateScoreAdmin(admin.ModelAdmin):
    list_display = ["worker", "job_id", "missing_count", "missing_nar_size", "outputs_present", "updated_at"]
    search_fields = ["job_id"]
