"""Build logs: appends per second, the stored size of a realistic log, and what a log-heavy build costs
the hand-out rate.

    .venv/bin/python bench/logs.py [--pieces 2000] [--piece-kib 16] [--threads 2] [--log-mib 8] [--builds 200]

All in this process, calling the services the `serve` process calls (no WebSocket: what is measured is
the server's work per frame):

- appends: one build's log sent as --pieces BuildLog pieces of --piece-kib KiB of compiler-like text
  (`logs.build_log_append`: the fence, the log row, one chunk row, one transaction each), first alone,
  then --threads builds at once, each on its own connection;
- stored size: a realistic log of --log-mib MiB (make, compiler and test lines with their paths and
  warnings) sent in 16 KiB pieces, its assignment closed, then sealed (`build_log_seal_step`): the
  text's bytes, the zstandard blob's bytes, the seal's time and a whole read's time;
- hand-out rate: --builds builds handed out and completed one after another (`request_job`, then
  `building`, `build_output`, `JobCompleted` through `handle_report`), first on a quiet server, then while
  --threads other builds stream their logs as fast as the database takes them, then while each of
  --logging-builds builds logs at a worker's top pace (a 16 KiB piece every 250 ms).

Needs PostgreSQL (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, setup_django, summary  # noqa: E402
from queue_depth import seed  # noqa: E402


def compiler_log(n_bytes: int, seed_value: int = 7) -> str:
    """Text like a C/C++ project's build log: make, compiler invocations, warnings, test results."""
    rng = random.Random(seed_value)
    modules = [f"src/{d}/{f}" for d in ("core", "net", "io", "util", "crypto") for f in ("a", "b", "c", "d")]
    lines: list[str] = []
    size = 0
    i = 0
    while size < n_bytes:
        i += 1
        module = rng.choice(modules) + f"_{rng.randint(0, 400)}"
        kind = rng.random()
        if kind < 0.55:
            line = (
                f"gcc -DHAVE_CONFIG_H -I. -I./include -O2 -g -Wall -Wextra -fPIC -c {module}.c "
                f"-o build/{module}.o -MD -MP -MF build/.deps/{module}.Tpo"
            )
        elif kind < 0.7:
            line = f"  CC       {module}.lo"
        elif kind < 0.8:
            line = (
                f"{module}.c:{rng.randint(1, 3000)}:{rng.randint(1, 80)}: warning: unused variable "
                f"'tmp{rng.randint(0, 99)}' [-Wunused-variable]"
            )
        elif kind < 0.9:
            where = f"/build/source-{i % 97}/{module.split('/')[1]}"
            line = f"make[{rng.randint(1, 4)}]: Entering directory '{where}'"
        else:
            line = f"PASS: tests/test_{module.replace('/', '_')} {rng.randint(1, 999)} ({rng.random():.3f} s)"
        lines.append(line + "\n")
        size += len(line) + 1
    return "".join(lines)


def _piece_sender(worker_id: Any, assignment: Any) -> Any:
    from django.utils import timezone

    from gradient.core.protocol import BuildLog
    from gradient.scheduling.services.logs import build_log_append

    build_id = str(assignment.job.builds[0].build_id)
    offset = 0

    def send(text: str) -> None:
        nonlocal offset
        message = BuildLog(
            job_id=assignment.job_key,
            assignment_id=str(assignment.assignment_id),
            build_id=build_id,
            offset=offset,
            data=text,
        )
        outcome = build_log_append(worker_id=worker_id, message=message, now=timezone.now())
        if not outcome.accepted:
            raise RuntimeError(f"a piece was not stored: {outcome.detail}")
        offset += len(text)

    return send


def _ask(worker_id: Any) -> Any:
    from django.utils import timezone

    from gradient.scheduling.services.assignment import request_job

    handed = request_job(worker_id=worker_id, protocol_kind="build", now=timezone.now())
    if handed is None:
        raise RuntimeError("nothing to hand out")
    return handed


def appends(workers: list[Any], pieces: int, piece_kib: int, threads: int) -> None:
    from django.db import connection

    text = compiler_log(pieces * piece_kib * 1024 + 1)
    size = piece_kib * 1024
    chunks = [text[i * size : (i + 1) * size] for i in range(pieces)]

    def stream(worker: Any, out: list[float]) -> None:
        try:
            send = _piece_sender(worker.id, _ask(worker.id))
            for chunk in chunks:
                started = time.perf_counter()
                send(chunk)
                out.append((time.perf_counter() - started) * 1000)
        finally:
            connection.close()

    alone: list[float] = []
    started = time.perf_counter()
    stream(workers[0], alone)
    elapsed = time.perf_counter() - started
    rate = pieces * piece_kib / 1024 / elapsed
    print(
        f"  appends, one build:      {pieces / elapsed:8.0f} pieces/s, {rate:6.1f} MiB/s; "
        f"per piece {summary(alone)}"
    )
    per_thread: list[list[float]] = [[] for _ in range(threads)]
    runners = [threading.Thread(target=stream, args=(workers[1 + i], per_thread[i])) for i in range(threads)]
    started = time.perf_counter()
    for r in runners:
        r.start()
    for r in runners:
        r.join()
    elapsed = time.perf_counter() - started
    total = sum(len(p) for p in per_thread)
    rate = total * piece_kib / 1024 / elapsed
    every = [x for p in per_thread for x in p]
    print(
        f"  appends, {threads} builds at once: {total / elapsed:6.0f} pieces/s, {rate:6.1f} MiB/s; "
        f"per piece {summary(every)}"
    )


