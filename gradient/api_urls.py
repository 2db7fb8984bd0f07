"""/api/v1/: each app contributes its own routes."""

from __future__ import annotations

from typing import Any

urlpatterns: list[Any] = []
