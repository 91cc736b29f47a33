"""The outbox, as the dispatcher role reads and marks it (the dispatcher itself is activities/process/dispatcher.py).

A pass runs on one session that holds a session advisory lock (a lock on no row), so that two dispatchers do not
publish the same backlog at once. Any dispatcher may take the lock, and the lock lives exactly as long as the
session that took it.

That session is bounded, so that a holder that stops answering (its process paused, its host cut off by a network
that drops packets silently) stops no other dispatcher for long. When it takes the lock, the session sets its own
`idle_session_timeout` and `idle_in_transaction_session_timeout` to `lock_idle_seconds`: a holder silent for that long
has its session ended by the server, and the lock goes with it, whatever became of the holder's process or network.
The holder keeps the rule on its side: it never leaves its session silent for more than half the bound between two
statements (the dispatcher bounds each publication by `OutboxPass.publish_seconds`), every statement of the pass is
bounded by `lock_idle_seconds` on the client, and a holder that finds it was silent for longer (it was paused) or
that its session is gone ends its pass. Before the session goes back to the pool it releases the lock and restores
both timeouts, in one statement; if it cannot, the session is dropped rather than pooled.

Taking over after a bounded silence is safe because publishing a row twice is harmless: each row is published with
its own message ID, and the export's workflow ignores a second delivery of one message. A holder that wakes after
its session was ended may publish the row it was publishing once more; it cannot mark it (its session is gone), and
its pass ends there.

A pass that finds the lock taken gets None; `lock_holder` says who holds it, for the dispatcher's log. Any role
that may connect can take the lock (its key is a constant), and only a dispatcher's own session bounds its silence:
a session of another role that holds it would stop every dispatcher for as long as it lives. So `lock_holder` also
says whether the holder is of the dispatchers' role, and a pass may be asked to run without the lock
(`dispatch_pass(unlocked=True)`); the dispatcher does so while a session of another role holds it, since publishing
a row twice is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store import errors
from store.statements import RoleStore, statement

log = logging.getLogger(__name__)

# One key for every dispatcher of this database (pg_try_advisory_lock's bigint): "exports outbox".
LOCK_KEY = 0x6578706F727473
# How long the session that holds the lock may stay silent before the server ends it, and the lock with it: the
# longest another dispatcher waits for a holder that stopped answering (plus its own poll interval).
LOCK_IDLE_SECONDS = 5.0

_TIMEOUTS = ("idle_session_timeout", "idle_in_transaction_session_timeout")
# The lock, and only if it was taken, the bound on its session's silence, in one statement: no moment where this
# session holds the lock unbounded. MATERIALIZED: the lock is tried once, whatever the planner makes of the rest.
_TAKE = text("""
WITH taken AS MATERIALIZED (SELECT pg_try_advisory_lock(:key) AS locked)
SELECT locked, pg_backend_pid() AS pid,
       CASE WHEN locked THEN set_config('idle_session_timeout', :idle_ms, false) END AS idle,
       CASE WHEN locked THEN set_config('idle_in_transaction_session_timeout', :idle_ms, false) END AS in_transaction
  FROM taken""")
# The lock released and both timeouts back to the values the session had before (what RESET would restore).
_RELEASE = text("""
SELECT pg_advisory_unlock(:key) AS released,
       (SELECT count(set_config(name, reset_val, false)) FROM pg_settings
         WHERE name IN ('idle_session_timeout', 'idle_in_transaction_session_timeout')) AS restored""")
_TOUCH = text("SELECT pg_backend_pid()")
# Who holds the lock: pg_locks shows every session's pid; pg_stat_activity shows every session's role, and the
# holder's state only to its own role (every dispatcher's) and to roles allowed to read all statistics. A dispatcher
# may log in as a member of the dispatchers' role (per-worker or rotated credentials): such a holder is one of ours.
_HOLDER = text("""
SELECT l.pid, a.state, extract(epoch FROM clock_timestamp() - a.state_change)::float8 AS silent_seconds,
       a.usename AS role,
       a.usename = current_user OR pg_has_role(a.usesysid, 'exports_dispatcher', 'MEMBER') AS ours
  FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND (l.classid::int8 << 32 | l.objid::int8) = :key
 LIMIT 1""")


@dataclass(frozen=True)
class Pending:
    message_id: UUID
    kind: str
    job_id: UUID
    tenant_id: UUID | None = None  # None only for a wake-up whose export is gone


@dataclass(frozen=True)
class LockHolder:
    """The session that holds the outbox lock: its backend pid, its state and silence when this role may see them
    (None otherwise), and its role, and whether that is this dispatcher's (None when not known)."""

    pid: int
    state: str | None
    silent_seconds: float | None
    role: str | None = None
    ours: bool | None = None


class LockLost(Exception):
    """The pass's session no longer holds (or may no longer hold) the outbox lock: the pass must end."""


