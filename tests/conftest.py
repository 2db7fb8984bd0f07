"""Shared fixtures. Tests run on PostgreSQL (the Makefile's `pytest` target names it); a few tests that
need PostgreSQL itself (SQL-level delete actions, catalogue reads) say so with `postgres_only`."""

from __future__ import annotations

import pytest
from django.db import connection


@pytest.fixture
def postgres_only(db: None) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (set DATABASE_URL)")
