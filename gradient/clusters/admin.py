from django.contrib import admin

from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterMember, ClusterReservation


class ClusterMemberInline(admin.TabularInline):
    model = ClusterMember
    fields = ["role", "index", "evaluation", "derivation_build", "primary", "pin"]
    raw_id_fields = ["evaluation", "derivation_build"]
    extra = 0


class ClusterAttemptInline(admin.TabularInline):
    model = ClusterAttempt
    fields = readonly_fields = (
        "number",
        "created_at",
        "started_at",
        "finished_at",
        "outcome",
        "reason",
        "seats",
    )
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(ClusterJob)
class ClusterJobAdmin(admin.ModelAdmin):
    list_display = ["id", "status", "priority", "same_zone", "attempts", "retry_budget", "created_at"]
    list_filter = ["status", "priority", "same_zone"]
    search_fields = ["id"]
    inlines = [ClusterMemberInline, ClusterAttemptInline]


@admin.register(ClusterAttempt)
class ClusterAttemptAdmin(admin.ModelAdmin):
    list_display = ["cluster_job", "number", "created_at", "started_at", "finished_at", "outcome"]
    list_filter = ["outcome"]
    raw_id_fields = ["cluster_job"]


@admin.register(ClusterReservation)
class ClusterReservationAdmin(admin.ModelAdmin):
    list_display = ["cluster_job", "created_at", "expires_at"]
    raw_id_fields = ["cluster_job"]
