"""What every page of the operator's console shares: scheduler-owned rows shown read-only (for
superusers too), operator actions behind a confirmation page, and readable values (relative times with
the exact time on hover, durations, names before UUIDs).

A scheduler-owned row changes only through the services, which append the change to the job's record;
so its admin has no add, no change form, no delete and no bulk delete, whoever signs in (the add URL
answers 403, the change URL is a view). What an operator may do is an action: `operator_action` wraps
a service call in a confirmation page and runs it as `admin:<username>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import FieldDoesNotExist, PermissionDenied
from django.db.models import BooleanField, DateTimeField, Model, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString


def _staff(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff)


def _worded(model: type[Model], name: Any) -> Any:
    """A boolean field of `model` as a `flag` (words, not Django's ✓/✖ icons), a datetime field as
    `when` (the console's one time style: relative, the exact time on hover, not Django's
    "Dec. 4, 2026, 2:13 a.m."); anything else as is."""
    if not isinstance(name, str):
        return name
    try:
        field = model._meta.get_field(name)
    except FieldDoesNotExist:
        return name
    if not isinstance(field, BooleanField | DateTimeField):
        return name
    key = (model._meta.label_lower, name)
    if key not in _FLAGS:
        description = str(field.verbose_name)
        if isinstance(field, BooleanField):
            _FLAGS[key] = flag(name, description)
        else:
            _FLAGS[key] = when(name, description.removesuffix(" at") if name.endswith("_at") else description)
    return _FLAGS[key]


_FLAGS: dict[tuple[str, str], Callable[[Any], SafeString | str]] = {}


class WordedBooleans:
    """For an admin or inline: a boolean field shown read-only (a list's column, a view's field) says
    yes or no in words, and a datetime field reads in the one relative style. A form's checkbox or
    date input, where a value is edited, stays as it is."""

    model: type[Model]

    def get_list_display(self, request: HttpRequest) -> Any:
        return [_worded(self.model, name) for name in super().get_list_display(request)]  # type: ignore[misc]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = super().get_fields(request, obj)  # type: ignore[misc]
        if self.has_change_permission(request, obj):  # type: ignore[attr-defined]
            readonly = set(super().get_readonly_fields(request, obj))  # type: ignore[misc]
            return [_worded(self.model, f) if f in readonly else f for f in fields]
        return [_worded(self.model, f) for f in fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [_worded(self.model, f) for f in super().get_readonly_fields(request, obj)]  # type: ignore[misc]


class ReadOnlyAdmin(WordedBooleans, admin.ModelAdmin):
    """A scheduler-owned model: its pages are views; what an operator may change is an action."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _staff(request)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return _staff(request)

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Who may run the operator actions (`permissions=["operate"]`): staff."""
        return _staff(request)


class ReadOnlyInline(WordedBooleans, admin.TabularInline):
    """An inline of a scheduler-owned model: rows shown, none added, changed or deleted."""

    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _staff(request)


class RelativeHistory:
    """For the admin of a row an operator edits by form (a worker's projects, a project's members): its
    *History*, Django's change history, shows each change's time in the console's one style (relative,
    the exact time on hover; templates/admin/object_history.html) instead of "Dec. 4, 2026, 2:13 a.m."."""

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        response = super().history_view(request, object_id, extra_context)  # type: ignore[misc]
        page = (getattr(response, "context_data", None) or {}).get("action_list")
        if page is not None:
            page.object_list = list(page.object_list)
            for action in page.object_list:
                action.when = ago(action.action_time)
        return response  # type: ignore[no-any-return]


def actor_of(request: HttpRequest) -> str:
    """How the record names an operator acting from the console."""
    return f"admin:{request.user.get_username()}"


@dataclass(frozen=True)
class Operation:
    """An operator action on one row: `applies(row)` says whether it can be taken now, `run(row, actor)`
    calls the service and says what it did (an exception of `refused` is shown and changed nothing).

    It is offered twice, both behind a confirmation page: as a button on the row's page
    (`<id>/operate/<name>/`) and as an action of the list (`bulk()`)."""

    name: str
    label: str  # "Restart", the button
    description: str  # "Restart the selected evaluations", the list's action
    explain: str  # what happens, on the confirmation page
    applies: Callable[[Any], bool]
    run: Callable[[Any, str], str]
    refused: tuple[type[Exception], ...] = ()
    summary: Callable[[int], str] | None = None  # the list action's closing message, from how many it did
    # What it will do to this row beyond `explain`, one line each, listed under the row on the
    # confirmation page (which shared builds a cluster's abort spares, which failed builds a restart
    # leaves failed).
    consequences: Callable[[Any], list[str]] | None = None
    # A checkbox on the confirmation page ("Also rebuild its failed builds"), offered when `option_applies`
    # says so for a row; ticked, `run_option` is called instead of `run`.
    option: str = ""
    option_applies: Callable[[Any], bool] | None = None
    run_option: Callable[[Any, str], str] | None = None
    # Ticked unless the operator unticks it: a restart that reused the builds it failed on would fail
    # again at once, which is never what "restart" means to the person who pressed it.
    option_default: bool = False
    # Where the row's page leads once it is done (a restart: the new evaluation); None stays on the row.
    lands_on: Callable[[Any], Any | None] | None = None

    def offers_option(self, rows: list[Any]) -> bool:
        return (
            bool(self.option)
            and self.option_applies is not None
            and any(self.option_applies(r) for r in rows)
        )

    def confirmation(
        self, modeladmin: admin.ModelAdmin, request: HttpRequest, rows: list[Any], skipped: int, single: bool
    ) -> TemplateResponse:
        return TemplateResponse(
            request,
            "admin/console/confirm_action.html",
            {
                **modeladmin.admin_site.each_context(request),
                "title": f"{self.label}: are you sure?",
                "opts": modeladmin.model._meta,
                "rows": rows,
                "details": [(row, self.consequences(row) if self.consequences else []) for row in rows],
                "offer_option": self.offers_option(rows),
                "skipped": skipped,
                "operation": self,
                "single": single,
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            },
        )

    def carry_out(self, modeladmin: admin.ModelAdmin, request: HttpRequest, rows: Iterable[Any]) -> int:
        actor = actor_of(request)
        with_option = request.POST.get("option") == "yes" and self.run_option is not None
        done = 0
        # "Worker “demo-a”: drained": the admin capitalises a message's first letter, which must not be
        # a name's; and the row is read again, so its status is the one after the action.
        noun = modeladmin.model._meta.verbose_name
        for row in rows:
            run = self.run_option if with_option and self.run_option is not None else self.run
            try:
                text = run(row, actor)
            except self.refused as exc:
                modeladmin.message_user(request, format_html("{} “{}”: {}", noun, row, exc), messages.WARNING)
                continue
            done += 1
            fresh = type(row)._default_manager.filter(pk=row.pk).first() or row
            modeladmin.message_user(request, format_html("{} “{}”: {}", noun, fresh, text), messages.SUCCESS)
        return done

    def bulk(self) -> Callable[..., Any]:
        def action(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
            selected = list(queryset)
            rows = [row for row in selected if self.applies(row)]
            if request.POST.get("confirmed") != "yes":
                return self.confirmation(modeladmin, request, rows, len(selected) - len(rows), single=False)
            if not rows:
                modeladmin.message_user(
                    request, "None of the selected rows can take this now.", messages.WARNING
                )
            done = self.carry_out(modeladmin, request, rows)
            if self.summary is not None:
                modeladmin.message_user(request, self.summary(done), messages.INFO)
            return None

        action.__name__ = self.name
        return admin.action(description=self.description, permissions=["operate"])(action)


class OperatedAdmin(ReadOnlyAdmin):
    """A read-only admin whose rows take `operations`: a button for each on the row's page, each behind a
    confirmation page, and the same as actions of the list (list them in `actions` with `.bulk()`)."""

    operations: tuple[Operation, ...] = ()
    change_form_template = "admin/console/change_form.html"

    def get_urls(self) -> list[Any]:
        info = self.model._meta.app_label, self.model._meta.model_name
        extra = [
            path(
                "<path:object_id>/operate/<str:name>/",
                self.admin_site.admin_view(self.operate_view),
                name=f"{info[0]}_{info[1]}_operate",
            )
        ]
        return extra + super().get_urls()

    def operate_view(self, request: HttpRequest, object_id: str, name: str) -> HttpResponse:
        if not self.has_operate_permission(request):
            raise PermissionDenied
        operation = next((op for op in self.operations if op.name == name), None)
        obj = self.get_object(request, object_id)
        if operation is None or obj is None:
            raise Http404("No such row or action.")
        change_url = reverse(
            f"admin:{self.model._meta.app_label}_{self.model._meta.model_name}_change", args=[obj.pk]
        )
        if request.method != "POST" or request.POST.get("confirmed") != "yes":
            applies = operation.applies(obj)
            return operation.confirmation(
                self, request, [obj] if applies else [], int(not applies), single=True
            )
        if not operation.applies(obj):
            self.message_user(
                request, f"{obj}: {operation.label.lower()} does not apply now.", messages.WARNING
            )
        elif operation.carry_out(self, request, [obj]) and operation.lands_on is not None:
            landing = operation.lands_on(obj)
            if landing is not None:
                meta = landing._meta
                return HttpResponseRedirect(
                    reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[landing.pk])
                )
        return HttpResponseRedirect(change_url)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        obj = self.get_object(request, object_id)
        buttons = []
        if obj is not None and self.has_operate_permission(request):
            info = self.model._meta.app_label, self.model._meta.model_name
            buttons = [
                (op.label, reverse(f"admin:{info[0]}_{info[1]}_operate", args=[obj.pk, op.name]))
                for op in self.operations
                if op.applies(obj)
            ]
        context = {**(extra_context or {}), "operation_buttons": buttons}
        return super().change_view(request, object_id, form_url, extra_context=context)


# --- Readable values -----------------------------------------------------------------------------------


def duration(seconds: float | None) -> str:
    """`850 ms`, `12.4 s`, `3 min 5 s`, `2 h 10 min`, `3 d 4 h`; `-` for None."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def between(start: datetime | None, end: datetime | None) -> str:
    """The time from `start` to `end`; an end a little before its start (stamped by two clocks, or read
    twice) is no time, never a negative one."""
    if start is None or end is None:
        return "-"
    return duration(max(0.0, (end - start).total_seconds()))


