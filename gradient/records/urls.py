"""The records app's REST routes, included under /api/v1/."""

from __future__ import annotations

from django.urls import path

from gradient.records.api import EvaluationHistoryView

urlpatterns = [
    path(
        "evaluations/<str:evaluation_id>/history", EvaluationHistoryView.as_view(), name="evaluation-history"
    ),
]
