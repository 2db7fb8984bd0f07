"""WebSocket routes. The worker protocol's consumer is mounted at /proto (exactly)."""

from __future__ import annotations

from typing import Any

from django.urls import re_path

from gradient.workers.proto.consumer import WorkerConsumer

websocket_urlpatterns: list[Any] = [
    re_path(r"^proto$", WorkerConsumer.as_asgi()),
]
