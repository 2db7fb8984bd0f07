"""Worker tokens: a random secret shown once at registration; only its SHA-256 is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_new() -> tuple[str, str]:
    """A fresh token (32 random bytes, URL-safe) and the hash to store. Never one starting with "-":
    `--token -x...` on a command line reads as an option (the reference worker would refuse it)."""
    token = secrets.token_urlsafe(32)
    while token.startswith("-"):
        token = secrets.token_urlsafe(32)
    return token, token_hash(token)


def token_matches(token: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented token with the stored hash."""
    return hmac.compare_digest(token_hash(token), stored_hash)
