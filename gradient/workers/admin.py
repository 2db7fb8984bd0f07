from django.contrib import admin

from gradient.workers.models import CandidateScore, IdleSlot, SentCandidate, Worker, WorkerSession


class WorkerSessionInline(admin.TabularInline):
    model = WorkerSession
    fields = readonly_fields = (
        "opened_at",
        "last_seen",
        "closed_at",
        "close_reason",
        "draining",
        "server_boot",
    )
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["name", "active", "zone", "architectures", "max_concurrent_builds", "last_seen"]
    list_filter = ["active", "zone", "can_build", "can_eval", "can_fetch"]
    search_fields = ["name", "id"]
    filter_horizontal = ["projects"]
    readonly_fields = ["token_hash", "last_seen", "capabilities_at", "metrics_at"]
    inlines = [WorkerSessionInline]


@admin.register(WorkerSession)
class WorkerSessionAdmin(admin.ModelAdmin):
    list_display = ["worker", "opened_at", "last_seen", "closed_at", "draining", "close_reason"]
    list_filter = ["draining"]
    raw_id_fields = ["worker"]


@admin.register(IdleSlot)
class IdleSlotAdmin(admin.ModelAdmin):
    list_display = ["worker", "kind", "recorded_at"]
    list_filter = ["kind"]


@admin.register(SentCandidate)
class SentCandidateAdmin(admin.ModelAdmin):
    list_display = ["worker", "job_id"]
    search_fields = ["job_id"]


@admin.register(CandidateScore)
class CandidateScoreAdmin(admin.ModelAdmin):
    list_display = ["worker", "job_id", "missing_count", "missing_nar_size", "outputs_present", "updated_at"]
    search_fields = ["job_id"]
