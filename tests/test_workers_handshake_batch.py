"""A batch of handshakes (workers.services.worker_sessions_open, issue 31 item 2): every InitConnection
of a process in a few milliseconds opens its session in one transaction of set statements, and each is
decided exactly as worker_session_open decides one alone."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from gradient.core.protocol import InitCapabilities, WorkerCapabilities
from gradient.recovery.models import ServerBoot
from gradient.scheduling.models import SentList, SentOffer
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from gradient.workers.services import (
    HandshakeAccepted,
    HandshakeRejected,
    SessionOpen,
    worker_register,
    worker_sessions_open,
    workers_capabilities_replace,
)
from tests.factories import ProjectFactory

pytestmark = pytest.mark.django_db

BUSY = HandshakeRejected(496, "this worker already has an open session")


def _boot(*, stopped: bool = False) -> ServerBoot:
    now = timezone.now()
    return ServerBoot.objects.create(
        hostname="h", pid=1, started_at=now, last_heartbeat=now, stopped_at=now if stopped else None
    )


def _request(worker_id: object, token: str, caps: InitCapabilities | None = None) -> SessionOpen:
    return SessionOpen(
        worker_id=str(worker_id),
        token=token,
        capabilities=caps or InitCapabilities(fetch=True, eval=True, build=True),
        channel_name=f"chan-{uuid.uuid4().hex[:8]}",
        session_id=uuid.uuid4(),
    )


def _registered(n: int, projects: list[object] | None = None) -> list[tuple[Worker, str]]:
    return [worker_register(name=f"w{i}-{uuid.uuid4().hex[:6]}", projects=projects or []) for i in range(n)]


def test_a_batch_opens_every_session_with_its_capabilities_and_nothing_offered() -> None:
    projects = [ProjectFactory(name="zeta"), ProjectFactory(name="alpha")]
    workers = _registered(12, projects)
    boot = _boot()
    now = timezone.now()
    first = workers[0][0]
    IdleSlot.objects.create(worker=first, kind="build", recorded_at=now)
    Worker.objects.filter(id=first.id).update(cpu_usage_pct=99.0, metrics_at=now)
    SentOffer.objects.create(worker=first, sent_list=SentList.objects.create(job_ids=["build:x"]))
    requests = [
        _request(w.id, token, InitCapabilities(fetch=i % 2 == 0, eval=i % 3 == 0, build=True))
        for i, (w, token) in enumerate(workers)
    ]

    results = worker_sessions_open(requests=requests, server_boot=boot.id, now=now)

    assert [type(r) for r in results] == [HandshakeAccepted] * len(requests)
    for request, result in zip(requests, results, strict=True):
        assert isinstance(result, HandshakeAccepted)
        assert result.session.session_id == request.session_id
        assert str(result.session.worker_id) == request.worker_id
        assert result.authorized_projects == ["alpha", "zeta"]
        session = WorkerSession.objects.get(id=request.session_id)
        assert (session.closed_at, session.server_boot, session.channel_name) == (
            None,
            boot.id,
            request.channel_name,
        )
        worker = Worker.objects.get(id=request.worker_id)
        caps = request.capabilities
        assert (worker.can_fetch, worker.can_eval, worker.can_build) == (caps.fetch, caps.eval, caps.build)
        assert (worker.metrics_at, worker.cpu_usage_pct, worker.last_seen) == (None, None, now)
    assert not IdleSlot.objects.filter(worker=first).exists()
    assert not SentOffer.objects.filter(worker=first).exists()


def test_the_statements_of_a_batch_do_not_grow_with_its_handshakes() -> None:
    boot = _boot()

    def statements(n: int) -> int:
        requests = [_request(w.id, token) for w, token in _registered(n, [ProjectFactory()])]
        with CaptureQueriesContext(connection) as queries:
            results = worker_sessions_open(requests=requests, server_boot=boot.id, now=timezone.now())
        assert all(isinstance(r, HandshakeAccepted) for r in results)
        return len(queries.captured_queries)

    assert statements(3) == statements(40)


def test_each_handshake_of_a_batch_is_decided_as_alone() -> None:
    (
        (ok, ok_token),
        (bad, _),
        (off, off_token),
        (twice, twice_token),
        (live, live_token),
        (dead, dead_token),
    ) = _registered(6)
    Worker.objects.filter(id=off.id).update(active=False)
    live_boot, dead_boot = _boot(), _boot(stopped=True)
    now = timezone.now()
    held = WorkerSession.objects.create(
        worker=live, channel_name="c", server_boot=live_boot.id, opened_at=now, last_seen=now
    )
    orphan = WorkerSession.objects.create(
        worker=dead, channel_name="c", server_boot=dead_boot.id, opened_at=now, last_seen=now
    )
    requests = [
        _request(ok.id, ok_token),
        _request(uuid.uuid4(), "anything"),
        _request("not-a-uuid", "anything"),
        _request(bad.id, "wrong"),
        _request(off.id, off_token),
        _request(twice.id, twice_token),
        _request(twice.id, twice_token),
        _request(live.id, live_token),
        _request(dead.id, dead_token),
    ]

    results = worker_sessions_open(requests=requests, server_boot=_boot().id, now=now)

    assert isinstance(results[0], HandshakeAccepted)
    assert results[1:5] == [
        HandshakeRejected(403, "unknown worker"),
        HandshakeRejected(403, "unknown worker"),
        HandshakeRejected(401, "bad token"),
        HandshakeRejected(403, "worker is deactivated"),
    ]
    assert isinstance(results[5], HandshakeAccepted) and results[6] == BUSY
    assert results[7] == BUSY
    assert isinstance(results[8], HandshakeAccepted)
    held.refresh_from_db()
    orphan.refresh_from_db()
    assert held.closed_at is None  # a live server's session is not taken over
    assert orphan.closed_at is not None  # a dead server's is closed, and the new one opened
    assert (
        WorkerSession.objects.filter(worker=dead, closed_at__isnull=True).get().id == requests[8].session_id
    )
    assert not WorkerSession.objects.filter(worker__in=[off, bad]).exists()
    assert WorkerSession.objects.filter(worker=twice, closed_at__isnull=True).count() == 1


def test_a_batch_applied_again_after_a_commit_it_did_not_hear_accepts_its_own_sessions() -> None:
    """lanes.retrying applies a batch again when its connection died, perhaps after the commit: the
    sessions it opened then are its own, not another's (no 496)."""
    boot = _boot()
    requests = [_request(w.id, token) for w, token in _registered(5, [ProjectFactory(name="p")])]
    first = worker_sessions_open(requests=requests, server_boot=boot.id, now=timezone.now())
    again = worker_sessions_open(
        requests=requests, server_boot=boot.id, now=timezone.now() + timedelta(milliseconds=5)
    )
    assert again == first
    assert all(isinstance(r, HandshakeAccepted) and r.authorized_projects == ["p"] for r in again)
    assert WorkerSession.objects.filter(closed_at__isnull=True).count() == len(requests)


