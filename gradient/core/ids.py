"""Ids as they arrive from outside (a report's assignment_id, a REST path, a job key's tail)."""

from __future__ import annotations

import uuid


def parse_uuid(value: object) -> uuid.UUID | None:
    """The uuid `value` is or spells (any form `uuid.UUID` reads), or None for anything else: a
    malformed string, None, a number. Never raises."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except (ValueError, TypeError, AttributeError):
        return None
