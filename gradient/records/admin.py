"""Job records in the admin: read-only, with the folded status and the entries as a timeline (who,
when, what), and actions that commit control intents as the signed-in operator."""

from __future__ import annotations

from typing import Any, ClassVar

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from gradient.console import WordedBooleans, ago, flag, when
from gradient.records.decisions.fold import fold
from gradient.records.decisions.project import project
from gradient.records.errors import DecodeError, InvalidHistory, RecordError
from gradient.records.models import JobRecord
from gradient.records.schemas import (
    Abandon,
    Cancel,
    ControlIntent,
    GiveUp,
    Hold,
    Release,
    Requeue,
    Resubmit,
    decode_header,
)
from gradient.records.selectors import Named, names_in, record_discovery, record_entries
from gradient.records.services import commit_control
from gradient.records.timeline import Line, Ref, timeline


def _commit_each(
    modeladmin: JobRecordAdmin, request: HttpRequest, queryset: QuerySet[JobRecord], intent: ControlIntent
) -> None:
    actor = f"admin:{request.user.get_username()}"
    for record in queryset.filter(tombstoned_at__isnull=True):
        try:
            receipt = commit_control(job_key=record.job_key, intent=intent, actor=actor, now=timezone.now())
        except RecordError as exc:
            modeladmin.message_user(request, f"{record.job_key}: {exc}", messages.ERROR)
            continue
        level = messages.SUCCESS if receipt.applied else messages.WARNING
        modeladmin.message_user(request, f"{record.job_key}: {receipt.message}", level)


def _action(name: str, intent: ControlIntent, description: str):  # type: ignore[no-untyped-def]
    def action(modeladmin: JobRecordAdmin, request: HttpRequest, queryset: QuerySet[JobRecord]) -> None:
        _commit_each(modeladmin, request, queryset, intent)

    action.__name__ = name
    return admin.action(description=description, permissions=["operate"])(action)


SETTLED = flag("settled", yes="settled", no="not yet")


@admin.register(JobRecord)
class JobRecordAdmin(WordedBooleans, admin.ModelAdmin):
    list_display = [
        "job_key",
        "revision",
        SETTLED,
        when("settled_at", "settled at"),
        when("created_at", "created"),
        when("tombstoned_at", "tombstoned"),
    ]
    list_filter = ["settled", ("tombstoned_at", admin.EmptyFieldListFilter)]
    search_fields = ["job_key", "idempotency_key"]
    date_hierarchy = "created_at"
    readonly_fields: ClassVar[Any] = [
        "job_key",
        "revision",
        "status_summary",
        "header_summary",
        "timeline_table",
        "idempotency_key",
        "digest",
        SETTLED,
        "settled_at",
        "tombstoned_at",
        "created_by",
        "created_at",
    ]
    fields = tuple(readonly_fields)
    actions = [
        _action("cancel", Cancel(reason="from the admin"), "Cancel the selected jobs"),
        _action("hold", Hold(reason="from the admin"), "Hold the selected jobs"),
        _action("release", Release(), "Release the selected jobs"),
        _action("requeue", Requeue(reason="from the admin"), "Requeue the selected jobs"),
        _action("give_up", GiveUp(reason="from the admin"), "Give up on the selected jobs"),
        _action("resubmit", Resubmit(reason="from the admin"), "Resubmit the selected jobs"),
        _action("abandon", Abandon(reason="from the admin"), "Abandon the leftovers of the selected jobs"),
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: JobRecord | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: JobRecord | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: JobRecord | None = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    @admin.display(description="Status (folded)")
    def status_summary(self, obj: JobRecord) -> SafeString | str:
        now = timezone.now()
        try:
            header = decode_header(obj.header, schema=obj.header_schema)
            job = fold(header, record_entries(record=obj, upto=obj.revision), now)
        except (DecodeError, InvalidHistory) as exc:
            return f"cannot be folded by this build: {exc}"
        status = project(
            job,
            record_discovery(job_key=obj.job_key, recorded=(s.object for s in job.submissions), now=now),
            now,
        )
        lines = [
            ("phase", status.phase.value),
            ("desired", status.desired.value),
            ("outcome", status.outcome.value + (f" ({status.cause})" if status.cause else "")),
            ("row status", status.row_status.value if status.row_status else "row gone"),
            (
                "submissions",
                f"{status.submissions}, current attempt {status.attempt or '-'} on {status.worker or '-'}",
            ),
            ("holds", "; ".join(status.holds) or "none"),
            ("escalations", "; ".join(status.escalations) or "none"),
            ("clean-up pending", "yes" if status.cleanup_pending else "no"),
            ("not settled because", "; ".join(status.unsettled) or "-"),
        ]
        return format_html(
            "<table>{}</table>", format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", lines)
        )

    @admin.display(description="Header")
    def header_summary(self, obj: JobRecord) -> SafeString | str:
        try:
            header = decode_header(obj.header, schema=obj.header_schema)
        except DecodeError as exc:
            return f"{obj.header_schema}: cannot be decoded by this build: {exc}"
        plan = ", ".join(f"{name} {getattr(header.plan, name)}" for name in header.plan.__struct_fields__)
        return format_html(
            "generation {} (supersedes {}), created by {} {}<br>plan: {}<br>"
            "<details><summary>json</summary><pre>{}</pre></details>",
            header.generation,
            header.supersedes or "nothing",
            header.created_by or "the system",
            ago(header.created_at),
            plan,
            obj.header,
        )

    @admin.display(description="Timeline")
    def timeline_table(self, obj: JobRecord) -> SafeString | str:
        return render_timeline(obj)


def render_timeline(record: JobRecord) -> SafeString | str:
    """The record's entries as an HTML table (who, when, what, and what each control intent did), for
    every admin page that shows a job."""
    entries = record_entries(record=record, upto=record.revision)
    if not entries:
        return "tombstoned: the entries were dropped" if record.tombstoned_at else "no entries yet"
    try:
        job = fold(decode_header(record.header, schema=record.header_schema), entries, timezone.now())
    except (DecodeError, InvalidHistory):
        job = None
    named = names_in(e.body for e in entries)
    now = timezone.now()
    rows = [
        (
            row.revision,
            ago(row.at, now),
            row.actor or "-",
            row.kind,
            _linked(row.parts, named),
            row.effect,
            row.body,
        )
        for row in timeline(entries, job, {key: n.name for key, n in named.items()})
    ]
    return format_html(
        "<table><tr><th>#</th><th>when</th><th>who</th><th>kind</th><th>what</th><th>effect</th>"
        "<th>body</th></tr>{}</table>",
        format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            "<td><details><summary>json</summary><pre>{}</pre></details></td></tr>",
            rows,
        ),
    )