def _caps(n: int, zone: str | None = None) -> WorkerCapabilities:
    return WorkerCapabilities(
        architectures=[f"arch-{n}"],
        system_features=["kvm"] if n % 2 else [],
        max_concurrent_builds=n,
        cpu_count=n + 1,
        ram_total_mb=1000 * n,
        cpu_core_score=10 * n,
        zone=zone if zone is not None else f"zone-{n}",
        endpoint=None,
    )


def test_a_fleets_capabilities_are_stored_together_each_as_alone() -> None:
    boot = _boot()
    workers = _registered(6)
    requests = [_request(w.id, token) for w, token in workers]
    results = worker_sessions_open(requests=requests, server_boot=boot.id, now=timezone.now())
    sessions = [r.session for r in results if isinstance(r, HandshakeAccepted)]
    items = [(s, _caps(i + 1)) for i, s in enumerate(sessions)]
    items.append((sessions[0], _caps(9)))  # said again: the last one stands
    now = timezone.now()
    workers_capabilities_replace(items=items, now=now)  # one statement of fixed text (fixed_cursor)
    for i, session in enumerate(sessions):
        n = 9 if i == 0 else i + 1
        w = Worker.objects.get(id=session.worker_id)
        assert (w.architectures, w.system_features, w.max_concurrent_builds, w.cpu_count) == (
            [f"arch-{n}"],
            ["kvm"] if n % 2 else [],
            n,
            n + 1,
        )
        assert (w.ram_total_mb, w.cpu_core_score, w.zone, w.capabilities_at) == (
            1000 * n,
            10 * n,
            f"zone-{n}",
            now,
        )


def test_capabilities_the_database_refuses_cost_only_their_own_message() -> None:
    """A NUL in a string is valid JSON but no PostgreSQL text: the batch is stored one by one, that
    message dropped, the others stored."""
    from gradient.workers.proto.dispatcher import capabilities_batch

    boot = _boot()
    requests = [_request(w.id, token) for w, token in _registered(3)]
    results = worker_sessions_open(requests=requests, server_boot=boot.id, now=timezone.now())
    sessions = [r.session for r in results if isinstance(r, HandshakeAccepted)]
    capabilities_batch(
        [(sessions[0], _caps(1)), (sessions[1], _caps(2, zone="bad\x00zone")), (sessions[2], _caps(3))]
    )
    zones = {w.id: w.zone for w in Worker.objects.filter(id__in=[s.worker_id for s in sessions])}
    assert [zones[s.worker_id] for s in sessions] == ["zone-1", None, "zone-3"]
