import uuid
from datetime import datetime

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "gradient.scheduling"
    label = "scheduling"
    verbose_name = "Scheduling: evaluations, shared builds, assignments"

    def ready(self) -> None:
        from gradient.records.schemas import JobKind
        from gradient.records.selectors import (
            register_discovery_provider,
            register_name_provider,
            register_read_access,
        )
        from gradient.records.services import register_control_hook
        from gradient.scheduling.record_providers import (
            evaluation_discovery,
            evaluation_read_access,
            names_of_ids,
        )
        from gradient.scheduling.services import operations
        from gradient.scheduling.services.evaluations import on_control

        # Operators' intents (admin, REST) land on the record; this carries them out on the rows.
        register_control_hook(kind=JobKind.EVALUATION, hook=on_control)
        # A resubmit (the console's restart, or the records page's action) makes the next generation.
        register_control_hook(kind=JobKind.EVALUATION, hook=operations.on_control)
        # What the rows show about an evaluation, and who may read its record: records reads no
        # scheduling table itself.
        register_discovery_provider(kind=JobKind.EVALUATION, provider=evaluation_discovery)
        register_name_provider(names_of_ids)
        register_read_access(kind=JobKind.EVALUATION, provider=evaluation_read_access)

        from gradient.scheduling.services.lifecycle import worker_jobs_return_lost
        from gradient.scheduling.services.offers import forget_offers_of_workers, forget_worker_offers
        from gradient.workers.services import register_session_hooks

        def worker_lost(worker_id: uuid.UUID, reason: str, now: datetime) -> None:
            forget_worker_offers(worker_id)
            worker_jobs_return_lost(worker_id=worker_id, reason=reason, now=now)

        # A new session has been offered nothing; a lost worker's single jobs go back to the pool (also
        # those of a worker whose server died with its socket, which has no session to close).
        register_session_hooks(opened=forget_offers_of_workers, lost=worker_lost, without_session=True)
