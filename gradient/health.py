"""GET /healthz: 200 when what the service needs answers, 503 otherwise.

What it needs: the database, and with REDIS_URL the Redis that carries the channel layer (without it
every handshake fails with 1011). The body says which part is down, never how it failed: an error's text
names hosts and ports, and /healthz answers anyone. The reason goes to the log instead.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse

from gradient.middleware import OUTAGE_RETRY_AFTER_SECS

log = logging.getLogger("gradient.health")

REDIS_TIMEOUT_SECS = 1.0


@lru_cache(maxsize=1)
def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_SECS, socket_connect_timeout=REDIS_TIMEOUT_SECS
    )


def _database_ok() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        log.warning("healthz: the database does not answer: %s", exc)
        return False
    return True


def _redis_ok() -> bool:
    try:
        return bool(_redis(settings.REDIS_URL).ping())
    except Exception as exc:  # redis.RedisError, OSError: down is down
        log.warning("healthz: Redis (the channel layer) does not answer: %s", exc)
        return False


def healthz(request: HttpRequest) -> JsonResponse:
    database = _database_ok()
    channel_layer = _redis_ok() if settings.REDIS_URL else True
    body = {
        "status": "ok" if database and channel_layer else "error",
        "database": connection.vendor if database else "unavailable",
        "embedded": settings.EMBEDDED,
        "channel_layer": ("redis" if settings.REDIS_URL else "in-memory") if channel_layer else "unavailable",
    }
    response = JsonResponse(body, status=200 if database and channel_layer else 503)
    if response.status_code == 503:
        response["Retry-After"] = str(OUTAGE_RETRY_AFTER_SECS)
        response._has_been_logged = True  # type: ignore[attr-defined]  # the warning above says why
    return response
