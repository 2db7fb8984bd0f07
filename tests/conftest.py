"""Shared fixtures. Tests run on PostgreSQL (the Makefile's `pytest` target names it); a few tests that
need PostgreSQL itself (SQL-level delete actions, catalogue reads) say so with `postgres_only`."""

from __future__ import annotations

import os

import pytest
from django.db import connection


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--faults-long",
        action="store_true",
        default=False,
        help="run the fault tests (tests/test_faults_*.py) in their long form: more kills, more "
        "terminations, many more fuzz examples (also GRADIENT_FAULTS_LONG=1)",
    )


@pytest.fixture(scope="session")
def faults_long(request: pytest.FixtureRequest) -> bool:
    """The fault tests' long form: `--faults-long`, or GRADIENT_FAULTS_LONG=1 (docs/faults.md)."""
    return bool(request.config.getoption("--faults-long")) or os.environ.get("GRADIENT_FAULTS_LONG") == "1"


@pytest.fixture
def postgres_only(db: None) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (set DATABASE_URL)")


@pytest.fixture
def make_worker() -> object:
    """Register a worker as an operator would (token shown once, stored hashed): returns a function
    `make(name=None, projects=(), active=True) -> (worker, token)`. Needs a django_db mark."""
    from gradient.scheduling.models import Project
    from gradient.workers.services import worker_register

    counter = iter(range(1_000_000))

    def make(
        name: str | None = None, projects: tuple[str, ...] = (), active: bool = True
    ) -> tuple[object, str]:
        rows = [Project.objects.get_or_create(name=p)[0] for p in projects]
        worker, token = worker_register(name=name or f"worker-{next(counter)}", projects=rows)
        if not active:
            worker.active = False
            worker.save(update_fields=["active"])
        return worker, token

    return make


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, object]]]:
    """Messages the clusters services push to workers (clusters.services.common.push), as (worker id,
    message as its JSON object), recorded once their transaction commits: run the code under
    `django_capture_on_commit_callbacks(execute=True)` in a non-transactional test."""
    import msgspec
    from django.db import transaction

    from gradient.clusters.services import common

    out: list[tuple[str, dict[str, object]]] = []

    def record(worker_id: object, message: object) -> None:
        transaction.on_commit(lambda: out.append((str(worker_id), msgspec.to_builtins(message))))

    monkeypatch.setattr(common, "push_to_worker_on_commit", record)
    return out


@pytest.fixture(autouse=True)
def fresh_api_throttles() -> None:
    """The REST throttles count in the local-memory cache, which outlives a test: start each at zero."""
    from django.core.cache import cache

    cache.clear()
