"""Shared fixtures. Tests run on PostgreSQL (the Makefile's `pytest` target names it); a few tests that
need PostgreSQL itself (SQL-level delete actions, catalogue reads) say so with `postgres_only`."""

from __future__ import annotations

import pytest
from django.db import connection


@pytest.fixture
def postgres_only(db: None) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (set DATABASE_URL)")


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, object]]]:
    """Messages pushed to workers through the channel layer (send_to_worker_now), as (worker id, message).
    Pushes leave only once their transaction committed: run the code under
    `django_capture_on_commit_callbacks(execute=True)` in a non-transactional test."""
    from gradient.scheduling import effects

    out: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(
        effects, "send_to_worker_now", lambda worker_id, message: out.append((str(worker_id), message))
    )
    return out
