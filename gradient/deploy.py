"""What `serve` refuses to start with (docs/security.md, the deploy checklist).

Without DJANGO_SECRET_KEY the settings fall back to a key that is in the source code, so anyone could
sign a session cookie or a password-reset link. That is fine for the embedded development mode (SQLite,
one process); outside it, `serve` listens on loopback only (a local test, a conformance run:
operations.md documents the development key as the default) and refuses any other address. DEBUG is no
exception (issue 36, finding 5): with DJANGO_DEBUG=1 a public key served on every address, silently. The
embedded mode may still listen beyond loopback (`make run HOST=0.0.0.0` on a fresh checkout), but says
loudly what that means.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.core.management.base import CommandError


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_insecure_start(*, host: str) -> str | None:
    """Raise CommandError when `serve` must not start with these settings on `host`; returns a warning
    to print when it may, but only on loopback, or in the embedded mode beyond it."""
    if not settings.USING_DEVELOPMENT_SECRET_KEY:
        return None
    if settings.EMBEDDED:
        if _loopback(host):
            return None
        return (
            f"gradient: WARNING: serve listens on {host} with the built-in development key, which is "
            "public: anyone who reaches this address can forge an admin session. The embedded mode allows "
            "it for trying Gradient out; set DJANGO_SECRET_KEY (a long random string) for anything else "
            "(docs/security.md)."
        )
    if not _loopback(host):
        raise CommandError(
            "DJANGO_SECRET_KEY is not set: the built-in development key is public. Set DJANGO_SECRET_KEY "
            "(a long random string, the same for every serve process) before listening on "
            f"{host}; without it serve listens on loopback only (docs/security.md)."
        )
    return "gradient: DJANGO_SECRET_KEY is not set; using the development key, on loopback only"
