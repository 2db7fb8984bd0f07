from django.apps import AppConfig


class GradientConfig(AppConfig):
    """The project package doubles as an app for its management commands (`serve`) and templates."""

    name = "gradient"
    label = "gradient"
    verbose_name = "Gradient"
