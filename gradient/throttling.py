"""The REST throttles: generous rates that bound a runaway client, read from the settings on every
request so an operator (or a test) can change them without a restart of the code that holds them."""

from __future__ import annotations

from django.conf import settings
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle


class UserThrottle(UserRateThrottle):
    """Requests per signed-in user (settings.GRADIENT_API_THROTTLE_USER, e.g. "20000/hour")."""

    def get_rate(self) -> str | None:
        return settings.GRADIENT_API_THROTTLE_USER or None


class AnonThrottle(AnonRateThrottle):
    """Requests per client address without a token (settings.GRADIENT_API_THROTTLE_ANON)."""

    def get_rate(self) -> str | None:
        return settings.GRADIENT_API_THROTTLE_ANON or None
