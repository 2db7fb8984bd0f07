"""The ASGI application: Django over HTTP, the worker protocol over WebSocket at /proto."""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
django_asgi_app = get_asgi_application()

from asgiref.sync import sync_to_async  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up first)
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import SuspiciousOperation  # noqa: E402
from django.core.handlers.exception import response_for_exception  # noqa: E402
from django.http import Http404, HttpRequest, HttpResponseBase  # noqa: E402
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


class StaticFiles(ASGIStaticFilesHandler):
    """Django's static files handler, with a path that climbs out of the static files (`../`, `%2e%2e`)
    answered 404 like any missing file: Django's finders raise SuspiciousFileOperation for it, which the
    handler let through as a 500 with its traceback (issue 36, finding 6)."""

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        try:
            return await super().get_response_async(request)
        except SuspiciousOperation:
            missing = Http404("No such static file.")
            return await sync_to_async(response_for_exception, thread_sensitive=False)(request, missing)


application = ProtocolTypeRouter(
    {
        # The admin's CSS and scripts, served by Django itself: no separate web server to set up.
        "http": StaticFiles(django_asgi_app),
        "websocket": URLRouter([*websocket_urlpatterns, re_path(r"", unknown_websocket)]),  # type: ignore[arg-type]
    }
)
