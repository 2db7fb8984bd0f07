"""REST authentication beside knox's: a module of its own, as DRF's APIView imports the authentication
classes of the settings while gradient.auth imports DRF's views."""

from __future__ import annotations

from typing import Any

from knox.auth import TokenAuthentication


class BearerTokenAuthentication(TokenAuthentication):  # type: ignore[misc]  # knox is untyped
    """The same tokens sent as `Authorization: Bearer <token>` (what most HTTP clients and CI systems send
    by default), beside knox's `Token` prefix. Listed after knox's class, so a 401 still asks for
    `Token` (the first class names WWW-Authenticate)."""

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"
