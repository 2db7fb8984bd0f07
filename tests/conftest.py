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
    """Messages the clusters services push to workers (scheduling.effects.send_to_worker_on_commit), as
    (worker id, message), recorded once their transaction commits: run the code under
    `django_capture_on_commit_callbacks(execute=True)` in a non-transactional test."""
    from django.db import transaction

    from gradient.scheduling import effects

    out: list[tuple[str, dict[str, object]]] = []

    def record(worker_id: object, message: dict[str, object]) -> None:
        transaction.on_commit(lambda: out.append((str(worker_id), message)))

    monkeypatch.setattr(effects, "send_to_worker_on_commit", record)
    return out
