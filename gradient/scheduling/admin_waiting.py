"""The waiting reason in the evaluation admin: a "Waiting for" column and detail field in an operator's
words (decisions.waiting.describe, as REST's waiting_reason_text) and a filter by reason."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from gradient.scheduling.decisions.waiting import FOREIGN_REASONS, PASS_REASONS, describe
from gradient.scheduling.models import Evaluation

LABELS = {
    "eval_workers": "a worker that can fetch or evaluate",
    "workers": "a worker that can build it (architecture, features)",
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
