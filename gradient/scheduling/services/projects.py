"""Projects and who belongs to them: the namespaces evaluations, workers and REST submitters share."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import User
from django.db import transaction

from gradient.scheduling.models import Project


def project_create(*, name: str) -> Project:
    return Project.objects.create(name=name)


def user_create(*, username: str, password: str, is_staff: bool, projects: Iterable[Project]) -> User:
    """A REST client (submitter) of the given projects, or an operator (is_staff)."""
    with transaction.atomic():
        user = User.objects.create_user(username=username, password=password, is_staff=is_staff)
        for project in projects:
            project.members.add(user)
    return user
