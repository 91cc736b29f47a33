"""One place where an activity's failure is classified for Temporal: a definite refusal from the store (invalid
text, a number out of range, a constraint, a privilege) becomes a non-retryable ApplicationError with a one-line
message, so the step ends at once and visibly; anything else (connection loss, a lock timeout, a serialization
failure, or an error nobody classified) is retried, within the bound of the step's retry policy."""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from activities import error_types
from store import errors

MAX_MESSAGE = 300


def one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:MAX_MESSAGE]


class _ClassifyingInbound(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        try:
            return await self.next.execute_activity(input)
        except ApplicationError:
            raise
        except Exception as exc:
            if not errors.is_deterministic(exc):
                raise
            activity.logger.warning("%s refused for good: %s", activity.info().activity_type, one_line(exc))
            raise error_types.store_refusal(exc, one_line(exc)) from None


class ClassifyStoreErrors(Interceptor):
    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _ClassifyingInbound(next)
