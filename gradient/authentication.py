"""The REST token authentication: knox's (gradient.auth), with a credential that is no token refused
as one (401), and the same tokens accepted as `Authorization: Bearer <token>`.

knox decodes the header's bytes as UTF-8, so `Authorization: Token \\xe9` (any byte above 0x7f that is
not UTF-8) failed with a 500 on every route. A token is printable ASCII (64 hex characters): anything
else cannot match one, so it is not even looked up.

Apart from gradient.auth because DRF's APIView imports these classes while its module is being loaded,
and gradient.auth imports APIView.
"""

from __future__ import annotations

from typing import Any

from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from rest_framework.exceptions import AuthenticationFailed


class TokenAuthentication(KnoxTokenAuthentication):  # type: ignore[misc]  # knox is untyped
    def authenticate_credentials(self, token: bytes) -> Any:
        try:
            text = token.decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("Invalid token.") from None
        if not text.isprintable():
            raise AuthenticationFailed("Invalid token.")
        return super().authenticate_credentials(token)


class BearerTokenAuthentication(TokenAuthentication):
    """The same tokens sent as `Authorization: Bearer <token>` (what most HTTP clients and CI systems send
    by default), beside knox's `Token` prefix. Listed after the Token class, so a 401 still asks for
    `Token` (the first class names WWW-Authenticate)."""

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"
