from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "gradient.clusters"
    label = "clusters"
    verbose_name = "Cluster jobs"
