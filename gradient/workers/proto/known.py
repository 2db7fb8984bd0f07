"""QueryKnownDerivations (protocol.md, "Known derivations"): a rare message, answered on a lane thread
by one indexed read (scheduling.services.known). Every query is answered; a query for an assignment that
is not the worker's open evaluation assignment gets an empty list."""

from __future__ import annotations

from gradient.core.protocol import KnownDerivations, QueryKnownDerivations, ServerMessage
from gradient.scheduling.services.known import known_derivations
from gradient.workers.services import SessionRef


def query_known_derivations(*, session: SessionRef, message: QueryKnownDerivations) -> list[ServerMessage]:
    known = known_derivations(
        worker_id=session.worker_id,
        job_key=message.job_id,
        assignment_id=message.assignment_id,
        drv_paths=message.drv_paths,
    )
    return [KnownDerivations(job_id=message.job_id, assignment_id=message.assignment_id, drv_paths=known)]
