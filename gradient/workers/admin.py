"""Workers in the console: a worker's name and projects are edited here (and a new one registered,
its token shown once); everything it reports is a view, and drain, deactivate, activate and new tokens
are actions, behind a confirmation page, signed on the records of the jobs it runs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from gradient.console import (
    OperatedAdmin,
    Operation,
    ReadOnlyAdmin,
    ReadOnlyInline,
    RelativeHistory,
    actor_of,
    ago,
    assignment_job_link,
    flag,
    when,
)
from gradient.names import NameCheckedForm
from gradient.recovery.models import ServerBoot
from gradient.scheduling import selectors as scheduling
from gradient.scheduling.services import operations
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from gradient.workers.services import worker_activate, worker_token_reset
from gradient.workers.tokens import token_new


def _show_token_once(request: HttpRequest, worker: Worker, token: str) -> None:
    messages.warning(
        request,
        f"Token of worker {worker.name} (id {worker.id}): {token} . Copy it now: it is stored hashed and "
        "will not be shown again.",
    )


DRAINING = flag("draining", yes="draining", no="no")


class WorkerSessionInline(ReadOnlyInline):
    model = WorkerSession
    fields = readonly_fields = ("opened", "seen", "closed", "close_reason", DRAINING, "server")  # type: ignore[assignment]
    show_change_link = True
    verbose_name = "session"
    verbose_name_plural = "sessions (latest first)"

    @admin.display(description="opened")
    def opened(self, obj: WorkerSession) -> SafeString | str:
        return ago(obj.opened_at)

    @admin.display(description="last seen")
    def seen(self, obj: WorkerSession) -> SafeString | str:
        return ago(obj.last_seen)

    @admin.display(description="closed")
    def closed(self, obj: WorkerSession) -> SafeString | str:
        return ago(obj.closed_at) if obj.closed_at else "open"

    @admin.display(description="server")
    def server(self, obj: WorkerSession) -> str:
        """The serve process that held the session, by host and pid (its boot id is no name)."""
        boot = ServerBoot.objects.filter(id=obj.server_boot).first()
        return f"{boot.hostname}:{boot.pid}" if boot is not None else "a server no longer known"

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).order_by("-opened_at")


def _open_session(worker: Worker) -> WorkerSession | None:
    return worker.sessions.filter(closed_at__isnull=True).first()


def _drain(worker: Worker, actor: str) -> str:
    return operations.worker_request_drain(worker_id=worker.id, actor=actor, now=timezone.now()).message


def _deactivate(worker: Worker, actor: str) -> str:
    return operations.worker_request_deactivate(worker_id=worker.id, actor=actor, now=timezone.now()).message


def _activate(worker: Worker, actor: str) -> str:
    worker_activate(worker_id=worker.id)
    return f"activated by {actor}"


WORKER_OPERATIONS = (
    Operation(
        name="drain_workers",
        label="Drain",
        description="Drain the selected connected workers (nothing new; running jobs finish)",
        explain="Drain: the worker gets no new job from any server; what it runs finishes. The mark lasts "
        "until it reconnects.",
        applies=lambda w: w.active and (s := _open_session(w)) is not None and not s.draining,
        run=_drain,
        refused=(operations.ActionRefused,),
    ),
    Operation(
        name="deactivate_workers",
        label="Deactivate",
        description="Deactivate the selected workers (closes their sessions)",
        explain="Deactivate: the worker is refused from now on (403), its open session closes and its "
        "running jobs go back to the pool.",
        applies=lambda w: w.active,
        run=_deactivate,
        refused=(operations.ActionRefused,),
        summary=lambda n: f"Deactivated {n} worker(s).",
    ),
    Operation(
        name="activate_workers",
        label="Activate",
        description="Activate the selected deactivated workers (allowed to connect again)",
        explain="Activate: the worker may connect again with its token; it gets work once it connects.",
        applies=lambda w: not w.active,
        run=_activate,
        summary=lambda n: f"Activated {n} worker(s).",
    ),
)


@admin.register(Worker)
class WorkerAdmin(RelativeHistory, OperatedAdmin):
    """Name and projects are the operator's; the rest is what the worker reported, as a view."""

    form = NameCheckedForm

    # One "state" column in words instead of three icon columns (a red ✖ for an ordinary "not
    # draining" read as an error), so that "last seen" fits a 1 400 px screen beside the filters.
    list_display = [
        "name",
        "state",
        "zone",
        "architectures_text",
        "slots",
        "seen",
    ]
    list_filter = ["active", "zone", "can_build", "can_eval", "can_fetch"]
    search_fields = ["name", "id"]
    filter_horizontal = ["projects"]
    fields = ["name", "projects"]
    readonly_fields: ClassVar[Any] = [
        "id",
        flag("active", yes="yes", no="no: deactivated, refused when it connects"),
        "connection",
        "current_jobs",
        "recent_jobs",
        "capabilities",
        "metrics",
        "seen",
        "deactivated",
    ]
    inlines = [WorkerSessionInline]
    operations = WORKER_OPERATIONS
    actions = [*(op.bulk() for op in WORKER_OPERATIONS), "issue_new_tokens"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)  # registering a worker

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)  # its name and projects

    def get_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return ["name", "projects"] if obj is None else ["name", "projects", *self.readonly_fields]

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return [] if obj is None else self.readonly_fields

    def get_inlines(self, request, obj):  # type: ignore[no-untyped-def]
        return [] if obj is None else self.inlines

    @admin.display(description="state")
    def state(self, obj: Worker) -> str:
        session = _open_session(obj)
        if not obj.active:
            return "deactivated"
        if session is None:
            return "not connected"
        return "connected, draining" if session.draining else "connected"

    @admin.display(description="slots (running)")
    def slots(self, obj: Worker) -> str:
        return f"{obj.max_concurrent_builds} ({self.running(obj)})"

    @admin.display(description="architectures")
    def architectures_text(self, obj: Worker) -> str:
        return ", ".join(obj.architectures) or "-"

    @admin.display(description="running")
    def running(self, obj: Worker) -> int:
        return scheduling.open_assignments(obj.id).count()

    @admin.display(description="last seen", ordering="last_seen")
    def seen(self, obj: Worker) -> SafeString | str:
        return ago(obj.last_seen)

    @admin.display(description="deactivated", ordering="deactivated_at")
    def deactivated(self, obj: Worker) -> SafeString | str:
        return ago(obj.deactivated_at) if obj.deactivated_at else "no"

    @admin.display(description="connection")
    def connection(self, obj: Worker) -> SafeString | str:
        session = _open_session(obj)
        if session is None:
            return "not connected" + ("" if obj.active else " (deactivated)")
        return format_html(
            "connected{} since {}", ", draining" if session.draining else "", ago(session.opened_at)
        )

    def _jobs_table(self, rows: Iterable[Any]) -> SafeString | str:
        rows = list(rows)
        if not rows:
            return "none"
        return format_html(
            "<table><tr><th>job</th><th>dispatched</th><th>outcome</th><th>reason</th></tr>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                (
                    (assignment_job_link(r), ago(r.dispatched_at), r.outcome or "running", r.reason or "-")
                    for r in rows
                ),
            ),
        )

    @admin.display(description="current jobs")
    def current_jobs(self, obj: Worker) -> SafeString | str:
        rows = scheduling.open_assignments(obj.id).select_related("derivation_build", "evaluation", "worker")
        return self._jobs_table(rows)

    @admin.display(description="recent jobs")
    def recent_jobs(self, obj: Worker) -> SafeString | str:
        return self._jobs_table(scheduling.recent_assignments(obj.id))

    @admin.display(description="capabilities")
    def capabilities(self, obj: Worker) -> SafeString:
        steps = [
            name
            for name, on in (("fetch", obj.can_fetch), ("eval", obj.can_eval), ("build", obj.can_build))
            if on
        ]
        lines = [
            ("runs", ", ".join(steps) or "nothing yet"),
            ("architectures", ", ".join(obj.architectures) or "-"),
            ("system features", ", ".join(obj.system_features) or "-"),
            ("concurrent builds", obj.max_concurrent_builds),
            ("CPUs", obj.cpu_count if obj.cpu_count is not None else "unknown"),
            ("RAM", f"{obj.ram_total_mb} MB" if obj.ram_total_mb is not None else "unknown"),
            ("zone", obj.zone or "-"),
            ("reported", ago(obj.capabilities_at)),
        ]
        return format_html(
            "<table>{}</table>", format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", lines)
        )

    @admin.display(description="metrics (latest heartbeat)")
    def metrics(self, obj: Worker) -> SafeString:
        def value(v: float | int | None, unit: str) -> str:
            return "unknown" if v is None else f"{round(v, 1)} {unit}"

        lines = [
            ("CPU in use", value(obj.cpu_usage_pct, "%")),
            ("RAM free", value(obj.ram_free_mb, "MB")),
            ("disk", value(obj.disk_speed_mbps, "MB/s")),
            ("upload", value(obj.upload_speed_mbps, "MB/s")),
            ("download", value(obj.download_speed_mbps, "MB/s")),
            ("peak build RAM", value(obj.build_peak_ram_mb, "MB")),
            ("reported", ago(obj.metrics_at)),
        ]
        return format_html(
            "<table>{}</table>", format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", lines)
        )

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

    @admin.action(
        description="Issue new tokens for the selected workers (shown once)", permissions=["operate"]
    )
    def issue_new_tokens(self, request: HttpRequest, queryset: QuerySet[Worker]) -> HttpResponse | None:
        for worker in queryset:
            token = worker_token_reset(worker_id=worker.id)
            if token is not None:
                _show_token_once(request, worker, token)
                self.log_change(request, worker, f"new token issued by {actor_of(request)}")
        return None


@admin.register(WorkerSession)
class WorkerSessionAdmin(ReadOnlyAdmin):
    list_display = [
        "worker",
        when("opened_at", "opened"),
        when("last_seen", "last seen"),
        when("closed_at", "closed"),
        DRAINING,
        "close_reason",
    ]
    list_filter = ["draining"]
    list_select_related = ["worker"]


@admin.register(IdleSlot)
class IdleSlotAdmin(ReadOnlyAdmin):
    list_display = ["worker", "kind", "recorded_at"]
    list_filter = ["kind"]
