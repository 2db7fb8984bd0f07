"""Build logs in the console (docs/logs.md): a build's page shows the end of its latest log, follows it
live while the build runs (the page polls `GET /api/v1/builds/{id}/log?offset=N` with the operator's
session), links the whole log, and puts a failure's last lines beside its error; an evaluation's page
shows the last lines of each failed build's log beside that build's error.

Two mixins for the ModelAdmins of gradient.scheduling.admin, each one read-only field rendered from
its own template (templates/admin/scheduling/).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe

from gradient.core.vocab import BUILD_ABORTABLE, BuildStatus
from gradient.scheduling.decisions.logs import plain_text, tail_lines
from gradient.scheduling.models import DerivationBuild, Evaluation
from gradient.scheduling.services.logs import build_log_tail, build_log_window

FAILED: tuple[str, ...] = (
    BuildStatus.FAILED_PERMANENT,
    BuildStatus.FAILED_TIMEOUT,
    BuildStatus.FAILED_TRANSIENT,
)
LIVE: tuple[str, ...] = (*BUILD_ABORTABLE, BuildStatus.FAILED_TRANSIENT)  # a log may still come
WAITING: tuple[str, ...] = (
    BuildStatus.CREATED,
    BuildStatus.QUEUED,
    BuildStatus.FAILED_TRANSIENT,
)  # a new try may
FAILURE_LINES = 25
SHOWN_FAILED_BUILDS = 10


def _log_url(build: DerivationBuild) -> str:
    return reverse("build-log", kwargs={"build_id": str(build.id)})


def render_build_log(build: DerivationBuild) -> SafeString:
    window = build_log_window(build=build)
    failed = build.status in FAILED
    shown = plain_text(window.text) if window is not None else ""
    context: dict[str, Any] = {
        "build": build,
        "url": _log_url(build),
        "live": build.status in LIVE,
        "retry": build.status in WAITING,
        "window": window,
        "window_text": shown,
        "next_offset": (window.offset + len(window.text)) if window is not None else 0,
        "failed": failed,
        "last_error": build.last_error,
        "failure_tail": tail_lines(shown, FAILURE_LINES) if failed else "",
    }
    return mark_safe(render_to_string("admin/scheduling/build_log.html", context))  # noqa: S308 (escaped by the template)


def render_failed_build_logs(evaluation: Evaluation) -> SafeString:
    builds = list(
        DerivationBuild.objects.filter(evaluation_links__evaluation=evaluation, status__in=FAILED)
        .order_by("finished_at", "drv_path")
        .distinct()[: SHOWN_FAILED_BUILDS + 1]
    )
    rows = [
        {
            "build": b,
            "admin_url": reverse("admin:scheduling_derivationbuild_change", args=[b.id]),
            "url": _log_url(b),
            "tail": plain_text(build_log_tail(build=b, lines=FAILURE_LINES)),
        }
        for b in builds[:SHOWN_FAILED_BUILDS]
    ]
    context = {"rows": rows, "more": len(builds) > SHOWN_FAILED_BUILDS, "evaluation": evaluation}
    return mark_safe(render_to_string("admin/scheduling/failed_build_logs.html", context))  # noqa: S308


class BuildLogMixin:
    """For the shared build's ModelAdmin: a read-only `build_log` field."""

    @admin.display(description="Build log")
    def build_log(self, obj: DerivationBuild) -> SafeString | str:
        if obj is None or obj.pk is None:
            return ""
        return render_build_log(obj)


class FailedBuildLogsMixin:
    """For the evaluation's ModelAdmin: a read-only `failed_build_logs` field."""

    @admin.display(description="Failed builds, with the last lines of their logs")
    def failed_build_logs(self, obj: Evaluation) -> SafeString | str:
        if obj is None or obj.pk is None:
            return ""
        return render_failed_build_logs(obj)
