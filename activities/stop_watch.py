"""The stop watcher: hears a stop request the moment the cancellation's row write commits (LISTEN/NOTIFY), and
confirms it against the row before stopping the build. It is for speed only: cutoff 2 refuses delivery to a
stopped attempt whether or not this watcher heard anything.

A worker listens once for all its builds (`StopListener`): one connection, opened at its first build and held until
it shuts down, hands each notification to the watch of the export it names. A connection per build would cost a
PostgreSQL session (about 6 ms of CPU, client and server) for every export, and every build's connection would hear
every other export's stops.

A listening connection that died says nothing (a network that drops packets, a NAT table flushed), so the listener
asks it for one bounded round trip every CHECK_EVERY_SECONDS. A connection that does not answer within
CHECK_TIMEOUT_SECONDS, or that closed, is dropped and a new one made, again at that pace while PostgreSQL is away;
once it listens again every watch reads its row, since a stop written meanwhile was notified to nobody. So a stop
written while the listener was away stops the build within CHECK_EVERY_SECONDS + CHECK_TIMEOUT_SECONDS (4 s), a
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


class StopListener:
    """The worker's one listening connection on CHANNEL, kept alive, and the watches it hands notifications to."""

    def __init__(self, dsn: str, bounds: Bounds | None = None, *, check_every: float = CHECK_EVERY_SECONDS,
                 check_timeout: float = CHECK_TIMEOUT_SECONDS):
        self.dsn = dsn
        self.bounds = Bounds.defaults() if bounds is None else bounds
        self.check_every = check_every
        self.check_timeout = check_timeout
        self._watches: dict[str, set[StopWatch]] = {}  # by the export's ID as NOTIFY's payload spells it
        self._conn: asyncpg.Connection | None = None
        self._closed = asyncio.Event()  # the listening connection closed: listen again now, not at the next check
        self._tried = asyncio.Event()  # the first try to listen has ended, listening or not
        self._away_since: float | None = None  # monotonic; while not listening
        self._said_unavailable = False  # one log line per absence, not one per try
        self._keeping: asyncio.Task[None] | None = None
        self._reads_left: set[asyncio.Task[None]] = set()  # ended watches' reads, each within its own bound

    async def add(self, watch: StopWatch) -> None:
        """Hand `watch` its export's notifications; returns once the listener listens, or its first try failed (it
        tries again at each check, and the build goes on meanwhile)."""
        self._watches.setdefault(str(watch.job_id), set()).add(watch)
        if self._keeping is None:
            self._keeping = asyncio.create_task(self._keep_listening(), name="stop-listener")
        try:
            await self._tried.wait()  # bounded: _listen's own bound
        except BaseException:
            self.remove(watch)  # its build was cancelled meanwhile: never a watch left behind
            raise

    def remove(self, watch: StopWatch) -> None:
        key = str(watch.job_id)
        watches = self._watches.get(key)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[key]

    def leave_to_end(self, read: asyncio.Task[None]) -> None:
        """Keep an ended watch's read until it ends by itself (asyncio holds only weak references to tasks)."""
        self._reads_left.add(read)
        read.add_done_callback(self._reads_left.discard)

    async def close(self) -> None:
        """The worker shuts down."""
        keeping, self._keeping = self._keeping, None
        if keeping is not None:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping
        for read in list(self._reads_left):  # the pool goes too: nothing is left to keep
            read.cancel()
        await asyncio.gather(*self._reads_left, return_exceptions=True)
        self._drop()

    def _every_watch(self) -> list[StopWatch]:
        return [watch for watches in self._watches.values() for watch in watches]

    async def _listen(self) -> bool:
        conn: asyncpg.Connection | None = None
        try:
            # The connect has its own bound; this one covers LISTEN's round trip too.
            async with asyncio.timeout(self.bounds.connect_seconds + self.check_timeout):
                conn = await connect_raw(self.dsn, self.bounds)
                await conn.add_listener(CHANNEL, self._notified)
        except BaseException as exc:
            if conn is not None:
                conn.terminate()  # cancelled (the worker stops) or failed halfway: never a connection left behind
            if not isinstance(exc, Exception):
                raise
            if self._away_since is None:
                self._away_since = time.monotonic()
            if not self._said_unavailable:
                self._said_unavailable = True
                log.warning("stop listener unavailable, builds go on unheard; trying again every %g s: %s",
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
        try:
            await self._listen()
        finally:
            self._tried.set()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.check_every):
                    await self._closed.wait()
            problem = await self._problem(self._conn) if self._conn is not None else None
            if problem is not None:
                log.warning("stop listener: its connection %s, listening again", problem)
                self._away_since = time.monotonic()
                self._drop()
            if self._conn is None and await self._listen():
                away, self._away_since, self._said_unavailable = self._away_since, None, False
                watches = self._every_watch()
                log.info("stop listener listening again after %.1f s; %d builds read their rows",
                         time.monotonic() - away if away is not None else 0.0, len(watches))
                for watch in watches:
                    watch.owe_a_read()
            for watch in self._every_watch():
                watch.check()

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
        for watch in list(self._watches.get(payload, ())) if isinstance(payload, str) else ():
            watch.look()


class StopWatch:
    """One build's watch: looks at its row when it starts, when its export's stop is notified, and when the listener
    listens again; stops the build once the row shows a stop request for this attempt."""

    def __init__(self, listener: StopListener, store: JobStore, job_id: UUID, attempt_id: UUID,
                 on_stop: Callable[[], None]):
        self.listener = listener
        self.store = store
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.on_stop = on_stop
        # A read of the row on the store's pool: perhaps a new connection, then one round trip.
        self.read_timeout = listener.bounds.connect_seconds + listener.check_timeout
        self._confirming: asyncio.Task[None] | None = None
        self._again = False
        self._unread = False  # a read of the row is owed (it failed, or the listener listens again)
        self._stopped = False
        self._ended = False  # its build ended: a read still under way is not acted on

    async def __aenter__(self) -> StopWatch:
        await self.listener.add(self)
        # A stop recorded before we listened would never be notified again: look once now.
        self.look()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.listener.remove(self)
        self._ended = True
        # A read under way (a small build often ends before its first one is answered) ends by itself, within its
        # bound, and is ignored. Cancelled mid-statement, the pool would take its connection for one that met a
        # dead network and replace every connection it holds: about two new sessions per export in P1.
        if self._confirming is not None and not self._confirming.done():
            self.listener.leave_to_end(self._confirming)

    def owe_a_read(self) -> None:
        self._unread = True

    def check(self) -> None:
        """The listener's periodic check: a read owed is made now."""
        if self._unread:
            self.look()

    def look(self) -> None:
        self._unread = False
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.create_task(self._confirm())
        else:
            # A read already under way may have started before this stop committed: read once more after it.
            self._again = True

    async def _confirm(self) -> None:
        while not self._stopped and not self._ended:
            self._again = False
            try:
                async with asyncio.timeout(self.read_timeout):
                    row = await self.store.read_job(self.job_id)
            except Exception as exc:
                if self._ended:
                    return
                log.warning("could not confirm a stop request for %s, reading again in %g s: %s", self.job_id,
                            self.listener.check_every, errors.describe(exc))
                self._unread = True
                return
            if self._ended:
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
