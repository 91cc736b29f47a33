"""The stop watcher: hears a stop request the moment the cancellation's row write commits (LISTEN/NOTIFY), and
confirms it against the row before stopping the build. It is for speed only: cutoff 2 refuses delivery to a
stopped attempt whether or not this watcher heard anything.

A listening connection that died says nothing (a network that drops packets, a NAT table flushed), so the watcher
asks it for one bounded round trip every CHECK_EVERY_SECONDS. A connection that does not answer within
CHECK_TIMEOUT_SECONDS, or that closed, is dropped and a new one made, again at that pace while PostgreSQL is away;
once the watcher listens again it reads the row, since a stop written meanwhile was notified to nobody. So a stop
written while the watcher was away stops the build within CHECK_EVERY_SECONDS + CHECK_TIMEOUT_SECONDS (4 s), a
connect and a read of PostgreSQL being back. A read of the row that fails is made again at the next check. The
connection has the worker's bounds and keepalives (store/db.py), so the kernel may see a dead peer sooner still."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from uuid import UUID

import asyncpg

from store import errors
from store.db import Bounds, connect_raw
from store.jobs import JobStore
from store.models import Status

log = logging.getLogger(__name__)

CHANNEL = "exports_stop"
CHECK_EVERY_SECONDS = 2.0
CHECK_TIMEOUT_SECONDS = 2.0


class StopWatch:
    def __init__(self, store: JobStore, dsn: str, job_id: UUID, attempt_id: UUID, on_stop: Callable[[], None],
                 bounds: Bounds | None = None, *, check_every: float = CHECK_EVERY_SECONDS,
                 check_timeout: float = CHECK_TIMEOUT_SECONDS):
        self.store = store
        self.dsn = dsn
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.on_stop = on_stop
        self.check_every = check_every
        self.check_timeout = check_timeout
        self.bounds = Bounds.defaults() if bounds is None else bounds
        # A read of the row on the store's pool: perhaps a new connection, then one round trip.
        self.read_timeout = self.bounds.connect_seconds + check_timeout
        self._conn: asyncpg.Connection | None = None
        self._closed = asyncio.Event()  # the listening connection closed: listen again now, not at the next check
        self._away_since: float | None = None  # monotonic; while not listening
        self._said_unavailable = False  # one log line per absence, not one per try
        self._confirming: asyncio.Task[None] | None = None
        self._again = False
        self._unread = False  # a read of the row is owed (it failed, or the watcher listens again)
        self._stopped = False
        self._keeping: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StopWatch:
        await self._listen()  # unavailable: logged, tried again at each check; the build goes on meanwhile
        # A stop recorded before we listened would never be notified again: look once now.
        self._look()
        self._keeping = asyncio.create_task(self._keep_listening(), name=f"stop-watch-{self.job_id}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in (self._keeping, self._confirming):
            if task is not None and not task.done():
                task.cancel()
        self._drop()

    async def _listen(self) -> bool:
        conn: asyncpg.Connection | None = None
        try:
            # The connect has its own bound; this one covers LISTEN's round trip too.
            async with asyncio.timeout(self.bounds.connect_seconds + self.check_timeout):
                conn = await connect_raw(self.dsn, self.bounds)
                await conn.add_listener(CHANNEL, self._notified)
        except BaseException as exc:
            if conn is not None:
                conn.terminate()  # cancelled (the build ends) or failed halfway: never a connection left behind
            if not isinstance(exc, Exception):
                raise
            if self._away_since is None:
                self._away_since = time.monotonic()
            if not self._said_unavailable:
                self._said_unavailable = True
                log.warning("stop watcher for %s unavailable, trying again every %g s: %s", self.job_id,
                            self.check_every, errors.describe(exc))
            return False
        conn.add_termination_listener(self._terminated)
        self._conn = conn
        return True

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._closed.clear()
        if conn is not None:
            conn.terminate()  # never a goodbye that waits on a silent network

    def _terminated(self, conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> None:
        if conn is self._conn:
            self._closed.set()

    async def _keep_listening(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.check_every):
                    await self._closed.wait()
            problem = await self._problem(self._conn) if self._conn is not None else None
            if problem is not None:
                log.warning("stop watcher for %s: its connection %s, listening again", self.job_id, problem)
                self._away_since = time.monotonic()
                self._drop()
            if self._conn is None and await self._listen():
                away, self._away_since, self._said_unavailable = self._away_since, None, False
                log.info("stop watcher for %s listening again after %.1f s, reading the row", self.job_id,
                         time.monotonic() - away if away is not None else 0.0)
                self._unread = True
            if self._unread:
                self._look()

    async def _problem(self, conn: asyncpg.Connection) -> str | None:
        """Why the listening connection is no use, or None when it answers within the check's bound."""
        if conn.is_closed():
            return "closed"
        try:
            async with asyncio.timeout(self.check_timeout):
                await conn.fetchval("SELECT 1")
        except TimeoutError:
            return f"did not answer within {self.check_timeout:g} s"
        except Exception as exc:
            return f"failed: {errors.describe(exc)}"
        return None

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload == str(self.job_id):
            self._look()

    def _look(self) -> None:
        self._unread = False
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.create_task(self._confirm())
        else:
            # A read already under way may have started before this stop committed: read once more after it.
            self._again = True

    async def _confirm(self) -> None:
        while not self._stopped:
            self._again = False
            try:
                async with asyncio.timeout(self.read_timeout):
                    row = await self.store.read_job(self.job_id)
            except Exception as exc:
                log.warning("could not confirm a stop request for %s, reading again in %g s: %s", self.job_id,
                            self.check_every, errors.describe(exc))
                self._unread = True
                return
            if (row is not None and row.status is Status.RUNNING and row.attempt_id == self.attempt_id
                    and row.stop_request_id is not None):
                log.info("stop request %s confirmed for %s attempt %s", row.stop_request_id, self.job_id,
                         self.attempt_id)
                self._stopped = True
                self.on_stop()
                return
            if not self._again:
                return
