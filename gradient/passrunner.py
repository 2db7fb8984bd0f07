"""The in-process pass runner of embedded mode (no REDIS_URL): one daemon thread that runs every pass
of gradient.schedule.PASSES on its interval, through the same Celery task bodies Celery beat would
call. Leases (recovery.services.pass_run) keep it from overlapping with any other runner."""

from __future__ import annotations

import logging
import threading
import time

from django.db import close_old_connections

from gradient.celery import app
from gradient.schedule import PASSES, PassSpec

log = logging.getLogger("gradient.passes")


class PassRunner:
    def __init__(self, passes: tuple[PassSpec, ...] = PASSES, tick: float = 0.5) -> None:
        self._passes = [p for p in passes if p.seconds() > 0]
        self._tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        app.loader.import_default_modules()
        self._thread = threading.Thread(target=self._loop, name="gradient-passes", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        due = {spec.name: time.monotonic() for spec in self._passes}
        while not self._stop.is_set():
            now = time.monotonic()
            for spec in self._passes:
                if now < due[spec.name]:
                    continue
                due[spec.name] = now + spec.seconds()
                self.run_once(spec)
            self._stop.wait(self._tick)

    @staticmethod
    def run_once(spec: PassSpec) -> None:
        close_old_connections()
        try:
            app.tasks[spec.task]()
        except Exception:  # a failing pass is logged by pass_run and retried on its next tick
            log.exception("in-process pass %s failed", spec.name)
        finally:
            close_old_connections()
