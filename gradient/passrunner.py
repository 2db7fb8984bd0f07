"""The in-process pass runner of embedded mode (no REDIS_URL): one daemon thread that runs every pass
of gradient.schedule.PASSES on its interval, through the same Celery task bodies Celery beat would
call. Leases (runtime.passes.pass_run) keep it from overlapping with any other runner.

It installs the passes into django-celery-beat's table as beat would, and honours the admin's switch:
a pass whose *Periodic task* is disabled is skipped until it is enabled again."""

from __future__ import annotations

import logging
import threading
import time

from django.db import close_old_connections

from gradient.celery import app
from gradient.schedule import PASSES, PassSpec, beat_schedule

log = logging.getLogger("gradient.passes")


class PassRunner:
    def __init__(self, passes: tuple[PassSpec, ...] = PASSES, tick: float = 0.5) -> None:
        self._passes = [p for p in passes if p.seconds() > 0]
        self._tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        app.loader.import_default_modules()
        self.install()
        self._thread = threading.Thread(target=self._loop, name="gradient-passes", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @staticmethod
    def install() -> None:
        """The passes as *Periodic tasks* in the admin, exactly as beat's DatabaseScheduler installs them
        (a pass an operator paused stays paused)."""
        from django_celery_beat.schedulers import DatabaseScheduler

        try:
            app.conf.beat_schedule = beat_schedule()
            DatabaseScheduler(app=app, lazy=True).setup_schedule()
        except Exception:
            log.exception("installing the passes as periodic tasks failed; they run regardless")
        finally:
            close_old_connections()

    @staticmethod
    def paused(names: list[str]) -> set[str]:
        """The passes among `names` an operator disabled in the admin."""
        from django_celery_beat.models import PeriodicTask

        try:
            return set(
                PeriodicTask.objects.filter(name__in=names, enabled=False).values_list("name", flat=True)
            )
        except Exception:
            log.exception("reading the paused passes failed")
            return set()
        finally:
            close_old_connections()

    def _loop(self) -> None:
        due = {spec.name: time.monotonic() for spec in self._passes}
        while not self._stop.is_set():
            now = time.monotonic()
            ready = [spec for spec in self._passes if now >= due[spec.name]]
            paused = self.paused([spec.name for spec in ready]) if ready else set()
            for spec in ready:
                due[spec.name] = now + spec.seconds()
                if spec.name in paused:
                    log.debug("in-process pass %s is paused in the admin", spec.name)
                    continue
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
