"""Two ways of seeing a step through: to its end however often its caller is cancelled (`run_to_end`), and
again while its error says a later try may succeed (`retry_patiently`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from store import errors

log = logging.getLogger(__name__)

T = TypeVar("T")


async def run_to_end(work: Awaitable[T], on_cancel: Callable[[], None] = lambda: None) -> T:
    """Await `work` to its end however often the caller is cancelled meanwhile: for steps whose effect must be
    recorded once begun (an upload and its evidence, a stop's terminal write)."""
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            on_cancel()


async def retry_patiently(step: Callable[[], Coroutine[Any, Any, T]], *, retryable: Callable[[Exception], bool],
                          patience: float, first_delay: float, max_delay: float, what: str,
                          give_up: asyncio.Event | None = None) -> T:
    """`step` again while its error is `retryable`, one log line a try, backing off from `first_delay` to
    `max_delay`, for at most `patience` seconds or until `give_up` is set; then its last error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    delay = first_delay
    while True:
        try:
            return await step()
        except Exception as exc:
            if not retryable(exc) or loop.time() + delay > deadline or (give_up is not None and give_up.is_set()):
                raise
            log.warning("%s: %s; trying again in %.1f s", what, errors.describe(exc), delay)
        if give_up is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(give_up.wait(), delay)
        delay = min(delay * 2, max_delay)
