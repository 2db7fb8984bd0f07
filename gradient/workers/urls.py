"""/api/v1/ routes of the workers app (included by gradient.api_urls)."""

from __future__ import annotations

from django.urls import path

from gradient.workers import api

urlpatterns = [
    path("auth/token", api.AuthTokenView.as_view(), name="auth-token"),
    path("users", api.UsersView.as_view(), name="users"),
    path("users/<str:user_id>", api.UserDetailView.as_view(), name="user-detail"),
    path("projects", api.ProjectsView.as_view(), name="projects"),
    path("projects/<str:project_id>", api.ProjectDetailView.as_view(), name="project-detail"),
    path("workers", api.WorkersView.as_view(), name="workers"),
    path("workers/<str:worker_id>", api.WorkerDetailView.as_view(), name="worker-detail"),
    path("workers/<str:worker_id>/deactivate", api.WorkerDeactivateView.as_view(), name="worker-deactivate"),
    path("workers/<str:worker_id>/drain", api.WorkerDrainView.as_view(), name="worker-drain"),
    path("workers/<str:worker_id>/activate", api.WorkerActivateView.as_view(), name="worker-activate"),
]
