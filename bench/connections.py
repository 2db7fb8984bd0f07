"""Connections: memory and heartbeat handling for 1 000 connected workers on one `serve` process.

    .venv/bin/python bench/connections.py [--workers 1000] [--procs 2] [--heartbeat-secs 10] [--secs 60]
        [--default-caps] [--at-once] [--pending N]
    .venv/bin/python bench/connections.py --restart [--workers 50] [--default-caps]

Lightweight WebSocket clients (the `websockets` library, many to a process) speak the protocol as a
worker does: InitConnection, InitAck, WorkerCapabilities, then the WorkerMetrics heartbeat every
--heartbeat-secs (spread over the period). A heartbeat has no reply, so each is followed by a
RequestJobList as a fence: the server handles one socket's frames in order, and its JobListChunk (empty:
nothing is queued) comes back once both were handled. That round trip is the heartbeat latency printed.

Printed: connect time (TCP, upgrade, InitConnection to InitAck) p50/p99 and for all of them, serve RSS
idle and with every worker connected and after the heartbeats, the heartbeat round trip p50/p99, the
heartbeats handled per second and serve's CPU use meanwhile. The open-file limit is raised to its hard
limit (serve inherits it); `serve` runs with REDIS_URL (the channel layer on Redis, as in production).

A client retries what a worker retries (HTTP 503 before the upgrade, Reject{503}) with a jittered
back-off, and the retries are printed; any other refusal is an error. The per-address caps are lifted
(all clients share one address) unless --default-caps: then serve runs with every cap as shipped, the
case of a fleet behind one NAT. --at-once: every client of a process connects at once (not 50 at a time).

--pending N: N Queued builds of the workers' project are seeded first (one evaluation Building), and
each client waits for its first JobOffer after its WorkerCapabilities: printed, the time from the start
of its connect to that offer. The heartbeats are then skipped (their RequestJobList fence would be the
whole queue's list, 1 000 candidates a page, every 10 s for every worker: not a heartbeat).

--restart: --workers reference worker processes (`python -m gradient.workers.client`, sim executor)
connect; then `serve` is killed with SIGKILL and started again on the same port. Printed: how long after
the restart (its /healthz answering) each worker had a session again, and how many worker processes
exited (none should: a worker retries everything but 401 and 403).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    WORKER_CAPABILITIES,
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

CONNECT_CONCURRENCY = 50
CONNECT_TRIES = 30


def raise_fd_limit(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = hard if hard == resource.RLIM_INFINITY else max(soft, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        raise SystemExit(f"the open-file limit is {soft}, below the {needed} needed; raise it (ulimit -Hn)")
    return soft


# --- a client process --------------------------------------------------------------------------------


async def _client(spec: dict, marker: Path) -> dict:  # type: ignore[type-arg]
    import websockets

    connect_ms: list[float] = []
    first_offer_ms: list[float] = []
    heartbeat_ms: list[float] = []
    errors: list[str] = []
    retried: list[str] = []
    sockets: list = []  # type: ignore[type-arg]
    gate = asyncio.Semaphore(len(spec["workers"]) if spec["at_once"] else CONNECT_CONCURRENCY)

    async def hello(worker_id: str, token: str) -> None:
        async with gate:
            started = time.perf_counter()
            for attempt in range(CONNECT_TRIES):
                try:
                    ws = await _hello_once(worker_id, token)
                    break
                except _Retry as why:
                    retried.append(str(why))
                    await asyncio.sleep(min(5.0, 0.2 * 2**attempt) * random.uniform(0.5, 1.0))  # noqa: S311
            else:
                raise RuntimeError(f"no InitAck in {CONNECT_TRIES} tries")
            connect_ms.append((time.perf_counter() - started) * 1000)
            await ws.send(json.dumps(WORKER_CAPABILITIES))
            sockets.append(ws)
            if spec["pending"]:
                while json.loads(await asyncio.wait_for(ws.recv(), 120)).get("type") != "JobOffer":
                    pass
                first_offer_ms.append((time.perf_counter() - started) * 1000)

    async def _hello_once(worker_id: str, token: str):  # type: ignore[no-untyped-def]
        try:
            ws = await websockets.connect(
                spec["url"], max_size=8 * 2**20, open_timeout=60, ping_interval=None
            )
        except websockets.InvalidStatus as exc:
            if exc.response.status_code == 503:
                raise _Retry("HTTP 503") from None
            raise
        await ws.send(
            json.dumps(
                {
                    "type": "InitConnection",
                    "worker_id": worker_id,
                    "token": token,
                    "capabilities": {"fetch": False, "eval": False, "build": True},
                    "protocol": 1,
                }
            )
        )
        try:
            ack = json.loads(await asyncio.wait_for(ws.recv(), 60))
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == 4503:  # the Reject was lost on the way
                raise _Retry("Reject 503") from None
            raise
        if ack.get("type") == "Reject" and ack.get("code") == 503:
            await ws.close()
            raise _Retry("Reject 503")
        if ack.get("type") != "InitAck":
            raise RuntimeError(f"handshake refused: {ack}")
        return ws

    results = await asyncio.gather(*(hello(w, t) for w, t in spec["workers"]), return_exceptions=True)
    errors.extend(repr(r) for r in results if isinstance(r, BaseException))
    await asyncio.to_thread(marker.write_text, str(len(sockets)))
    await asyncio.to_thread(sys.stdin.readline)  # the go: every client process is connected

    period, until = spec["heartbeat_secs"], time.monotonic() + spec["secs"]

    async def heartbeat(ws) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(random.uniform(0, period))  # noqa: S311 (spread, not security)
        while time.monotonic() < until:
            started = time.perf_counter()
            metrics = {
                "type": "WorkerMetrics",
                "cpu_usage_pct": 5.0,
                "ram_free_mb": 2048,
                "disk_speed_mbps": None,
                "upload_speed_mbps": None,
                "download_speed_mbps": None,
                "build_peak_ram_mb": None,
            }
            await ws.send(json.dumps(metrics))
            await ws.send(json.dumps({"type": "RequestJobList"}))
            while True:
                frame = json.loads(await ws.recv())
                if frame.get("type") == "JobListChunk" and frame.get("is_final"):
                    break
            heartbeat_ms.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(max(0.0, period - (time.perf_counter() - started)))

    if not spec["pending"]:
        results = await asyncio.gather(*(heartbeat(ws) for ws in sockets), return_exceptions=True)
        errors.extend(repr(r) for r in results if isinstance(r, BaseException))
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    return {
        "connect_ms": connect_ms,
        "first_offer_ms": first_offer_ms,
        "heartbeat_ms": heartbeat_ms,
        "errors": errors,
        "retried": retried,
    }


class _Retry(Exception):
    """What a worker retries after a back-off."""


def client_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    raise_fd_limit(len(spec["workers"]) + 100)
    result = asyncio.run(_client(spec, Path(out_path + ".connected")))
    Path(out_path).write_text(json.dumps(result))


# --- the run -----------------------------------------------------------------------------------------


# The per-address caps as shipped (bench/common.py lifts them for the other benchmarks).
DEFAULT_CAPS = {
    "GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS": None,
    "GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS": None,
}


def run(
    workers: int,
    procs: int,
    heartbeat_secs: float,
    secs: float,
    database_url: str,
    *,
    default_caps: bool,
    at_once: bool,
    pending: int = 0,
) -> None:
    import psutil
    from django.db import close_old_connections

    from gradient.scheduling.services.projects import project_create
    from gradient.workers.models import WorkerSession
    from gradient.workers.services import worker_register
    from tests.support.processes import serve

    limit = raise_fd_limit(workers + 200)
    reset_tables()
    project = project_create(name="connections")
    if pending:
        from common import seed_queued_builds
        from django.utils import timezone

        from gradient.scheduling.models import Evaluation, EvaluationStatus

        evaluation = Evaluation.objects.create(
            project=project, repository="sim:connections", commit="c", status=EvaluationStatus.BUILDING
        )
        seed_queued_builds(evaluation, pending, "connections", timezone.now())
    credentials = []
    for i in range(workers):
        worker, token = worker_register(name=f"conn-{i}", projects=[project])
        credentials.append((str(worker.id), token))
    logs = log_dir()
    env = service_env(database_url, redis_url(), **(DEFAULT_CAPS if default_caps else {}))
    print(f"workers: {workers} in {procs} client processes; open-file limit {limit}")
    print(
        f"caps: {'as shipped' if default_caps else 'per-address caps lifted'}; "
        f"{'every client of a process at once' if at_once else f'{CONNECT_CONCURRENCY} at a time'}"
    )
    with serve(env, logs, extra_args=["--log-level", "warning"]) as server:
        pid = server.process.pid
        time.sleep(2)
        idle = rss_mb(pid)
        clients = []
        started = time.monotonic()
        for p in range(procs):
            spec = logs / f"connections-{p}.json"
            out = logs / f"connections-{p}.out.json"
            for path in (out, Path(f"{out}.connected")):
                path.unlink(missing_ok=True)
            spec.write_text(
                json.dumps(
                    {
                        "url": server.ws_url,
                        "workers": credentials[p::procs],
                        "heartbeat_secs": heartbeat_secs,
                        "secs": secs,
                        "at_once": at_once,
                        "pending": pending > 0,
                    }
                )
            )
            log = open(logs / f"connections-{p}.log", "wb")  # noqa: SIM115 (the child owns it)
            clients.append(
                (
                    subprocess.Popen(
                        [sys.executable, __file__, "--client", str(spec), str(out)],
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    out,
                )
            )
        try:
            wait_for(
                lambda: all(Path(f"{out}.connected").exists() for _, out in clients),
                timeout=600,
                what="every client connected",
            )
            all_connected = time.monotonic() - started
            sessions = WorkerSession.objects.filter(closed_at__isnull=True).count()
            time.sleep(2)
            connected_rss = rss_mb(pid)
            process = psutil.Process(pid)
            cpu_before = process.cpu_times()
            for client, _ in clients:
                assert client.stdin is not None
                client.stdin.write(b"go\n")
                client.stdin.flush()
            hb_started = time.monotonic()
            for client, _ in clients:
                client.wait(secs + 600)
            hb_elapsed = time.monotonic() - hb_started
            cpu_after = process.cpu_times()
            after_rss = rss_mb(pid)
        finally:
            for client, _ in clients:
                if client.poll() is None:
                    client.send_signal(signal.SIGKILL)
                    client.wait(10)
        close_old_connections()
        connect_ms: list[float] = []
        first_offer_ms: list[float] = []
        heartbeat_ms: list[float] = []
        errors: list[str] = []
        retried: list[str] = []
        for _, out in clients:
            if out.exists():
                data = json.loads(out.read_text())
                retried += data["retried"]
                connect_ms += data["connect_ms"]
                first_offer_ms += data["first_offer_ms"]
                heartbeat_ms += data["heartbeat_ms"]
                errors += data["errors"]
            else:
                errors.append("a client process left no results")
    cpu = (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / hb_elapsed * 100
    print(f"  connected: {len(connect_ms)} of {workers} ({sessions} open sessions) in {all_connected:.1f} s")
    print(f"  connect + handshake: {summary(connect_ms)}")
    why = ", ".join(f"{n} {what}" for what, n in sorted(Counter(retried).items())) or "none"
    print(f"  retried (as a worker retries): {why}")
    if pending:
        print(f"  pending builds: {pending}; first JobOffer (from the start of the connect),")
        print(f"    {len(first_offer_ms)} of {workers} workers: {summary(first_offer_ms)}")
    per_worker = (connected_rss - idle) * 1024 / max(1, len(connect_ms))
    print(f"  serve RSS: {idle:.0f} MiB idle, {connected_rss:.0f} MiB with every worker connected")
    print(f"             ({per_worker:.0f} KiB per connection), {after_rss:.0f} MiB after the heartbeats")
    if pending:
        print(f"  heartbeats: skipped (--pending); {load_average()}")
    else:
        print(
            f"  heartbeats (WorkerMetrics + RequestJobList fence, every {heartbeat_secs:g} s for "
            f"{secs:g} s): {len(heartbeat_ms) / hb_elapsed:.0f}/s handled"
        )
        print(f"  heartbeat round trip: {summary(heartbeat_ms)}")
        print(f"  serve CPU during the heartbeats: {cpu:.0f} % of one core; {load_average()}")
    for error in errors[:5]:
        print(f"  error: {error}")


# --- --restart: kill -9 of serve with reference workers connected ------------------------------------


def run_restart(workers: int, database_url: str, *, default_caps: bool, back_within: float = 30.0) -> None:
    from contextlib import ExitStack

    from django.db import close_old_connections

    from gradient.scheduling.services.projects import project_create
    from gradient.workers.models import WorkerSession
    from gradient.workers.services import worker_register
    from tests.support.processes import reference_worker, serve

    raise_fd_limit(workers * 4 + 200)
    reset_tables()
    project = project_create(name="restart")
    logs = log_dir()
    env = service_env(database_url, redis_url(), **(DEFAULT_CAPS if default_caps else {}))
    print(f"reference workers: {workers} (sim executor); caps: {'as shipped' if default_caps else 'lifted'}")

    def open_sessions(since: datetime.datetime | None = None) -> int:
        close_old_connections()
        sessions = WorkerSession.objects.filter(closed_at__isnull=True)
        if since is not None:
            sessions = sessions.filter(opened_at__gte=since)
        return sessions.values("worker_id").distinct().count()

    with ExitStack() as stack:
        first = stack.enter_context(serve(env, logs, extra_args=["--log-level", "warning"]))
        port = first.port
        processes = []
        for i in range(workers):
            worker, token = worker_register(name=f"restart-{i}", projects=[project])
            processes.append(
                stack.enter_context(
                    reference_worker(
                        first.ws_url,
                        str(worker.id),
                        token,
                        logs,
                        name=f"restart-{i}",
                        extra_args=["--arch", "x86_64-linux", "--cpu-core-score", "800"],
                    )
                )
            )
        wait_for(lambda: open_sessions() == workers, timeout=300, what="every worker connected")
        print(f"  connected: {workers} of {workers}")
        first.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        since = datetime.datetime.now(datetime.UTC)
        second = stack.enter_context(serve(env, logs, extra_args=["--log-level", "warning"], port=port))
        restarted = time.monotonic()
        print(f"  serve killed (SIGKILL) and answering again after {restarted - killed_at:.1f} s")
        back: list[float] = []
        deadline = restarted + max(back_within * 4, 120.0)
        while time.monotonic() < deadline:
            n = open_sessions(since)
            while len(back) < n:
                back.append(time.monotonic() - restarted)
            if n >= workers or all(p.process.poll() is not None for p in processes):
                break
            time.sleep(0.2)
        exited = [p.name for p in processes if p.process.poll() is not None]
        refusals = sum(p.log().count("(503)") for p in processes)
        second_log = second.log()
    late = [t for t in back if t > back_within]
    print(f"  back after the restart: {len(back)} of {workers}; {summary([t * 1000 for t in back])}")
    print(
        f"  back within {back_within:g} s: {len(back) - len(late)}; later: {len(late)}; "
        f"never: {workers - len(back)}"
    )
    print(f"  worker processes exited: {len(exited)}{' (' + ', '.join(exited[:5]) + ')' if exited else ''}")
    print(f"  refusals the workers retried (503 in their logs): {refusals}")
    if "Traceback" in second_log:
        print("  serve logged a traceback after the restart")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--heartbeat-secs", type=float, default=10.0)
    parser.add_argument("--secs", type=float, default=60.0, help="how long the heartbeats run")
    parser.add_argument(
        "--default-caps", action="store_true", help="keep the per-address caps as shipped (one NAT's fleet)"
    )
    parser.add_argument("--at-once", action="store_true", help="every client of a process connects at once")
    parser.add_argument(
        "--pending", type=int, default=0, help="Queued builds seeded; each worker's first JobOffer is timed"
    )
    parser.add_argument(
        "--restart", action="store_true", help="kill -9 serve with --workers reference workers connected"
    )
    args = parser.parse_args()
    if args.workers < 1 or args.procs < 1 or args.heartbeat_secs <= 0 or args.secs <= 0 or args.pending < 0:
        parser.error("--workers and --procs must be >= 1, --heartbeat-secs and --secs > 0, --pending >= 0")
    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}; Redis: {redis_url()}")
    if args.restart:
        run_restart(args.workers, url, default_caps=args.default_caps)
        return
    run(
        args.workers,
        args.procs,
        args.heartbeat_secs,
        args.secs,
        url,
        default_caps=args.default_caps,
        at_once=args.at_once,
        pending=args.pending,
    )


if __name__ == "__main__":
    main()
