"""The hand-out path end to end: N lightweight workers over /proto taking M Queued builds from `serve`,
beside the bare-claim ceiling and a naive SKIP LOCKED queue measured in the same run.

    .venv/bin/python bench/handout.py [--clients 30] [--builds 3000] [--duration 30] [--rate R]
                                      [--servers 1] [--ceiling-jobs 2000] [--ceiling-threads 8]
                                      [--naive-window 10] [--naive-jobs 200000] [--lift-address-caps]

1. The bare-claim ceiling, as bench/assign.py measures it (`bare_claim_ceiling`: threads running only
   the claim statement on distinct jobs, on reset tables).
2. The naive queue, the yardstick: a table of its own in the bench database (bench_naive_queue,
   created, truncated and seeded with --naive-jobs rows), 8 asyncio psycopg connections on the same
   PostgreSQL, each in a loop: SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1 and UPDATE to claimed, commit;
   UPDATE to done, commit (three statements and two commits per job). Jobs completed in --naive-window
   seconds. A queue that empties is not a rate: the run stops with an error if a claim finds no job or
   no job is left at the end (raise --naive-jobs). The table is truncated afterwards.
3. The tables reset again and seeded: one project, one evaluation Building with --builds Queued shared
   builds, --clients workers registered for the project.
4. --servers `serve` processes (`--no-passes`, REDIS_URL: the channel layer on Redis, as in production;
   no Celery, so no periodic pass runs), the clients spread round-robin over them. serve admits the
   clients with its default caps (docs/security.md: 16 sockets before their handshake per address, 256
   in all, 128 HTTP connections per address), though they all come from one address at once;
   --lift-address-caps lifts the per-address caps and raises the total above --clients, as every run
   before issue 35 did. Its settings are the tests' otherwise (tests/support/processes.py base_env),
   printed; its DJANGO_SETTINGS_MODULE is bench.counted_settings, gradient's settings plus a count of
   the statements it sends.
5. The clients, all in this process (the `websockets` library, compression off, no client pings), all
   connecting at once: InitConnection, InitAck, WorkerCapabilities (x86_64-linux, one build slot), a
   WorkerMetrics heartbeat every 10 s, and the job loop: RequestJob{build} -> AssignJob ->
   AssignJobResponse accepted -> JobUpdate building -> JobUpdate build_output (each BuildSpec's outputs)
   -> JobCompleted. A RequestJob unanswered for 10 s is sent again, as the reference worker does; a
   session the server closes is reconnected after 1 s. Pushed JobOffer/JobListChunk frames are ignored.
   Closed loop by default (the next RequestJob right after JobCompleted); with --rate R, RequestJobs are
   issued at R/s in all, each to an idle client (a tick with no idle client is counted as missed).
6. The measured window opens once every client has its InitAck (or --handshake-timeout after the
   start) and lasts --duration seconds, or less when the builds run out. At its end the clients stop
   sending and the run waits for PostgreSQL's statistics to be flushed before reading the commits.

Printed: the naive queue's jobs/s, whether the admission caps were lifted and serve's settings other
than the defaults; then hand-outs/s in the window and its ratio to the ceiling, RequestJob -> AssignJob
p50/p99 (from the first unanswered RequestJob of the slot), the time from the start to the first
hand-out, how many clients got their InitAck out of how many and how long the slowest took, serve and
PostgreSQL CPU per hand-out (from /proc/<pid>/stat; PostgreSQL: every `postgres` process of the machine,
and of it the backends of the bench database), commits per hand-out (pg_stat_database.xact_commit of
the bench database, read after the statistics flush), statements per hand-out (those serve's processes
sent in the window, counted in them by bench/counted_settings.py: each execute through psycopg, each
parameter set of an executemany, each COPY; not the BEGIN and COMMIT psycopg sends around a transaction.
pg_stat_statements would need a restart of the shared server), lost claims (the
gradient_claims_lost_total metric), sessions closed by the server per close code, the jobs that ever
had two open assignments at once (overlapping dispatched_job rows of one job), the naive queue's
PostgreSQL CPU per job and the hand-out rate as a multiple of it. The last line is read by outside
checks; keep its form.

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench) and
Redis (REDIS_URL, default redis://127.0.0.1:6379/7).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    WORKER_CAPABILITIES,
    describe_machine,
    load_average,
    log_dir,
    percentile,
    read_statement_counts,
    redis_url,
    reset_tables,
    seed_queued_builds,
    service_env,
    setup_django,
)

HEARTBEAT_SECS = 10.0
REPEAT_SECS = 10.0  # an unanswered RequestJob is sent again after this long (the reference worker's)
RECONNECT_SECS = 1.0
# A backend flushes its statistics at most once a second while busy, and 10 s after it went idle.
STATS_FLUSH_SECS = 11.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Pushed offers the clients ignore; a frame's `type` comes first (gradient.core.protocol.encode).
IGNORED = ('"type":"JobOffer"', '"type":"JobListChunk"')

encode = msgspec.json.encode
decode = msgspec.json.decode


@dataclass
class Config:
    clients: int = 30
    builds: int = 3000
    duration: float = 30.0
    rate: float | None = None
    servers: int = 1
    ceiling_jobs: int = 2000
    ceiling_threads: int = 8
    handshake_timeout: float = 30.0
    lift_address_caps: bool = False
    naive_window: float = 10.0
    naive_jobs: int = 200_000
    naive_connections: int = 8
    latencies_to: str | None = None


# --- the database side -------------------------------------------------------------------------------


def seed(clients: int, builds: int) -> list[tuple[str, str]]:
    """Reset tables; one evaluation Building with `builds` Queued shared builds of its project, and
    `clients` workers registered for that project. Returns their (worker id, token)."""
    from django.db import connection
    from django.utils import timezone

    from gradient.scheduling.models import Evaluation, EvaluationStatus
    from gradient.scheduling.services.projects import project_create
    from gradient.workers.services import worker_register

    reset_tables()
    now = timezone.now()
    project = project_create(name="handout")
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:handout", commit="handout", status=EvaluationStatus.BUILDING
    )
    seed_queued_builds(evaluation, builds, "handout", now)
    credentials = []
    for i in range(clients):
        worker, token = worker_register(name=f"handout-{i}", projects=[project])
        credentials.append((str(worker.id), token))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return credentials


DOUBLE_ASSIGNMENTS = """
SELECT count(DISTINCT a.job_id) FROM dispatched_job a JOIN dispatched_job b
  ON a.job_id = b.job_id AND a.id < b.id
 AND a.dispatched_at < COALESCE(b.finished_at, 'infinity')
 AND b.dispatched_at < COALESCE(a.finished_at, 'infinity')
