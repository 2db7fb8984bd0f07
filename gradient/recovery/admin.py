from django.contrib import admin

from gradient.recovery.models import PassState, ServerBoot


@admin.register(ServerBoot)
class ServerBootAdmin(admin.ModelAdmin):
    list_display = ["id", "hostname", "pid", "started_at", "recovered_at", "last_heartbeat", "stopped_at"]


@admin.register(PassState)
class PassStateAdmin(admin.ModelAdmin):
    list_display = ["name", "runs", "last_started_at", "last_finished_at", "last_duration_ms", "lease_holder"]
    readonly_fields = [f.name for f in PassState._meta.fields]
