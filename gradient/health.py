"""GET /healthz: 200 when the database answers, 503 otherwise."""

from __future__ import annotations

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        return JsonResponse({"status": "error", "database": str(exc)}, status=503)
    return JsonResponse(
        {
            "status": "ok",
            "database": connection.vendor,
            "embedded": settings.EMBEDDED,
            "channel_layer": "redis" if settings.REDIS_URL else "in-memory",
        }
    )