def ago(at: datetime | None, now: datetime | None = None) -> SafeString | str:
    """`3 min ago` (or `in 2 min`), the exact time on hover."""
    if at is None:
        return "-"
    now = now or timezone.now()
    delta = (now - at).total_seconds()
    words = f"{duration(abs(delta))} ago" if delta >= 0 else f"in {duration(-delta)}"
    exact = timezone.localtime(at).strftime("%Y-%m-%d %H:%M:%S %Z")
    # The page keeps the words current (templates/admin/base_site.html), as a live log ticks.
    return format_html('<time datetime="{}" title="{}">{}</time>', at.isoformat(), exact, words)


def with_relative_deadline(render: Callable[[Callable[[datetime], str]], str]) -> SafeString | str:
    """Text that names a deadline (`render` is handed how to say it), with the deadline as `ago` says
    it ("aborted in 4 min 59 s unless ..."; the exact time on hover, kept current by the page) and the
    rest escaped. Text without a deadline comes back as it was."""
    marker = "\x00"  # no text of ours holds a NUL; a name that did could not be stored
    deadlines: list[datetime] = []

    def said(at: datetime) -> str:
        deadlines.append(at)
        return marker

    text = render(said)
    if not deadlines:
        return text
    before, _, after = text.partition(marker)
    return format_html("{}{}{}", before, ago(deadlines[0]), after)


