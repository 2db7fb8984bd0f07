"""The Celery app. Its beat schedule is gradient.schedule's, the one list of periodic passes that the
in-process runner reads too; django-celery-beat's DatabaseScheduler installs it into the database so
operators see and pause the passes in the admin."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

app = Celery("gradient")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(
    ["gradient.workers", "gradient.scheduling", "gradient.clusters", "gradient.recovery", "gradient.records"]
)


@app.on_after_finalize.connect
def _install_beat_schedule(sender: Celery, **_: object) -> None:
    from gradient.schedule import beat_schedule

    sender.conf.beat_schedule = beat_schedule()
