from django.apps import AppConfig


class GradientConfig(AppConfig):
    """The project package doubles as an app for its management commands (`serve`) and templates."""

    name = "gradient"
    label = "gradient"
    verbose_name = "Gradient"

    def ready(self) -> None:
        from gradient.auth import connect_signals

        connect_signals()
