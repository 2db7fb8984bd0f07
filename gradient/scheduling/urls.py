"""/api/v1/ routes of the scheduling app (included by gradient.api_urls)."""

from __future__ import annotations

from django.urls import path

from gradient.scheduling import api

urlpatterns = [
    path("evaluations", api.EvaluationsView.as_view(), name="evaluations"),
    path("evaluations/<str:evaluation_id>", api.EvaluationDetailView.as_view(), name="evaluation-detail"),
    path(
        "evaluations/<str:evaluation_id>/cancel", api.EvaluationCancelView.as_view(), name="evaluation-cancel"
    ),
    path(
        "evaluations/<str:evaluation_id>/restart",
        api.EvaluationRestartView.as_view(),
        name="evaluation-restart",
    ),
    path(
        "evaluations/<str:evaluation_id>/prioritize",
        api.EvaluationPrioritizeView.as_view(),
        name="evaluation-prioritize",
    ),
    path("builds", api.BuildsView.as_view(), name="builds"),
    path("builds/<str:build_id>", api.BuildDetailView.as_view(), name="build-detail"),
    path("builds/<str:build_id>/rebuild", api.BuildRebuildView.as_view(), name="build-rebuild"),
    path("builds/<str:build_id>/prioritize", api.BuildPrioritizeView.as_view(), name="build-prioritize"),
    path("builds/<str:build_id>/log", api.BuildLogView.as_view(), name="build-log"),
]
