"""Shared set-up for the benchmarks: a dedicated PostgreSQL database, migrated and emptied; the real
processes (`serve`, Celery) from tests/support/processes.py; memory, load and pass-duration sampling."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/7"
LOG_DIR = ROOT / "var" / "bench"
# Every client of a benchmark is on this machine, so at one address: the per-address caps of
# docs/security.md (sockets before their handshake, open HTTP connections) would make the clients' own
# bursts thrash. Most benchmarks measure the service, not the admission of strangers, and lift them.
ADDRESS_CAPS = ("GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS", "GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS")


def setup_django(database_url: str | None = None) -> str:
    """Point Django at the benchmark database (created if missing), migrate it, and return its URL."""
    url = database_url or os.environ.get("BENCH_DATABASE_URL") or DEFAULT_DATABASE_URL
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
    create_database(url)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    return url


def redis_url() -> str:
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def create_database(url: str) -> None:
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
            "sent_candidate, sent_offer, sent_list, candidate_score, worker_session, worker_project, "
            "worker, project, record_entry, job_record, cached_path, pass_state, server_boot CASCADE"
        )


def service_env(
    database_url: str, redis: str | None, *, lift_address_caps: bool = True, **extra: str | None
) -> dict[str, str]:
    """The environment of a `serve` or Celery process of a benchmark: the tests' (scoring policy
    `simple`, since the workers' CPU figures are this machine's and would read as saturation), quiet
    logs, this database, and Redis when given (None: the in-memory channel layer and in-process
    passes); the per-address caps (ADDRESS_CAPS) lifted unless `lift_address_caps` is False."""
    from tests.support.processes import base_env

    caps = dict.fromkeys(ADDRESS_CAPS, "0") if lift_address_caps else {}
    return base_env(
        DATABASE_URL=database_url,
        REDIS_URL=redis,
        GRADIENT_LOG_LEVEL=os.environ.get("GRADIENT_LOG_LEVEL", "WARNING"),
        **{**caps, **extra},
    )


def read_statement_counts(directory: Path) -> int:
    """The statements sent so far by every `serve` process that counts them into `directory`
    (bench/counted_settings.py: a little-endian 64-bit count per process)."""
    return sum(int.from_bytes(path.read_bytes()[:8], "little") for path in directory.iterdir())


def log_dir() -> Path:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return LOG_DIR


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (NaN once it is gone)."""
    import psutil

    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return float("nan")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


class PassSampler:
    """Pass durations as the passes record them: each run of a pass ends in pass_lease_release, which
    writes its `last_duration_ms` and bumps `runs` on its pass_state row. Polled often enough (well
    under a pass interval), every run is seen once."""

    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.durations: dict[str, list[float]] = {}

    def baseline(self) -> None:
        """Runs finished before the measured run do not count."""
        from gradient.recovery.models import PassState

        self.runs = dict(PassState.objects.values_list("name", "runs"))

    def poll(self) -> None:
        from gradient.recovery.models import PassState

        for name, runs, duration in PassState.objects.values_list("name", "runs", "last_duration_ms"):
            if runs > self.runs.get(name, 0) and duration is not None:
                self.durations.setdefault(name, []).append(duration)
            self.runs[name] = runs

    def lines(self) -> list[str]:
        if not self.durations:
            return ["  (no pass finished during the run)"]
        return [
            f"  {name:<26} {len(values):>3} runs: p50 {percentile(values, 50):8.1f} ms, "
            f"max {max(values):8.1f} ms"
            for name, values in sorted(self.durations.items())
        ]


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
        f"Python {platform.python_version()}; {load_average()}"
    )


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"p50 {percentile(values, 50):.2f} ms, p99 {percentile(values, 99):.2f} ms, "
        f"mean {statistics.fmean(values):.2f} ms (n={len(values)})"
    )


def wait_for(predicate: Any, timeout: float, interval: float = 0.2, what: str = "") -> Any:
    """Poll `predicate` until it is truthy; raise naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# What every benchmark's build worker says of itself after its handshake (one x86_64-linux slot).
WORKER_CAPABILITIES: dict[str, Any] = {
    "type": "WorkerCapabilities",
    "architectures": ["x86_64-linux"],
    "system_features": [],
    "max_concurrent_builds": 1,
    "cpu_count": 2,
    "ram_total_mb": 4096,
    "cpu_core_score": 1000,
    "zone": None,
    "endpoint": None,
}
SEED_BATCH = 5000


def seed_queued_builds(evaluation: Any, count: int, tag: str, now: Any) -> list[Any]:
    """`count` Queued x86_64-linux shared builds that `evaluation` needs, in batches of SEED_BATCH;
    their paths carry `tag`. Returns the builds."""
    from gradient.scheduling.models import DerivationBuild, EvaluationBuild

    made: list[Any] = []
    for start in range(0, count, SEED_BATCH):
        builds = DerivationBuild.objects.bulk_create(
            [
                DerivationBuild(
                    drv_path=f"/nix/store/{i:032d}-{tag}-{i}.drv",
                    system="x86_64-linux",
                    status="Queued",
                    queued_at=now,
                    outputs=[{"name": "out", "path": f"/nix/store/{i:032d}-{tag}-{i}"}],
                )
                for i in range(start, min(count, start + SEED_BATCH))
            ]
        )
        EvaluationBuild.objects.bulk_create([EvaluationBuild(evaluation=evaluation, build=b) for b in builds])
        made.extend(builds)
    return made
