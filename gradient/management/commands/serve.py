"""`python manage.py serve`: startup recovery, then the ASGI server (HTTP, admin, REST, /proto).

Without REDIS_URL, and unless --no-passes, the periodic passes run in this process on their schedule.
With REDIS_URL they are Celery beat's (`celery -A gradient worker -B`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import close_old_connections
from django.utils import timezone

from gradient.http_protocol import StrictTextWebSocketProtocol, TimedHttpProtocol, sample_socket_lines
from gradient.passrunner import PassRunner
from gradient.runtime import lanes
from gradient.runtime.boot import set_current_boot
from gradient.runtime.heap import tune_for_serving
from gradient.runtime.passes import (
    server_boot_drain,
    server_boot_heartbeat,
    server_boot_start,
    server_boot_stop,
)

log = logging.getLogger("gradient.serve")

# Frames up to this size reach the consumer, which refuses anything over the protocol's 1 MiB with
# Error{400} and close code 4400 (uvicorn itself would only close with 1009).
WS_MAX_SIZE = 4 * 1024 * 1024
BOOT_HEARTBEAT_SECS = 10.0
WORKER_DRAIN_SECS = 18.0  # Draining, then every session closed, within the 20 s the contract allows


class GradientServer(uvicorn.Server):
    """uvicorn, with the worker drain in front of its shutdown: on SIGTERM stop accepting, send
    Draining to every worker session of this process and close them (within 20 s), then let uvicorn
    finish the remaining HTTP requests."""

    boot_id: uuid.UUID | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        from gradient.workers.proto.consumer import drain_local_sessions

        for server in self.servers:
            server.close()
        if self.boot_id is not None:
            await asyncio.to_thread(_drain_begin, self.boot_id)
        try:
            closed = await asyncio.wait_for(drain_local_sessions(), timeout=WORKER_DRAIN_SECS)
            log.info("drained %d worker session(s)", closed)
        except Exception:
            log.exception("draining worker sessions failed")
        if self.boot_id is not None:
            await asyncio.to_thread(_park_for_drain)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without re-raising SIGTERM/SIGINT once shut down: `serve` then finishes its own
        cleanup (the boot's stopped_at) and exits 0 after a graceful stop."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _drain_begin(boot_id: uuid.UUID) -> None:
    """Mark this instance draining, so that no other instance counts on it."""
    from django.db import close_old_connections

    try:
        server_boot_drain(boot_id=boot_id, now=timezone.now())
    except Exception:
        log.exception("marking the boot draining failed")
    finally:
        close_old_connections()


def _park_for_drain() -> None:
    """Once this instance's workers are gone: when no other instance serves, the waiting pass parks every
    in-flight evaluation as `draining` (unparked at the next start, or by the pass once one serves)."""
    from django.db import close_old_connections

    from gradient.scheduling.services.waiting import refresh_waiting_state

    try:
        result = refresh_waiting_state(
            now=timezone.now(), grace_secs=settings.GRADIENT_SCHEDULER_UNBUILDABLE_GRACE_SECS, use_memo=False
        )
        if result.draining:
            log.info("drain: %d evaluation(s) parked as draining", result.parked)
    except Exception:
        log.exception("parking evaluations for the drain failed")
    finally:
        close_old_connections()


class Command(BaseCommand):
    help = "Run startup recovery, then serve HTTP, the admin, REST and the /proto WebSocket."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-passes", action="store_true", help="Do not run the periodic passes here.")
        parser.add_argument("--log-level", default="info")

    def handle(self, *args: Any, **options: Any) -> None:
        from gradient.deploy import refuse_insecure_start

        warning = refuse_insecure_start(host=options["host"])
        if warning:
            self.stderr.write(warning)
        boot = server_boot_start(now=timezone.now())
        set_current_boot(boot.id)
        self.stdout.write(
            f"gradient: boot {boot.id} ({'embedded' if settings.EMBEDDED else 'external'} database)"
        )

        from gradient.recovery.startup import run_startup_recovery

        run_startup_recovery(boot_id=boot.id)

        from gradient.scheduling.book import enable_here

        if enable_here() is not None:
            self.stdout.write("gradient: the queue's heads kept in memory (LISTEN gradient_queue)")

        from gradient.workers.proto.dispatcher import warm_lanes

        warm_lanes()

        runner: PassRunner | None = None
        if not settings.REDIS_URL and not options["no_passes"]:
            runner = PassRunner()
            runner.start()
            self.stdout.write("gradient: periodic passes run in-process (no REDIS_URL)")

        stop_heartbeat = threading.Event()

        def heartbeat() -> None:
            while not stop_heartbeat.wait(BOOT_HEARTBEAT_SECS):
                try:
                    server_boot_heartbeat(boot_id=boot.id, now=timezone.now())
                except Exception:
                    log.exception("boot heartbeat failed")
                finally:
                    close_old_connections()

        threading.Thread(target=heartbeat, name="gradient-boot-heartbeat", daemon=True).start()

        config = uvicorn.Config(
            "gradient.asgi:application",
            host=options["host"],
            port=options["port"],
            log_level=options["log_level"],
            lifespan="off",
            # X-Forwarded-For is Gradient's to judge (GRADIENT_TRUSTED_PROXIES, gradient.throttling): uvicorn
            # would believe it from 127.0.0.1 by default, and any local client could forge its address.
            proxy_headers=False,
            http=TimedHttpProtocol,  # a request's headers within GRADIENT_HTTP_REQUEST_TIMEOUT_SECS
            ws=StrictTextWebSocketProtocol,  # a text frame that is no UTF-8: 1007, one INFO line
            ws_max_size=WS_MAX_SIZE,
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
            timeout_graceful_shutdown=20,
        )
        sample_socket_lines()  # after uvicorn.Config, which configures its loggers
        tune_for_serving()  # what startup made is frozen; fewer, cheaper collections (runtime/heap.py)
        try:
            server = GradientServer(config)
            server.boot_id = boot.id
            server.run()
        finally:
            stop_heartbeat.set()
            if runner is not None:
                runner.stop()
            lanes.shutdown_all()  # the lanes' long-lived database connections
            # This thread's connection dates from startup recovery: the database may have dropped it
            # since (a restart, pg_terminate_backend). The health check replaces a dead one.
            close_old_connections()
            server_boot_stop(boot_id=boot.id, now=timezone.now())