"""


def double_assignments() -> int:
    """Jobs that ever had two open assignments at once: two dispatched_job rows of one job whose
    [dispatched_at, finished_at) intervals overlap."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(DOUBLE_ASSIGNMENTS)
        return int(cursor.fetchone()[0])


def server_close_reasons(since: Any, until: Any) -> Counter[str]:
    """The sessions closed while the clients ran, by their recorded reason (the server's side of it)."""
    from gradient.workers.models import WorkerSession

    closed = WorkerSession.objects.filter(closed_at__gte=since, closed_at__lt=until)
    reasons = closed.values_list("close_reason", flat=True)
    return Counter(reasons)


# --- counters: CPU from /proc, commits and lost claims from PostgreSQL ------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) in seconds; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def postgres_cpu() -> dict[int, float]:
    """CPU seconds of every `postgres` process on the machine, by pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat[stat.index("(") + 1 : stat.rindex(")")] == "postgres":
                out[int(entry.name)] = cpu_seconds(int(entry.name))
    return out


@dataclass
class Snapshot:
    at: float
    serve_cpu: float
    postgres: dict[int, float]
    own_cpu: float  # this process: the clients
    statements: int  # sent by serve's processes (bench/counted_settings.py)


def snapshot(serve_pids: list[int], statements: Path) -> Snapshot:
    return Snapshot(
        time.monotonic(),
        sum(cpu_seconds(p) for p in serve_pids),
        postgres_cpu(),
        cpu_seconds(os.getpid()),
        read_statement_counts(statements),
    )


COUNTERS = (
    "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()), "
    "(SELECT COALESCE(sum(value), 0) FROM metric_count WHERE name = %s)"
)


def db_counters(conn: Any) -> tuple[int, float]:
    """(commits of the bench database, lost claims so far), in one statement: one commit of its own."""
    from gradient.runtime.metrics import CLAIMS_LOST

    row = conn.execute(COUNTERS, [CLAIMS_LOST]).fetchone()
    return int(row[0]), float(row[1])


def backend_pids(conn: Any) -> set[int]:
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()").fetchall()
    return {int(r[0]) for r in rows}


# --- the naive queue: the yardstick of the same run --------------------------------------------------

NAIVE_TABLE = "bench_naive_queue"
NAIVE_CREATE = f"""
CREATE TABLE IF NOT EXISTS {NAIVE_TABLE} (
    id bigserial PRIMARY KEY,
    payload text NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    claims integer NOT NULL DEFAULT 0,
    claimed_at timestamptz,
    done_at timestamptz
);
CREATE INDEX IF NOT EXISTS {NAIVE_TABLE}_queued ON {NAIVE_TABLE} (id) WHERE status = 'queued'
"""
NAIVE_CLAIM = (
    f"SELECT id, payload FROM {NAIVE_TABLE} WHERE status = 'queued' "
    "ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
)
NAIVE_CLAIMED = (
    f"UPDATE {NAIVE_TABLE} SET status = 'claimed', claims = claims + 1, claimed_at = now() WHERE id = %s"
)
NAIVE_DONE = f"UPDATE {NAIVE_TABLE} SET status = 'done', done_at = now() WHERE id = %s"


class NaiveQueueDry(RuntimeError):
    pass


@dataclass
class NaiveResult:
    jobs: int  # completed in the window
    seconds: float
    seeded: int
    left: int  # still queued at the end
    double_claims: int
    postgres_cpu: float  # every postgres process, in the window
    client_cpu: float  # this process's, in the window

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


def naive_seed(database_url: str, jobs: int) -> None:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(NAIVE_CREATE)
        conn.execute(f"TRUNCATE {NAIVE_TABLE} RESTART IDENTITY")
        conn.execute(
            f"INSERT INTO {NAIVE_TABLE} (payload) SELECT 'job-' || i FROM generate_series(1, %s) AS i", [jobs]
        )
        conn.execute(f"VACUUM ANALYZE {NAIVE_TABLE}")


async def naive_queue(database_url: str, jobs: int, connections: int, window: float) -> NaiveResult:
    """A textbook PostgreSQL queue on its own table of the bench database, seeded with `jobs` rows:
    `connections` asyncio psycopg connections, each in a loop claiming one job (SELECT ... FOR UPDATE
    SKIP LOCKED LIMIT 1, UPDATE to claimed, commit) and completing it (UPDATE to done, commit): three
    statements and two commits per job. Jobs completed in `window` seconds once every connection is
    open; raises NaiveQueueDry when a claim finds the queue empty before the window ends."""
    import psycopg

    await asyncio.to_thread(naive_seed, database_url, jobs)
    conns = [await psycopg.AsyncConnection.connect(database_url) for _ in range(connections)]
    done: list[float] = []
    stop = asyncio.Event()

    async def loop(conn: psycopg.AsyncConnection[Any]) -> None:
        while not stop.is_set():
            row = await (await conn.execute(NAIVE_CLAIM)).fetchone()
            if row is None:
                raise NaiveQueueDry(
                    f"the naive queue ran dry: all {jobs} jobs taken before its {window:g} s window ended "
                    "(raise --naive-jobs)"
                )
            await conn.execute(NAIVE_CLAIMED, [row[0]])
            await conn.commit()
            await conn.execute(NAIVE_DONE, [row[0]])
            await conn.commit()
            done.append(time.monotonic())

    try:
        started, cpu_start, own_start = time.monotonic(), postgres_cpu(), cpu_seconds(os.getpid())
        loops = [asyncio.create_task(loop(c)) for c in conns]
        finished, _ = await asyncio.wait(loops, timeout=window, return_when=asyncio.FIRST_EXCEPTION)
        stop.set()
        ended, cpu_end, own_end = time.monotonic(), postgres_cpu(), cpu_seconds(os.getpid())
        for task in finished:
            task.result()  # a loop ends early only by raising: the queue ran dry, or the database failed
        await asyncio.gather(*loops)
    finally:
        stop.set()
        for conn in conns:
            await conn.close()
    in_window = sum(1 for at in done if at <= ended)
    with psycopg.connect(database_url, autocommit=True) as conn:
        left, doubles = conn.execute(
            f"SELECT count(*) FILTER (WHERE status = 'queued'), count(*) FILTER (WHERE claims > 1) "
            f"FROM {NAIVE_TABLE}"
        ).fetchone() or (0, 0)
        # Its dead rows would otherwise stay behind, for autovacuum to work through during the hand-outs.
        conn.execute(f"TRUNCATE {NAIVE_TABLE}")
    if left == 0:
        raise NaiveQueueDry(
            f"the naive queue took all {jobs} jobs in its window: not a rate (raise --naive-jobs)"
        )
    pg = sum(cpu - cpu_start.get(pid, 0.0) for pid, cpu in cpu_end.items())
    return NaiveResult(in_window, ended - started, jobs, int(left), int(doubles), pg, own_end - own_start)


# --- the clients ---------------------------------------------------------------------------------------


@dataclass
class Bench:
    """What every client shares: the clock, the figures, and whether to stop."""

    config: Config
    started: float = 0.0
    stopping: bool = False
    stopped_at: Any = None  # wall clock (timezone.now()) when the clients stopped
    acks: list[float] = field(default_factory=list)  # seconds from the start to each first InitAck
    handed: list[float] = field(default_factory=list)  # monotonic time of each AssignJob
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (when, ms)
    requests: int = 0
    repeats: int = 0
    unrequested: int = 0
    missed_ticks: int = 0
    server_closes: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    idle: deque[Client] = field(default_factory=deque)
    all_acked: asyncio.Event = field(default_factory=asyncio.Event)
    out_of_builds: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def open_loop(self) -> bool:
        return self.config.rate is not None


class Client:
    def __init__(self, bench: Bench, url: str, worker_id: str, token: str) -> None:
        self.bench, self.url, self.worker_id, self.token = bench, url, worker_id, token
        self.ws: Any = None
        self.acked = False
        self.waiting_since: float | None = None  # the first unanswered RequestJob of the slot
        self.repeat: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        import websockets

        while not self.bench.stopping:
            try:
                await self.session()
            except websockets.ConnectionClosed as exc:
                if not self.bench.stopping:
                    code = exc.rcvd.code if exc.rcvd is not None else 1006
                    self.bench.server_closes[str(code)] += 1
            except (TimeoutError, OSError, websockets.InvalidHandshake) as exc:
                if not self.bench.stopping:
                    self.bench.errors.append(f"connect: {exc!r}")
            finally:
                self.forget_session()
            if not self.bench.stopping:
                await asyncio.sleep(RECONNECT_SECS)

    def forget_session(self) -> None:
        self.ws = None
        self.waiting_since = None
        if self.repeat is not None:
            self.repeat.cancel()
            self.repeat = None

    async def session(self) -> None:
        import websockets

        async with websockets.connect(
            self.url, compression=None, ping_interval=None, max_size=8 * 2**20, open_timeout=120
        ) as ws:
            await ws.send(
                encode(
                    {
                        "type": "InitConnection",
                        "worker_id": self.worker_id,
                        "token": self.token,
                        "capabilities": {"fetch": False, "eval": False, "build": True},
                        "protocol": 1,
                    }
                ).decode()
            )
            frame = decode(await ws.recv())
            if frame.get("type") != "InitAck":
                self.bench.refusals[f"{frame.get('type')} {frame.get('code')}"] += 1
                await asyncio.sleep(RECONNECT_SECS)
                return
            if not self.acked:
                self.acked = True
                self.bench.acks.append(time.monotonic() - self.bench.started)
                if len(self.bench.acks) == self.bench.config.clients:
                    self.bench.all_acked.set()
            self.ws = ws
            await ws.send(encode(WORKER_CAPABILITIES).decode())
            heartbeat = asyncio.create_task(self.heartbeat(ws))
            try:
                await self.free()
                async for raw in ws:
                    if any(tag in raw[:64] for tag in IGNORED):  # pages of 1 000 candidates: not decoded
                        continue
                    frame = decode(raw)
                    kind = frame.get("type")
                    if kind == "AssignJob":
                        await self.on_assign(ws, frame)
                    elif kind in ("Error", "Reject", "AbortJob", "Draining"):
                        self.bench.errors.append(f"{kind}: {frame}")
            finally:
                heartbeat.cancel()
            if not self.bench.stopping:  # a clean close (1000, 1001) ends the iteration without raising
                self.bench.server_closes[str(ws.close_code)] += 1

    async def heartbeat(self, ws: Any) -> None:
        await asyncio.sleep(random.uniform(0, HEARTBEAT_SECS))  # noqa: S311 (spread, not security)
        metrics = encode(
            {
                "type": "WorkerMetrics",
                "cpu_usage_pct": 5.0,
                "ram_free_mb": 2048,
                "disk_speed_mbps": None,
                "upload_speed_mbps": None,
                "download_speed_mbps": None,
                "build_peak_ram_mb": None,
            }
        ).decode()
        while not self.bench.stopping:
            await ws.send(metrics)
            await asyncio.sleep(HEARTBEAT_SECS)

    async def free(self) -> None:
        """The slot is free: ask at once (closed loop) or wait for a tick (open loop)."""
        if self.bench.open_loop:
            self.bench.idle.append(self)
        else:
            await self.request()

    async def request(self) -> None:
        if self.bench.stopping or self.ws is None:
            return
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
            self.bench.requests += 1
        else:
            self.bench.repeats += 1
        self.repeat = asyncio.get_running_loop().call_later(
            REPEAT_SECS, lambda: asyncio.ensure_future(self.request())
        )
        with contextlib.suppress(Exception):  # a closed socket ends the session in run()
            await self.ws.send('{"type":"RequestJob","kind":"build"}')

    async def on_assign(self, ws: Any, frame: dict[str, Any]) -> None:
        now = time.monotonic()
        bench = self.bench
        if self.repeat is not None:
            self.repeat.cancel()
            self.repeat = None
        if self.waiting_since is None:
            bench.unrequested += 1
        else:
            bench.latencies.append((now, (now - self.waiting_since) * 1000))
            self.waiting_since = None
        bench.handed.append(now)
        if len(bench.handed) >= bench.config.builds:
            bench.out_of_builds.set()
        if bench.stopping:
            return
        job_id, assignment_id = frame["job_id"], frame["assignment_id"]
        started = time.perf_counter()
        await ws.send(
            encode(
                {
                    "type": "AssignJobResponse",
                    "job_id": job_id,
                    "assignment_id": assignment_id,
                    "accepted": True,
                }
            ).decode()
        )
        for spec in frame["job"]["builds"]:
            for update in (
                {"kind": "building", "build_id": spec["build_id"]},
                {
                    "kind": "build_output",
                    "build_id": spec["build_id"],
                    "outputs": [{**o, "nar_size": 1000} for o in spec["outputs"]],
                    "substituted": False,
                },
            ):
                await ws.send(
                    encode(
                        {
                            "type": "JobUpdate",
                            "job_id": job_id,
                            "assignment_id": assignment_id,
                            "update": update,
                        }
                    ).decode()
                )
        elapsed_ms = int((time.perf_counter() - started) * 1000)
        await ws.send(
            encode(
                {
                    "type": "JobCompleted",
                    "job_id": job_id,
                    "assignment_id": assignment_id,
                    "elapsed_ms": elapsed_ms,
                }
            ).decode()
        )
        await self.free()


async def ticker(bench: Bench, rate: float) -> None:
    """Open loop: a RequestJob every 1/rate seconds in all, each from an idle client."""
    period = 1.0 / rate
    next_at = time.monotonic()
    while not bench.stopping:
        next_at += period
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        while bench.idle and bench.idle[0].ws is None:  # its session ended meanwhile
            bench.idle.popleft()
        if bench.idle:
            await bench.idle.popleft().request()
        else:
            bench.missed_ticks += 1


@dataclass
class Window:
    start: Snapshot
    end: Snapshot
    handouts: int
    latencies: list[float]
    early: bool
    acked: int  # clients with their InitAck when it opened


async def drive(
    bench: Bench,
    urls: list[str],
    credentials: list[tuple[str, str]],
    serve_pids: list[int],
    statements: Path,
    conn: Any,
) -> tuple[Window, tuple[int, float], tuple[int, float], set[int]]:
    """Run the clients; return the window and the database counters at its start and end."""
    from django.utils import timezone

    config = bench.config
    clients = [Client(bench, urls[i % len(urls)], w, t) for i, (w, t) in enumerate(credentials)]
    bench.started = time.monotonic()
    tasks = [asyncio.create_task(c.run()) for c in clients]
    if bench.open_loop:
        assert config.rate is not None
        tasks.append(asyncio.create_task(ticker(bench, config.rate)))
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(bench.all_acked.wait(), config.handshake_timeout)
    start = snapshot(serve_pids, statements)
    db_start = await asyncio.to_thread(db_counters, conn)
    handed_before, acked_before = len(bench.handed), len(bench.acks)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(bench.out_of_builds.wait(), config.duration)
    end = snapshot(serve_pids, statements)
    bench.stopping = True
    bench.stopped_at = timezone.now()
    handouts = len(bench.handed) - handed_before
    latencies = [ms for at, ms in bench.latencies if start.at <= at <= end.at]
    if config.latencies_to:  # every answered RequestJob: seconds since the clients started, ms waited
        lines = "".join(f"{at - bench.started:.3f} {ms:.1f}\n" for at, ms in bench.latencies)
        await asyncio.to_thread(Path(config.latencies_to).write_text, lines)
    backends = await asyncio.to_thread(backend_pids, conn)
    await asyncio.sleep(STATS_FLUSH_SECS)  # the clients are quiet: every backend's statistics flushed
    db_end = await asyncio.to_thread(db_counters, conn)
    await asyncio.gather(*(c.ws.close() for c in clients if c.ws is not None), return_exceptions=True)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    window = Window(start, end, handouts, latencies, bench.out_of_builds.is_set(), acked_before)
    return window, db_start, db_end, backends


# --- the run -----------------------------------------------------------------------------------------


def run(config: Config, database_url: str) -> None:
    import psycopg
    from assign import bare_claim_ceiling
    from connections import raise_fd_limit
    from django.db import close_old_connections
    from django.utils import timezone

    from tests.support.processes import serve

    print(
        f"clients: {config.clients}, builds: {config.builds}, servers: {config.servers}, "
        + (f"open loop at {config.rate:g} RequestJobs/s" if config.rate else "closed loop")
        + f", window {config.duration:g} s"
    )
    ceiling = bare_claim_ceiling(config.ceiling_jobs, config.ceiling_threads)
    print(
        f"bare-claim ceiling: {ceiling:.0f} claims/s "
        f"({config.ceiling_jobs} jobs, {config.ceiling_threads} threads)"
    )
    naive = asyncio.run(
        naive_queue(database_url, config.naive_jobs, config.naive_connections, config.naive_window)
    )
    print(
        f"naive SKIP LOCKED queue: {naive.rate:.0f} jobs/s ({naive.jobs} in {naive.seconds:.1f} s, "
        f"{config.naive_connections} connections, {naive.seeded} seeded, {naive.left} left; "
        f"jobs claimed twice: {naive.double_claims})"
    )
    seeded = time.perf_counter()
    credentials = seed(config.clients, config.builds)
    print(
        f"seeded {config.builds} Queued builds, {config.clients} workers "
        f"in {time.perf_counter() - seeded:.1f} s"
    )
    close_old_connections()
    raise_fd_limit(config.clients * config.servers + 200)  # serve inherits it
    # By default serve admits the clients as it would strangers (docs/security.md): they all connect at
    # once from one address. Lifted, the per-address caps are off and the cap on sockets before their
    # handshake is above the clients, as every benchmark before issue 35 ran.
    lifted = {"GRADIENT_PROTO_MAX_UNAUTHENTICATED": str(max(256, config.clients + 64))}
    # The scheduling policy and the presence flush as in production, not the tests' (`simple`, 0.25 s):
    # the clients report 5 % CPU and half their RAM free, which the default policy does not hold back.
    defaults: dict[str, str | None] = {
        "GRADIENT_SCHEDULING_POLICY": None,
        "GRADIENT_PRESENCE_FLUSH_SECS": None,
    }
    env = service_env(
        database_url,
        redis_url(),
        lift_address_caps=config.lift_address_caps,
        **defaults,
        **(lifted if config.lift_address_caps else {}),
    )
    print(
        "admission caps: "
        + ("lifted (--lift-address-caps)" if config.lift_address_caps else "the defaults (not lifted)")
        + "; serve's settings other than the defaults: "
        + ", ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("GRADIENT_"))
    )
    logs = log_dir()
    statements = Path(tempfile.mkdtemp(prefix="statements-", dir=logs))
    env.update(DJANGO_SETTINGS_MODULE="bench.counted_settings", BENCH_STATEMENT_COUNTS=str(statements))
    bench = Bench(config)
    since = timezone.now()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, statements, ignore_errors=True)
        servers = [
            stack.enter_context(serve(env, logs, extra_args=["--no-passes", "--log-level", "warning"]))
            for _ in range(config.servers)
        ]
        conn = stack.enter_context(psycopg.connect(database_url, autocommit=True))
        pids = [s.process.pid for s in servers]
        window, db_start, db_end, backends = asyncio.run(
            drive(bench, [s.ws_url for s in servers], credentials, pids, statements, conn)
        )
        doubles = double_assignments()
        reasons = server_close_reasons(since, bench.stopped_at)
        close_old_connections()
        logs_of = [s.log_path for s in servers]
    report(bench, window, ceiling, naive, db_start, db_end, backends, doubles, reasons, logs_of)


def report(
    bench: Bench,
    window: Window,
    ceiling: float,
    naive: NaiveResult,
    db_start: tuple[int, float],
    db_end: tuple[int, float],
    backends: set[int],
    doubles: int,
    reasons: Counter[str],
    logs: list[Path],
) -> None:
    config = bench.config
    seconds = window.end.at - window.start.at
    n = window.handouts
    rate = n / seconds if seconds > 0 else float("nan")
    per = (lambda x: x / n * 1000) if n else (lambda x: float("nan"))
    serve_cpu = window.end.serve_cpu - window.start.serve_cpu
    pg = {pid: cpu - window.start.postgres.get(pid, 0.0) for pid, cpu in window.end.postgres.items()}
    pg_all, pg_bench = sum(pg.values()), sum(v for pid, v in pg.items() if pid in backends)
    commits = db_end[0] - db_start[0] - 2  # the bench's own: the first counters and the backends statements
    lost = db_end[1] - db_start[1]
    p50, p99 = percentile(window.latencies, 50), percentile(window.latencies, 99)
    first = min(bench.handed) - bench.started if bench.handed else float("nan")
    acked = len(bench.acks)
    print(f"  window: {seconds:.1f} s" + (" (ended early: every build handed out)" if window.early else ""))
    print(
        f"  hand-outs: {n} in the window = {rate:.1f}/s ({len(bench.handed)} in all); "
        f"{rate / ceiling:.3f} of the claim ceiling"
    )
    print(f"  RequestJob -> AssignJob: p50 {p50:.1f} ms, p99 {p99:.1f} ms (n={len(window.latencies)})")
    print(
        f"  RequestJobs: {bench.requests} first, "
        f"{bench.repeats} repeated after {REPEAT_SECS:g} s unanswered; "
        f"AssignJobs without a RequestJob out: {bench.unrequested}"
        + (f"; open-loop ticks with no idle client: {bench.missed_ticks}" if bench.open_loop else "")
    )
    print(f"  first hand-out {first:.2f} s after the clients started connecting")
    slowest = max(bench.acks) if bench.acks else float("nan")
    print(
        f"  InitAck: {acked} of {config.clients} clients ({window.acked} when the window opened, "
        f"{window.start.at - bench.started:.1f} s after the start); the slowest after {slowest:.2f} s"
    )
    print(f"  serve CPU: {serve_cpu:.1f} s in the window = {per(serve_cpu):.2f} ms per hand-out")
    statements = window.end.statements - window.start.statements
    print(
        f"  PostgreSQL CPU: {pg_all:.1f} s (every postgres process) = {per(pg_all):.2f} ms per hand-out; "
        f"of it the bench database's backends {pg_bench:.1f} s = {per(pg_bench):.2f} ms"
    )
    clients_cpu = window.end.own_cpu - window.start.own_cpu
    print(f"  the clients' CPU (this process): {clients_cpu:.1f} s in the window")
    print(f"  commits: {commits} = {commits / n if n else float('nan'):.2f} per hand-out")
    print(
        f"  statements sent by serve: {statements} = {statements / n if n else float('nan'):.1f} "
        "per hand-out (each execute through psycopg; not BEGIN and COMMIT)"
    )
    print(f"  lost claims: {lost:.0f}")
    closes = ", ".join(f"{code}: {k}" for code, k in sorted(bench.server_closes.items())) or "none"
    print(f"  sessions closed by the server (close code: count): {closes}")
    closed = {r: k for r, k in reasons.items() if r}
    if closed:
        print(f"  sessions closed, as the server recorded them: {dict(closed)}")
    if bench.refusals:
        print(f"  handshakes refused: {dict(bench.refusals)}")
    for error in bench.errors[:5]:
        print(f"  error: {error}")
    if len(bench.errors) > 5:
        print(f"  ... {len(bench.errors) - 5} more errors")
    print(f"  serve logs: {', '.join(str(p) for p in logs)}")
    print(f"  {load_average()} at the end")
    if config.servers > 1:
        print(f"  jobs that ever had two open assignments at once: {doubles}")
    print(
        f"  naive SKIP LOCKED queue: {naive.rate:.1f} jobs/s, PostgreSQL CPU "
        f"{naive.postgres_cpu / naive.jobs * 1000:.2f} ms per job, its clients' "
        f"{naive.client_cpu / naive.jobs * 1000:.2f} ms (3 statements, 2 commits per job)"
    )
    print(f"  hand-outs: {rate:.1f}/s = {rate / naive.rate:.2f} × the naive queue")
    print(
        f"handout: {rate:.1f}/s = {rate / ceiling:.3f} of the claim ceiling ({ceiling:.0f}/s); "
        f"RequestJob->AssignJob p50 {p50:.1f} ms p99 {p99:.1f} ms; double assignments {doubles}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--builds", type=int, default=3000, help="Queued builds seeded before the run")
    parser.add_argument("--duration", type=float, default=30.0, help="the measured window, seconds")
    parser.add_argument("--rate", type=float, default=None, help="open loop: RequestJobs per second in all")
    parser.add_argument("--servers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--ceiling-jobs", type=int, default=2000)
    parser.add_argument("--ceiling-threads", type=int, default=8)
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=30.0,
        help="the window opens when every client has its InitAck, or this long after the start",
    )
    parser.add_argument(
        "--lift-address-caps",
        action="store_true",
        help="lift serve's per-address caps and raise its cap on sockets before their handshake above "
        "--clients (as before issue 35); by default serve runs with the default caps",
    )
    parser.add_argument(
        "--naive-window", type=float, default=10.0, help="the naive SKIP LOCKED queue's window, seconds"
    )
    parser.add_argument(
        "--naive-jobs",
        type=int,
        default=200_000,
        help="jobs seeded into the naive queue; the run fails if its window empties them",
    )
    parser.add_argument(
        "--latencies-to",
        default=None,
        help="write each answered RequestJob as a line: seconds since the clients started, ms waited",
    )
    args = parser.parse_args()
    if min(args.clients, args.builds, args.ceiling_jobs, args.ceiling_threads, args.naive_jobs) < 1:
        parser.error("--clients, --builds, --ceiling-jobs, --ceiling-threads and --naive-jobs must be >= 1")
    if args.duration <= 0 or args.naive_window <= 0:
        parser.error("--duration and --naive-window must be > 0")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be > 0")
    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {urlparse(url).path.lstrip('/')}; Redis: {redis_url()}")
    try:
        run(Config(**vars(args)), url)
    except NaiveQueueDry as exc:
        sys.exit(f"handout: {exc}")


if __name__ == "__main__":
    main()
