from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "gradient.recovery"
    label = "recovery"
    verbose_name = "Recovery and periodic passes"
