"""The outbox dispatcher: publishes each outbox row as signal-with-start of the export's workflow.

Runs under the dispatcher role, which may read the outbox and set published_at and nothing else. It wakes on
LISTEN (a trigger notifies on every outbox insert) and polls as a fallback. A row whose publication fails stays
unpublished and is retried with the same message ID, which the workflow uses to ignore a second delivery of one
row, so publishing a row twice is harmless.

No row lock is held while Temporal is asked: a Temporal that does not answer would hold them for as long as its
client retries, once per row. Instead a pass reads the unpublished rows in one short statement, publishes them in
waves of up to `concurrency` side by side outside any transaction (an export's later row in a later wave, so its
rows go out in their order), and marks each wave's published rows with one conditional update, all through
store/outbox.py, whose session advisory lock keeps two dispatchers from publishing the same backlog at once. A wave
with a failed publication ends the pass once its other rows are marked: Temporal is away, and the next poll tries
again. A publication Temporal refuses for its own run (its run takes no more signals, say: a flood spent the
server's quota) is no outage: the pass goes on, and after REFUSALS_BEFORE_GIVING_UP such refusals the row is given
up, marked published with a warning, so that it never holds back the rows behind it. The wake-up is a hint: the
run reads its row at its idle recheck anyway, and the sweeper wakes an export left queued. A stop ends the pass
after the wave in flight. A pass that hears of new rows while it publishes gives way after GIVE_WAY_SECONDS, so
that the next read takes them in their tenant's turn (the batch's order), rather than after the rest of a batch
another tenant filled.

The lock's session is bounded (store/outbox.py says how): a dispatcher that stops answering while it holds the lock
(paused, or cut off) loses it after `Outbox.lock_idle_seconds` of silence, and another dispatcher takes over. So
that a healthy holder never looks silent, each publication is bounded by `OutboxPass.publish_seconds`, half that
bound (a publication that takes longer has failed, as above), so a wave is too, and the holder checks its session
before each wave.
Meanwhile the other dispatchers' passes publish nothing: the first skipped pass is noted at debug level, and once
passes have found the lock taken for longer than a poll interval, one warning names the holder (its backend pid)
and how long it has been silent; the pass that takes the lock again says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from uuid import UUID

import asyncpg
from exports_client.client import WORKFLOW_TYPE
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import ExportInput, Wake
from activities.process.temporal import short_reason
from store import errors
from store.db import Bounds, connect_raw
from store.outbox import LockHolder, Outbox, OutboxPass, Pending
from workflows.identity import export_workflow_id, tenant_priority

# The logger keeps the name it had before the module moved into process/: log filters and alerts match on it.
log = logging.getLogger("activities.dispatcher")

NOTIFY_CHANNEL = "exports_outbox"
# How long a pass publishes its batch before it gives way to rows inserted since its read (LD5): another tenant's
# new row then waits behind this much of a backlog at most, not a whole batch, and a backlog still takes one read
# per this many seconds at most while rows keep coming.
GIVE_WAY_SECONDS = 0.2
# How many times Temporal may refuse one row for its own run before the dispatcher gives the row up.
REFUSALS_BEFORE_GIVING_UP = 3
# Refusals that concern one workflow, not Temporal as a whole: its run's signal quota spent, say.
_REFUSED_FOR_ITS_RUN = frozenset({RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.FAILED_PRECONDITION})


class OutboxDispatcher:
    def __init__(
        self,
        client: Client,
        outbox: Outbox,
        listen_dsn: str,
        *,
        task_queue: str,
        poll_seconds: float,
        batch: int = 100,
        concurrency: int = 16,
        bounds: Bounds | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"the dispatcher publishes at least one row at a time, not {concurrency}")
        self.client = client
        self.outbox = outbox
        self.listen_dsn = listen_dsn
        self.bounds = bounds  # the LISTEN connection's (store/db.py)
        self.task_queue = task_queue
        self.poll_seconds = poll_seconds
        self.batch = batch
        self.concurrency = concurrency
        self._nudged = asyncio.Event()
        self._failing = False
        self._lock_taken_since: float | None = None  # since when every pass has found the lock taken
        self._lock_wait_said = False  # and whether that wait has been warned about
        # A session of another role that holds the outbox lock past the bound: passes run without the lock meanwhile.
        self._squatter: LockHolder | None = None
        self._refusals: dict[UUID, int] = {}  # rows Temporal refused for their own run, and how many times
        self._stop: asyncio.Event | None = None

    async def publish(self, message_id: UUID, job_id: UUID, tenant_id: UUID | None = None) -> None:
        await self.client.start_workflow(
            WORKFLOW_TYPE,
            ExportInput(job_id=job_id),
            id=export_workflow_id(job_id),
            task_queue=self.task_queue,
            start_signal="wake",
            start_signal_args=[Wake(message_id=message_id)],
            # A run started here is keyed to its tenant, and its steps with it (LD5); a run already open keeps its
            # own key (the signal reaches it; the key is a start's only).
            priority=tenant_priority(tenant_id),
        )

    async def dispatch_once(self) -> int:
        """Publish one batch of unpublished rows; the number published (0 while another dispatcher holds the lock)."""
        published = 0
        async with self.outbox.dispatch_pass(unlocked=self._squatter is not None) as outbox:
            if outbox is None:
                await self._lock_taken()
                return 0
            if outbox.locked:
                self._lock_free()
            elif not await self._still_squatted():
                return 0
            started = time.monotonic()
            rows = await outbox.pending(self.batch)
            while rows and not (self._stop is not None and self._stop.is_set()):
                if self._nudged.is_set() and time.monotonic() - started >= GIVE_WAY_SECONDS:
                    # New rows since the read: the next pass reads again, each tenant in its turn, rather than
                    # leave them behind the rest of this batch.
                    break
                wave, rows = next_wave(rows, self.concurrency)
                await outbox.still_held()
                done: list[UUID] = []
                failed: list[tuple[Pending, str | TimeoutError]] = []
                for row, failure in zip(wave, await asyncio.gather(*(self._publish(outbox, row) for row in wave)),
                                        strict=True):
                    if failure is None:
                        done.append(row.message_id)
                    elif isinstance(failure, Refused):
                        if self._given_up(row, failure):
                            done.append(row.message_id)
                    else:
                        failed.append((row, failure))
                if done:
                    await outbox.mark_published(done)
                    published += len(done)
                if failed:
                    if any(isinstance(failure, TimeoutError) for _, failure in failed):
                        await outbox.still_held()  # a pause of this process, rather than Temporal, ends it: LockLost
                    row, failure = failed[0]
                    more = f" and {len(failed) - 1} more of its wave" if len(failed) > 1 else ""
                    log.warning("outbox row %s (%s for %s)%s not published, the next pass tries again: %s",
                                row.message_id, row.kind, row.job_id, more, failure)
                    break
        return published

    async def _publish(self, outbox: OutboxPass, row: Pending) -> str | TimeoutError | None:
        """Publish one row within the pass's bound on a publication: None, or why it was not published (a
        `Refused` when Temporal refused it for its own run)."""
        try:
            async with asyncio.timeout(outbox.publish_seconds):
                await self.publish(row.message_id, row.job_id, row.tenant_id)
        except TimeoutError:
            return TimeoutError(f"Temporal did not answer within {outbox.publish_seconds:g} s")
        except RPCError as exc:
            return (Refused if exc.status in _REFUSED_FOR_ITS_RUN else str)(short_reason(exc))
        except Exception as exc:
            return short_reason(exc)
        self._refusals.pop(row.message_id, None)
        return None

    def _given_up(self, row: Pending, why: str) -> bool:
        """Counts a refusal of `row` for its own run; whether the row is now given up (to be marked published)."""
        refused = self._refusals.get(row.message_id, 0) + 1
        if refused < REFUSALS_BEFORE_GIVING_UP:
            self._refusals[row.message_id] = refused
            (log.warning if refused == 1 else log.debug)(
                "outbox row %s (%s for %s) refused by Temporal for its run, tried again at the next pass: %s",
                row.message_id, row.kind, row.job_id, why)
            return False
        del self._refusals[row.message_id]
        log.warning("outbox row %s (%s for %s) given up after %d refusals for its run (%s): the run reads its row "
                    "at its idle recheck, and the sweeper wakes an export left queued", row.message_id, row.kind,
                    row.job_id, refused, why)
        return True

    async def _lock_taken(self) -> None:
        """A skipped pass: debug, until passes have found the lock taken for longer than a poll interval; then one
        warning for this wait, naming the holder. Past twice the bound on a holder's silence (a dispatcher's own
        session that stops answering loses the lock within one), a holder of another role is taken for what it is:
        not a dispatcher, and bound by nothing; the next passes publish without the lock."""
        now = time.monotonic()
        if self._lock_taken_since is None:
            self._lock_taken_since = now
        waited = now - self._lock_taken_since
        if waited >= 2 * self.outbox.lock_idle_seconds:
            holder = await self.outbox.lock_holder()
            if holder is not None and holder.ours is False:
                self._squatter = holder
                log.error("the outbox lock has been held for %.1f s by backend pid %d of role %s, not a dispatcher "
                          "(nothing bounds its silence): passes publish without the lock until it lets go; a row "
                          "may be published twice meanwhile, which is harmless", waited, holder.pid, holder.role)
                return
        if self._lock_wait_said or waited < self.poll_seconds:
            log.debug("outbox lock taken by another session: this pass publishes nothing")
            return
        self._lock_wait_said = True
        log.warning("outbox passes have published nothing for %.1f s: %s; a holder that stops answering loses the "
                    "lock after %g s of silence, and this dispatcher then takes over",
                    waited, _holder(await self.outbox.lock_holder()), self.outbox.lock_idle_seconds)

    async def _still_squatted(self) -> bool:
        """Before a pass without the lock: whether a session of another role still holds it. Once it has let go,
        the next pass takes the lock again (this one publishes nothing)."""
        squatter = self._squatter
        assert squatter is not None  # a pass runs without the lock only while one is known
        holder = await self.outbox.lock_holder()
        if holder is not None and holder.ours is False:
            return True
        log.warning("the outbox lock is no longer held by backend pid %d of role %s: passes take it again",
                    squatter.pid, squatter.role)
        self._squatter = None
        self._lock_taken_since = None
        self._lock_wait_said = False
        return False

    def _lock_free(self) -> None:
        if self._squatter is not None:
            log.warning("outbox lock taken again: backend pid %d of role %s let go of it", self._squatter.pid,
                        self._squatter.role)
            self._squatter = None
        elif self._lock_wait_said and self._lock_taken_since is not None:
            log.info("outbox lock taken again after %.1f s: outbox dispatch works again",
                     time.monotonic() - self._lock_taken_since)
        self._lock_taken_since = None
        self._lock_wait_said = False

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop  # a stop ends the pass after its wave in flight, not after the backlog
        listener = await self._listen()
        try:
            while not stop.is_set():
                self._nudged.clear()
                try:
                    while await self.dispatch_once() == self.batch and not stop.is_set():
                        pass
                except Exception as exc:  # the database is away: said once, and tried again at each poll
                    self._failed(f"outbox dispatch failed, trying again every {self.poll_seconds:g} s: "
                                 f"{errors.describe(exc)}")
                else:
                    if self._failing:
                        log.info("outbox dispatch works again")
                    self._failing = False
                if listener is None or listener.is_closed():
                    listener = await self._listen()
                waiters = [asyncio.ensure_future(self._nudged.wait()), asyncio.ensure_future(stop.wait())]
                await asyncio.wait(waiters, timeout=self.poll_seconds, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
        finally:
            if listener is not None:
                await listener.close()

    async def _listen(self) -> asyncpg.Connection | None:
        try:
            conn = await connect_raw(self.listen_dsn, self.bounds)
            await conn.add_listener(NOTIFY_CHANNEL, lambda *args: self._nudged.set())
            return conn
        except Exception as exc:
            self._failed(f"LISTEN {NOTIFY_CHANNEL} unavailable, polling only: {errors.describe(exc)}")
            return None

    def _failed(self, message: str) -> None:
        """One warning when an outage begins; while it lasts, the same news at debug level."""
        (log.debug if self._failing else log.warning)(message)
        self._failing = True


class Refused(str):
    """Why Temporal refused a row for its own run (not an outage): the pass goes on without it."""


def next_wave(rows: list[Pending], size: int) -> tuple[list[Pending], list[Pending]]:
    """The next rows to publish side by side, at most `size`, in the batch's order, at most one of each export:
    an export's later row waits for the next wave, so its rows go out in their order. The rest, in order."""
    wave: list[Pending] = []
    rest: list[Pending] = []
    seen: set[UUID] = set()
    for row in rows:
        (wave if len(wave) < size and row.job_id not in seen else rest).append(row)
        seen.add(row.job_id)
    return wave, rest


def _holder(holder: LockHolder | None) -> str:
    if holder is None:
        return "another dispatcher holds the outbox lock"
    if holder.state is None:
        return f"backend pid {holder.pid} holds the outbox lock (its state is not visible to this role)"
    if holder.state == "idle" and holder.silent_seconds is not None:
        return f"backend pid {holder.pid} holds the outbox lock, silent for {holder.silent_seconds:.1f} s"
    return f"backend pid {holder.pid} holds the outbox lock ({holder.state})"
