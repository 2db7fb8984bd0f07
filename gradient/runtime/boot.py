"""The id of this process's ServerBoot, set once by `serve` (and by tests that stand in for it)."""

from __future__ import annotations

import uuid

_current: uuid.UUID | None = None


def set_current_boot(boot_id: uuid.UUID) -> None:
    global _current
    _current = boot_id


def current_boot() -> uuid.UUID:
    """The boot that owns sessions opened by this process; a process that never called serve (tests,
    Celery workers) gets a stable id of its own."""
    global _current
    if _current is None:
        _current = uuid.uuid4()
    return _current
