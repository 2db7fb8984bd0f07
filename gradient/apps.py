from django.apps import AppConfig


class GradientConfig(AppConfig):
    """The project package doubles as an app for its management commands (`serve`) and templates."""

    name = "gradient"
    label = "gradient"
    verbose_name = "Gradient"

    def ready(self) -> None:
        from gradient import auth
        from gradient.workers import revocation

        auth.connect_signals()
        revocation.connect_signals()
