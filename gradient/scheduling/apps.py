from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "gradient.scheduling"
    label = "scheduling"
    verbose_name = "Scheduling: evaluations, shared builds, assignments"
