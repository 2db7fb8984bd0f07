"""Job keys, formatted and parsed in one place: `eval:<uuid>`, `build:<uuid>`, `cluster:<uuid>`.

A job key names a job across tables and on the wire: dispatched_job.job_id, a candidate's job_id, a
cluster seat's job_key, a record's job_key (`eval:` or `cluster:`). Formatting always writes the
canonical (lower-case, hyphenated) uuid. Parsing never raises on a malformed key: `JobKey.parse`
returns None; `JobKey.require` raises `JobKeyError` (a ValueError) for callers that must refuse one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

from gradient.core.ids import parse_uuid
from gradient.core.vocab import JobKeyKind, JobKind, RecordKind

SINGLE_JOB_KEYS: Final = frozenset({JobKeyKind.EVAL, JobKeyKind.BUILD})
"""The keys of single jobs, what a worker runs: `eval:` and `build:`."""
RECORD_KEYS: Final = frozenset({JobKeyKind.EVAL, JobKeyKind.CLUSTER})
"""The keys of jobs that have a record: `eval:` and `cluster:`."""

_CANONICAL_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

# Any of the kinds a key can be made of (JobKind, RecordKind or JobKeyKind, by value).
_KEY_KIND: Final = {
    JobKind.EVAL.value: JobKeyKind.EVAL,
    JobKind.BUILD.value: JobKeyKind.BUILD,
    RecordKind.EVALUATION.value: JobKeyKind.EVAL,
    RecordKind.CLUSTER.value: JobKeyKind.CLUSTER,
}
_JOB_KIND: Final = {JobKeyKind.EVAL: JobKind.EVAL, JobKeyKind.BUILD: JobKind.BUILD}
_RECORD_KIND: Final = {JobKeyKind.EVAL: RecordKind.EVALUATION, JobKeyKind.CLUSTER: RecordKind.CLUSTER}


class JobKeyError(ValueError):
    """Not a job key (of the kinds asked for)."""


@dataclass(frozen=True, slots=True)
class JobKey:
    kind: JobKeyKind
    id: uuid.UUID

    @classmethod
    def of(cls, kind: JobKeyKind | JobKind | RecordKind, job_id: uuid.UUID | str) -> JobKey:
        """The key of this job; a `job_id` that is no uuid raises ValueError."""
        return cls(_KEY_KIND[kind.value], _as_uuid(job_id))

    @classmethod
    def parse(
        cls, text: object, *, kinds: Collection[JobKeyKind] | None = None, canonical: bool = False
    ) -> JobKey | None:
        """The key `text` is, or None: not a string, no known prefix, a prefix not in `kinds`, or no
        uuid after it. `canonical` accepts only the form `str(key)` writes (lower-case, hyphenated),
        as stored keys are compared as text."""
        if not isinstance(text, str):
            return None
        prefix, sep, rest = text.partition(":")
        if not sep:
            return None
        try:
            kind = JobKeyKind(prefix)
        except ValueError:
            return None
        if kinds is not None and kind not in kinds:
            return None
        if canonical and _CANONICAL_UUID.match(rest) is None:
            return None
        parsed = parse_uuid(rest)
        return cls(kind, parsed) if parsed is not None else None

    @classmethod
    def require(
        cls, text: object, *, kinds: Collection[JobKeyKind] | None = None, canonical: bool = False
    ) -> JobKey:
        """As `parse`, raising JobKeyError instead of returning None."""
        key = cls.parse(text, kinds=kinds, canonical=canonical)
        if key is None:
            wanted = " or ".join(f"{k}:<uuid>" for k in JobKeyKind if kinds is None or k in kinds)
            raise JobKeyError(f"{text!r} is not a job key ({wanted})")
        return key

    @property
    def job_kind(self) -> JobKind | None:
        """The single job's kind (`eval:`, `build:`); None for a cluster key."""
        return _JOB_KIND.get(self.kind)

    @property
    def record_kind(self) -> RecordKind | None:
        """The kind of record this key names (`eval:`, `cluster:`); None for a build key."""
        return _RECORD_KIND.get(self.kind)

    def __str__(self) -> str:
        return _format(self.kind, self.id)


def _format(kind: JobKeyKind, job_id: uuid.UUID) -> str:
    return f"{kind.value}:{job_id}"


def _as_uuid(job_id: uuid.UUID | str) -> uuid.UUID:
    return job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(str(job_id))


# The three formats as text, for the hot paths (a key per candidate) and the columns that store them.


def eval_key(evaluation_id: uuid.UUID | str) -> str:
    """`eval:<uuid>`."""
    return _format(JobKeyKind.EVAL, _as_uuid(evaluation_id))


def build_key(build_id: uuid.UUID | str) -> str:
    """`build:<uuid>`."""
    return _format(JobKeyKind.BUILD, _as_uuid(build_id))


def cluster_key(cluster_id: uuid.UUID | str) -> str:
    """`cluster:<uuid>`."""
    return _format(JobKeyKind.CLUSTER, _as_uuid(cluster_id))


def job_key(kind: JobKeyKind | JobKind | RecordKind, job_id: uuid.UUID | str) -> str:
    """The key of this job as text (`str(JobKey.of(kind, job_id))`)."""
    return str(JobKey.of(kind, job_id))
