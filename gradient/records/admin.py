from django.contrib import admin

from gradient.records.models import JobRecord, RecordEntry


class RecordEntryInline(admin.TabularInline):
    model = RecordEntry
    fields = readonly_fields = (
        "revision",
        "kind",
        "schema",
        "body",
        "actor",
        "recorded_at",
    )
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(JobRecord)
class JobRecordAdmin(admin.ModelAdmin):
    list_display = ["job_key", "revision", "settled", "created_at", "tombstoned_at"]
    list_filter = ["settled"]
    search_fields = ["job_key", "idempotency_key"]
    readonly_fields = [f.name for f in JobRecord._meta.fields]
    inlines = [RecordEntryInline]