class OutboxPass:
    """What a dispatcher may do while it holds the lock; each statement commits on its own.

    Each statement first checks that the session has not been silent for as long as the server allows (else the
    lock may be another dispatcher's by now, and LockLost ends the pass), and is bounded by that same time on the
    client (a statement lost in a silent network ends the pass with LockLost, not after TCP's many minutes)."""

    def __init__(self, conn: AsyncConnection, pid: int, idle_seconds: float, *, locked: bool = True) -> None:
        self.locked = locked  # False: a pass run without the lock, which a session of another role holds
        self._conn = conn
        self._pid = pid
        self._idle_seconds = idle_seconds
        self._spoke = time.monotonic()  # when this session last sent a statement

    @property
    def publish_seconds(self) -> float:
        """How long the holder may be away from its session (publishing one row) before it gives the row up."""
        return self._idle_seconds / 2

    async def pending(self, batch: int) -> list[Pending]:
        async with self._statement():
            rows = (await self._conn.execute(statement("outbox_pending"), {"batch": batch})).all()
            await self._conn.commit()
        return [Pending(*row) for row in rows]

    async def mark_published(self, message_ids: list[UUID]) -> int:
        """How many of the rows this mark set: fewer when some were marked already (by a dispatcher that held the
        lock before)."""
        async with self._statement():
            marked = (await self._conn.execute(statement("outbox_mark_published"),
                                               {"message_ids": message_ids})).rowcount
            await self._conn.commit()
        return marked

    async def still_held(self) -> None:
        """Before a publication: the pass ends (LockLost, or the driver's error for a session that is gone) unless
        this session still holds the lock. The session is asked only once it has been silent for a quarter of the
        bound (after a pause, or a slow publication); right after a statement it is not asked again."""
        if time.monotonic() - self._spoke < self._idle_seconds / 4:
            return
        async with self._statement():
            pid = await self._conn.scalar(_TOUCH)
            await self._conn.commit()
        if pid != self._pid:
            await self._conn.invalidate()
            raise LockLost(f"the outbox lock's session (backend pid {self._pid}) was replaced by {pid}")

    @asynccontextmanager
    async def _statement(self) -> AsyncIterator[None]:
        silent = time.monotonic() - self._spoke
        if silent >= self._idle_seconds:
            await self._conn.invalidate()
            raise LockLost(f"this dispatcher was silent for {silent:.1f} s mid-pass, longer than the "
                           f"{self._idle_seconds:g} s the server allows the outbox lock's session: the lock may be "
                           f"another dispatcher's now")
        self._spoke = time.monotonic()
        bound = asyncio.timeout(self._idle_seconds)
        try:
            async with bound:
                yield
        except TimeoutError as exc:
            if not bound.expired():
                raise
            await self._conn.invalidate()
            raise LockLost(f"the outbox lock's session did not answer within {self._idle_seconds:g} s") from exc


class Outbox(RoleStore):
    def __init__(self, engine: AsyncEngine, *, lock_idle_seconds: float = LOCK_IDLE_SECONDS,
                 reread_timeout_seconds: float = 5.0) -> None:
        super().__init__(engine, reread_timeout_seconds=reread_timeout_seconds)
        if lock_idle_seconds < 1:
            raise ValueError("lock_idle_seconds must be at least 1 (the server counts it in milliseconds, and a "
                             "holder needs room for a publication)")
        self.lock_idle_seconds = lock_idle_seconds

    @asynccontextmanager
    async def dispatch_pass(self, *, unlocked: bool = False) -> AsyncIterator[OutboxPass | None]:
        """One pass on one session holding the outbox lock; None when another session holds it, unless `unlocked`:
        then a pass without the lock (`OutboxPass.locked` False)."""
        async with self.db.connection() as conn:
            try:
                async with asyncio.timeout(self.lock_idle_seconds):
                    taken = (await conn.execute(_TAKE, {"key": LOCK_KEY, "idle_ms": self._idle_ms})).one()
                    await conn.commit()
            except BaseException:
                # Whether the lock was taken is unknown: the session must not go back to the pool with it.
                await conn.invalidate()
                raise
            if not taken.locked:
                # Nothing to release: the session's timeouts are set only with the lock.
                yield OutboxPass(conn, taken.pid, self.lock_idle_seconds, locked=False) if unlocked else None
                return
            try:
                yield OutboxPass(conn, taken.pid, self.lock_idle_seconds)
            finally:
                await self._release(conn)

    async def lock_holder(self) -> LockHolder | None:
        """Who holds the outbox lock now (None: nobody, or pg_locks is not readable by this role)."""
        try:
            async with asyncio.timeout(self.lock_idle_seconds):
                row = await self.db.row(_HOLDER, key=LOCK_KEY)
        except Exception as exc:
            log.debug("could not ask who holds the outbox lock: %s", errors.describe(exc))
            return None
        return None if row is None else LockHolder(row["pid"], row["state"], row["silent_seconds"], row["role"],
                                                   row["ours"])

    @property
    def _idle_ms(self) -> str:
        return str(int(self.lock_idle_seconds * 1000))

    async def _release(self, conn: AsyncConnection) -> None:
        """Release the lock and restore the session's timeouts, or drop the session: a pooled connection must never
        keep the lock, nor a bound on its silence that would have the server end it while it waits in the pool."""
        if conn.invalidated:
            return  # the session is gone, and its lock with it
        try:
            async with asyncio.timeout(self.lock_idle_seconds):
                await conn.rollback()
                await conn.execute(_RELEASE, {"key": LOCK_KEY})
                await conn.commit()
        except Exception as exc:
            log.warning("the outbox lock's session was gone at the end of this pass, dropping it (%s): a holder "
                        "silent for %g s loses its session, and another dispatcher may publish the same rows again, "
                        "which is harmless", errors.describe(exc), self.lock_idle_seconds)
            await conn.invalidate()
