from django.apps import AppConfig


class RecordsConfig(AppConfig):
    name = "gradient.records"
    label = "records"
    verbose_name = "Job records"
