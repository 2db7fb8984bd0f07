from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "gradient.scheduling"
    label = "scheduling"
    verbose_name = "Scheduling: evaluations, shared builds, assignments"

    def ready(self) -> None:
        from gradient.records.schemas import JobKind
        from gradient.records.services import register_control_hook
        from gradient.scheduling.services.evaluations import on_control

        # Operators' intents (admin, REST) land on the record; this carries them out on the rows.
        register_control_hook(kind=JobKind.EVALUATION, hook=on_control)
