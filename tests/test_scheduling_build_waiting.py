"""Why a queued shared build waits, in words: the build's console page and REST read this text. A seat
reserved for a waiting cluster holds its worker's build slots, and the text says so."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.clusters.models import ClusterReservation
from gradient.core.vocab import BuildStatus
from gradient.scheduling.selectors import build_waiting_text
from tests.factories import ClusterJobFactory, DerivationBuildFactory, connected_worker

pytestmark = pytest.mark.django_db


def _reserve(*workers: object) -> None:
    now = timezone.now()
    ClusterReservation.objects.create(
        cluster_job=ClusterJobFactory(),
        seats=[
            {"role": "a", "index": i, "kind": "build", "worker_id": str(w.id)}  # type: ignore[attr-defined]
            for i, w in enumerate(workers)
        ],
        created_at=now,
        expires_at=now + timedelta(minutes=30),
    )


def test_a_queued_build_with_capable_workers_says_how_many_and_what_is_ahead() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now())
    connected_worker(can_build=True, architectures=["x86_64-linux"])
    assert build_waiting_text(build).startswith("1 connected worker can build it; ")


def test_a_build_whose_every_capable_worker_is_reserved_for_a_cluster_says_so() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now())
    worker = connected_worker(can_build=True, architectures=["x86_64-linux"])
    _reserve(worker)
    text = build_waiting_text(build)
    assert "reserved for a waiting cluster" in text and "gets no single build" in text


def test_a_build_with_some_capable_workers_reserved_counts_them() -> None:
    build = DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now())
    held = connected_worker(can_build=True, architectures=["x86_64-linux"])
    connected_worker(can_build=True, architectures=["x86_64-linux"])
    _reserve(held)
    assert build_waiting_text(build).startswith(
        "2 connected workers can build it (1 of them reserved for a waiting cluster); "
    )
