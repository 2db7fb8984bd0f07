"""The waiting reason in the evaluation admin: a "Waiting for" column and detail field in an operator's
words (decisions.waiting.describe, as REST's waiting_reason_text) and a filter by reason."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from gradient.scheduling.decisions.waiting import FOREIGN_REASONS, PASS_REASONS, describe
from gradient.scheduling.models import Evaluation

LABELS = {
    "eval_workers": "a worker that can fetch or evaluate",
    "workers": "a worker that can build it (architecture, features)",
    "saturated": "a worker that is not saturated (CPU, RAM)",
    "graph_stuck": "its graph to be repaired (stuck)",
    "draining": "the server to finish draining",
    "approval": "approval",
    "no_cache": "a cache",
    "cache_storage_full": "cache storage",
}


@admin.display(description="Waiting for")
def waiting_for(obj: Evaluation) -> str:
    """Empty when the evaluation is not waiting."""
    return describe(obj.waiting_reason)


def brief(reason: dict[str, Any] | None) -> str:
    """The reason in a few words for a list's column: "workers: aarch64-linux (kvm)", "a worker serving
    rest-proj"; the sentence (describe) is on the evaluation's page and on hover."""
    if not reason:
        return ""
    name = reason.get("reason")
    if reason.get("project"):
        return f"a worker serving {reason['project']}"
    if name == "workers":
        needs = [
            u["architecture"]
            + (f" ({', '.join(u['required_features'])})" if u.get("required_features") else "")
            for u in reason.get("unmet", [])
        ]
        serving = sorted({p for u in reason.get("unserved", []) for p in u["projects"]})
        needs += [f"serving {p}" for p in serving]
        return "workers: " + "; ".join(needs)
    if name == "eval_workers":
        return f"a worker that can {reason.get('capability', 'evaluate')}"
    if name == "saturated":
        signals = ", ".join(reason.get("signals", {}))
        return f"a less loaded worker (theirs: {signals})" if signals else LABELS[name]
    if name == "graph_stuck" and reason.get("aborted_builds"):
        return "aborted builds to be queued again: " + ", ".join(
            str(b.get("name") or b.get("id")) for b in reason["aborted_builds"]
        )
    return LABELS.get(str(name), str(name))


@admin.display(description="waiting for")
def waiting_for_brief(obj: Evaluation) -> SafeString | str:
    """The list's column: brief, with the whole sentence on hover."""
    if not obj.waiting_reason:
        return ""
    return format_html('<span title="{}">{}</span>', describe(obj.waiting_reason), brief(obj.waiting_reason))


class WaitingReasonFilter(admin.SimpleListFilter):
    """Evaluations by what they wait for (the `reason` of their waiting_reason)."""

    title = "waiting for"
    parameter_name = "waiting_for"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, LABELS.get(name, name)) for name in sorted(PASS_REASONS | FOREIGN_REASONS)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() is None:
            return queryset
        return queryset.filter(waiting_reason__reason=self.value())
