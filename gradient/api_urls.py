"""/api/v1/: each app contributes its own routes."""

from __future__ import annotations

from typing import Any

from django.urls import include, path

from gradient import auth

urlpatterns: list[Any] = [
    path("auth/tokens", auth.TokensView.as_view(), name="auth-tokens"),
    path("auth/tokens/<str:token_id>", auth.TokenDetailView.as_view(), name="auth-token-detail"),
    path("auth/logout", auth.LogoutView.as_view(), name="auth-logout"),
    path("", include("gradient.workers.urls")),
    path("", include("gradient.records.urls")),
    path("", include("gradient.scheduling.urls")),
    path("", include("gradient.clusters.urls")),
]