def _page_of(named: Named | None, object_id: str) -> str:
    """The console page of a named object, or "" where the console has none for its model."""
    if named is None:
        return ""
    app_label, _, model_name = named.model.partition(".")
    try:
        return reverse(f"admin:{app_label}_{model_name}_change", args=[object_id])
    except NoReverseMatch:
        return ""


def _linked(line: Line, named: dict[str, Named]) -> SafeString:
    """A timeline line as HTML: each object it names is a link to its console page (issue 34, item 9)."""
    shown: list[SafeString | str] = []
    for piece in line:
        if isinstance(piece, Ref) and (url := _page_of(named.get(piece.id), piece.id)):
            shown.append(format_html('<a href="{}">{}</a>', url, piece.text))
        else:
            shown.append(piece.text if isinstance(piece, Ref) else piece)
    return format_html_join("", "{}", ((p,) for p in shown))


def render_job_timeline(job_key: str) -> SafeString | str:
    """The timeline of the record named by `job_key`, with a link to the record's own page."""
    record = JobRecord.objects.filter(job_key=job_key).first()
    if record is None:
        if job_key.startswith("build:"):
            # Not an error: shared builds have no record of their own (yet).
            return (
                "Shared builds have no record of their own yet: what happened to this build (its tries, "
                "rebuilds, prioritizing) is on the records of the evaluations that need it, listed above."
            )
        return "No record: this job was made outside the services (SQL, a fixture), so it has no history."
    link = reverse("admin:records_jobrecord_change", args=[record.pk])
    return format_html(
        '<p><a href="{}" title="{}">The whole record</a>, revision {}{}</p>{}',
        link,
        record.job_key,
        record.revision,
        ", settled" if record.settled else "",
        render_timeline(record),
    )


class RecordTimelineMixin:
    """For a job's ModelAdmin: a read-only `record_timeline` field showing the job's record, and the
    History button leading to it (Django's own history lists admin edits, which these rows never get)."""

    @admin.display(description="Record (timeline)")
    def record_timeline(self, obj: Any) -> SafeString | str:
        return format_html('<div id="record-timeline">{}</div>', render_job_timeline(obj.job_key))

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        meta = self.model._meta  # type: ignore[attr-defined]
        change = reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[object_id])
        return HttpResponseRedirect(f"{change}#record-timeline")