def when(name: str, description: str | None = None) -> Callable[[Any], SafeString | str]:
    """A column or read-only field showing the datetime `name` as `ago` does (relative, the exact UTC
    time on hover), sortable by it: the one time style of the console."""

    def show(obj: Any) -> SafeString | str:
        return ago(getattr(obj, name))

    show.short_description = description or name.removesuffix("_at").replace("_", " ")  # type: ignore[attr-defined]
    show.admin_order_field = name  # type: ignore[attr-defined]
    show.__name__ = f"{name}_when"
    return show


def flag(
    name: str, description: str | None = None, *, yes: str = "yes", no: str = "no"
) -> Callable[[Any], str]:
    """A column or read-only field showing the boolean `name` in words, sortable by it. Django's own
    red ✖ icon says "something is wrong" where "no" is only an answer (not settled yet, not the same
    zone, not draining), so the console shows no boolean icons: each flag says what it means."""

    def show(obj: Any) -> str:
        return yes if getattr(obj, name) else no

    show.short_description = description or name.replace("_", " ")  # type: ignore[attr-defined]
    show.admin_order_field = name  # type: ignore[attr-defined]
    show.__name__ = f"{name}_flag"
    return show


def as_list(items: Iterable[Any], empty: str = "none") -> SafeString | str:
    """A JSON list (errors, warnings, outputs, features) as a bulleted list, not as its JSON."""
    shown = [str(i) for i in items or []]
    if not shown:
        return empty
    return format_html(
        '<ul class="plain-list">{}</ul>', format_html_join("", "<li>{}</li>", ((i,) for i in shown))
    )


