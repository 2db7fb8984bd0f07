"""Counters in a window, shared by every process: `rate_counter` rows, one atomic upsert per hit.

A window starts at its key's first hit and lasts `period` seconds; a hit after it starts a new one. The
REST and login throttles (gradient.throttling) count requests with it, and the build logs
(scheduling.services.logs) a worker's log bytes per hour.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.utils import timezone

# One hit in this many also deletes counters whose window ended a day ago.
PRUNE_ONE_IN = 1000

_UPSERT = """
    INSERT INTO rate_counter (key, window_start, hits) VALUES (%(key)s, %(now)s, %(add)s)
    ON CONFLICT (key) DO UPDATE SET
        hits = CASE WHEN rate_counter.window_start > %(cutoff)s
                    THEN rate_counter.hits + %(add)s ELSE %(add)s END,
        window_start = CASE WHEN rate_counter.window_start > %(cutoff)s
                            THEN rate_counter.window_start ELSE %(now)s END
    RETURNING hits, window_start
"""


def hit(key: str, period: int, *, now: datetime | None = None, add: int = 1) -> tuple[int, float]:
    """Count one hit (`add` = 0: only look) of `key` in a window of `period` seconds. Returns the hits
    of the current window, this one included, and the seconds until it ends."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=period)
    params: dict[str, Any] = {"key": key, "now": now, "add": add, "cutoff": cutoff}
    with connection.cursor() as cursor:
        if add == 0:
            cursor.execute("SELECT hits, window_start FROM rate_counter WHERE key = %(key)s", params)
            row = cursor.fetchone()
            if row is None or _aware(row[1]) <= cutoff:
                return 0, float(period)
        else:
            cursor.execute(_UPSERT, params)
            row = cursor.fetchone()
            if random.randrange(PRUNE_ONE_IN) == 0:  # noqa: S311 (not security)
                cursor.execute(
                    "DELETE FROM rate_counter WHERE window_start < %s",
                    [now - timedelta(seconds=period + 86400)],
                )
    hits, window_start = int(row[0]), _aware(row[1])
    return hits, max(0.0, (window_start + timedelta(seconds=period) - now).total_seconds())


def _aware(value: Any) -> datetime:
    if isinstance(value, str):  # SQLite hands back text
        value = datetime.fromisoformat(value)
    if timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value  # type: ignore[no-any-return]
