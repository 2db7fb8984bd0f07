"""The fleet simulator: N reference workers (sim executor) over real WebSockets against one or more
`serve` processes sharing one PostgreSQL (and Redis), running M evaluations of a given shape.

    .venv/bin/python bench/fleet.py --workers 100 --servers 1 --evaluations 20 --shape wide --size 40
    .venv/bin/python bench/fleet.py --workers 100 --servers 2 --evaluations 40 --shape mixed --size 10
    .venv/bin/python bench/fleet.py --workers 100 --shape queued --size 2000   # queued builds only

The workers are the reference worker itself (`gradient.workers.client.worker.Worker` with the `sim`
executor), many to a process (`--worker-procs`), each with its own WebSocket, spread round-robin over the
servers. With one server and no `--celery`, `serve` runs the periodic passes in-process (no REDIS_URL,
the in-memory channel layer); with `--servers` above 1 or `--celery`, every `serve` and a Celery worker
with beat share Redis (REDIS_URL, default redis://127.0.0.1:6379/7) and the passes run on beat.

Shapes (each evaluation gets its own store paths through `salt`): `chain` (a chain of --size builds),
`diamond` (4 builds), `wide` (--size independent builds), `mixed` (the three in turn), `queued` (one
evaluation already Building with --size Queued builds: the assignment path alone, as bench/assign.py
uses it). Evaluations are submitted once every worker is connected.

Printed: assignments per second (evaluation and build jobs, from the dispatched_job rows),
RequestJob-to-AssignJob latency p50/p99 as the workers saw it, every pass's duration as the pass
recorded it (pass_state), and each server's resident memory (idle, peak, after).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ROOT,
    PassSampler,
    describe_machine,
    load_average,
    log_dir,
    redis_url,
    reset_tables,
    rss_mb,
    service_env,
    setup_django,
    summary,
    wait_for,
)

SHAPES = ("chain", "diamond", "wide", "mixed", "queued")


@dataclass
class FleetConfig:
    workers: int = 100
    servers: int = 1
    evaluations: int = 20
    shape: str = "wide"
    size: int = 40
    celery: bool = False
    worker_procs: int = 2
    slots: int = 1
    build_ms: int = 0
    idle_request_secs: float = 10.0
    timeout: float = 900.0

    @property
    def uses_redis(self) -> bool:
        return self.servers > 1 or self.celery


@dataclass
class FleetResult:
    config: FleetConfig
    assignments: int = 0
    eval_assignments: int = 0
    elapsed: float = 0.0
    span: float = 0.0
    latencies: list[float] = field(default_factory=list)
    requests: int = 0
    overlapped: int = 0
    evaluations: dict[str, int] = field(default_factory=dict)
    builds: int = 0
    rss: list[tuple[float, float, float]] = field(default_factory=list)  # idle, peak, after per serve
    passes: PassSampler = field(default_factory=PassSampler)
    load: str = ""
    errors: list[str] = field(default_factory=list)

    def print(self) -> None:
        c = self.config
        mode = "Redis + Celery beat" if c.uses_redis else "in-process passes"
        print(
            f"fleet: {c.workers} reference workers (sim, {c.slots} slot(s), {c.worker_procs} processes) over "
            f"{c.servers} serve process(es), {mode}; {c.evaluations} evaluation(s) of shape {c.shape} "
            f"(size {c.size}), build time {c.build_ms} ms, idle RequestJob every {c.idle_request_secs:g} s"
        )
        print(f"  evaluations: {self.evaluations}; shared builds: {self.builds}")
        rate = self.assignments / self.elapsed if self.elapsed else float("nan")
        span_rate = (self.assignments - 1) / self.span if self.span else float("nan")
        print(
            f"  assignments: {self.assignments} ({self.eval_assignments} evaluation jobs) in "
            f"{self.elapsed:.1f} s = {rate:.1f}/s (first to last hand-out: {span_rate:.1f}/s)"
        )
        print(f"  RequestJob -> AssignJob latency: {summary(self.latencies)}")
        print(
            f"  RequestJobs sent: {self.requests}; AssignJobs after more than one RequestJob (an idle "
            f"repeat: that sample is bounded by the idle interval): {self.overlapped}"
        )
        print("  pass durations (pass_state):")
        for line in self.passes.lines():
            print(line)
        for i, (idle, peak, after) in enumerate(self.rss):
            print(f"  serve {i + 1} RSS: {idle:.0f} MiB idle, {peak:.0f} MiB peak, {after:.0f} MiB after")
        print(f"  {self.load} at the end")
        for error in self.errors[:5]:
            print(f"  error: {error}")


# --- the database side -------------------------------------------------------------------------------


def _register(config: FleetConfig) -> tuple[Any, list[tuple[str, str]]]:
    from gradient.scheduling.services.projects import project_create
    from gradient.workers.services import worker_register

    reset_tables()
    project = project_create(name="fleet")
    credentials = []
    for i in range(config.workers):
        worker, token = worker_register(name=f"fleet-{i}", projects=[project])
        credentials.append((str(worker.id), token))
    return project, credentials


def _repository(shape: str, n: int, config: FleetConfig) -> str:
    ms = f"&duration_ms={config.build_ms}"
    if shape == "chain":
        return f"sim:chain?n={config.size}&salt=fleet{n}{ms}"
    if shape == "diamond":
        return f"sim:diamond?salt=fleet{n}{ms}"
    return f"sim:wide?n={config.size}&salt=fleet{n}{ms}"


def submit_evaluations(project: Any, config: FleetConfig) -> None:
    from django.utils import timezone

    from gradient.scheduling.services.evaluations import evaluation_create

    shapes = ("chain", "diamond", "wide") if config.shape == "mixed" else (config.shape,)
    for n in range(config.evaluations):
        evaluation_create(
            project=project,
            repository=_repository(shapes[n % len(shapes)], n, config),
            commit="fleet",
            now=timezone.now(),
        )


def seed_queued_builds(project: Any, jobs: int) -> None:
    """One evaluation already Building, with `jobs` Queued shared builds: the hand-out path alone."""
    from django.utils import timezone

    from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationBuild, EvaluationStatus

    evaluation = Evaluation.objects.create(
        project=project, repository="sim:queued", commit="fleet", status=EvaluationStatus.BUILDING
    )
    now = timezone.now()
    builds = DerivationBuild.objects.bulk_create(
        [
            DerivationBuild(
                drv_path=f"/nix/store/{i:032d}-queued-{i}.drv",
                system="x86_64-linux",
                status="Queued",
                queued_at=now,
                outputs=[{"name": "out", "path": f"/nix/store/{i:032d}-queued-{i}"}],
            )
            for i in range(jobs)
        ]
    )
    EvaluationBuild.objects.bulk_create([EvaluationBuild(evaluation=evaluation, build=b) for b in builds])


def _evaluations_by_status() -> dict[str, int]:
    from django.db.models import Count

    from gradient.scheduling.models import Evaluation

    return dict(Evaluation.objects.values_list("status").annotate(n=Count("id")).order_by())


def _all_finished(expected: int) -> bool:
    from gradient.scheduling.models import EVALUATION_TERMINAL, Evaluation

    return Evaluation.objects.filter(status__in=EVALUATION_TERMINAL).count() >= expected


def _open_sessions() -> int:
    from gradient.workers.models import WorkerSession

    return WorkerSession.objects.filter(closed_at__isnull=True).count()


def _assignment_figures(result: FleetResult) -> None:
    from django.db.models import Max, Min

    from gradient.scheduling.models import DerivationBuild, DispatchedJob, JobKind

    rows = DispatchedJob.objects.all()
    result.assignments = rows.count()
    result.eval_assignments = rows.filter(kind=JobKind.EVAL).count()
    span = rows.aggregate(first=Min("dispatched_at"), last=Max("dispatched_at"))
    if span["first"] and span["last"]:
        result.span = (span["last"] - span["first"]).total_seconds()
    result.builds = DerivationBuild.objects.count()


# --- the run -----------------------------------------------------------------------------------------


def run_fleet(config: FleetConfig, database_url: str) -> FleetResult:
    from django.db import close_old_connections

    from tests.support.processes import celery_worker, serve

    result = FleetResult(config=config)
    project, credentials = _register(config)
    expected = config.evaluations
    if config.shape == "queued":
        seed_queued_builds(project, config.size)
        expected = 1
    env = service_env(database_url, redis_url() if config.uses_redis else None)
    logs = log_dir()
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(serve(env, logs, extra_args=["--log-level", "warning"]))
            for _ in range(config.servers)
        ]
        if config.uses_redis:
            stack.enter_context(celery_worker(env, logs, name="fleet-celery", concurrency=2))
        pids = [s.process.pid for s in servers]
        idle = [rss_mb(pid) for pid in pids]
        peak = list(idle)
        result.passes.baseline()
        # Queued builds are there before the workers connect, so that run counts from their start.
        started = time.monotonic()
        hosts = _start_hosts(config, credentials, [s.ws_url for s in servers], logs)
        try:
            wait_for(
                lambda: _open_sessions() >= config.workers,
                timeout=120,
                what=f"{config.workers} worker sessions",
            )
            if config.shape != "queued":
                started = time.monotonic()
                submit_evaluations(project, config)
            deadline = started + config.timeout
            while not _all_finished(expected):
                if time.monotonic() > deadline:
                    result.errors.append(f"not finished within {config.timeout:.0f} s")
                    break
                result.passes.poll()
                peak = [max(p, rss_mb(pid)) for p, pid in zip(peak, pids, strict=True)]
                close_old_connections()
                time.sleep(0.25)
            result.elapsed = time.monotonic() - started
            result.passes.poll()
            after = [rss_mb(pid) for pid in pids]
            result.rss = list(zip(idle, peak, after, strict=True))
            result.load = load_average()
        finally:
            for stats in _stop_hosts(hosts):
                result.latencies.extend(stats["latencies"])
                result.requests += stats["requests"]
                result.overlapped += stats["overlapped"]
                result.errors.extend(stats["errors"])
    _assignment_figures(result)
    result.evaluations = _evaluations_by_status()
    return result


@dataclass
class _Host:
    process: subprocess.Popen[bytes]
    out: Path


def _start_hosts(
    config: FleetConfig, credentials: list[tuple[str, str]], urls: list[str], logs: Path
) -> list[_Host]:
    workers = [(urls[i % len(urls)], wid, token) for i, (wid, token) in enumerate(credentials)]
    hosts = []
    procs = max(1, min(config.worker_procs, len(workers)))
    for p in range(procs):
        spec = logs / f"fleet-host-{p}.json"
        out = logs / f"fleet-host-{p}.out.json"
        out.unlink(missing_ok=True)
        spec.write_text(
            json.dumps(
                {
                    "workers": workers[p::procs],
                    "slots": config.slots,
                    "build_ms": config.build_ms,
                    "idle_request_secs": config.idle_request_secs,
                }
            )
        )
        with open(logs / f"fleet-host-{p}.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--host", str(spec), str(out)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        hosts.append(_Host(process, out))
    return hosts


def _stop_hosts(hosts: list[_Host]) -> list[dict[str, Any]]:
    for host in hosts:
        if host.process.poll() is None:
            host.process.send_signal(signal.SIGTERM)
    stats = []
    for host in hosts:
        try:
            host.process.wait(60)
        except subprocess.TimeoutExpired:
            host.process.kill()
            host.process.wait(10)
        if host.out.exists():
            stats.append(json.loads(host.out.read_text()))
        else:
            stats.append(
                {"latencies": [], "requests": 0, "overlapped": 0, "errors": ["a worker host left no stats"]}
            )
    return stats


# --- a worker host: many reference workers in one process ------------------------------------------


def host_main(spec_path: str, out_path: str) -> None:
    """Run the reference workers of one spec file until SIGTERM; then write what they saw."""
    import logging

    from gradient.core.protocol import AssignJob, RequestJob
    from gradient.workers.client import worker as client
    from gradient.workers.client.config import parse_config
    from gradient.workers.executors import make_executor

    logging.basicConfig(level=logging.WARNING)  # reconnects show in var/bench/fleet-host-*.log
    spec = json.loads(Path(spec_path).read_text())
    latencies: list[float] = []
    counters = {"requests": 0, "overlapped": 0}

    # The one instrumentation: when each RequestJob left, and how long until an AssignJob came back.
    # A connection's messages are handled one at a time on the server, and an unanswered RequestJob gets
    # no reply, so an AssignJob answers the latest RequestJob unless the server took longer than the
    # worker's idle interval to answer (then a later, idle RequestJob was already out, and the sample is
    # an underestimate bounded by that interval). Such AssignJobs are counted as overlapped.
    original_send = client.Connection.send
    original_assign = client.Connection.on_assign_job

    async def send(self: Any, message: Any) -> None:
        if isinstance(message, RequestJob):
            pending = getattr(self, "_bench_pending", [])
            pending.append(time.perf_counter())
            self._bench_pending = pending
            counters["requests"] += 1
        await original_send(self, message)

    async def on_assign_job(self: Any, message: AssignJob) -> None:
        pending = getattr(self, "_bench_pending", [])
        if message.cluster is None and pending:
            latencies.append((time.perf_counter() - pending[-1]) * 1000)
            if len(pending) > 1:
                counters["overlapped"] += 1
            pending.clear()
        await original_assign(self, message)

    client.Connection.send = send  # type: ignore[method-assign]
    client.Connection.on_assign_job = on_assign_job  # type: ignore[method-assign]

    workers = []
    for url, worker_id, token in spec["workers"]:
        config = parse_config(
            [
                "--server",
                url,
                "--worker-id",
                worker_id,
                "--token",
                token,
                "--executor",
                "sim",
                "--arch",
                "x86_64-linux",
                "--slots",
                str(spec["slots"]),
                "--cpu-core-score",
                "1000",
                "--idle-request-secs",
                str(spec["idle_request_secs"]),
                "--stop-grace-secs",
                "1",
            ],
            environ={},
        )
        workers.append(client.Worker(config, make_executor("sim", sim_build_ms=spec["build_ms"])))

    async def run() -> list[Any]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [w.request_stop() for w in workers])
        tasks = []
        for w in workers:  # spread the handshakes a little
            tasks.append(asyncio.create_task(w.run()))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(run())
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException) or o != 0]
    Path(out_path).write_text(json.dumps({"latencies": latencies, **counters, "errors": errors}))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--host":
        host_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--evaluations", type=int, default=20)
    parser.add_argument("--shape", choices=SHAPES, default="wide")
    parser.add_argument("--size", type=int, default=40, help="chain length, wide width, queued builds")
    parser.add_argument("--celery", action="store_true", help="Redis and Celery beat even with one server")
    parser.add_argument("--worker-procs", type=int, default=2, help="processes the workers run in")
    parser.add_argument("--slots", type=int, default=1, help="build slots per worker")
    parser.add_argument("--build-ms", type=int, default=0, help="sim build time per derivation")
    parser.add_argument(
        "--idle-request-secs",
        type=float,
        default=10.0,
        help="the reference worker's repeat RequestJob while idle (its default, 10 s); a latency sample is "
        "valid while the server answers within it",
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if min(args.workers, args.servers, args.evaluations, args.size, args.worker_procs, args.slots) < 1:
        parser.error("--workers, --servers, --evaluations, --size, --worker-procs and --slots must be >= 1")
    config = FleetConfig(**{k: v for k, v in vars(args).items()})
    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}")
    run_fleet(config, url).print()


if __name__ == "__main__":
    main()
