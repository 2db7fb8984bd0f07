from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "gradient.clusters"
    label = "clusters"
    verbose_name = "Cluster jobs"

    def ready(self) -> None:
        from gradient.clusters.services.lifecycle import on_control
        from gradient.records.schemas import JobKind
        from gradient.records.services import register_control_hook

        # An operator's abort (admin, REST) lands on the cluster's record; this carries it out on the rows.
        register_control_hook(kind=JobKind.CLUSTER, hook=on_control)
