"""What a serve remembers of its sessions' workers (assignment's cards): a claim batch reads only the
workers it has no card of, the claim statement checks what a card may have wrong (the session open and
not draining, the seat not held, the slots free), and a request a card left without a choice is decided
again from what the database holds. Memory may make a claim lose, never win."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from gradient.core.protocol import WorkerMetrics
from gradient.core.vocab import BuildStatus, EvaluationStatus
from gradient.scheduling import selectors
from gradient.scheduling.models import DerivationBuild, DispatchedJob, build_key
from gradient.scheduling.services import assignment, graph, lifecycle
from gradient.scheduling.services.assignment import request_builds
from gradient.scheduling.services.claims import REFUSED_FULL, REFUSED_HELD, REFUSED_SESSION
from gradient.workers.models import Worker, WorkerSession
from tests.factories import ClusterJobFactory, EvaluationFactory, ProjectFactory, connected_worker
from tests.scheduling_helpers import build_claim_for, drv

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("postgres_only")]


def _queued(project: object, *names: str) -> list[DerivationBuild]:
    evaluation = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(evaluation=evaluation, derivations=[drv(n) for n in names], now=timezone.now())
    return list(DerivationBuild.objects.filter(evaluation_links__evaluation=evaluation))


def _session(worker: Worker) -> WorkerSession:
    return WorkerSession.objects.get(worker=worker, closed_at__isnull=True)


def _ask(worker: Worker, session: WorkerSession, **kwargs: object) -> assignment.Assignment | None:
    return request_builds(
        worker_ids=[worker.id], session_ids=[session.id], now=timezone.now(), tried=[], **kwargs
    )[0]


def _finish(answer: assignment.Assignment | None) -> None:
    assert answer is not None
    DispatchedJob.objects.filter(id=answer.assignment_id).update(
        finished_at=timezone.now(), outcome="Completed", reason="done"
    )


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[uuid.UUID]]:
    reads: list[list[uuid.UUID]] = []
    real = selectors.workers_scored_of_batch

    def counted(worker_ids, now=None):  # type: ignore[no-untyped-def]
        reads.append(list(worker_ids))
        return real(worker_ids, now)

    monkeypatch.setattr(selectors, "workers_scored_of_batch", counted)
    return reads


def test_a_sessions_second_request_reads_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    project = ProjectFactory()
    _queued(project, "a", "b")
    worker = connected_worker([project])
    session = _session(worker)
    reads = _counting_reads(monkeypatch)
    _finish(_ask(worker, session))
    assert reads == [[worker.id]]
    second = _ask(worker, session)
    assert second is not None and reads == [[worker.id]], "the card served it"


def test_a_card_behind_the_workers_projects_still_hands_out_the_new_projects_build() -> None:
    first, second = ProjectFactory(), ProjectFactory()
    [a] = _queued(first, "a")
    worker = connected_worker([first])
    session = _session(worker)
    taken = _ask(worker, session)
    assert taken is not None and taken.job_key == build_key(a.id)
    _finish(taken)
    [b] = _queued(second, "b")
    worker.projects.add(second)  # an operator's change: nothing tells the serve
    answer = _ask(worker, session)
    assert answer is not None and answer.job_key == build_key(b.id)


def test_a_session_drained_behind_its_card_gets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    project = ProjectFactory()
    _queued(project, "a", "b")
    worker = connected_worker([project])
    session = _session(worker)
    _finish(_ask(worker, session))
    # The serve's drain marks its sessions in the database; the card still says "not draining".
    WorkerSession.objects.filter(id=session.id).update(draining=True)
    assert _ask(worker, session) is None
    assert DispatchedJob.objects.filter(finished_at__isnull=True).count() == 0
    assert DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count() == 1


def test_a_full_worker_behind_its_card_gets_nothing_until_a_slot_is_free() -> None:
    project = ProjectFactory()
    _queued(project, "a", "b")
    worker = connected_worker([project], max_concurrent_builds=1)
    session = _session(worker)
    first = _ask(worker, session)
    assert first is not None
    # The card has no count of open builds: the claim statement finds the one slot taken.
    assert _ask(worker, session) is None
    assert DispatchedJob.objects.filter(finished_at__isnull=True).count() == 1
    # Its end on its way (reported, not applied yet) frees the slot.
    assert _ask(worker, session, finishing=[1]) is not None


def test_the_heartbeat_newer_than_the_workers_row_is_what_the_card_is_scored_with() -> None:
    project = ProjectFactory()
    _queued(project, "a", "b")
    worker = connected_worker([project])
    session = _session(worker)
    calm = _ask(worker, session)
    assert calm is not None and calm.score.breakdown.get("ResourceSaturation", 0.0) == 0.0
    _finish(calm)
    # A saturated CPU holds every job back (scoring.saturation_holds_back): the heartbeat, not yet in
    # the worker's row, is what the card is scored with.
    busy = (WorkerMetrics(cpu_usage_pct=99.0), timezone.now())
    assert _ask(worker, session, metrics=[busy]) is None
    assert DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count() == 1
    calm_again = (WorkerMetrics(cpu_usage_pct=5.0), timezone.now())
    assert _ask(worker, session, metrics=[calm_again]) is not None


def test_the_claim_statement_says_why_it_refused_a_claim_for_its_worker() -> None:
    project = ProjectFactory()
    a, b = _queued(project, "a", "b")
    worker = connected_worker([project])
    session = _session(worker)
    now = timezone.now()

    refused: dict[uuid.UUID, str] = {}
    held_until = now + timedelta(minutes=30)
    reservation = [{"role": "r", "index": 0, "kind": "build", "worker_id": str(worker.id)}]
    from gradient.clusters.models import ClusterReservation

    hold = ClusterReservation.objects.create(
        cluster_job=ClusterJobFactory(), seats=reservation, created_at=now, expires_at=held_until
    )
    held = build_claim_for(a, worker, session.id, room=1)
    assert lifecycle.claim_builds(claims=[held], now=now, refused=refused) == set()
    assert refused == {held.assignment_id: REFUSED_HELD}
    hold.delete()

    won = build_claim_for(a, worker, session.id, room=1)
    assert lifecycle.claim_builds(claims=[won], now=now, refused=refused) == {won.assignment_id}
    full = build_claim_for(b, worker, session.id, room=1)
    assert lifecycle.claim_builds(claims=[full], now=now, refused=refused) == set()
    assert refused[full.assignment_id] == REFUSED_FULL

    WorkerSession.objects.filter(id=session.id).update(draining=True)
    draining = build_claim_for(b, worker, session.id, room=2)
    assert lifecycle.claim_builds(claims=[draining], now=now, refused=refused) == set()
    assert refused[draining.assignment_id] == REFUSED_SESSION

    # Nothing written for a refused claim: b is still Queued, with no assignment.
    assert DerivationBuild.objects.get(id=b.id).status == BuildStatus.QUEUED
    assert not DispatchedJob.objects.filter(derivation_build_id=b.id).exists()


def test_a_read_begun_before_a_sessions_card_was_forgotten_keeps_nothing_of_that_session() -> None:
    project = ProjectFactory()
    first, second = connected_worker([project]), connected_worker([project])
    epoch = assignment._cards_epoch
    states, open_builds, scores = selectors.workers_scored_of_batch([first.id, second.id])
    assignment.forget_card(_session(first).id)  # its WorkerCapabilities handled while the read ran
    assignment._keep_cards(states, open_builds, scores, epoch, time.monotonic(), gone=())
    assert _session(first).id not in assignment._cards
    assert assignment._cards[_session(second).id].state.id == second.id
