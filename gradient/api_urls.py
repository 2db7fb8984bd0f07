"""/api/v1/: each app contributes its own routes."""

from __future__ import annotations

from typing import Any

from django.urls import include, path

urlpatterns: list[Any] = [
    path("", include("gradient.workers.urls")),
    path("", include("gradient.records.urls")),
    path("", include("gradient.scheduling.urls")),
    path("", include("gradient.clusters.urls")),
]
