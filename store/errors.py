"""The one place that turns driver errors into answers: constraint violations become domain errors named after
their constraints, and connection loss or timeouts are "uncertain" (the write may or may not have committed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
from sqlalchemy import exc as sa_exc


class StoreError(Exception):
    """A definite answer from the database that the caller should report."""


class ConstraintViolation(StoreError):
    constraint = ""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__ or self.constraint)


class JobAlreadyExists(ConstraintViolation):
    """an export with this ID already exists"""

    constraint = "export_jobs_pkey"


class DeliveryKeyTaken(ConstraintViolation):
    """this tenant already has an export with this delivery key"""

    constraint = "uq_export_jobs_original_key"


class UnknownDestination(ConstraintViolation):
    """no such destination for this tenant"""

    constraint = "fk_export_jobs_destination"


class ReplacementSlotTaken(ConstraintViolation):
    """the original already has a live, delivered or identifying replacement"""

    constraint = "uq_export_jobs_one_replacement"


class TransitionAlreadyRecorded(ConstraintViolation):
    """this transition is already recorded for this attempt"""

    constraint = "uq_attempt_transition"


class ReplacementMismatch(ConstraintViolation):
    """a replacement must carry its original's tenant and delivery key, and name an original"""

    constraint = "fk_export_jobs_replaces"


class FailureCodeMismatch(ConstraintViolation):
    """a Failed export needs exactly one failure code, and no other status may carry one"""

    constraint = "ck_export_jobs_failure"


class NotReplaceable(StoreError):
    """The original is not OutcomeUnknown or Failed for a reason that proves nothing was finalized, or it is not
    this tenant's."""


class NotPermitted(StoreError):
    """The database role may not do this (a privilege or row-level security refused it)."""


class CancellationRequestExists(ConstraintViolation):
    """this request ID is already recorded for this tenant"""

    constraint = "pk_cancellation_requests"


_BY_CONSTRAINT: dict[str, type[ConstraintViolation]] = {
    cls.constraint: cls
    for cls in (
        JobAlreadyExists,
        DeliveryKeyTaken,
        UnknownDestination,
        ReplacementSlotTaken,
        TransitionAlreadyRecorded,
        CancellationRequestExists,
        ReplacementMismatch,
        FailureCodeMismatch,
    )
}
# pk_deliveries guards the same rule as uq_export_jobs_original_key, and fires first in the creation statement.
_BY_CONSTRAINT["pk_deliveries"] = DeliveryKeyTaken

LOCK_NOT_AVAILABLE = "55P03"
INSUFFICIENT_PRIVILEGE = "42501"


def _wrapped(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those it wraps (SQLAlchemy's `orig`, or the cause), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = getattr(current, "orig", None) or current.__cause__


def describe(exc: BaseException) -> str:
    """One line for a log: the innermost error (the driver's or the socket's), without SQLAlchemy's wrapping."""
    root = list(_wrapped(exc))[-1]
    said = str(root) or ("no answer within its bound" if isinstance(root, TimeoutError) else "")
    text = " ".join(f"{type(root).__name__}: {said}".split())
    return text[:300]


def postgres_error(exc: BaseException) -> asyncpg.PostgresError | None:
    """The server's own error behind SQLAlchemy's and the adapter's wrappers, if the server answered."""
    return next((e for e in _wrapped(exc) if isinstance(e, asyncpg.PostgresError)), None)


def is_lock_timeout(exc: BaseException) -> bool:
    err = postgres_error(exc)
    return err is not None and err.sqlstate == LOCK_NOT_AVAILABLE


def is_uncertain(exc: BaseException) -> bool:
    """Connection loss or a timeout: the statement may have committed. Ask the row, not the exception."""
    if isinstance(exc, (OSError, asyncio.TimeoutError, TimeoutError)):
        return True
    if isinstance(exc, asyncpg.InterfaceError):
        # Only a closed connection; the adapter's other interface errors (another operation in progress, wrong
        # argument count, bad configuration) refuse the statement before it is sent: real answers.
        return "connection is closed" in str(exc)
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    err = postgres_error(exc)
    if err is not None:
        # Class 08: connection exception; 57P01..57P03: the server is shutting down or restarting.
        return err.sqlstate.startswith("08") or err.sqlstate in ("57P01", "57P02", "57P03")
    cause = exc.__cause__ or getattr(exc, "orig", None)
    return cause is not None and cause is not exc and is_uncertain(cause)


# Answers that may differ on a retry: a serialization failure, a deadlock, a lock or statement timeout, a server
# short of resources. Everything else the server says (invalid text, a number out of range, a constraint or a
# privilege) is the same answer next time.
_TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014"})


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection loss or a timeout (uncertain), a server answer that may change, or no host that
    answers as the URL asks (a failover under way: no primary yet; nothing was sent)."""
    if is_uncertain(exc):
        return True
    if any(isinstance(e, asyncpg.exceptions.TargetServerAttributeNotMatched) for e in _wrapped(exc)):
        return True
    err = postgres_error(exc)
    return err is not None and (err.sqlstate in _TRANSIENT_SQLSTATES or err.sqlstate.startswith("53"))


def is_deterministic(exc: BaseException) -> bool:
    """A definite refusal that no retry can change: a domain error, the server's answer to this statement, or a
    value the driver refused to send (asyncpg's client-side DataError, e.g. a number out of range)."""
    if isinstance(exc, StoreError):
        return True
    if is_transient(exc):
        return False
    if postgres_error(exc) is not None:
        return True
    return any(isinstance(e, asyncpg.exceptions._base.DataError) for e in _wrapped(exc))


def translate(exc: BaseException) -> BaseException:
    """The domain error for a constraint violation, or the exception itself."""
    err = postgres_error(exc)
    if err is None:
        return exc
    if err.sqlstate == INSUFFICIENT_PRIVILEGE:
        return NotPermitted(str(err))
    cls = _BY_CONSTRAINT.get(getattr(err, "constraint_name", None) or "")
    return cls() if cls is not None else exc
