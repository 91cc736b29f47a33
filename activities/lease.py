"""The lease keeper and the activities' heartbeats.

One keeper per attempt on the worker that builds it renews the row lease, for the build that holds the attempt,
from the build's start to the attempt's terminal write: across the build, cutoff 2 and the delivery, which are
separate activities on this worker's own task queue. Between two of them the keeper is handed over and keeps
renewing, so no gap waits longer than a renewal interval; if the next step does not adopt it within a bound (its
schedule-to-start timeout), it stops and the lease lapses for recovery.

A renewal that throws stops nothing and is retried soon: after half a second, then backing off, doubling, to at most
`_MAX_RETRY_SECONDS` (2 s, or the interval if that is shorter), never to a whole interval. So once PostgreSQL is back
the keeper renews within one such delay. The last renewal that succeeded before an outage came at most one interval
before it began, so an outage shorter than lease - renew_every - min(2 s, renew_every) never lets the lease lapse (the
time a failing renewal takes to fail comes on top: a refused connection fails at once). A renewal that changes no row
means the attempt lost ownership: `on_lost` is called once and renewing stops. Renewals are serialized, so an
on-demand renewal never overlaps a scheduled one.

The keeper keeps time by its own clock, so that a network gone silent cannot hold it: a renewal not answered within
`renewal_timeout` (at most 5 s, and half of lease - renew_every) is abandoned, its answer uncertain (the next renewal
settles it, as they match the same row), and tried again at once on another connection; so a silent partition
shorter than lease - renew_every never lets the lease lapse. Each renewal that succeeds tells the keeper until when
the lease surely holds: one lease from the moment it was sent. When that moment comes within `lapse_margin` (1 s,
less for short leases) with no renewal answered since, `on_lapsing` is called once: a build stops there, before
recovery may take its attempt over; an upload in progress, which passed the point of no return, goes on and is told
nothing.

Heartbeats are the activity's own (`heartbeating`): Temporal sees the activity alive and, in the reply, tells it of
its cancellation.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from temporalio import activity

from activities.process import metrics
from store import errors
from store.jobs import JobStore

log = logging.getLogger(__name__)

_CONFIRM_RETRY_SECONDS = 0.5
_FIRST_RETRY_SECONDS = 0.5
# The longest a renewal that threw waits before it is tried again (the interval, if that is shorter). Not the interval
# itself: when the database comes back, the keeper's next try may still be one whole retry delay away, and the lease
# must not run out meanwhile. With the production lease of 60 s renewed every 20 s, a backoff up to the interval let
# an outage of 32 s lapse the lease; capped at 2 s, any outage shorter than 60 - 20 - 2 = 38 s is survived, at the
# cost of one failed connection attempt every 2 s per attempt renewing on the worker while the database is away.
_MAX_RETRY_SECONDS = 2.0
# The longest a renewal is waited for before it is abandoned: a few round trips on a slow network, far from the
# lease (a renewal tried again on a silent network costs at most this, each time).
_MAX_RENEWAL_WAIT_SECONDS = 5.0
# How long before the lease surely holds no more a step is told that it lapses (its `on_lapsing`), so that a build
# stops while its attempt is still its own.
_LAPSE_MARGIN_SECONDS = 1.0


class RenewalUnanswered(TimeoutError):
    """A renewal abandoned past its bound: whether it changed the row is unknown."""


class LeaseKeeper:
    def __init__(
        self,
        store: JobStore,
        job_id: UUID,
        attempt_id: UUID,
        holder: str | None,
        *,
        renew_every: float,
        on_done: Callable[[LeaseKeeper], None] = lambda keeper: None,
        leased_at: float | None = None,
    ) -> None:
        """`leased_at`: when (the event loop's clock) the statement that last set the lease was sent, if known."""
        self.store = store
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.holder = holder
        self.renew_every = renew_every
        lease = store.lease_seconds
        self.renewal_timeout = min(_MAX_RENEWAL_WAIT_SECONDS, max(lease - renew_every, 0.2) / 2)
        # Well before the lease lapses, and well after the next scheduled renewal would have answered.
        self.lapse_margin = min(_LAPSE_MARGIN_SECONDS, renew_every / 2, (lease - renew_every) / 4)
        self.on_lost: Callable[[], None] = lambda: None
        self.on_lapsing: Callable[[], None] = lambda: None
        self.on_done = on_done
        self._lapse_timer: asyncio.TimerHandle | None = None
        self._abandoned: set[asyncio.Task[bool]] = set()
        self.lost = False
        self._finished = False
        self._finishing = False  # finish() was called: a renewal that now finds no row is not a loss
        self._adopt_by: float | None = None  # handed over: the next step must adopt the keeper by then
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        if leased_at is not None:
            self._leased(leased_at)

    @property
    def done(self) -> bool:
        return self._finished or self._finishing or self.lost

    @property
    def held(self) -> bool:
        """Adopted by a step, which must hand it over or finish it before it ends."""
        return not self.done and self._adopt_by is None

    @property
    def handed_over(self) -> bool:
        """Renewing for a step that has not adopted it yet."""
        return not self.done and self._adopt_by is not None

    def start(self) -> LeaseKeeper:
        self._task = asyncio.create_task(self._run(), name=f"lease-{self.job_id}")
        return self

    def adopt(self, on_lost: Callable[[], None] = lambda: None,
              on_lapsing: Callable[[], None] = lambda: None) -> None:
        """The attempt's current step takes the keeper over; `on_lost` is what a loss of ownership stops, and
        `on_lapsing` what a lease about to lapse unrenewed stops (nothing, for a step past the point of no
        return)."""
        self._adopt_by = None
        self.on_lost = on_lost
        self.on_lapsing = on_lapsing

    def hand_over(self, within: float) -> None:
        """The current step ended and the attempt goes on in another: keep renewing until it adopts the keeper,
        for at most `within` seconds."""
        self.on_lost = lambda: None
        self.on_lapsing = lambda: None
        self._adopt_by = asyncio.get_running_loop().time() + within

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.renew_every
        retry = _FIRST_RETRY_SECONDS
        longest_retry = min(_MAX_RETRY_SECONDS, self.renew_every)
        try:
            while not self.lost:
                await asyncio.sleep(delay)
                if self._adopt_by is not None and loop.time() > self._adopt_by:
                    log.warning("attempt %s of export %s: the next step did not start in time; the lease is left "
                                "to lapse for recovery", self.attempt_id, self.job_id)
                    break
                renewed = await self._renew()
                if renewed is None:
                    delay, retry = min(retry, longest_retry), min(retry * 2, longest_retry)
                elif isinstance(renewed, RenewalUnanswered):
                    delay = 0  # it waited its bound already: again at once, on another connection
                else:
                    delay, retry = self.renew_every, _FIRST_RETRY_SECONDS
        finally:
            self._stop_lapse_timer()
            if not self._finishing:
                if not self.lost:
                    self._finished = True  # given up: renewals from here on would only mislead
                self.on_done(self)

    async def renew_now(self) -> bool:
        """One renewal, serialized with the scheduled ones. False only when a renewal changed no row."""
        return await self._renew() is not False

    async def _renew(self) -> bool | RenewalUnanswered | None:
        """Whether the renewal changed the row; RenewalUnanswered when it was abandoned past its bound, None when
        it threw (either is retried soon)."""
        async with self._lock:
            if self._finished:
                return not self.lost
            try:
                renewed = await self._renewal(self.renewal_timeout)
            except RenewalUnanswered as exc:
                metrics.RENEWALS_FAILED.labels(reason="error").inc()
                log.warning("lease renewal for %s attempt %s %s, trying again now", self.job_id, self.attempt_id,
                            exc)
                return exc
            except Exception as exc:
                metrics.RENEWALS_FAILED.labels(reason="error").inc()
                log.warning("lease renewal for %s attempt %s failed, retrying soon: %s",
                            self.job_id, self.attempt_id, errors.describe(exc))
                return None
            self._note(renewed)
            return renewed

    async def confirm(self, within: float) -> bool:
        """A renewal that matches exactly one row, before an irreversible step. One that throws or does not answer
        is retried for up to `within` seconds, and the answer comes by then; False when a renewal changes no row,
        or none could be made in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            async with self._lock:
                try:
                    renewed = await self._renewal(max(min(self.renewal_timeout, deadline - loop.time()), 0.01))
                except Exception as exc:
                    metrics.RENEWALS_FAILED.labels(reason="error").inc()
                    if loop.time() + _CONFIRM_RETRY_SECONDS >= deadline:
                        log.warning("attempt %s of export %s could not confirm its lease within %.0f s: %s",
                                    self.attempt_id, self.job_id, within, errors.describe(exc))
                        return False
                    if isinstance(exc, RenewalUnanswered):
                        continue  # it waited its bound already
                else:
                    self._note(renewed)
                    return renewed
            await asyncio.sleep(_CONFIRM_RETRY_SECONDS)

    async def _renewal(self, timeout: float) -> bool:
        """One renewal statement, abandoned after `timeout` (RenewalUnanswered): it goes on in the background to
        its own end (its connection is dropped), never waited for, since what holds it may be a silent network."""
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        caller = asyncio.current_task()
        # Named after its caller: the keeper's own renewals and a step's on-demand ones stay told apart.
        task = asyncio.create_task(self.store.renew_lease(self.job_id, self.attempt_id, self.holder),
                                   name=caller.get_name() if caller is not None else None)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except BaseException:
            task.cancel()
            raise
        if not done:
            task.cancel()
            self._abandoned.add(task)
            task.add_done_callback(self._forget_abandoned)
            raise RenewalUnanswered(f"had no answer within {timeout:.1f} s and was abandoned")
        renewed = task.result()
        if renewed:
            self._leased(sent_at)
        return renewed

    def _forget_abandoned(self, task: asyncio.Task[bool]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned renewal's end is nobody's news

    def _leased(self, sent_at: float) -> None:
        """A renewal sent at `sent_at` changed the row: the lease holds for one lease from then, at least (the
        server adds it to its own clock, later). Tell the step when it is about to lapse."""
        self._stop_lapse_timer()
        if self.done:
            return
        loop = asyncio.get_running_loop()
        self._lapse_timer = loop.call_at(sent_at + self.store.lease_seconds - self.lapse_margin, self._lapsing)

    def _stop_lapse_timer(self) -> None:
        if self._lapse_timer is not None:
            self._lapse_timer.cancel()
            self._lapse_timer = None

    def _lapsing(self) -> None:
        self._lapse_timer = None
        if self.done:
            return
        log.warning("attempt %s of export %s: no lease renewal answered, and its lease lapses within %.1f s",
                    self.attempt_id, self.job_id, self.lapse_margin)
        metrics.RENEWALS_FAILED.labels(reason="lapsing").inc()
        self.on_lapsing()

    def _note(self, renewed: bool) -> None:
        # A renewal that finishes after the terminal write finds no row; that is not a loss of ownership.
        if not renewed and not self._finishing and not self.lost:
            self.lost = True
            self._stop_lapse_timer()
            metrics.RENEWALS_FAILED.labels(reason="lost").inc()
            log.warning("attempt %s lost ownership of export %s", self.attempt_id, self.job_id)
            self.on_lost()

    @asynccontextmanager
    async def terminal_write(self) -> AsyncIterator[None]:
        """Around the attempt's terminal write. A renewal that finds no row from here on may be this very write's
        doing, so it is not reported as lost ownership (a takeover shows in the write's own result instead);
        renewals stop right after the write."""
        self._finishing = True
        try:
            yield
        finally:
            await self.finish()

    async def finish(self) -> None:
        """Stop renewing, right after the attempt's terminal write. Waits for a renewal in flight; never raises."""
        # Marked before waiting: `_finished` is checked by the renewal in flight when it returns, and set here only
        # once that renewal has released the lock, so without this its empty result would be reported as a loss.
        self._finishing = True
        self._stop_lapse_timer()
        async with self._lock:  # waits for a renewal in flight (bounded) rather than interrupting it
            self._finished = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.on_done(self)


class Beats:
    """When the current activity heartbeat, and so whether Temporal still waits for it: Temporal gives a step up
    once its heartbeat timeout passes without a heartbeat (counted from its start until the first). A heartbeat
    after such a silence revives nothing, so the step stays late once any gap between its heartbeats (or between
    its start and the first) reached half the timeout: a margin for the clocks of the Temporal server, PostgreSQL
    and this worker, which agree within far less."""

    def __init__(self, started: datetime, timeout: timedelta | None) -> None:
        self.started = started
        self.timeout = timeout
        self.last: datetime | None = None
        self.late = False

    def mark(self) -> None:
        now = datetime.now(UTC)
        if self.timeout is not None and now - (self.last or self.started) >= self.timeout / 2:
            self.late = True
        self.last = now

    def bound(self) -> datetime | None:
        """Until when the run certainly still waits for this step (already past for a late step); None when the
        step has no timeout to give it up by."""
        if self.timeout is None:
            return None
        if self.late:
            return self.started
        return (self.last or self.started) + self.timeout / 2


_BEATS: contextvars.ContextVar[Beats | None] = contextvars.ContextVar("activity_heartbeats", default=None)


def beats() -> Beats | None:
    """The current activity's heartbeats (made at its first ask, in its own context, and shared with the tasks it
    starts afterwards); None outside an activity."""
    if not activity.in_activity():
        return None
    found = _BEATS.get()
    if found is None:
        info = activity.info()
        found = Beats(info.started_time, info.heartbeat_timeout or info.start_to_close_timeout)
        _BEATS.set(found)
    return found


def heartbeat(*details: Any) -> None:
    """A heartbeat of the current activity, noted for `beats`: every heartbeat of an attempt step goes here."""
    noted = beats()
    if noted is not None:
        noted.mark()
    activity.heartbeat(*details)


@asynccontextmanager
async def heartbeating(every: float, details: Callable[[], Any] = lambda: None) -> AsyncIterator[None]:
    """Heartbeats for the current activity while the block runs (created in its context, so they are its own);
    none when the step runs outside an activity (called directly)."""
    if beats() is None:  # made here, before the task copies this context: the task's beats are the step's
        yield
        return

    async def beat() -> None:
        # The first after one interval, not at the start: a step shorter than that sends none (each heartbeat that
        # reaches the server is a billable action), and Temporal counts the heartbeat timeout from the start.
        while True:
            await asyncio.sleep(every)
            heartbeat(details())

    task = asyncio.create_task(beat(), name=f"heartbeat-{activity.info().activity_type}")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
