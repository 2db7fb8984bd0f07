from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "gradient.workers"
    label = "workers"
    verbose_name = "Workers"
