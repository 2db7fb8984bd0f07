"""WebSocket routes. The worker protocol's consumer is mounted at /proto."""

from __future__ import annotations

from typing import Any

websocket_urlpatterns: list[Any] = []
