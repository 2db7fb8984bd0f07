"""The records app's errors. Each refusal has its own class, so callers (the REST layer, the passes,
tests) can tell a history the protocol could not have written from bytes it cannot read, and a lost
race from a bad request."""

from __future__ import annotations


class RecordError(Exception):
    """Base of every error the records app raises on purpose."""


class DecodeError(RecordError):
    """An entry or header that strict decoding refuses. Never skipped."""


class SchemaError(DecodeError):
    """An unknown schema name, an unknown or missing field, a wrong type, malformed JSON or trailing
    data after the JSON value."""


class UnknownNameError(DecodeError):
    """A name this build does not know: an enum value, a control intent or a fact type."""


class InvalidHistory(RecordError):
    """A history the protocol could not have written. Fold refuses it rather than folding it into
    something plausible."""

    def __init__(self, revision: int, message: str) -> None:
        super().__init__(f"revision {revision}: {message}")
        self.revision = revision
        self.message = message


class UnknownRecord(RecordError, LookupError):
    """No record has this job key."""


class RecordExists(RecordError):
    """A record with this job key exists already: a header is written once."""


class RecordTombstoned(RecordError):
    """The record was tombstoned: nothing can be appended to it any more."""


class NotSettled(RecordError):
    """Only a settled record can be tombstoned."""


class IdempotencyConflict(RecordError):
    """The Idempotency-Key names a job submitted with a different spec."""

    def __init__(self, idempotency_key: str, job_key: str) -> None:
        super().__init__(f"Idempotency-Key {idempotency_key!r} names {job_key}, submitted with another spec")
        self.idempotency_key = idempotency_key
        self.job_key = job_key


class RevisionConflict(RecordError):
    """The revision a commit was based on is no longer current: someone else committed first."""

    def __init__(self, job_key: str, expected: int) -> None:
        super().__init__(f"{job_key}: revision {expected} is no longer current")
        self.job_key = job_key
        self.expected = expected


class ControlDeadlineExceeded(RecordError):
    """commit_control kept losing revision races until its deadline."""


class ProviderMissing(RuntimeError):
    """No app registered the provider records needs for this kind of job (discovery, read access).

    The owning app registers it from its AppConfig.ready(); a missing one is a wiring bug, so this is
    deliberately not a RecordError: nothing that handles refusals may swallow it."""

    def __init__(self, what: str, kind: str, register: str) -> None:
        super().__init__(
            f"no {what} provider is registered for {kind} jobs: the app that owns {kind} jobs calls "
            f"gradient.records.selectors.{register}() from its AppConfig.ready() (is it in INSTALLED_APPS?)"
        )
        self.what = what
        self.kind = kind
