"""Server boots and pass states in the console: views only (the runtime writes them)."""

from django.contrib import admin

from gradient.console import ReadOnlyAdmin, ago, duration
from gradient.recovery.models import PassState, ServerBoot


@admin.register(ServerBoot)
class ServerBootAdmin(ReadOnlyAdmin):
    list_display = ["id", "hostname", "pid", "started_at", "recovered_at", "last_heartbeat", "stopped_at"]


@admin.register(PassState)
class PassStateAdmin(ReadOnlyAdmin):
    list_display = ["name", "runs", "last_run", "took", "lease_holder"]

    @admin.display(description="last run", ordering="last_started_at")
    def last_run(self, obj: PassState) -> str:
        return ago(obj.last_started_at)

    @admin.display(description="duration", ordering="last_duration_ms")
    def took(self, obj: PassState) -> str:
        return duration(obj.last_duration_ms / 1000) if obj.last_duration_ms is not None else "-"
