"""Gradient under load: a real `serve` process and N simulated workers over real WebSockets.

Each simulated worker speaks the protocol (InitConnection, WorkerCapabilities, then RequestJob per
free slot); on AssignJob it accepts, reports build_output and JobCompleted at once, and asks again.
Measured: assignments per second over the run and the RequestJob-to-AssignJob latency, plus the
server's resident memory. Used by bench/assign.py; runnable alone:

    .venv/bin/python bench/service_load.py --workers 100 --jobs 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, describe_machine, reset_tables, setup_django, summary  # noqa: E402

REQUEST_TIMEOUT = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prepare(workers: int, jobs: int) -> list[tuple[str, str]]:
    from django.utils import timezone

    from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationBuild, EvaluationStatus
    from gradient.workers.services import project_create, worker_register

    reset_tables()
    project = project_create(name="bench")
    evaluation = Evaluation.objects.create(
        project=project, repository="sim:wide", commit="bench", status=EvaluationStatus.BUILDING
    )
    now = timezone.now()
    builds = DerivationBuild.objects.bulk_create(
        [
            DerivationBuild(
                drv_path=f"/nix/store/{i:032d}-load-{i}.drv",
                system="x86_64-linux",
                status="Queued",
                queued_at=now,
                outputs=[{"name": "out", "path": f"/nix/store/{i:032d}-load-{i}"}],
            )
            for i in range(jobs)
        ]
    )
    EvaluationBuild.objects.bulk_create([EvaluationBuild(evaluation=evaluation, build=b) for b in builds])
    credentials = []
    for i in range(workers):
        worker, token = worker_register(name=f"load-{i}", projects=[project])
        credentials.append((str(worker.id), token))
    return credentials


async def _worker(url: str, worker_id: str, token: str, state: dict[str, Any]) -> None:
    import websockets

    async with websockets.connect(url, max_size=8 * 1024 * 1024) as ws:
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
        ack = json.loads(await ws.recv())
        assert ack["type"] == "InitAck", ack
        await ws.send(
            json.dumps(
                {
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
            )
        )
        while state["assigned"] < state["jobs"]:
            started = time.perf_counter()
            await ws.send(json.dumps({"type": "RequestJob", "kind": "build"}))
            assign = None
            deadline = started + REQUEST_TIMEOUT
            while assign is None and time.perf_counter() < deadline:
                try:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), deadline - time.perf_counter()))
                except TimeoutError:
                    break
                if frame["type"] == "AssignJob":
                    assign = frame
            if assign is None:
                continue  # unanswered: an idle slot; ask again
            state["latencies"].append((time.perf_counter() - started) * 1000)
            state["assigned"] += 1
            state["last"] = time.perf_counter()
            job_id, assignment_id = assign["job_id"], assign["assignment_id"]
            spec = assign["job"]["builds"][0]
            await ws.send(
                json.dumps(
                    {
                        "type": "AssignJobResponse",
                        "job_id": job_id,
                        "assignment_id": assignment_id,
                        "accepted": True,
                    }
                )
            )
            outputs = [{"name": o["name"], "path": o["path"], "nar_size": 1024} for o in spec["outputs"]]
            update = {
                "kind": "build_output",
                "build_id": spec["build_id"],
                "outputs": outputs,
                "substituted": False,
            }
            await ws.send(
                json.dumps(
                    {"type": "JobUpdate", "job_id": job_id, "assignment_id": assignment_id, "update": update}
                )
            )
            await ws.send(
                json.dumps(
                    {
                        "type": "JobCompleted",
                        "job_id": job_id,
                        "assignment_id": assignment_id,
                        "elapsed_ms": 1,
                    }
                )
            )


async def _fleet(url: str, credentials: list[tuple[str, str]], jobs: int) -> dict[str, Any]:
    state: dict[str, Any] = {"assigned": 0, "jobs": jobs, "latencies": [], "last": None}
    started = time.perf_counter()
    results = await asyncio.gather(
        *(_worker(url, w, t, state) for w, t in credentials), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    state["elapsed"] = (state["last"] or time.perf_counter()) - started
    state["errors"] = errors
    return state


def _rss_mb(pid: int) -> float:
    import psutil

    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return float("nan")


def run_service_load(*, database_url: str, workers: int, jobs: int) -> None:
    credentials = _prepare(workers, jobs)
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1"}
    env.setdefault("REDIS_URL", "redis://127.0.0.1:6379/7")
    log = open(ROOT / "var" / "bench-serve.log", "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--no-passes", "--log-level", "warning"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):  # noqa: S310
                    break
            except OSError:
                time.sleep(0.1)
        idle_rss = _rss_mb(server.pid)
        state = asyncio.run(_fleet(f"ws://127.0.0.1:{port}/proto", credentials, jobs))
        busy_rss = _rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        log.close()
    print(f"service: {workers} workers over WebSockets, {jobs} build jobs, one serve process")
    rate = state["assigned"] / state["elapsed"]
    print(f"  assignments: {state['assigned']} in {state['elapsed']:.1f} s = {rate:.0f}/s")
    print(f"  RequestJob -> AssignJob latency: {summary(state['latencies'])}")
    print(f"  serve RSS: {idle_rss:.0f} MiB idle, {busy_rss:.0f} MiB after the run")
    if state["errors"]:
        print(f"  worker errors: {len(state['errors'])}, first: {state['errors'][0]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    url = setup_django()
    print(f"machine: {describe_machine()}")
    run_service_load(database_url=url, workers=args.workers, jobs=args.jobs)


if __name__ == "__main__":
    main()
