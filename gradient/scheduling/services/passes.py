"""The scheduling passes: one unit of work per call, so a pass is a loop of steps and tests call a step."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from gradient.runtime.outbox import push_to_worker
from gradient.scheduling.services import graph
from gradient.scheduling.services.offers import (
    connected_worker_ids,
    job_offers,
    pass_cache,
    promote_retries,
)
from gradient.scheduling.services.waiting import WaitingPassResult, refresh_waiting_state


@dataclass
class AssignmentPassResult:
    promoted: int = 0
    offers: int = 0
    workers: int = 0
    waiting: WaitingPassResult | None = None


def offer_step(*, worker_id: uuid.UUID, now: datetime) -> int:
    """Push one worker its offer delta (JobOffer), after the sent set was committed. Returns how many
    messages went out."""
    messages = job_offers(worker_id=worker_id, now=now)
    for message in messages:
        push_to_worker(worker_id, message)
    return len(messages)


def assignment_pass(*, now: datetime) -> AssignmentPassResult:
    """Every 5 s: builds out of backoff go back to the queue, every connected worker is offered what it
    was not offered yet (SchedulerMsg::ReOffer), and the waiting pass runs at the end."""
    result = AssignmentPassResult(promoted=promote_retries(now=now))
    with pass_cache():  # each build's candidate message is made once for all the workers
        for worker_id in connected_worker_ids():
            result.workers += 1
            result.offers += offer_step(worker_id=worker_id, now=now)
    result.waiting = refresh_waiting_state(
        now=now, grace_secs=settings.GRADIENT_SCHEDULER_UNBUILDABLE_GRACE_SECS
    )
    return result


def build_resync_pass(*, now: datetime) -> int:
    """Every 60 s: the full resync. Every Created build whose dependencies succeeded is queued, whoever
    missed the kick."""
    return graph.queue_ready_builds(build_ids=None, now=now)
