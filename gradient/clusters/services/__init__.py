"""Writes on cluster jobs (the database side of cluster-jobs.md), one module per concern:

- `attempts`: claim_cluster, start_cluster_attempt, close_cluster_attempt, the prepare's coordinator
  actions, expire_overdue_prepares;
- `members`: cluster_member_answer, cluster_member_report, cluster_signal_forward, cluster_worker_lost
  (what the worker session's job loop calls for members);
- `settle`: resolving a started attempt with its verdict and settling every member;
- `dispatch`: the cluster-dispatch pass and cluster_dispatch_kick;
- `lifecycle`: cluster_create, cluster_request_abort, cluster_abort, the control hook;
- `recovery`: recover_clusters_at_startup;
- `retention`: cluster_jobs_delete_expired.
"""

from gradient.clusters.services.attempts import (
    ClaimedAttempt,
    claim_cluster,
    close_cluster_attempt,
    expire_overdue_prepares,
    start_cluster_attempt,
)
from gradient.clusters.services.dispatch import cluster_dispatch_kick, cluster_dispatch_pass
from gradient.clusters.services.lifecycle import (
    ClusterInputError,
    MemberSpec,
    cluster_abort,
    cluster_create,
    cluster_request_abort,
)
from gradient.clusters.services.members import (
    cluster_member_answer,
    cluster_member_report,
    cluster_signal_forward,
    cluster_worker_lost,
)
from gradient.clusters.services.recovery import recover_clusters_at_startup
from gradient.clusters.services.retention import RETENTION_BATCH, cluster_jobs_delete_expired

__all__ = [
    "RETENTION_BATCH",
    "ClaimedAttempt",
    "ClusterInputError",
    "MemberSpec",
    "claim_cluster",
    "close_cluster_attempt",
    "cluster_abort",
    "cluster_create",
    "cluster_dispatch_kick",
    "cluster_dispatch_pass",
    "cluster_jobs_delete_expired",
    "cluster_member_answer",
    "cluster_member_report",
    "cluster_request_abort",
    "cluster_signal_forward",
    "cluster_worker_lost",
    "expire_overdue_prepares",
    "recover_clusters_at_startup",
    "start_cluster_attempt",
]
