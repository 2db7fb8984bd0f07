"""/api/v1/ routes of the clusters app (included by gradient.api_urls)."""

from __future__ import annotations

from django.urls import path

from gradient.clusters import api

urlpatterns = [
    path("clusters", api.ClustersView.as_view(), name="clusters"),
    path("clusters/<str:cluster_id>", api.ClusterDetailView.as_view(), name="cluster-detail"),
    path("clusters/<str:cluster_id>/abort", api.ClusterAbortView.as_view(), name="cluster-abort"),
]
