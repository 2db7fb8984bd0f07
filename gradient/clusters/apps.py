from django.apps import AppConfig


class ClustersConfig(AppConfig):
    name = "gradient.clusters"
    label = "clusters"
    verbose_name = "Cluster jobs"

    def ready(self) -> None:
        from gradient.clusters.record_providers import cluster_discovery
        from gradient.clusters.record_providers import names_of_ids as cluster_names
        from gradient.clusters.services.lifecycle import on_control
        from gradient.records.schemas import JobKind
        from gradient.records.selectors import register_discovery_provider, register_name_provider
        from gradient.records.services import register_control_hook

        # An operator's abort (admin, REST) lands on the cluster's record; this carries it out on the rows.
        register_control_hook(kind=JobKind.CLUSTER, hook=on_control)
        # What the rows show about a cluster job: records reads no clusters table itself.
        register_discovery_provider(kind=JobKind.CLUSTER, provider=cluster_discovery)
        register_name_provider(cluster_names)

        from gradient.clusters.selectors import RESERVATION_SQL, RESERVED_SEAT_SQL, workers_reserved_for
        from gradient.clusters.services.dispatch import cluster_idle_kick
        from gradient.clusters.services.members import cluster_member_message, cluster_worker_lost
        from gradient.scheduling.selectors import register_seat_hold
        from gradient.scheduling.services.assignment import register_idle_listener
        from gradient.scheduling.services.reports import register_member_handler
        from gradient.workers.services import register_session_hooks

        # The scheduler knows nothing of clusters; it asks through these. A member's reports and
        # answers go to its attempt; a reserved seat gets no single job; an unanswered RequestJob may
        # place a waiting cluster at once; a lost worker's members are lost into their attempts.
        register_member_handler(cluster_member_message)
        register_seat_hold(workers_reserved_for, reads=[RESERVATION_SQL], condition=RESERVED_SEAT_SQL)
        register_idle_listener(cluster_idle_kick)
        register_session_hooks(
            lost=lambda worker_id, reason, now: cluster_worker_lost(worker_id=worker_id, now=now)
        )
