"""Startup recovery, run by `serve` before it accepts connections."""

from __future__ import annotations

import logging
import uuid

from django.utils import timezone

from gradient.recovery.models import ServerBoot

log = logging.getLogger("gradient.recovery")


def run_startup_recovery(*, boot_id: uuid.UUID) -> None:
    """Marks the boot recovered. The recovery steps of waiting-and-recovery.md (closing assignments and
    attempts of earlier boots, requeueing work) are added here as the apps that own them land."""
    ServerBoot.objects.filter(id=boot_id).update(recovered_at=timezone.now())
    log.info("startup recovery done for boot %s", boot_id)
