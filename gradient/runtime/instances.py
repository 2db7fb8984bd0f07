"""Reads about server instances: which are live, and whether the service as a whole is draining."""

from __future__ import annotations

from datetime import datetime, timedelta

from gradient.recovery.models import ServerBoot

# A boot that has not heartbeaten for this long is dead (serve heartbeats every 10 s).
DEAD_BOOT_SECS = 30


def live_boots(*, now: datetime) -> list[ServerBoot]:
    """Server instances running now: not stopped, heartbeat fresh."""
    return list(
        ServerBoot.objects.filter(
            stopped_at__isnull=True, last_heartbeat__gte=now - timedelta(seconds=DEAD_BOOT_SECS)
        )
    )


def service_draining(*, now: datetime) -> bool:
    """The service is draining when no live instance serves and the latest instance to start drained
    (it is stopping, or stopped after a drain and nothing has started since). A crashed instance is not a
    drain, and with no instance ever started (Celery alone, tests) nothing is draining."""
    live = live_boots(now=now)
    if any(b.draining_since is None for b in live):
        return False
    if live:
        return True  # every live instance is draining
    latest = ServerBoot.objects.order_by("-started_at").only("draining_since").first()
    return latest is not None and latest.draining_since is not None
