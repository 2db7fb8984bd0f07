"""Connections: memory and heartbeat handling for 1 000 connected workers on one `serve` process.

    .venv/bin/python bench/connections.py [--workers 1000] [--procs 2] [--heartbeat-secs 10] [--secs 60]

Lightweight WebSocket clients (the `websockets` library, many to a process) speak the protocol as a
worker does: InitConnection, InitAck, WorkerCapabilities, then the WorkerMetrics heartbeat every
--heartbeat-secs (spread over the period). A heartbeat has no reply, so each is followed by a
RequestJobList as a fence: the server handles one socket's frames in order, and its JobListChunk (empty:
nothing is queued) comes back once both were handled. That round trip is the heartbeat latency printed.

Printed: connect time (TCP, upgrade, InitConnection to InitAck) p50/p99 and for all of them, serve RSS
idle and with every worker connected and after the heartbeats, the heartbeat round trip p50/p99, the
heartbeats handled per second and serve's CPU use meanwhile. The open-file limit is raised to its hard
limit (serve inherits it); `serve` runs with REDIS_URL (the channel layer on Redis, as in production).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import signal
import subprocess
import sys
import time
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
    heartbeat_ms: list[float] = []
    errors: list[str] = []
    sockets: list = []  # type: ignore[type-arg]
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def hello(worker_id: str, token: str) -> None:
        async with gate:
            started = time.perf_counter()
            ws = await websockets.connect(
                spec["url"], max_size=8 * 2**20, open_timeout=60, ping_interval=None
            )
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
            ack = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if ack.get("type") != "InitAck":
                raise RuntimeError(f"handshake refused: {ack}")
            connect_ms.append((time.perf_counter() - started) * 1000)
            await ws.send(json.dumps(WORKER_CAPABILITIES))
            sockets.append(ws)

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

    results = await asyncio.gather(*(heartbeat(ws) for ws in sockets), return_exceptions=True)
    errors.extend(repr(r) for r in results if isinstance(r, BaseException))
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    return {"connect_ms": connect_ms, "heartbeat_ms": heartbeat_ms, "errors": errors}


def client_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    raise_fd_limit(len(spec["workers"]) + 100)
    result = asyncio.run(_client(spec, Path(out_path + ".connected")))
    Path(out_path).write_text(json.dumps(result))


# --- the run -----------------------------------------------------------------------------------------


def run(workers: int, procs: int, heartbeat_secs: float, secs: float, database_url: str) -> None:
    import psutil
    from django.db import close_old_connections

    from gradient.scheduling.services.projects import project_create
    from gradient.workers.models import WorkerSession
    from gradient.workers.services import worker_register
    from tests.support.processes import serve

    limit = raise_fd_limit(workers + 200)
    reset_tables()
    project = project_create(name="connections")
    credentials = []
    for i in range(workers):
        worker, token = worker_register(name=f"conn-{i}", projects=[project])
        credentials.append((str(worker.id), token))
    logs = log_dir()
    env = service_env(database_url, redis_url())
    print(f"workers: {workers} in {procs} client processes; open-file limit {limit}")
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
        heartbeat_ms: list[float] = []
        errors: list[str] = []
        for _, out in clients:
            if out.exists():
                data = json.loads(out.read_text())
                connect_ms += data["connect_ms"]
                heartbeat_ms += data["heartbeat_ms"]
                errors += data["errors"]
            else:
                errors.append("a client process left no results")
    cpu = (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / hb_elapsed * 100
    print(f"  connected: {len(connect_ms)} of {workers} ({sessions} open sessions) in {all_connected:.1f} s")
    print(f"  connect + handshake: {summary(connect_ms)}")
    per_worker = (connected_rss - idle) * 1024 / max(1, len(connect_ms))
    print(f"  serve RSS: {idle:.0f} MiB idle, {connected_rss:.0f} MiB with every worker connected")
    print(f"             ({per_worker:.0f} KiB per connection), {after_rss:.0f} MiB after the heartbeats")
    print(
        f"  heartbeats (WorkerMetrics + RequestJobList fence, every {heartbeat_secs:g} s for {secs:g} s): "
        f"{len(heartbeat_ms) / hb_elapsed:.0f}/s handled"
    )
    print(f"  heartbeat round trip: {summary(heartbeat_ms)}")
    print(f"  serve CPU during the heartbeats: {cpu:.0f} % of one core; {load_average()}")
    for error in errors[:5]:
        print(f"  error: {error}")


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
    args = parser.parse_args()
    if args.workers < 1 or args.procs < 1 or args.heartbeat_secs <= 0 or args.secs <= 0:
        parser.error("--workers and --procs must be >= 1, --heartbeat-secs and --secs > 0")
    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}; Redis: {redis_url()}")
    run(args.workers, args.procs, args.heartbeat_secs, args.secs, url)


if __name__ == "__main__":
    main()
