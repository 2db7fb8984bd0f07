"""The project package's own table: the rate counters of gradient.throttling."""

from __future__ import annotations

from django.db import models


class RateCounter(models.Model):
    """Hits of one throttle key (a user, an address, an account's failed logins) since `window_start`.
    Kept in the database so every `serve` process shares the count and a restart does not reset it; one
    atomic upsert per hit (gradient.runtime.counters.hit)."""

    key = models.CharField(max_length=255, primary_key=True)
    window_start = models.DateTimeField()
    hits = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "rate_counter"

    def __str__(self) -> str:
        return f"{self.key}: {self.hits} since {self.window_start:%Y-%m-%d %H:%M:%S}"
