"""The records pass: a thin task over services.records_check, under the pass lease."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils import timezone

from gradient.records.services import records_check
from gradient.runtime.passes import pass_run


def _check() -> dict[str, Any]:
    return records_check(now=timezone.now(), settle=True).summary()


@shared_task(name="gradient.records.tasks.check_pass")
def check_pass() -> dict[str, Any] | None:
    """Every 300 s: fold every unsettled record, report jobs whose rows disagree with their fold, and
    settle the records whose settled predicate holds."""
    return pass_run(name="records-check", body=_check)