def stored_size(worker: Any, log_mib: int) -> None:
    from django.utils import timezone

    from gradient.scheduling.models import BuildLog, DerivationBuild
    from gradient.scheduling.services.logs import build_log_read, build_log_seal_step
    from tests.scheduling_helpers import build as complete

    text = compiler_log(log_mib * 1024 * 1024)
    assignment = _ask(worker.id)
    send = _piece_sender(worker.id, assignment)
    for i in range(0, len(text), 16 * 1024):
        send(text[i : i + 16 * 1024])
    complete(worker.id, assignment)
    started = time.perf_counter()
    sealed = build_log_seal_step(now=timezone.now())
    seal_ms = (time.perf_counter() - started) * 1000
    log = BuildLog.objects.get(assignment_id=assignment.assignment_id)
    blob = len(bytes(log.blob or b""))
    raw = len(text.encode())
    build = DerivationBuild.objects.get(id=log.build_id)
    started = time.perf_counter()
    read = build_log_read(build=build, assignment_id=assignment.assignment_id, offset=0)
    read_ms = (time.perf_counter() - started) * 1000
    assert sealed == 1 and read is not None and read.text == text
    print(
        f"  stored size, a {raw / 1024 / 1024:.1f} MiB compiler log: blob {blob / 1024:.0f} KiB "
        f"({raw / blob:.1f}x smaller, zstandard level 10); seal {seal_ms:.0f} ms, whole read {read_ms:.0f} ms"
    )


def handout_rate(workers: list[Any], builds: int, threads: int) -> None:
    from django.db import connection

    from tests.scheduling_helpers import build as complete

    def hand_out(worker: Any, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            complete(worker.id, _ask(worker.id))
        return n / (time.perf_counter() - started)

    quiet = hand_out(workers[0], builds)
    stop = threading.Event()
    sent = [0] * threads
    piece = compiler_log(16 * 1024)[: 16 * 1024]

    def heavy(i: int) -> None:
        try:
            send = _piece_sender(workers[1 + i].id, _ask(workers[1 + i].id))
            while not stop.is_set():
                send(piece)
                sent[i] += 1
        finally:
            connection.close()

    runners = [threading.Thread(target=heavy, args=(i,)) for i in range(threads)]
    for r in runners:
        r.start()
    time.sleep(0.5)
    before = sum(sent)
    started = time.perf_counter()
    loaded = hand_out(workers[0], builds)
    logged = (sum(sent) - before) / (time.perf_counter() - started)
    stop.set()
    for r in runners:
        r.join()
    print(
        f"  hand-out rate, quiet:                            {quiet:7.1f} builds/s "
        "(claim, building, output, completed)"
    )
    print(
        f"  hand-out rate, {threads} builds streaming logs flat out: {loaded:7.1f} builds/s "
        f"({loaded / quiet:.0%}), while {logged:.0f} pieces/s ({logged * 16 / 1024:.1f} MiB/s) "
        "were stored"
    )
    # A log at the worker's own pace: one piece every 250 ms per build, so 4 pieces/s each.
    print(
        f"  (a worker sends at most 4 pieces/s per build: {logged / 4:.0f} builds logging at once "
        "at that pace)"
    )


def paced_handout_rate(workers: list[Any], builds: int, logging_builds: int) -> None:
    """The hand-out rate while `logging_builds` builds log at the worker's own top pace: a 16 KiB
    piece every 250 ms each (64 KiB/s per build), sent round robin from one thread."""
    from django.db import connection

    from tests.scheduling_helpers import build as complete

    stop = threading.Event()
    piece = compiler_log(16 * 1024)[: 16 * 1024]
    sent = [0]

    def paced() -> None:
        try:
            senders = [_piece_sender(workers[1].id, _ask(workers[1].id)) for _ in range(logging_builds)]
            interval = 0.25 / logging_builds
            next_at = time.perf_counter()
            while not stop.is_set():
                for send in senders:
                    send(piece)
                    sent[0] += 1
                    next_at += interval
                    pause = next_at - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    if stop.is_set():
                        break
        finally:
            connection.close()

    runner = threading.Thread(target=paced)
    runner.start()
    time.sleep(0.5)
    before = sent[0]
    started = time.perf_counter()
    for _ in range(builds):
        complete(workers[0].id, _ask(workers[0].id))
    elapsed = time.perf_counter() - started
    rate = builds / elapsed
    logged = (sent[0] - before) / elapsed
    stop.set()
    runner.join()
    print(
        f"  hand-out rate, {logging_builds:3d} builds logging at 64 KiB/s each:  {rate:7.1f} builds/s "
        f"({logged:.0f} pieces/s stored meanwhile)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pieces", type=int, default=2000)
    parser.add_argument("--piece-kib", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-mib", type=int, default=8)
    parser.add_argument("--builds", type=int, default=200)
    parser.add_argument("--logging-builds", type=int, nargs="*", default=[1, 10])
    args = parser.parse_args()
    url = setup_django()
    os.environ.setdefault("GRADIENT_BUILD_LOG_MAX_BYTES", str(64 * 1024 * 1024))
    print(f"machine: {describe_machine()}")
    print(f"database: {url}")
    needed = args.builds * (2 + len(args.logging_builds)) + 2 * args.threads + sum(args.logging_builds) + 10
    workers, _ = seed(needed, 2 + args.threads)
    appends(workers, args.pieces, args.piece_kib, args.threads)
    stored_size(workers[0], args.log_mib)
    handout_rate(workers, args.builds, args.threads)
    for logging_builds in args.logging_builds:
        paced_handout_rate(workers, args.builds, logging_builds)


if __name__ == "__main__":
    main()
