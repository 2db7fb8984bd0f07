"""No reference worker gives up after a restart (issue 36, finding 3, the worker side).

Real processes: `serve` and reference workers on loopback. `serve` is killed with SIGKILL while the
workers are connected, and started again on its port. Every worker comes back by itself and none exits,
whatever the new boot answers it on the way: connection refused while nothing listens, a session of the
killed boot still open (496), a socket closed to make room (503), a refusal before the upgrade (HTTP 403
or 503). Only 401 and 403 in a `Reject` are final (gradient.workers.client.worker.FATAL_REJECTS).

To have the new boot make room for certain, its admission is squeezed (one silent socket per address, no
grace) and the workers' reconnections reach it at once: they are paused (SIGSTOP) across the kill, the new
boot is paused once it answers, the workers are resumed (each finds its socket dead and reconnects into the
listening socket's backlog), then the boot is resumed and finds them all waiting. Before (52a5f93), a
socket closed to make room was answered `Reject{400}`, which the worker took as final: it exited.
"""

from __future__ import annotations

import re
import signal
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import close_old_connections

from gradient.recovery.models import ServerBoot
from gradient.workers.models import WorkerSession
from tests.support.faults import Operator, service_env, start_workers
from tests.support.processes import ServeProcess, WorkerProcess, serve, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

WORKERS = 8
# The reference worker's back-off is capped at 30 s (reconnect_max_secs): each has tried again by then.
BACK_WITHIN_SECS = 30 + 30


def _with_a_session(since: datetime | None = None) -> set[str]:
    """The workers with an open session (opened at or after `since`)."""
    close_old_connections()
    sessions = WorkerSession.objects.filter(closed_at__isnull=True)
    if since is not None:
        sessions = sessions.filter(opened_at__gte=since)
    return {str(w) for w in sessions.values_list("worker__name", flat=True)}


def _lines(log: str, pattern: str) -> int:
    return len(re.findall(pattern, log))


def test_after_a_kill_of_serve_every_reference_worker_comes_back_and_none_exits(tmp_path: Path) -> None:
    env = service_env(
        GRADIENT_PROTO_MAX_UNAUTHENTICATED_PER_ADDRESS="1",
        GRADIENT_PROTO_SILENT_GRACE_SECS="0",
    )
    names = [f"r{k}" for k in range(WORKERS)]
    workers: list[WorkerProcess] = []
    second: ServeProcess | None = None
    with ExitStack() as stack:
        first = stack.enter_context(serve(env, tmp_path))
        try:
            op = Operator.login(first)
            op.project("demo")
            workers = start_workers(stack, op, first.ws_url, tmp_path, names)
            wait_until(lambda: _with_a_session() == set(names), timeout=60, what="every worker connected")

            for w in workers:
                w.pause()
            assert first.stop(signal.SIGKILL) == -signal.SIGKILL
            second = stack.enter_context(serve(env, tmp_path, port=first.port))
            boot = ServerBoot.objects.get(pid=second.process.pid)
            second.process.send_signal(signal.SIGSTOP)
            since = datetime.now(UTC)
            for w in workers:
                w.resume()
            time.sleep(3)  # each finds its socket dead, waits its first back-off (<= 1 s), and connects
            second.process.send_signal(signal.SIGCONT)

            back = wait_until(
                lambda: _with_a_session(since) == set(names) and _with_a_session(since),
                timeout=BACK_WITHIN_SECS,
                what="every worker back with a session of the new boot",
            )
        except BaseException:
            for w in workers:
                print(f"--- {w.name}\n{w.log()[-3000:]}")
            for s in (first, second):
                if s is not None:
                    print(f"--- serve {s.process.pid}\n{s.log()[-5000:]}")
            raise
        exited = {w.name: w.process.poll() for w in workers if w.process.poll() is not None}
        logs = {w.name: w.log() for w in workers}
        serve_log = second.log()

    assert back == set(names)
    assert exited == {}, exited
    assert set(
        WorkerSession.objects.filter(closed_at__isnull=True).values_list("server_boot", flat=True)
    ) <= {boot.id}
    for name, log in logs.items():
        # Each says why it reconnected (the connection closed under it), and none was refused for good.
        assert _lines(log, r"the server closed the connection|lost or failed"), (name, log[-2000:])
        assert "the server refused this worker" not in log, (name, log[-2000:])
    retried = {
        code: sum(_lines(log, rf"refused this session \({code}\)") for log in logs.values())
        for code in (496, 503)
    }
    refused_before = sum(_lines(log, r"HTTP 403|HTTP 503") for log in logs.values())
    print(
        f"{WORKERS} workers back after a kill -9 of serve, none exited; Rejects retried: {retried}; "
        f"refusals before the upgrade retried: {refused_before}"
    )
    assert "Traceback" not in serve_log, serve_log[serve_log.find("Traceback") - 300 :][:3000]
