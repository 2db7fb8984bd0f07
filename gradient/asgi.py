"""The ASGI application: Django over HTTP, the worker protocol over WebSocket at /proto."""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up first)
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import re_path  # noqa: E402

from gradient.workers.proto.routing import websocket_urlpatterns  # noqa: E402

UNKNOWN_WEBSOCKET = b'{"detail": "No WebSocket route here: workers connect to /proto."}'


async def unknown_websocket(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A WebSocket handshake on any path but /proto: 404, as HTTP answers an unknown URL (uvicorn's
    denial-response extension); a server without it gets the handshake refused (close 4404)."""
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        await send(
            {
                "type": "websocket.http.response.start",
                "status": 404,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": UNKNOWN_WEBSOCKET})
    else:
        await send({"type": "websocket.close", "code": 4404})


application = ProtocolTypeRouter(
    {
        # The admin's CSS and scripts, served by Django itself: no separate web server to set up.
        "http": ASGIStaticFilesHandler(django_asgi_app),
        "websocket": URLRouter([*websocket_urlpatterns, re_path(r"", unknown_websocket)]),  # type: ignore[arg-type]
    }
)
