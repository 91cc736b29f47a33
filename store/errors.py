"""The one place that turns driver errors into answers: constraint violations become domain errors named after
their constraints, and connection loss or timeouts are "uncertain" (the write may or may not have committed)."""

from __future__ import annotations

import asyncio

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
    )
}
# pk_deliveries guards the same rule as uq_export_jobs_original_key, and fires first in the creation statement.
_BY_CONSTRAINT["pk_deliveries"] = DeliveryKeyTaken

LOCK_NOT_AVAILABLE = "55P03"


def postgres_error(exc: BaseException) -> asyncpg.PostgresError | None:
    """The server's own error behind SQLAlchemy's and the adapter's wrappers, if the server answered."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, asyncpg.PostgresError):
            return current
        seen.add(id(current))
        current = getattr(current, "orig", None) or current.__cause__
    return None


def is_lock_timeout(exc: BaseException) -> bool:
    err = postgres_error(exc)
    return err is not None and err.sqlstate == LOCK_NOT_AVAILABLE


def is_uncertain(exc: BaseException) -> bool:
    """Connection loss or a timeout: the statement may have committed. Ask the row, not the exception."""
    if isinstance(exc, (OSError, asyncio.TimeoutError, TimeoutError, asyncpg.InterfaceError)):
        return True
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    err = postgres_error(exc)
    if err is not None:
        # Class 08: connection exception; 57P01..57P03: the server is shutting down or restarting.
        return err.sqlstate.startswith("08") or err.sqlstate in ("57P01", "57P02", "57P03")
    cause = exc.__cause__ or getattr(exc, "orig", None)
    return cause is not None and cause is not exc and is_uncertain(cause)


def translate(exc: BaseException) -> BaseException:
    """The domain error for a constraint violation, or the exception itself."""
    err = postgres_error(exc)
    constraint = getattr(err, "constraint_name", None) if err is not None else None
    cls = _BY_CONSTRAINT.get(constraint or "")
    return cls() if cls is not None else exc
