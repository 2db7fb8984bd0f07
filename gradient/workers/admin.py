from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from gradient.names import NameCheckedForm
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from gradient.workers.services import worker_activate, worker_deactivate, worker_token_reset
from gradient.workers.tokens import token_new


def _show_token_once(request: HttpRequest, worker: Worker, token: str) -> None:
    messages.warning(
        request,
        f"Token of worker {worker.name} (id {worker.id}): {token} . Copy it now: it is stored hashed and "
        "will not be shown again.",
    )


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
    form = NameCheckedForm
    list_display = ["name", "active", "zone", "architectures", "max_concurrent_builds", "last_seen"]
    list_filter = ["active", "zone", "can_build", "can_eval", "can_fetch"]
    search_fields = ["name", "id"]
    filter_horizontal = ["projects"]
    readonly_fields = ["id", "token_hash", "last_seen", "capabilities_at", "metrics_at", "deactivated_at"]
    inlines = [WorkerSessionInline]
    actions = ["deactivate_workers", "activate_workers", "issue_new_tokens"]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        # A new worker gets its token here; the add page's answer shows it once (response_add).
        if not change:
            token, obj.token_hash = token_new()
            request._gradient_worker_token = token
        super().save_model(request, obj, form, change)

    def response_add(self, request, obj, post_url_continue=None):  # type: ignore[no-untyped-def]
        token = getattr(request, "_gradient_worker_token", None)
        if token:
            _show_token_once(request, obj, token)
        return super().response_add(request, obj, post_url_continue)

    @admin.action(description="Deactivate the selected workers (closes their sessions)")
    def deactivate_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> HttpResponse | None:
        for worker in queryset:
            worker_deactivate(worker_id=worker.id, now=timezone.now())
        self.message_user(request, f"Deactivated {queryset.count()} worker(s).")
        return None

    @admin.action(description="Activate the selected workers")
    def activate_workers(self, request: HttpRequest, queryset: QuerySet[Worker]) -> HttpResponse | None:
        for worker in queryset:
            worker_activate(worker_id=worker.id)
        self.message_user(request, f"Activated {queryset.count()} worker(s).")
        return None

    @admin.action(description="Issue new tokens for the selected workers (shown once)")
    def issue_new_tokens(self, request: HttpRequest, queryset: QuerySet[Worker]) -> HttpResponse | None:
        for worker in queryset:
            token = worker_token_reset(worker_id=worker.id)
            if token is not None:
                _show_token_once(request, worker, token)
        return None


@admin.register(WorkerSession)
class WorkerSessionAdmin(admin.ModelAdmin):
    list_display = ["worker", "opened_at", "last_seen", "closed_at", "draining", "close_reason"]
    list_filter = ["draining"]
    raw_id_fields = ["worker"]


@admin.register(IdleSlot)
class IdleSlotAdmin(admin.ModelAdmin):
    list_display = ["worker", "kind", "recorded_at"]
    list_filter = ["kind"]
