"""Shared set-up for the benchmarks: a dedicated PostgreSQL database, migrated and emptied."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench"


def setup_django(database_url: str | None = None) -> str:
    """Point Django at the benchmark database (created if missing), migrate it, and return its URL."""
    url = database_url or os.environ.get("BENCH_DATABASE_URL") or DEFAULT_DATABASE_URL
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
    sys.path.insert(0, str(ROOT))
    _create_database(url)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    return url


def _create_database(url: str) -> None:
    import psycopg

    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def reset_tables() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE dispatched_job, build_attempt, evaluation_build, derivation_build_dependency, "
            "derivation_build, cluster_member, cluster_attempt, cluster_job, evaluation, idle_slot, "
            "sent_candidate, candidate_score, worker_session, worker_project, worker, project, "
            "record_entry, job_record CASCADE"
        )


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def describe_machine() -> str:
    import psutil

    return (
        f"{platform.node()}: {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}"
    )


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"p50 {percentile(values, 50):.2f} ms, p99 {percentile(values, 99):.2f} ms, "
        f"mean {statistics.fmean(values):.2f} ms (n={len(values)})"
    )
