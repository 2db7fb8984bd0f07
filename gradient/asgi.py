"""The ASGI application: Django over HTTP, the worker protocol over WebSocket at /proto."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up first)
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from gradient.workers.proto.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The admin's CSS and scripts, served by Django itself: no separate web server to set up.
        "http": ASGIStaticFilesHandler(django_asgi_app),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
