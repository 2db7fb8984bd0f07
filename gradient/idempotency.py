"""Idempotency-Key scope: a key is its submitter's, so another user's use of the same key neither
answers 409 (which would show that someone used it) nor takes it first. The key stored on the job's
record is `u<user id>:<key>`, or `u<user id>:sha256:<hex>` when that would be longer than the column."""

from __future__ import annotations

import hashlib
from typing import Any

MAX_STORED = 255


def scoped_key(user: Any, key: str) -> str:
    prefix = f"u{user.pk}:"
    if len(prefix) + len(key) <= MAX_STORED:
        return prefix + key
    return f"{prefix}sha256:{hashlib.sha256(key.encode()).hexdigest()}"
