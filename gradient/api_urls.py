"""/api/v1/: each app contributes its own routes."""

from __future__ import annotations

from typing import Any

from django.urls import include, path

urlpatterns: list[Any] = []
urlpatterns += [path("", include("gradient.records.urls"))]
urlpatterns += [path("", include("gradient.scheduling.urls"))]
urlpatterns += [path("", include("gradient.clusters.urls"))]
