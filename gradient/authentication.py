"""The REST token authentication: knox's (gradient.auth), with a credential that is no token refused
as one (401). knox decodes the header's bytes as UTF-8, so `Authorization: Token \\xe9` (any byte above
0x7f that is not UTF-8) failed with a 500 on every route. A token is printable ASCII (64 hex
characters): anything else cannot match one, so it is not even looked up.

Apart from gradient.auth because DRF's APIView imports this class while its module is being loaded, and
gradient.auth imports APIView.
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