def since(at: datetime | None, now: datetime | None = None) -> str:
    """How long since `at`, in words, for "running for ..." columns."""
    if at is None:
        return "-"
    return duration(max(timedelta(0), (now or timezone.now()) - at).total_seconds())


SCHEDULER_APPS = ("scheduling", "workers", "clusters", "records", "recovery")
SUPPORT_APP_NAMES = {
    "gradient": "Accounts · throttling counters",
    "auth": "Accounts · users and groups",
    "knox": "Accounts · REST API tokens",
    "authtoken": "Accounts · legacy DRF tokens (stored hashed)",
    "django_celery_beat": "Periodic passes under Celery beat",
}


def scheduler_first(app_list: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The admin index: the scheduler's apps first, in the order an operator needs them, then the
    accounts, tokens and Celery beat tables, each named for what it is (not "Knox", "Auth Token")."""
    rank = {label: i for i, label in enumerate(SCHEDULER_APPS)}
    for app in app_list:
        if app["app_label"] in SUPPORT_APP_NAMES:
            app["name"] = SUPPORT_APP_NAMES[app["app_label"]]
    return sorted(app_list, key=lambda app: (rank.get(app["app_label"], len(rank)), app["name"]))


def assignment_job_link(row: Any) -> SafeString | str:
    """An assignment's (dispatched_job's) job by name, linked to its page: a build by its derivation's
    name, an evaluation by repository@commit (select_related them)."""
    if row.derivation_build_id is not None:
        url = reverse("admin:scheduling_derivationbuild_change", args=[row.derivation_build_id])
    elif row.evaluation_id is not None:
        url = reverse("admin:scheduling_evaluation_change", args=[row.evaluation_id])
    else:
        return str(row.job_id)
    return format_html('<a href="{}">{}</a>', url, row.job_name)


def drv_name(drv_path: str) -> str:
    """A derivation's name without its store hash: /nix/store/<hash>-hello-2.12.drv -> hello-2.12."""
    base = drv_path.rsplit("/", 1)[-1]
    if base.endswith(".drv"):
        base = base[: -len(".drv")]
    head, sep, rest = base.partition("-")
    return rest if sep and len(head) == 32 else base


def names(objects: Iterable[Model]) -> str:
    return ", ".join(str(o) for o in objects) or "-"
