"""Ids as they arrive from outside (a report's assignment_id, a REST path, a job key's tail)."""

from __future__ import annotations

import uuid

# Strings read lately and their uuids: a job's reports name its assignment four times or more, and
# uuid.UUID parses in Python (a tenth of a report batch's time). Emptied when full; uuids are immutable.
_PARSED: dict[str, uuid.UUID] = {}
_PARSED_MAX = 1 << 16


def parse_uuid(value: object) -> uuid.UUID | None:
    """The uuid `value` is or spells (any form `uuid.UUID` reads), or None for anything else: a
    malformed string, None, a number. Never raises."""
    if isinstance(value, uuid.UUID):
        return value
    text = value if type(value) is str else None
    if text is not None and (known := _PARSED.get(text)) is not None:
        return known
    try:
        parsed = uuid.UUID(str(value))
    except (ValueError, TypeError, AttributeError):
        return None
    if text is not None:
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[text] = parsed
    return parsed
